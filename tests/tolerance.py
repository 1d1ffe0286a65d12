"""Tolerances for comparing two computation orders of the same maths (issue 26).

Two implementations of the same function (expert-parallel and one process, cached and full
decoding, blocked and masked dense products, fused and explicit attention) sum the same terms in
other orders, with products of other shapes that CPU kernels block differently, so they agree
only up to rounding, and how much rounding depends on the machine (Intel and AMD, AVX-512, AVX2
and the scalar kernels that `ATEN_CPU_CAPABILITY=default` selects). A fixed absolute tolerance
passes on one CPU and fails on another; it also says nothing of the bug it would still catch.

The rule here is the classic worst-case bound of floating-point summation: a sum of K terms
computed in any order is within (K - 1) u sum |terms| of the exact sum, u = eps / 2 the unit
roundoff, so two orders differ by at most about K eps sum |terms|. For a network, each of the L
reductions in sequence adds its own: the bound used is

    tol = L x K x eps(dtype) x scale

with K the longest reduction of the computation (model width, channel width, sequence length,
rows summed into a weight gradient), L how many such reductions follow each other (layers), and
scale the largest magnitude of the reference (the largest logit) unless the caller knows a larger
scale of the summed terms (a gradient whose terms cancel). It is a bound a rounding difference
stays under on any CPU (measured errors are 10-100x below it); a real difference is not: a
weight off by 1e-3 of itself, a position that reads the future or a dropped row moves outputs by
1e-3 x scale or more, which for every comparison in the suite is above its bound (each file
that uses the rule plants such a difference and checks that the comparison fails: see the
`planted` tests).
"""
from __future__ import annotations

import math

import torch

__all__ = ["order_tolerance", "orders_agree", "within_bound", "assert_orders_agree"]


def order_tolerance(expected: torch.Tensor, *, reduction: int, depth: int = 1, dtype: torch.dtype | None = None,
                    scale: float | None = None) -> float:
    """depth x reduction x eps(dtype) x scale (the module docstring); dtype defaults to expected's
    (fp32 for fp64 references of fp32 computations: pass it), scale to max |expected|."""
    if reduction < 1 or depth < 1:
        raise ValueError(f"reduction={reduction} and depth={depth} must be >= 1")
    dtype = dtype if dtype is not None else expected.dtype
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return depth * reduction * torch.finfo(dtype).eps * scale


def orders_agree(actual: torch.Tensor, expected: torch.Tensor, **rule) -> tuple[bool, float, float]:
    """(within the bound, max |actual - expected|, the bound), for `order_tolerance`'s keyword arguments."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    tol = order_tolerance(expected, **rule)
    diff = (actual.detach().double() - expected.detach().double()).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    finite = bool(torch.isfinite(actual).all()) == bool(torch.isfinite(expected).all())
    return finite and err <= tol and not math.isnan(err), err, tol


def within_bound(actual: torch.Tensor, expected: torch.Tensor, **rule) -> bool:
    """`orders_agree`'s verdict alone (for `assert within_bound(...), message`)."""
    return orders_agree(actual, expected, **rule)[0]


def assert_orders_agree(actual: torch.Tensor, expected: torch.Tensor, msg: str = "", **rule) -> None:
    """Fail unless actual and expected differ by no more than two computation orders may (module docstring)."""
    ok, err, tol = orders_agree(actual, expected, **rule)
    if not ok:
        shown = ", ".join(f"{k}={v}" for k, v in rule.items() if k != "dtype")
        raise AssertionError(f"{msg + ': ' if msg else ''}max |difference| {err:.3g} exceeds the rounding bound "
                             f"{tol:.3g} ({shown}): more than two orders of the same sums can differ by")
