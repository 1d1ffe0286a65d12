"""The blocked causal product (smlp/spatial.py) against the masked dense form it replaces."""
from __future__ import annotations

import contextlib

import pytest
import torch

from smlp.config import SGUConfig
from smlp.experts import SpatialExperts
from smlp.flop_forms import explicit_spatial
from smlp.gmlp import SpatialGatingUnit
from smlp.spatial import causal_product, causal_product_rows, executed_pairs, masked_dense_product
from tolerance import assert_orders_agree, within_bound

torch.set_num_threads(1)


def _case(A, n, G, K, T, dtype=torch.float64, seed=0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(G, T, T, generator=g, dtype=dtype)
    if transposed:  # the sMoE experts' layout: rows (G, K, n) read positions first
        x = torch.randn(A, G, K, n, generator=g, dtype=dtype).permute(0, 3, 1, 2)
    else:
        x = torch.randn(A, n, G, K, generator=g, dtype=dtype)
    return w.requires_grad_(), x.requires_grad_(), torch.randn(A, n, G, K, generator=g, dtype=dtype)


def _both(w, x, grad, block):
    out = []
    for fn in (lambda w, x: causal_product(w, x, block), masked_dense_product):
        wi, xi = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        y = fn(wi, xi)
        y.backward(grad)
        out.append((y.detach(), wi.grad, xi.grad))
    return out


@pytest.mark.parametrize("A, n, G, K, T, block", [
    (3, 10, 2, 4, 12, 4),      # n < T, n not a multiple of the block
    (2, 12, 1, 5, 12, 4),      # n = T, a multiple
    (1, 7, 3, 2, 9, 128),      # one block: the masked dense product itself
    (2, 9, 1, 3, 9, 1),        # blocks of one row: exactly the triangle
    (1, 1, 1, 4, 5, 4),        # one position
])
@pytest.mark.parametrize("transposed", [False, True])
def test_blocked_product_equals_the_masked_dense_form_forward_and_backward(A, n, G, K, T, block, transposed):
    w, x, grad = _case(A, n, G, K, T, transposed=transposed)
    (y, gw, gx), (y_ref, gw_ref, gx_ref) = _both(w, x, grad, block)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)
    # the masked entries and the rows and columns beyond n get no gradient, as the dense form gives
    assert torch.count_nonzero(torch.triu(gw, 1)) == 0 and torch.count_nonzero(gw[:, n:]) == 0
    assert y.stride() == x.stride()  # the output keeps the input's layout (no copy back)


