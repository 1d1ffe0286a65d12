"""The forms a FLOP counter traces: a module whose fast path fvcore cannot count keeps the plain form
of the same maths behind a flag, which a context manager sets.

    explicit_spatial    spatial products as the masked dense product (the paper's full T x T count,
                        Table 3), the token-routed gMLP's projections on the routed rows only
    explicit_attention  attention as matmuls (fvcore counts 0 for fused SDPA)
    explicit_experts    the FFN experts as one product per expert on its routed rows (no tiles, no padding)

The FLOPs calculator (eval/flops/counting.py) traces under all three (`counted_forms`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["counted_forms", "explicit_attention", "explicit_experts", "explicit_spatial", "flag_set"]


@contextlib.contextmanager
def flag_set(module: nn.Module, flag: str) -> Iterator[nn.Module]:
    """Within the block, `flag` is True on every submodule of `module` that has it; restored after."""
    flagged = [m for m in module.modules() if hasattr(m, flag)]
    before = [getattr(m, flag) for m in flagged]
    for m in flagged:
        setattr(m, flag, True)
    try:
        yield module
    finally:
        for m, value in zip(flagged, before):
            setattr(m, flag, value)


def explicit_spatial(module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Every spatial product in `module` as the masked dense product (the paper's count)."""
    return flag_set(module, "explicit_spatial")


def explicit_attention(module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Every CausalSelfAttention in `module` as explicit matmuls (FLOP counters)."""
    return flag_set(module, "explicit")


def explicit_experts(module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Every FFNExperts in `module` as its plain loop over the experts' routed rows."""
    return flag_set(module, "explicit_experts")


@contextlib.contextmanager
def counted_forms(module: nn.Module) -> Iterator[nn.Module]:
    """Every form of `module` as a FLOP counter counts it (the three flags above)."""
    with explicit_attention(module), explicit_spatial(module), explicit_experts(module):
        yield module
