"""The core's precision rules in half-precision models: what leaves autocast, what sums in fp32.

Under fairseq's --fp16 / --bf16 / --amp the core keeps out of half precision: the router's logits
and all derived from them (routing/logits.py); sums over many terms, such as the gradients of
weights a batch shares (spatial.py), in `accumulation_dtype`; and computations whose backward must
rebuild the forward's values exactly (HyperMixing), in one dtype under `no_autocast`.
fairseq_plugins/precision.py handles fairseq's side.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["accumulation_dtype", "autocast_enabled", "no_autocast"]


def no_autocast(device: torch.device):
    """A context that turns autocast off on `device`'s type (nothing to do on a type without autocast)."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # e.g. meta tensors (the FLOPs calculator's trace)
        return contextlib.nullcontext()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for `device_type` (False for a type without autocast, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):
        return False


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype to sum `dtypes` in: their promotion, at least fp32 (fp64 stays fp64)."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out
