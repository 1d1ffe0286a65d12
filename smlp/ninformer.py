"""The causal NiNformer token mixer, in the SGU's place inside a gMLP block.

NiNformer (Abdullah and Aydin 2024, sec. 3.2, eq. 8): Gating(I) = MLPMixer(I) * Linear(I), the gate
one MLP-Mixer layer (a token-mixing MLP over positions, then a channel-mixing MLP, each pre-norm with
a residual). In a gMLP block z1 plays Linear(I) and the Mixer layer reads z2. The paper gives no
decoder form; ours masks the token-mixing MLP x -> W2 GELU(W1 x + b1) + b2 (T -> r T -> T) as MADE
does: hidden unit m belongs to position m // r, W1 connects input s to unit m only if s <= m // r,
and W2 connects unit m to output t only if m // r <= t. Like the SGU's weight, both are sliced to
the length n <= T and run as full products (the mask saves no multiply-adds).

Shapes: the core's legend (smlp/__init__.py); here U = r n hidden units of the token-mixing MLP,
u of them new in a decoding step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import _positive
from .decoding_cache import cache_append
from .gmlp import MLP, check_decodable
from .profiling import RANGES
from .spatial import check_length

__all__ = ["NiNformerConfig", "CausalTokenMLP", "MixerSubUnit", "NiNformerGatingUnit"]


@dataclass(frozen=True, kw_only=True)
class NiNformerConfig:
    """NiNformer's gating unit with a causal token-mixing MLP.

    dim:             mixer input width F, split into z1 and z2 of C = F/2 channels each.
    seq_len:         T, the token-mixing MLP's input/output size; inputs may be shorter.
    channel_hidden:  hidden width of the Mixer layer's channel-mixing MLP.
    token_expansion: r, hidden units per position of the token-mixing MLP (r T in all).
    causal:          False gives the paper's unmasked token MLP: negative control only.
    """

    dim: int
    seq_len: int
    channel_hidden: int
    token_expansion: int = 1
    causal: bool = True

    def __post_init__(self) -> None:
        _positive("dim", self.dim)
        _positive("seq_len", self.seq_len)
        _positive("channel_hidden", self.channel_hidden)
        _positive("token_expansion", self.token_expansion)
        if self.dim % 2:
            raise ValueError(f"dim={self.dim} must be even: the NiNformer gating unit splits it into two halves")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal={self.causal!r} is invalid: it must be True or False")

    @property
    def gated_dim(self) -> int:
        return self.dim // 2


def _uniform_fan_in_(p: Tensor, fan_in: int) -> None:
    """nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as in NiNformer's code."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        p.uniform_(-bound, bound)


