"""The forms a FLOP counter traces: a module whose fast path fvcore cannot count keeps the plain form
of the same maths behind a flag, which a context manager sets.

    explicit_spatial    spatial products as the masked dense product (the paper's full T x T count,
                        Table 3), the token-routed gMLP's projections on the routed rows only
    explicit_attention  attention as matmuls (fvcore counts 0 for fused SDPA)

The FLOPs calculator (eval/flops/counting.py) traces under both.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["explicit_attention", "explicit_spatial", "flag_set"]


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
