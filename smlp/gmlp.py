"""The gMLP block and its token mixer, the causal Spatial Gating Unit (SGU).

gMLP (Liu et al. 2021, "Pay Attention to MLPs"), sec. 2.1: s(Z) = Z1 * (W Z2 + b), W a T x T spatial
weight initialized near zero and b at one. For language modelling W is masked lower triangular and
sliced to the length n <= T, so position t sees only positions <= t. The product runs as blocked
GEMMs that skip the zero triangle (spatial.py). The block can hold another token mixer in the SGU's
place (`TOKEN_MIXERS`: hypermixer.py, ninformer.py); the pieces they share are here.

Half precision: at init W Z2 is ~1e-5, and W Z2 + b rounds to exactly 1 in bf16 and fp16, which
would drop the spatial term from the gate. So the projection returns the gate minus one,
W Z2 + (b - 1), the unit computes Z1 + Z1 * (W Z2 + (b - 1)), and the bias is stored as its offset
b - 1 (`bias_offset`), whose small updates half-precision weights can hold.

Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import GMLPConfig, SGUConfig
from .decoding_cache import cache_append
from .profiling import RANGES
from .recompute import recomputed
from .spatial import causal_product, causal_step, causal_weight, check_length, init_spatial_, load_gate_bias_offset

__all__ = ["TOKEN_MIXERS", "MLP", "check_decodable", "SpatialProjection", "SpatialGatingUnit", "GMLPBlock"]

TOKEN_MIXERS = ("sgu", "hypermixer", "ninformer")  # what a gMLP block can mix tokens with


class MLP(nn.Sequential):
    """Linear -> GELU -> Linear (the token-mixer papers' MLP([d_in, d_hidden, d_out]))."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))


def check_decodable(module: nn.Module, causal: bool) -> None:
    """ValueError unless `module` (a token mixer) is causal: only causal mixers decode incrementally."""
    if not causal:
        raise ValueError(f"{type(module).__name__} was built with causal=False (every position sees every "
                         f"position): it cannot decode incrementally; only causal token mixers generate")


class SpatialProjection(nn.Module):
    """Causal multi-head spatial projection: head h mixes positions of its channel chunk with W_h.

    Returns W_h x + (b_h - 1), the gate minus one (module docstring: half precision).
    """

    def __init__(self, heads: int, seq_len: int, init_eps: float = 1e-3):
        super().__init__()
        self.heads, self.seq_len = heads, seq_len
        self.weight = nn.Parameter(torch.empty(heads, seq_len, seq_len))
        self.bias_offset = nn.Parameter(torch.empty(heads, seq_len))  # b - 1
        init_spatial_(self.weight, self.bias_offset, init_eps)
        self.explicit_spatial = False  # the masked dense product, for FLOP counting (flop_forms.py)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        load_gate_bias_offset(state_dict, prefix)  # a state that stores b itself
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x_BNC: Tensor) -> Tensor:
        B, n, C = x_BNC.shape
        check_length(n, self.seq_len)
        x_BNHc = x_BNC.reshape(B, n, self.heads, C // self.heads)
        if self.explicit_spatial:  # the masked dense product (FLOP counting: the paper's full T x T)
            y_BNHc = torch.einsum("hts,bshc->bthc", causal_weight(self.weight, n), x_BNHc)
        else:  # blocked: the zero triangle is skipped (spatial.py)
            y_BNHc = causal_product(self.weight, x_BNHc)
        y_BNHc = y_BNHc + self.bias_offset[:, :n].t()[None, :, :, None]
        return y_BNHc.reshape(B, n, C)

    def step(self, x_BtC: Tensor, start: int) -> Tensor:
        """Cached decoding: W x + (b - 1) at positions start..t-1 only, from all t positions of x, (B, k, C)."""
        check_length(x_BtC.shape[1], self.seq_len)
        return causal_step(self.weight, self.bias_offset, x_BtC, start)


class SpatialGatingUnit(nn.Module):
    """(Multi-head) causal SGU: out = z1 * (W LayerNorm(z2) + b), computed as z1 + z1 * (W LN(z2) + (b - 1))."""

    def __init__(self, cfg: SGUConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.LayerNorm(cfg.gated_dim)
        self.proj = SpatialProjection(cfg.heads, cfg.seq_len, cfg.init_eps)

    def forward(self, z_BNF: Tensor) -> Tensor:
        if z_BNF.shape[-1] != self.cfg.dim:
            raise ValueError(f"SGU expects width {self.cfg.dim}, got input of shape {tuple(z_BNF.shape)}")
        with record_function(RANGES["token_mixing"]):
            z1, z2 = z_BNF.chunk(2, dim=-1) if self.cfg.split else (z_BNF, z_BNF)
            return z1 + z1 * self.proj(self.norm(z2))

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding (smlp/decoding_cache.py): the normalized gated half of past positions is kept."""
        with record_function(RANGES["token_mixing"]):
            z1, z2 = z_BkF.chunk(2, dim=-1) if self.cfg.split else (z_BkF, z_BkF)
            v_BtC = cache_append(state, "v", self.norm(z2), start, limit=self.cfg.seq_len)
            return z1 + z1 * self.proj.step(v_BtC, start)


class GMLPBlock(nn.Module):
    """Dense gMLP block, pre-norm with residual.

    `mixer` replaces the SGU by another token mixer that maps the F channels to F/2 (hypermixer.py,
    ninformer.py) under the name `mixer`; the SGU is named `sgu`, as checkpoints hold it.
    """

    def __init__(self, cfg: GMLPConfig, mixer: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.LayerNorm(cfg.d_model)
        self.proj_in = nn.Linear(cfg.d_model, cfg.d_ffn)
        if mixer is None:
            self.sgu = SpatialGatingUnit(cfg.sgu)
        else:
            self.mixer = mixer
        self.proj_out = nn.Linear(cfg.d_ffn // 2, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute = False  # activation checkpointing: the block again in backward (recompute.py)

    @property
    def token_mixer(self) -> nn.Module:
        return self.sgu if "sgu" in self._modules else self.mixer

    def forward(self, x_BND: Tensor) -> Tensor:
        return recomputed(self.recompute, self._block, x_BND)

    def _block(self, x_BND: Tensor) -> Tensor:
        h = F.gelu(self.proj_in(self.norm(x_BND)))  # (B, N, F)
        h = self.proj_out(self.token_mixer(h))  # (B, N, D)
        return x_BND + self.dropout(h)

    def step(self, x_BkD: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..start+k-1 (eval mode; smlp/decoding_cache.py)."""
        h = F.gelu(self.proj_in(self.norm(x_BkD)))
        return x_BkD + self.proj_out(self.token_mixer.step(h, state, start))
