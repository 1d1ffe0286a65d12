"""The causal HyperMixer token mixer, in the SGU's place inside a gMLP block.

HyperMixer (Mai et al. 2023, sec. 2.3, Algorithm 1, App. D.2 and F) is MLP-Mixer's token-mixing MLP
W2 GELU(W1^T x_c) for every channel c, with the rows of W1 and W2 (N x U) generated per token by
hypernetworks: W1[s] = MLP1(x_s + p_s), W2[t] = MLP2(x_t + p_t), p fixed sinusoids (tied: W2 = W1).
As in the SGU, z splits into z1 and z2, z2 is mixed into a gate and the output is z1 * LayerNorm(mix).
The paper gives no decoder form; ours applies App. F's length normalisation to each prefix:

    paper (encoder):  y_t = W2[t] . GELU( (1/N) sum_{s<N} W1[s]^T x_s )
    causal (ours):    y_t = W2[t] . GELU( (1/(t+1)) sum_{s<=t} W1[s]^T x_s )

GELU sits between the prefix sum and W2, so, unlike linear attention, each position needs its own
U x C state. Positions go in chunks of I: a float64 carry plus an in-chunk cumulative sum gives a
chunk's states, used and dropped; the backward rebuilds them by subtracting each chunk's sum from the
carry. Half-precision inputs are mixed in fp32: bf16 prefix sums and 1/(t+1) are too inexact.
Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from .config import _positive
from .gmlp import MLP, check_decodable
from .precision import accumulation_dtype, no_autocast
from .profiling import RANGES
from .transformer import sinusoidal_positions

__all__ = ["CHUNK_ELEMENTS", "HyperMixerConfig", "hypermixing", "hypermixing_step", "HyperMixingUnit"]

CHUNK_ELEMENTS = 1 << 24  # auto chunk: at most this many elements per (B, I, U, C) tensor (64 MB in float32)


@dataclass(frozen=True, kw_only=True)
class HyperMixerConfig:
    """Causal HyperMixing in the SGU's place.

    dim:          mixer input width F, split into z1 and z2 of C = F/2 channels each.
    hidden_dim:   d', hidden units of the generated token-mixing MLP (hypernetwork output width).
    hyper_hidden: hidden width of each hypernetwork MLP (Algorithm 1: MLP([d, d, d']), i.e. C).
    tied:         one hypernetwork for W1 and W2 (W2 = W1, section 2.3), else two.
    chunk_size:   positions per chunk of the causal prefix computation; 0 = automatic.
    causal:       False gives the paper's encoder form (every position sees every position);
                  it exists as the negative control of the causality tests, not for language models.
    """

    dim: int
    hidden_dim: int
    hyper_hidden: int
    tied: bool = True
    chunk_size: int = 0
    causal: bool = True

    def __post_init__(self) -> None:
        _positive("dim", self.dim)
        _positive("hidden_dim", self.hidden_dim)
        _positive("hyper_hidden", self.hyper_hidden)
        if self.dim % 2:
            raise ValueError(f"dim={self.dim} must be even: HyperMixing splits it into two halves")
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 0:
            raise ValueError(f"chunk_size={self.chunk_size!r} is invalid: it must be 0 (automatic) or a positive "
                             "integer")
        for name in ("tied", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be True or False")

    @property
    def gated_dim(self) -> int:
        return self.dim // 2


# ---------------------------------------------------------------- HyperMixing, causal prefix form


def _chunk_len(chunk_size: int, B: int, U: int, C: int, n: int) -> int:
    if chunk_size:
        return min(chunk_size, n)
    return max(1, min(n, CHUNK_ELEMENTS // max(1, B * U * C)))


def _carry_dtype(x: Tensor) -> torch.dtype:
    # float64 keeps the backward's carry reconstruction exact; MPS has none.
    return torch.float32 if x.device.type == "mps" else torch.float64


def _outer(u_BIU: Tensor, v_BIC: Tensor) -> Tensor:
    """A_s = W1[s]^T x_s for every position of a chunk, (B, I, U, C).

    Under tracing (the FLOP counter) a matmul with inner size 1, so that these multiply-adds are
    counted; otherwise a broadcast multiply, faster on CPU. The numbers are the same either way.
    """
    if torch.jit.is_tracing():
        return torch.matmul(u_BIU.unsqueeze(-1), v_BIC.unsqueeze(-2))
    return u_BIU.unsqueeze(-1) * v_BIC.unsqueeze(-2)


def _states_(A_BIUC: Tensor, carry_BUC: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """In place: A_s -> Z_t = (carry + sum_{a<=s<=t} A_s) / (t+1); returns Z and 1/(t+1), (I, 1, 1).

    A loop of in-place adds over contiguous (B, U, C) slices, faster on CPU than torch.cumsum along
    dim 1. Forward and backward both use it, so their states agree bitwise.
    """
    I = A_BIUC.shape[1]
    A_BIUC[:, 0].add_(carry_BUC.to(A_BIUC.dtype))
    for i in range(1, I):
        A_BIUC[:, i].add_(A_BIUC[:, i - 1])
    inv_I = 1.0 / torch.arange(start + 1, start + I + 1, device=A_BIUC.device, dtype=A_BIUC.dtype)[:, None, None]
    return A_BIUC.mul_(inv_I), inv_I


def _causal_forward(u_BNU: Tensor, v_BNC: Tensor, w_BNU: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """y_t = w_t . GELU(S_t / (t+1)) chunk by chunk; returns y and the final carry S_{n-1}."""
    B, n, U = u_BNU.shape
    C = v_BNC.shape[-1]
    # meta tensors (the FLOPs calculator's trace) hold no memory: one chunk, a short trace, the same count
    I = n if v_BNC.is_meta else _chunk_len(chunk_size, B, U, C, n)
    carry_BUC = torch.zeros(B, U, C, device=v_BNC.device, dtype=_carry_dtype(v_BNC))
    acc = accumulation_dtype(v_BNC.dtype)
    ys = []
    for a in range(0, n, I):
        b = min(a + I, n)
        A_BIUC = _outer(u_BNU[:, a:b].to(acc), v_BNC[:, a:b].to(acc))
        chunk_BUC = A_BIUC.sum(dim=1).to(carry_BUC.dtype)
        Z_BIUC, _ = _states_(A_BIUC, carry_BUC, a)
        y_BIC = torch.matmul(w_BNU[:, a:b].to(acc).unsqueeze(-2), F.gelu(Z_BIUC)).squeeze(-2)
        ys.append(y_BIC.to(v_BNC.dtype))  # (B, I, C)
        carry_BUC = carry_BUC + chunk_BUC
    return torch.cat(ys, dim=1), carry_BUC


class _CausalHyperMixing(torch.autograd.Function):
    """Chunked causal HyperMixing whose backward recomputes the states (memory independent of n)."""

    @staticmethod
    def forward(ctx, u_BNU, v_BNC, w_BNU, chunk_size):
        y_BNC, carry_BUC = _causal_forward(u_BNU, v_BNC, w_BNU, chunk_size)
        ctx.save_for_backward(u_BNU, v_BNC, w_BNU, carry_BUC)
        ctx.chunk_size = chunk_size
        return y_BNC

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_BNC):
        u_BNU, v_BNC, w_BNU, carry_BUC = ctx.saved_tensors
        B, n, U = u_BNU.shape
        C = v_BNC.shape[-1]
        I = _chunk_len(ctx.chunk_size, B, U, C, n)
        du, dv, dw = torch.empty_like(u_BNU), torch.empty_like(v_BNC), torch.empty_like(w_BNU)
        later_BUC = torch.zeros_like(carry_BUC)  # sum of dL/dS_t over the positions after this chunk
        acc = accumulation_dtype(v_BNC.dtype)
        with no_autocast(u_BNU.device):
            for a in reversed(range(0, n, I)):
                b = min(a + I, n)
                u, v, w, dy = (t[:, a:b].to(acc) for t in (u_BNU, v_BNC, w_BNU, dy_BNC))
                A_BIUC = _outer(u, v)
                carry_BUC = carry_BUC - A_BIUC.sum(dim=1).to(carry_BUC.dtype)  # the carry before this chunk
                Z_BIUC, inv_I = _states_(A_BIUC, carry_BUC, a)
                H_BIUC = F.gelu(Z_BIUC)
                dw[:, a:b] = (H_BIUC * dy.unsqueeze(-2)).sum(-1)  # a batched matrix-vector bmm is slower on CPU
                dH_BIUC = torch.mul(w.unsqueeze(-1), dy.unsqueeze(-2), out=H_BIUC)
                dS_BIUC = torch.ops.aten.gelu_backward(dH_BIUC, Z_BIUC).mul_(inv_I)
                del A_BIUC, Z_BIUC, H_BIUC, dH_BIUC
                # S_t sums A_s over s <= t, so dL/dA_s = sum over t >= s of dL/dS_t: suffix sums in place
                for i in range(b - a - 2, -1, -1):
                    dS_BIUC[:, i].add_(dS_BIUC[:, i + 1])
                chunk_BUC = dS_BIUC[:, 0].to(later_BUC.dtype, copy=True)  # this chunk's sum
                dA_BIUC = dS_BIUC.add_(later_BUC.to(dS_BIUC.dtype).unsqueeze(1))
                later_BUC = later_BUC + chunk_BUC
                du[:, a:b] = (dA_BIUC * v.unsqueeze(-2)).sum(-1)
                dv[:, a:b] = torch.matmul(u.unsqueeze(-2), dA_BIUC).squeeze(-2)
        return du, dv, dw, None


def hypermixing(u_BNU: Tensor, v_BNC: Tensor, w_BNU: Tensor, *, causal: bool = True, chunk_size: int = 0) -> Tensor:
    """HyperMixing of values v with generated weights u = W1 and w = W2.

    causal: y_t = w_t . GELU(sum_{s<=t} u_s v_s^T / (t+1)), chunked, memory independent of n.
    not causal (the paper's encoder form): y_t = w_t . GELU(sum_{s<n} u_s v_s^T / n).
    """
    if u_BNU.dim() != 3 or u_BNU.shape != w_BNU.shape or v_BNC.shape[:2] != u_BNU.shape[:2]:
        raise ValueError(f"hypermixing expects u and w of shape (B, N, R) and v of shape (B, N, C) (R hidden units, "
                         f"C channels), got "
                         f"{tuple(u_BNU.shape)}, {tuple(w_BNU.shape)}, {tuple(v_BNC.shape)}")
    if not causal:
        n = v_BNC.shape[1]
        H_BUC = F.gelu(torch.matmul(u_BNU.transpose(1, 2), v_BNC) / n)
        return torch.matmul(w_BNU, H_BUC)
    # One dtype, no autocast: the backward must rebuild exactly the forward's states.
    dtype = torch.promote_types(torch.promote_types(u_BNU.dtype, v_BNC.dtype), w_BNU.dtype)
    u_BNU, v_BNC, w_BNU = u_BNU.to(dtype), v_BNC.to(dtype), w_BNU.to(dtype)
    with no_autocast(v_BNC.device):
        if torch.is_grad_enabled() and (u_BNU.requires_grad or v_BNC.requires_grad or w_BNU.requires_grad):
            return _CausalHyperMixing.apply(u_BNU, v_BNC, w_BNU, chunk_size)
        return _causal_forward(u_BNU, v_BNC, w_BNU, chunk_size)[0]


def hypermixing_step(u_BkU: Tensor, v_BkC: Tensor, w_BkU: Tensor, carry_BUC: Tensor | None, start: int, *,
                     chunk_size: int = 0) -> tuple[Tensor, Tensor]:
    """Causal HyperMixing of positions start..start+k-1 given the prefix sum of the earlier ones.

    carry_BUC = S_{start-1} = sum_{s<start} u_s v_s^T (None: start = 0), kept in float64 as the
    full forward keeps its carry. Returns y (B, k, C) and the new carry S_{start+k-1}: O(k U C)
    per call whatever `start` is (cached decoding, smlp/decoding_cache.py).
    """
    dtype = torch.promote_types(torch.promote_types(u_BkU.dtype, v_BkC.dtype), w_BkU.dtype)
    u_BkU, v_BkC, w_BkU = u_BkU.to(dtype), v_BkC.to(dtype), w_BkU.to(dtype)
    B, k, U = u_BkU.shape
    C = v_BkC.shape[-1]
    if carry_BUC is None:
        carry_BUC = torch.zeros(B, U, C, device=v_BkC.device, dtype=_carry_dtype(v_BkC))
    I = _chunk_len(chunk_size, B, U, C, k)
    ys = []
    with no_autocast(v_BkC.device):
        for a in range(0, k, I):
            b = min(a + I, k)
            A_BIUC = _outer(u_BkU[:, a:b], v_BkC[:, a:b])
            chunk_BUC = A_BIUC.sum(dim=1).to(carry_BUC.dtype)
            Z_BIUC, _ = _states_(A_BIUC, carry_BUC, start + a)
            ys.append(torch.matmul(w_BkU[:, a:b].unsqueeze(-2), F.gelu(Z_BIUC)).squeeze(-2))
            carry_BUC = carry_BUC + chunk_BUC
    return torch.cat(ys, dim=1), carry_BUC


class HyperMixingUnit(nn.Module):
    """out = z1 * LayerNorm(HyperMixing(LayerNorm(z2))), causal; the gMLP block's SGU replaced."""

    def __init__(self, cfg: HyperMixerConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.gated_dim
        self.norm = nn.LayerNorm(C)
        self.hyper_in = MLP(C, cfg.hyper_hidden, cfg.hidden_dim)  # generates W1 (and W2 when tied)
        self.hyper_out = None if cfg.tied else MLP(C, cfg.hyper_hidden, cfg.hidden_dim)
        self.out_norm = nn.LayerNorm(C)
        with torch.no_grad():
            self.out_norm.bias.fill_(1.0)  # gate near one at the start, as the SGU's bias (gMLP 2.1)

    def forward(self, z_BNF: Tensor) -> Tensor:
        with record_function(RANGES["token_mixing"]):
            return self._forward(z_BNF)

    def _forward(self, z_BNF: Tensor) -> Tensor:
        if z_BNF.dim() != 3 or z_BNF.shape[-1] != self.cfg.dim:
            raise ValueError(f"HyperMixingUnit expects (batch, length, {self.cfg.dim}), got {tuple(z_BNF.shape)}")
        z1_BNC, z2_BNC = z_BNF.chunk(2, dim=-1)
        v_BNC = self.norm(z2_BNC)
        n, C = v_BNC.shape[1:]
        h_BNC = v_BNC + sinusoidal_positions(n, C, v_BNC.device, v_BNC.dtype)  # x_j + p_j (section 2.3)
        u_BNU = self.hyper_in(h_BNC)
        w_BNU = u_BNU if self.hyper_out is None else self.hyper_out(h_BNC)
        m_BNC = hypermixing(u_BNU, v_BNC, w_BNU, causal=self.cfg.causal, chunk_size=self.cfg.chunk_size)
        return z1_BNC * self.out_norm(m_BNC)

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding (smlp/decoding_cache.py): the running prefix sum S is kept, (B, U, C) float64."""
        check_decodable(self, self.cfg.causal)
        with record_function(RANGES["token_mixing"]):
            z1_BkC, z2_BkC = z_BkF.chunk(2, dim=-1)
            v_BkC = self.norm(z2_BkC)
            k, C = v_BkC.shape[1:]
            h_BkC = v_BkC + sinusoidal_positions(k, C, v_BkC.device, v_BkC.dtype, start=start)
            u_BkU = self.hyper_in(h_BkC)
            w_BkU = u_BkU if self.hyper_out is None else self.hyper_out(h_BkC)
            m_BkC, state["carry"] = hypermixing_step(u_BkU, v_BkC, w_BkU, state.get("carry"), start,
                                                     chunk_size=self.cfg.chunk_size)
            return z1_BkC * self.out_norm(m_BkC)
