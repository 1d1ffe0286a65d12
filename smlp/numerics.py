"""Half-precision numerics shared by the layers: router logits in fp32.

Switch Transformer (Fedus et al. 2021, sec. 2.4, "selective precision") computes the router in
fp32 because its softmax and argmax are the part of an MoE layer that bfloat16 breaks; fairseq's
MoE branch (`moe_gating_use_fp32`), Megatron-Core (`--moe-router-dtype fp32`) and torchtitan do
the same for the gate projection itself, not only for the softmax after it. `router_logits` is
that projection: its inputs are upcast and autocast is off, so the logits, and everything the
routers derive from them (softmax, assignment scores, load-balancing losses), are fp32 whatever
the model's dtype (fairseq --fp16 / --bf16 halve every parameter) or autocast context (--amp).
The cost is one small matmul (rows x D x E) in fp32.

Shapes: S rows, D input width, E experts (or any K x E right-hand side).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["no_autocast", "router_logits"]


def no_autocast(device: torch.device):
    """A context that turns autocast off on `device`'s type (nothing to do on a type without autocast)."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # e.g. meta tensors (the FLOPs calculator's trace)
        return contextlib.nullcontext()


def router_logits(x_SD: Tensor, weight_DE: Tensor) -> Tensor:
    """x @ weight in fp32 (fp64 stays fp64), outside autocast: the router's logits, (S, E)."""
    dtype = torch.promote_types(torch.promote_types(x_SD.dtype, weight_DE.dtype), torch.float32)
    with no_autocast(x_SD.device):
        return torch.matmul(x_SD.to(dtype), weight_DE.to(dtype))
