"""The router's logits in one place: the gate projection, in fp32.

Switch Transformer (Fedus et al. 2021, sec. 2.4, "selective precision") keeps the router in fp32
because bfloat16 breaks its softmax and argmax. `router_logits` runs the projection itself in fp32
outside autocast, so the logits and what the routers derive from them (softmax, assignment scores,
load-balancing losses) are fp32 whatever the model's dtype, for one small (S x D x E) matmul. Every
learned router calls it; the rules that turn logits into a plan are in routes.py and gates.py.

Shapes: the core's legend (smlp/__init__.py); for the sMoE router D is the P prefix positions it reads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..precision import accumulation_dtype, autocast_enabled, no_autocast

__all__ = ["router_logits"]


def router_logits(x_SD: Tensor, weight_DE: Tensor) -> Tensor:
    """x @ weight in fp32 (fp64 stays fp64), outside autocast: the router's logits, (S, E)."""
    dtype = accumulation_dtype(x_SD.dtype, weight_DE.dtype)
    if x_SD.dtype == dtype and weight_DE.dtype == dtype and not autocast_enabled(x_SD.device.type):
        return torch.matmul(x_SD, weight_DE)  # nothing to change (an fp32 model): no casts, no context
    with no_autocast(x_SD.device):
        return torch.matmul(x_SD.to(dtype), weight_DE.to(dtype))
