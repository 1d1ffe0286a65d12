"""The router's logits, computed in one place: the gate projection in fp32 (Megatron-Core's `gating()`).

Switch Transformer (Fedus et al. 2021, sec. 2.4, "selective precision") computes the router in
fp32 because its softmax and argmax are the part of an MoE layer that bfloat16 breaks; fairseq's
MoE branch (`moe_gating_use_fp32`), Megatron-Core (`--moe-router-dtype fp32`) and torchtitan do
the same for the gate projection itself, not only for the softmax after it. `router_logits` is
that projection: its inputs are upcast and autocast is off, so the logits, and everything the
routers derive from them (softmax, assignment scores, load-balancing losses), are fp32 whatever
the model's dtype (fairseq --fp16 / --bf16 halve every parameter) or autocast context (--amp).
The cost is one small matmul (S x D x E) in fp32. Every learned router calls it: the token
routers through the registry's route functions (registry.py), the sMoE router (moe.SMoE) and the
token-routed gMLP (smlp/token_routed.py); the rules that turn logits into a plan are routes.py and
gates.py (Megatron-Core's `routing()`).

Shapes: the core's legend (smlp/__init__.py); here S rows, D their width (the model width; for the
sMoE router the P prefix positions it reads), E experts.
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
