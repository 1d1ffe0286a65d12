"""Several experts on one rank as one product (issue 22): the batched and grouped forms against the
loop over experts (outputs and every gradient)."""
from __future__ import annotations

import pytest
import torch

from smlp.experts import FFNExperts, SpatialExperts, grouped_mm_supported
from tolerance import assert_orders_agree, within_bound

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
        assert_orders_agree(a, b, reduction=max(sum(counts), 4 * D), depth=2)  # rows into a weight gradient, F


def test_ffn_experts_without_a_grouped_matmul_loop_exactly():
    torch.manual_seed(0)
    experts = FFNExperts(3, 4, 8, norm=True).double()  # grouped_mm has no fp64: the loop
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64)
    x, grad = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    got = _run(experts, experts, x, [2, 3, 4], grad)
    want = _run(experts, experts.forward_loop, x, [2, 3, 4], grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_ffn_experts_with_widths_grouped_mm_cannot_stride_loop():
    """grouped_mm refuses rows whose stride is not a multiple of 16 bytes (D = 6 in fp32: 24 bytes),
    on CUDA as here: such widths take the loop even where the grouped product is asked for."""
    torch.manual_seed(0)
    experts = FFNExperts(3, 6, 12)
    experts.grouped = True
    x, grad = torch.randn(9, 6), torch.randn(9, 6)
    if grouped_mm_supported(x.device, x.dtype):
        with pytest.raises(RuntimeError, match="16 bytes"):
            experts._grouped(x, [2, 3, 4])  # what the layer would have run
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
        assert_orders_agree(a, b, reduction=max(sum(counts), 133))  # rows into a weight gradient, positions


def test_planted_error_fails_the_one_product_against_loop_comparison():
    """One expert's weights off by 1e-3 of themselves, or two experts' rows swapped, are outside the
    rounding bound used above."""
    torch.manual_seed(0)
    counts, D = [3, 0, 9, 4], 8
    experts = FFNExperts(len(counts), D, 16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    x, grad = torch.randn(sum(counts), D), torch.randn(sum(counts), D)
    want = _run(experts, experts.forward_loop, x, counts, grad)
    with torch.no_grad():
        experts.w1[2] *= 1 + 1e-3
    got = _run(experts, experts.forward_loop, x, counts, grad)
    assert not within_bound(got[0], want[0], reduction=max(sum(counts), 4 * D), depth=2)
    with torch.no_grad():
        experts.w1[2] /= 1 + 1e-3
    swapped = _run(experts, experts.forward_loop, x, [3, 0, 4, 9], grad)
    assert not within_bound(swapped[0], want[0], reduction=max(sum(counts), 4 * D), depth=2)
