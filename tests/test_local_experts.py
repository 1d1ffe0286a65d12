"""Several experts on one rank as one product (issue 22): the batched and grouped forms against the
loop over experts (outputs and every gradient)."""
from __future__ import annotations

import pytest
import torch

from smlp.experts import FFNExperts, SpatialExperts, grouped_mm_supported

torch.set_num_threads(1)


def _run(module, fn, x, counts, grad):
    module.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_()
    y = fn(xi, counts)
    y.backward(grad)
    return [y.detach(), xi.grad] + [p.grad.clone() for p in module.parameters()]


def _refuse(*a, **k):
    raise AssertionError("the loop ran where one product was expected")


@pytest.mark.parametrize("counts, path", [([5, 5, 5, 5], "batched"), ([7], "batched"), ([3, 0, 9, 4], "grouped"),
                                          ([0, 0, 11, 0], "grouped")])
@pytest.mark.parametrize("norm", [False, True])
def test_ffn_experts_as_one_product_equal_the_loop(monkeypatch, counts, path, norm):
    torch.manual_seed(0)
    L, D = len(counts), 8
    experts = FFNExperts(L, D, 16, norm=norm)
    with torch.no_grad():  # not the init's ones and zeros: every parameter matters
        for p in experts.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, grad = torch.randn(sum(counts), D), torch.randn(sum(counts), D)
    want = _run(experts, experts.forward_loop, x, counts, grad)
    if path == "grouped" and not grouped_mm_supported(x.device, x.dtype):
        pytest.skip("torch's grouped matmul does not run here: the layer loops")
    experts.grouped = True  # on the CPU the layer loops by default (no faster, benchmarks/local_experts.py)
    monkeypatch.setattr(experts, "forward_loop", _refuse)
    got = _run(experts, experts, x, counts, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ffn_experts_without_a_grouped_matmul_loop_exactly():
    torch.manual_seed(0)
    experts = FFNExperts(3, 4, 8, norm=True).double()  # grouped_mm has no fp64: the loop
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64)
    x, grad = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    got = _run(experts, experts, x, [2, 3, 4], grad)
    want = _run(experts, experts.forward_loop, x, [2, 3, 4], grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("counts", [[4, 4, 4], [2, 5, 0]])
def test_spatial_experts_as_one_product_equal_the_loop(counts):
    torch.manual_seed(0)
    experts = SpatialExperts(len(counts), 140)  # two blocks of the causal product (and a partial one)
    with torch.no_grad():
        experts.weight.normal_(0, 140 ** -0.5)
        experts.bias.normal_(1, 0.1)
    x, grad = torch.randn(sum(counts), 133), torch.randn(sum(counts), 133)
    got = _run(experts, experts, x, counts, grad)
    want = _run(experts, experts.forward_dense, x, counts, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
