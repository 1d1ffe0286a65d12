"""Transformer decoder blocks for the dense and Transformer-MoE baselines (sMLP Table 1).

Pre-norm decoder block: x = x + Attn(LN(x)); x = x + FFN(LN(x)), the FFN dense or a tMoE (GShard,
Switch, Base Layers, HASH). Attention runs as torch's fused scaled_dot_product_attention, as
fairseq's transformer_lm does, so the baseline is not slowed by a hand-written mask; the same maths
as matmuls serves FLOP counting (`flop_forms.explicit_attention`).

Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import TMoEConfig
from .decoding_cache import cache_append
from .moe import TMoE
from .profiling import RANGES
from .recompute import recomputed

__all__ = ["CausalSelfAttention", "DenseFFN", "TransformerBlock", "sinusoidal_positions"]


def sinusoidal_positions(n: int, dim: int, device=None, dtype=torch.float32, start: int = 0) -> Tensor:
    """Fixed sinusoidal position embeddings (Vaswani et al. 2017) of positions start..start+n-1, (n, dim).

    Row p is the same whatever n and start are (cached decoding embeds only its new positions).
    """
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = torch.arange(start, start + n, device=device, dtype=torch.float32)[:, None] * freq[None, :]
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb.to(dtype)


def fused_attention_runs(q: Tensor) -> bool:
    """Whether torch's fused attention kernel can run on `q`'s device and dtype.

    On a CPU with AVX-512 hardware whose kernels were selected lower (`ATEN_CPU_CAPABILITY=avx2`),
    torch 2.13's fused bf16 attention calls an AVX-512-only packing routine and fails ("pack_vnni2 is
    only supported when avx512 is supported"); half precision there runs as explicit matmuls."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return True
    return _cpu_kernels_have_avx512()


@functools.cache
def _cpu_kernels_have_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; `explicit` selects the matmul form (FLOP counting)."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"heads={heads} must divide d_model={d_model}")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.explicit = False

    def forward(self, x_BND: Tensor) -> Tensor:
        B, n, D = x_BND.shape
        q, k, v = self.qkv(x_BND).view(B, n, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit or not fused_attention_runs(q):
            future = torch.ones(n, n, dtype=torch.bool, device=x_BND.device).triu(1)
            y_BHNd = self._explicit(q, k, v, future)
        else:
            p = self.dropout.p if self.training else 0.0
            y_BHNd = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.out(y_BHNd.transpose(1, 2).reshape(B, n, D))

    def _explicit(self, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor) -> Tensor:
        """softmax(q k^T / sqrt(d), masked where `hidden` is True) v as plain matmuls."""
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, N, N)
        return self.dropout(scores.masked_fill(hidden, float("-inf")).softmax(-1)) @ v

    def step(self, x_BkD: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding (smlp/decoding_cache.py): keys and values of past positions are kept."""
        B, k, D = x_BkD.shape
        q, key, value = self.qkv(x_BkD).view(B, k, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        key_BHtd = cache_append(state, "k", key, start, dim=2)
        value_BHtd = cache_append(state, "v", value, start, dim=2)
        mask_kt = None  # one new position sees every cached one
        if k > 1:  # new position start+i sees positions <= start+i
            t = start + k
            mask_kt = (torch.arange(t, device=x_BkD.device)[None, :]
                       <= torch.arange(start, t, device=x_BkD.device)[:, None])
        if fused_attention_runs(q):
            y_BHkd = F.scaled_dot_product_attention(q, key_BHtd, value_BHtd, attn_mask=mask_kt)
        else:
            hidden = torch.zeros((), dtype=torch.bool, device=q.device) if mask_kt is None else ~mask_kt
            y_BHkd = self._explicit(q, key_BHtd, value_BHtd, hidden)
        return self.out(y_BHkd.transpose(1, 2).reshape(B, k, D))


class DenseFFN(nn.Module):
    def __init__(self, d_model: int, d_ffn: int, activation: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ffn)
        self.fc2 = nn.Linear(d_ffn, d_model)
        self.activation = F.gelu if activation == "gelu" else F.relu

    def forward(self, x: Tensor, token_ids=None) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block; `moe` replaces the dense FFN with a tMoE."""

    def __init__(self, d_model: int, d_ffn: int, heads: int, *, dropout: float = 0.0, activation: str = "gelu",
                 moe: TMoEConfig | None = None, dispatcher=None):
        super().__init__()
        self.d_model = d_model
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = TMoE(moe, dispatcher) if moe is not None else DenseFFN(d_model, d_ffn, activation)
        self.dropout = nn.Dropout(dropout)
        # activation checkpointing (recompute.py): a dense block again in backward; with a tMoE, the attention
        # and the norm before its router (the tMoE recomputes its experts itself)
        self.recompute = False

    def forward(self, x_BND: Tensor, token_ids_BN: Tensor | None = None) -> Tensor:
        if not isinstance(self.ffn, TMoE):
            return recomputed(self.recompute, self._dense_block, x_BND)
        x_BND, h_BND = recomputed(self.recompute, self._attention, x_BND)
        ids = token_ids_BN.reshape(-1) if token_ids_BN is not None else None
        return x_BND + self.dropout(self.ffn(h_BND.reshape(-1, self.d_model), ids).view_as(x_BND))

    def _attention(self, x_BND: Tensor) -> tuple[Tensor, Tensor]:
        """(x + attention, its normalized form: the FFN's input)."""
        with record_function(RANGES["token_mixing"]):
            x_BND = x_BND + self.dropout(self.attn(self.norm1(x_BND)))
        return x_BND, self.norm2(x_BND)

    def _dense_block(self, x_BND: Tensor) -> Tensor:
        x_BND, h_BND = self._attention(x_BND)
        return x_BND + self.dropout(self.ffn(h_BND))

    def step(self, x_BkD: Tensor, state: dict, start: int, token_ids_Bk: Tensor | None = None) -> Tensor:
        """Cached decoding of positions start..start+k-1 (eval mode): the FFN / tMoE sees the new rows only."""
        with record_function(RANGES["token_mixing"]):
            x_BkD = x_BkD + self.attn.step(self.norm1(x_BkD), state, start)
        h = self.norm2(x_BkD).reshape(-1, self.d_model)
        ids = token_ids_Bk.reshape(-1) if token_ids_Bk is not None else None
        ffn = self.ffn.step if isinstance(self.ffn, TMoE) else self.ffn  # the tMoE's decoding fast path
        return x_BkD + ffn(h, ids).view_as(x_BkD)