class CausalTokenMLP(nn.Module):
    """MLP-Mixer's token-mixing MLP over positions, x -> W2 GELU(W1 x + b1) + b2, masked to be causal."""

    def __init__(self, seq_len: int, expansion: int = 1, causal: bool = True):
        super().__init__()
        self.seq_len, self.expansion, self.causal = seq_len, expansion, causal
        U = expansion * seq_len
        self.w1 = nn.Parameter(torch.empty(U, seq_len))
        self.b1 = nn.Parameter(torch.empty(U))
        self.w2 = nn.Parameter(torch.empty(seq_len, U))
        self.b2 = nn.Parameter(torch.empty(seq_len))
        for p, fan_in in ((self.w1, seq_len), (self.b1, seq_len), (self.w2, U), (self.b2, U)):
            _uniform_fan_in_(p, fan_in)

    def weights(self, n: int) -> tuple[Tensor, Tensor]:
        """W1 (r n x n) and W2 (n x r n) for length n: hidden unit m belongs to position m // r."""
        m = self.expansion * n
        w1_UN, w2_NU = self.w1[:m, :n], self.w2[:n, :m]
        if not self.causal:
            return w1_UN, w2_NU
        pos_N = torch.arange(n, device=self.w1.device)
        unit_U = torch.arange(m, device=self.w1.device) // self.expansion
        reads_UN = pos_N[None, :] <= unit_U[:, None]  # unit m reads positions <= its own
        feeds_NU = unit_U[None, :] <= pos_N[:, None]  # output t reads units of positions <= t
        return w1_UN * reads_UN, w2_NU * feeds_NU

    def forward(self, x_BNC: Tensor) -> Tensor:
        n = x_BNC.shape[1]
        check_length(n, self.seq_len)
        w1_UN, w2_NU = self.weights(n)
        x_BCN = x_BNC.transpose(1, 2)
        h_BCU = F.gelu(torch.matmul(x_BCN, w1_UN.t()) + self.b1[:self.expansion * n])
        return (torch.matmul(h_BCU, w2_NU.t()) + self.b2[:n]).transpose(1, 2)

    def step(self, x_BkC: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..t-1 (smlp/decoding_cache.py), (B, k, C).

        A hidden unit of position p reads positions <= p only, so it never changes once computed:
        a step computes the r k new units and its k outputs from the cached ones, O(t) per position.
        """
        check_decodable(self, self.causal)
        k = x_BkC.shape[1]
        t, r = start + k, self.expansion
        check_length(t, self.seq_len)
        x_BCt = cache_append(state, "x", x_BkC.transpose(1, 2), start, dim=2, limit=self.seq_len)
        pos_t = torch.arange(t, device=x_BkC.device)
        unit_U = torch.arange(r * t, device=x_BkC.device) // r
        new = slice(r * start, r * t)
        w1_ut = self.w1[new, :t] * (pos_t[None, :] <= unit_U[new, None])  # new units read positions <= theirs
        h_BCu = F.gelu(torch.matmul(x_BCt, w1_ut.t()) + self.b1[new])
        h_BCU = cache_append(state, "h", h_BCu, r * start, dim=2, limit=r * self.seq_len)
        w2_kU = self.w2[start:t, :r * t] * (unit_U[None, :] <= pos_t[start:, None])  # output s reads units <= s
        return (torch.matmul(h_BCU, w2_kU.t()) + self.b2[start:t]).transpose(1, 2)


class MixerSubUnit(nn.Module):
    """One MLP-Mixer layer: x + TokenMLP(LN(x)), then + ChannelMLP(LN(.)) (NiNformer's inner network)."""

    def __init__(self, cfg: NiNformerConfig):
        super().__init__()
        C = cfg.gated_dim
        self.token_norm = nn.LayerNorm(C)
        self.token_mlp = CausalTokenMLP(cfg.seq_len, cfg.token_expansion, cfg.causal)
        self.channel_norm = nn.LayerNorm(C)
        self.channel_mlp = MLP(C, cfg.channel_hidden, C)

    def forward(self, x_BNC: Tensor) -> Tensor:
        x_BNC = x_BNC + self.token_mlp(self.token_norm(x_BNC))
        return x_BNC + self.channel_mlp(self.channel_norm(x_BNC))

    def step(self, x_BkC: Tensor, state: dict, start: int) -> Tensor:
        x_BkC = x_BkC + self.token_mlp.step(self.token_norm(x_BkC), state, start)
        return x_BkC + self.channel_mlp(self.channel_norm(x_BkC))


class NiNformerGatingUnit(nn.Module):
    """out = z1 * MixerSubUnit(z2) (NiNformer eq. 8, with z1 as the linear branch); causal."""

    def __init__(self, cfg: NiNformerConfig):
        super().__init__()
        self.cfg = cfg
        self.mixer = MixerSubUnit(cfg)

    def forward(self, z_BNF: Tensor) -> Tensor:
        if z_BNF.dim() != 3 or z_BNF.shape[-1] != self.cfg.dim:
            raise ValueError(f"NiNformerGatingUnit expects (batch, length, {self.cfg.dim}), got {tuple(z_BNF.shape)}")
        z1_BNC, z2_BNC = z_BNF.chunk(2, dim=-1)
        with record_function(RANGES["token_mixing"]):
            return z1_BNC * self.mixer(z2_BNC)

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding (smlp/decoding_cache.py): the causal token MLP keeps its inputs and hidden units."""
        z1_BkC, z2_BkC = z_BkF.chunk(2, dim=-1)
        with record_function(RANGES["token_mixing"]):
            return z1_BkC * self.mixer.step(z2_BkC, state, start)
