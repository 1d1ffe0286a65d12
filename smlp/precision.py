"""The core's precision rules in half-precision models: what leaves autocast, what sums in fp32.

fairseq's --fp16 / --bf16 halve every parameter and --amp runs the forward under autocast; the
core keeps three things out of half precision (fairseq_plugins/precision.py patches fairseq's side):

- the router's logits and everything derived from them (routing/logits.py, Switch sec. 2.4);
- sums over many terms: gradients of weights shared by a batch (spatial.py), HyperMixing's prefix
  sums (hypermixer.py), softmax gates' losses (routing/gates.py): `accumulation_dtype`;
- computations whose backward must rebuild the forward's values exactly (HyperMixing), which
  therefore run in one dtype with autocast off (`no_autocast`).
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