def test_fp32_and_gradcheck():
    w, x, grad = _case(2, 11, 2, 3, 13, dtype=torch.float32, seed=1)
    (y, gw, gx), (y_ref, gw_ref, gx_ref) = _both(w, x, grad, 4)
    for a, b in ((y, y_ref), (gw, gw_ref), (gx, gx_ref)):
        assert_orders_agree(a, b, reduction=13 * 3)  # positions x rows summed into the weight gradient
    w, x, _ = _case(1, 6, 2, 2, 7, seed=2)
    assert torch.autograd.gradcheck(lambda w, x: causal_product(w, x, 4), (w, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_is_the_dense_half_products(dtype):
    """In half precision each output is one GEMM over its prefix, as in the dense product, and grad W
    sums the batch in fp32: the error against fp32 is that of the dense half-precision product."""
    w, x, grad = _case(4, 64, 1, 16, 64, dtype=torch.float32, seed=3)
    ref = _both(w, x, grad, 16)[1]
    wh, xh, gh = (t.detach().to(dtype) for t in (w, x, grad))
    blocked, dense = _both(wh, xh, gh, 16)
    assert blocked[0].dtype == dtype and blocked[1].dtype == dtype
    for got, dense_half, want in zip(blocked, dense, ref):
        err = float((got.double() - want.double()).norm() / want.double().norm())
        err_dense = float((dense_half.double() - want.double()).norm() / want.double().norm())
        assert err <= 1.5 * err_dense + 1e-4, (err, err_dense)


def test_autocast_runs_the_product_in_autocasts_dtype():
    w, x, grad = _case(2, 16, 1, 8, 16, dtype=torch.float32, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = causal_product(w, x, 4)
        y_ref = masked_dense_product(w.to(torch.bfloat16), x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    y.float().backward(grad)
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_executed_pairs_counts_the_triangle_and_the_diagonal_blocks():
    for n, block in ((256, 128), (1024, 128), (10, 4), (7, 128), (9, 1)):
        brute = sum(min((t // block + 1) * block, n) for t in range(n))  # row t reads up to its block's end
        assert executed_pairs(n, block) == brute
    assert executed_pairs(9, 1) == 9 * 10 // 2 and executed_pairs(7, 128) == 49


def test_layers_use_the_blocked_form_and_the_flop_counter_the_dense_one():
    """SGU and sMoE experts: the blocked and the explicit (masked dense) paths agree; the FLOP counter's
    context switches to the dense one and back."""
    torch.manual_seed(0)
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=300, heads=2))
    experts = SpatialExperts(2, 300)
    with torch.no_grad():
        for m in (sgu.proj, experts):
            m.weight.normal_(0, 300 ** -0.5)
    z, rows = torch.randn(2, 290, 16), torch.randn(10, 290)
    for module, run in ((sgu, lambda: sgu(z)), (experts, lambda: experts(rows, [4, 6])),
                        (experts, lambda: experts(rows, [5, 5]))):
        blocked = run()
        with explicit_spatial(module):
            assert all(m.explicit_spatial for m in module.modules() if hasattr(m, "explicit_spatial"))
            dense = run()
        assert not any(m.explicit_spatial for m in module.modules() if hasattr(m, "explicit_spatial"))
        assert_orders_agree(blocked, dense, reduction=290)  # a sum over up to 290 positions


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\(G, T, T\) weight and \(A, n <= T, G, K\)"):
        causal_product(torch.zeros(1, 4, 4), torch.zeros(1, 5, 1, 2))
    with pytest.raises(ValueError, match="block=0"):
        causal_product(torch.zeros(1, 4, 4), torch.zeros(1, 4, 1, 2), 0)


@pytest.mark.parametrize("family, routing", [("gmlp", None), ("smlp", "deterministic"), ("smlp", "partial")])
def test_executed_flops_are_what_the_blocked_model_multiplies(family, routing):
    """smlp_eval.flops.executed_macs (the benchmark's executed-FLOPs MFU) against torch's FlopCounterMode,
    which sees the blocked GEMMs the model runs: the multiply-adds the paper's count includes and the
    blocked model skips are the same in both (T = 300: three blocks, the last one partial)."""
    from torch.utils.flop_counter import FlopCounterMode

    from smlp.lm import LanguageModel, LMConfig
    from smlp_eval import flops as FL

    kw = dict(sparse_layers=1, num_experts=2, smoe_routing=routing) if family == "smlp" else {}
    cfg = LMConfig(family=family, vocab_size=50, d_model=16, d_ffn=32, seq_len=300, dense_layers=1, **kw)
    count = FL.count(cfg)
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    ids = torch.randint(4, 50, (1, 300))
    counted = {}
    for explicit in (False, True):
        with torch.no_grad(), (explicit_spatial(model) if explicit else contextlib.nullcontext()), \
                FlopCounterMode(display=False) as fc:
            model(ids)
        counted[explicit] = fc.get_total_flops() // 2  # FlopCounterMode counts 2 per multiply-add
    assert counted[True] - counted[False] == count.macs - FL.executed_macs(count) > 0


@pytest.mark.parametrize("counts", [[3, 3, 3], [2, 0, 7]])
def test_rows_grouped_by_expert_equal_the_masked_dense_product(counts):
    """The sMoE experts' layout (rows of positions, grouped by expert), equal and unequal counts."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 11, 11, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(sum(counts), 10, generator=g, dtype=torch.float64, requires_grad=True)
    y = causal_product_rows(w, x, counts, 4)
    rows = torch.split(x, counts)
    y_ref = torch.cat([r @ torch.tril(w[l, :10, :10]).t() for l, r in enumerate(rows)])
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(y.shape, generator=g, dtype=torch.float64)
    gw, gx = torch.autograd.grad(y, (w, x), grad)
    gw_ref, gx_ref = torch.autograd.grad(y_ref, (w, x), grad)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)


def test_planted_errors_fail_the_blocked_against_dense_comparison():
    """The rounding bound above catches a real difference: one weight off by 1e-3 of itself, or a
    block that reads one position past the diagonal (a leak)."""
    w, x, grad = _case(2, 11, 2, 3, 13, dtype=torch.float32, seed=1)
    (y, _, _), (y_ref, _, _) = _both(w, x, grad, 4)
    assert within_bound(y, y_ref, reduction=13 * 3)
    with torch.no_grad():
        w2 = w.detach().clone()
        w2[1, 6, 2] *= 1 + 1e-3
    assert not within_bound(causal_product(w2, x.detach(), 4), y_ref, reduction=13 * 3)
    leaky = torch.tril(w.detach(), 1)[:, :11, :11]  # each row also reads the next position
    y_leak = torch.einsum("gts,asgk->atgk", leaky, x.detach())
    assert not within_bound(y_leak, y_ref, reduction=13 * 3)
