"""Causal HyperMixer and NiNformer token mixers, in the SGU's place inside a gMLP block.

Both are all-MLP token mixers. Like the Spatial Gating Unit (gMLP section 2.1) each maps the
F-wide channel projection z of a gMLP block to F/2 channels: z is split into halves z1, z2 of
C = F/2 channels, z2 is mixed over positions into a gate, and the output is z1 * gate. Neither
paper gives a decoder form; the causal forms below are ours.

HyperMixer (Mai et al. 2023, "HyperMixer: An MLP-based Low Cost Alternative to Transformers",
section 2.3, Algorithm 1, Appendices D.2 and F). HyperMixing is MLP-Mixer's token-mixing MLP
TM-MLP(x_c) = W2 GELU(W1^T x_c), applied to every channel c, with the rows of W1, W2 (N x d')
generated per token by hypernetworks: W1[s] = MLP1(x_s + p_s), W2[t] = MLP2(x_t + p_t), where
p is a position embedding (here fixed sinusoids) and MLP_i: C -> C -> d' with GELU. Tied: W2 = W1.
The paper's output LayerNorm (Appendix F) is kept; its bias starts at one so the gate starts
near one, as the SGU's does (gMLP 2.1).

    paper (encoder):  y_t = W2[t] . GELU( (1/N) sum_{s<N} W1[s]^T x_s )      (length-normalised, App. F)
    causal (ours):    y_t = W2[t] . GELU( (1/(t+1)) sum_{s<=t} W1[s]^T x_s )   (positions 0..N-1)

The hidden layer of the token-mixing MLP is accumulated over the prefix and normalised by the
number of positions it holds (Appendix F's length normalisation, with the length each position
sees), then passed through GELU. Output t depends only on positions <= t; with t = N-1 it is the
paper's form. The prefix state S_t = sum_{s<=t} W1[s] (x) x_s is a d' x C matrix per position,
and GELU sits between the prefix sum and W2, so (unlike linear attention) the states cannot be
folded into the output. Computing them for all positions at once would hold N x d' x C numbers.
Instead positions go in chunks of L (`chunk_size`; 0 picks L so a chunk's (B, L, d', C) tensors stay
under CHUNK_ELEMENTS): a running d' x C carry plus an in-chunk cumulative sum gives the L states
of a chunk, which are used and dropped. Training uses a custom autograd function that saves only
its inputs and the final carry; the backward pass walks the chunks in reverse, rebuilding each
chunk's carry by subtracting the chunk's sum from the next carry, and accumulates from the end
the suffix sums the outer products need (dL/dA_s = sum_{t>=s} dL/dS_t). The carry is kept in
float64, so the subtraction recovers the earlier carry to float64 precision instead of cancelling
catastrophically (a float32 carry would lose ~n/t ulps at position t); HyperMixing runs in one
dtype with autocast off, so the backward rebuilds the states the forward used. Half-precision
inputs (fairseq --fp16 / --bf16, autocast) are mixed in fp32: each chunk is upcast, its prefix sums,
1/(t+1) (an arange in bf16 is wrong past 256) and GELU run in fp32, and only the outputs and input
gradients are stored in the input dtype (in bf16 the prefix sums alone cost 7% relative error).

Cost per sequence of n positions (d' = R hidden units, C channels, hypernetwork hidden width Hh):
    multiply-adds  n (C Hh + Hh R) per hypernetwork (1 tied, 2 untied)
                   + 2 n R C for the mixing (outer products W1[s] x_s^T, then W2[t] . H_t),
                   the paper's count (D.2: 4 N d' d operations = 2 N d' d multiply-adds),
                   + n R C additions (prefix sums) and n R C GELUs, which the encoder form
                   needs only R C times: the price of causality;
    memory         O(n (C + R)) for inputs and outputs + O(B L R C) working memory per chunk
                   + O(B R C) carry, whatever n is. Compute is linear in n.
The n R C elementwise work (prefix sums, GELU, and about 15 passes over (B, L, R, C) tensors in
training), not the multiply-adds, sets the wall-clock time: per FLOP this mixer is much slower than
the SGU or attention (3-4x per step for the tiny preset on CPU; memory-bandwidth bound on GPUs).
A fused kernel that keeps each state tile in registers would remove the passes; not written here.

NiNformer (Abdullah and Aydin 2024, section 3.2, eq. 8): Gating(I) = MLPMixer(I) * Linear(I), the
gate being one MLP-Mixer layer (token-mixing MLP over positions, then channel-mixing MLP, each
with a pre-LayerNorm and a residual). In a gMLP block z1 plays Linear(I) (the block's channel
projection already is a linear map of the normalised input) and the Mixer layer reads z2. The
token-mixing MLP x -> W2 GELU(W1 x + b1) + b2 over positions (T -> r T -> T) is made causal as
MADE does: hidden unit m belongs to position m // r; W1 connects input position s to unit m only
if s <= m // r, W2 connects unit m to output position t only if m // r <= t. Both weights are
masked themselves, sliced to the actual length n <= T (as the SGU's T x T weight). Cost:
2 r n^2 C multiply-adds for the token MLP (full products; the mask saves nothing, as for the
SGU) + 2 n C E for the channel MLP (hidden width E).

Shapes: B batch, N positions (n <= T), F mixer input width, C = F/2 gated channels, R hidden
units of the hypernetwork-generated MLP (d'), L positions per chunk, M = r n token-MLP hidden
units, E channel-MLP hidden width.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from .config import _positive
from .decoding import cache_append
from .mixers import check_length
from .profiling import RANGES
from .transformer import sinusoidal_positions

__all__ = [
    "TOKEN_MIXERS", "CHUNK_ELEMENTS", "HyperMixerConfig", "NiNformerConfig", "hypermixing", "hypermixing_step",
    "HyperMixingUnit",
    "CausalTokenMLP", "MixerSubUnit", "NiNformerGatingUnit", "make_token_mixer",
]

TOKEN_MIXERS = ("sgu", "hypermixer", "ninformer")  # what a gMLP block can mix tokens with
CHUNK_ELEMENTS = 1 << 24  # auto chunk: at most this many elements per (B, L, R, C) tensor (64 MB in float32)


@dataclass(frozen=True, kw_only=True)
class HyperMixerConfig:
    """Causal HyperMixing in the SGU's place (see the module docstring).

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


@dataclass(frozen=True, kw_only=True)
class NiNformerConfig:
    """NiNformer's gating unit with a causal token-mixing MLP (see the module docstring).

    dim:             mixer input width F, split into z1 and z2 of C = F/2 channels each.
    seq_len:         T, the token-mixing MLP's input/output size; inputs may be shorter.
    channel_hidden:  E, hidden width of the Mixer layer's channel-mixing MLP.
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


# ---------------------------------------------------------------- HyperMixing, causal prefix form


def _chunk_len(chunk_size: int, B: int, R: int, C: int, n: int) -> int:
    if chunk_size:
        return min(chunk_size, n)
    return max(1, min(n, CHUNK_ELEMENTS // max(1, B * R * C)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk is mixed in: at least fp32 (half-precision inputs are upcast per chunk)."""
    return torch.promote_types(dtype, torch.float32)


def _carry_dtype(x: Tensor) -> torch.dtype:
    # float64 makes the backward's carry reconstruction exact (module docstring); MPS has none.
    return torch.float32 if x.device.type == "mps" else torch.float64


def _no_autocast(device: torch.device):
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # a device type without autocast (meta): nothing to turn off
        return contextlib.nullcontext()


def _outer(u_BLR: Tensor, v_BLC: Tensor) -> Tensor:
    """A_s = W1[s]^T x_s for every position of a chunk, (B, l, R, C).

    Under tracing (fvcore, the FLOPs calculator) a matmul with inner size 1, so that these
    multiply-adds are counted; otherwise a broadcast multiply, 5-10x faster on CPU. Each entry is
    one product either way: the same numbers (tests/test_token_mixers.py checks it).
    """
    if torch.jit.is_tracing():
        return torch.matmul(u_BLR.unsqueeze(-1), v_BLC.unsqueeze(-2))
    return u_BLR.unsqueeze(-1) * v_BLC.unsqueeze(-2)


def _states_(A_BLRC: Tensor, carry_BRC: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """In place: A_s -> Z_t = (carry + sum_{a<=s<=t} A_s) / (t+1); returns Z and 1/(t+1), (l, 1, 1).

    A loop of in-place adds over contiguous (B, R, C) slices: torch.cumsum along dim 1 is about 15x
    slower on CPU here. Forward and backward both use this, so their states agree bitwise.
    """
    l = A_BLRC.shape[1]
    A_BLRC[:, 0].add_(carry_BRC.to(A_BLRC.dtype))
    for i in range(1, l):
        A_BLRC[:, i].add_(A_BLRC[:, i - 1])
    inv_L11 = 1.0 / torch.arange(start + 1, start + l + 1, device=A_BLRC.device, dtype=A_BLRC.dtype)[:, None, None]
    return A_BLRC.mul_(inv_L11), inv_L11


def _causal_forward(u_BNR: Tensor, v_BNC: Tensor, w_BNR: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """y_t = w_t . GELU(S_t / (t+1)) chunk by chunk; returns y and the final carry S_{n-1}."""
    B, n, R = u_BNR.shape
    C = v_BNC.shape[-1]
    # meta tensors (the FLOPs calculator's trace) hold no memory: one chunk, a short trace, the same count
    L = n if v_BNC.is_meta else _chunk_len(chunk_size, B, R, C, n)
    carry_BRC = torch.zeros(B, R, C, device=v_BNC.device, dtype=_carry_dtype(v_BNC))
    acc = _acc_dtype(v_BNC.dtype)
    ys = []
    for a in range(0, n, L):
        b = min(a + L, n)
        A_BLRC = _outer(u_BNR[:, a:b].to(acc), v_BNC[:, a:b].to(acc))
        chunk_BRC = A_BLRC.sum(dim=1).to(carry_BRC.dtype)
        Z_BLRC, _ = _states_(A_BLRC, carry_BRC, a)
        y_BLC = torch.matmul(w_BNR[:, a:b].to(acc).unsqueeze(-2), F.gelu(Z_BLRC)).squeeze(-2)
        ys.append(y_BLC.to(v_BNC.dtype))  # (B, l, C)
        carry_BRC = carry_BRC + chunk_BRC
    return torch.cat(ys, dim=1), carry_BRC


class _CausalHyperMixing(torch.autograd.Function):
    """Chunked causal HyperMixing whose backward recomputes the states (memory independent of n)."""

    @staticmethod
    def forward(ctx, u_BNR, v_BNC, w_BNR, chunk_size):
        y_BNC, carry_BRC = _causal_forward(u_BNR, v_BNC, w_BNR, chunk_size)
        ctx.save_for_backward(u_BNR, v_BNC, w_BNR, carry_BRC)
        ctx.chunk_size = chunk_size
        return y_BNC

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_BNC):
        u_BNR, v_BNC, w_BNR, carry_BRC = ctx.saved_tensors
        B, n, R = u_BNR.shape
        C = v_BNC.shape[-1]
        L = _chunk_len(ctx.chunk_size, B, R, C, n)
        du, dv, dw = torch.empty_like(u_BNR), torch.empty_like(v_BNC), torch.empty_like(w_BNR)
        later_BRC = torch.zeros_like(carry_BRC)  # sum of dL/dS_t over the positions after this chunk
        acc = _acc_dtype(v_BNC.dtype)
        with _no_autocast(u_BNR.device):
            for a in reversed(range(0, n, L)):
                b = min(a + L, n)
                u, v, w, dy = (t[:, a:b].to(acc) for t in (u_BNR, v_BNC, w_BNR, dy_BNC))
                A_BLRC = _outer(u, v)
                carry_BRC = carry_BRC - A_BLRC.sum(dim=1).to(carry_BRC.dtype)  # the carry before this chunk
                Z_BLRC, inv_L11 = _states_(A_BLRC, carry_BRC, a)
                H_BLRC = F.gelu(Z_BLRC)
                dw[:, a:b] = (H_BLRC * dy.unsqueeze(-2)).sum(-1)  # a batched matrix-vector bmm is slower on CPU
                dH_BLRC = torch.mul(w.unsqueeze(-1), dy.unsqueeze(-2), out=H_BLRC)
                dS_BLRC = torch.ops.aten.gelu_backward(dH_BLRC, Z_BLRC).mul_(inv_L11)
                del A_BLRC, Z_BLRC, H_BLRC, dH_BLRC
                # S_t sums A_s over s <= t, so dL/dA_s = sum over t >= s of dL/dS_t: suffix sums in place
                for i in range(b - a - 2, -1, -1):
                    dS_BLRC[:, i].add_(dS_BLRC[:, i + 1])
                chunk_BRC = dS_BLRC[:, 0].to(later_BRC.dtype, copy=True)  # this chunk's sum
                dA_BLRC = dS_BLRC.add_(later_BRC.to(dS_BLRC.dtype).unsqueeze(1))
                later_BRC = later_BRC + chunk_BRC
                du[:, a:b] = (dA_BLRC * v.unsqueeze(-2)).sum(-1)
                dv[:, a:b] = torch.matmul(u.unsqueeze(-2), dA_BLRC).squeeze(-2)
        return du, dv, dw, None


def hypermixing(u_BNR: Tensor, v_BNC: Tensor, w_BNR: Tensor, *, causal: bool = True, chunk_size: int = 0) -> Tensor:
    """HyperMixing of values v with generated weights u = W1 and w = W2 (module docstring).

    causal: y_t = w_t . GELU(sum_{s<=t} u_s v_s^T / (t+1)), chunked, memory independent of n.
    not causal (the paper's encoder form): y_t = w_t . GELU(sum_{s<n} u_s v_s^T / n).
    """
    if u_BNR.dim() != 3 or u_BNR.shape != w_BNR.shape or v_BNC.shape[:2] != u_BNR.shape[:2]:
        raise ValueError(f"hypermixing expects u and w of shape (B, N, R) and v of shape (B, N, C), got "
                         f"{tuple(u_BNR.shape)}, {tuple(w_BNR.shape)}, {tuple(v_BNC.shape)}")
    if not causal:
        n = v_BNC.shape[1]
        H_BRC = F.gelu(torch.matmul(u_BNR.transpose(1, 2), v_BNC) / n)
        return torch.matmul(w_BNR, H_BRC)
    # One dtype, no autocast: the backward must rebuild exactly the forward's states.
    dtype = torch.promote_types(torch.promote_types(u_BNR.dtype, v_BNC.dtype), w_BNR.dtype)
    u_BNR, v_BNC, w_BNR = u_BNR.to(dtype), v_BNC.to(dtype), w_BNR.to(dtype)
    with _no_autocast(v_BNC.device):
        if torch.is_grad_enabled() and (u_BNR.requires_grad or v_BNC.requires_grad or w_BNR.requires_grad):
            return _CausalHyperMixing.apply(u_BNR, v_BNC, w_BNR, chunk_size)
        return _causal_forward(u_BNR, v_BNC, w_BNR, chunk_size)[0]


def hypermixing_step(u_BkR: Tensor, v_BkC: Tensor, w_BkR: Tensor, carry_BRC: Tensor | None, start: int, *,
                     chunk_size: int = 0) -> tuple[Tensor, Tensor]:
    """Causal HyperMixing of positions start..start+k-1 given the prefix sum of the earlier ones.

    carry_BRC = S_{start-1} = sum_{s<start} u_s v_s^T (None: start = 0), kept in float64 as the
    full forward keeps its carry. Returns y (B, k, C) and the new carry S_{start+k-1}: O(k R C)
    per call whatever `start` is (cached decoding, smlp/decoding.py).
    """
    dtype = torch.promote_types(torch.promote_types(u_BkR.dtype, v_BkC.dtype), w_BkR.dtype)
    u_BkR, v_BkC, w_BkR = u_BkR.to(dtype), v_BkC.to(dtype), w_BkR.to(dtype)
    B, k, R = u_BkR.shape
    C = v_BkC.shape[-1]
    if carry_BRC is None:
        carry_BRC = torch.zeros(B, R, C, device=v_BkC.device, dtype=_carry_dtype(v_BkC))
    L = _chunk_len(chunk_size, B, R, C, k)
    ys = []
    with _no_autocast(v_BkC.device):
        for a in range(0, k, L):
            b = min(a + L, k)
            A_BLRC = _outer(u_BkR[:, a:b], v_BkC[:, a:b])
            chunk_BRC = A_BLRC.sum(dim=1).to(carry_BRC.dtype)
            Z_BLRC, _ = _states_(A_BLRC, carry_BRC, start + a)
            ys.append(torch.matmul(w_BkR[:, a:b].unsqueeze(-2), F.gelu(Z_BLRC)).squeeze(-2))
            carry_BRC = carry_BRC + chunk_BRC
    return torch.cat(ys, dim=1), carry_BRC


def _check_decodable(module: nn.Module, causal: bool) -> None:
    if not causal:
        raise ValueError(f"{type(module).__name__} was built with causal=False (every position sees every "
                         f"position): it cannot decode incrementally; only causal token mixers generate")


class _MLP(nn.Sequential):
    """Linear -> GELU -> Linear (the paper's MLP([d_in, d_hidden, d_out]))."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))


class HyperMixingUnit(nn.Module):
    """out = z1 * LayerNorm(HyperMixing(LayerNorm(z2))), causal; the gMLP block's SGU replaced."""

    def __init__(self, cfg: HyperMixerConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.gated_dim
        self.norm = nn.LayerNorm(C)
        self.hyper_in = _MLP(C, cfg.hyper_hidden, cfg.hidden_dim)  # generates W1 (and W2 when tied)
        self.hyper_out = None if cfg.tied else _MLP(C, cfg.hyper_hidden, cfg.hidden_dim)
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
        u_BNR = self.hyper_in(h_BNC)
        w_BNR = u_BNR if self.hyper_out is None else self.hyper_out(h_BNC)
        m_BNC = hypermixing(u_BNR, v_BNC, w_BNR, causal=self.cfg.causal, chunk_size=self.cfg.chunk_size)
        return z1_BNC * self.out_norm(m_BNC)

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding (smlp/decoding.py): the running prefix sum S is kept, (B, R, C) float64."""
        _check_decodable(self, self.cfg.causal)
        with record_function(RANGES["token_mixing"]):
            z1_BkC, z2_BkC = z_BkF.chunk(2, dim=-1)
            v_BkC = self.norm(z2_BkC)
            k, C = v_BkC.shape[1:]
            h_BkC = v_BkC + sinusoidal_positions(k, C, v_BkC.device, v_BkC.dtype, start=start)
            u_BkR = self.hyper_in(h_BkC)
            w_BkR = u_BkR if self.hyper_out is None else self.hyper_out(h_BkC)
            m_BkC, state["carry"] = hypermixing_step(u_BkR, v_BkC, w_BkR, state.get("carry"), start,
                                                     chunk_size=self.cfg.chunk_size)
            return z1_BkC * self.out_norm(m_BkC)


# ---------------------------------------------------------------- NiNformer


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
        M = expansion * seq_len
        self.w1 = nn.Parameter(torch.empty(M, seq_len))
        self.b1 = nn.Parameter(torch.empty(M))
        self.w2 = nn.Parameter(torch.empty(seq_len, M))
        self.b2 = nn.Parameter(torch.empty(seq_len))
        for p, fan_in in ((self.w1, seq_len), (self.b1, seq_len), (self.w2, M), (self.b2, M)):
            _uniform_fan_in_(p, fan_in)

    def weights(self, n: int) -> tuple[Tensor, Tensor]:
        """W1 (r n x n) and W2 (n x r n) for length n: hidden unit m belongs to position m // r."""
        m = self.expansion * n
        w1_MN, w2_NM = self.w1[:m, :n], self.w2[:n, :m]
        if not self.causal:
            return w1_MN, w2_NM
        pos_N = torch.arange(n, device=self.w1.device)
        unit_M = torch.arange(m, device=self.w1.device) // self.expansion
        reads_MN = pos_N[None, :] <= unit_M[:, None]  # unit m reads positions <= its own
        feeds_NM = unit_M[None, :] <= pos_N[:, None]  # output t reads units of positions <= t
        return w1_MN * reads_MN, w2_NM * feeds_NM

    def forward(self, x_BNC: Tensor) -> Tensor:
        n = x_BNC.shape[1]
        check_length(n, self.seq_len)
        w1_MN, w2_NM = self.weights(n)
        x_BCN = x_BNC.transpose(1, 2)
        h_BCM = F.gelu(torch.matmul(x_BCN, w1_MN.t()) + self.b1[:self.expansion * n])
        return (torch.matmul(h_BCM, w2_NM.t()) + self.b2[:n]).transpose(1, 2)

    def step(self, x_BkC: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..t-1 (smlp/decoding.py), (B, k, C).

        A hidden unit of position p reads positions <= p only, so once computed it never changes:
        the inputs and hidden units of past positions are kept, and a step computes the r k new
        units (reading t positions) and its k outputs (reading r t units): O(t) per position.
        """
        _check_decodable(self, self.causal)
        k = x_BkC.shape[1]
        t, r = start + k, self.expansion
        check_length(t, self.seq_len)
        x_BCt = cache_append(state, "x", x_BkC.transpose(1, 2), start, dim=2, limit=self.seq_len)
        pos_t = torch.arange(t, device=x_BkC.device)
        unit_M = torch.arange(r * t, device=x_BkC.device) // r
        new = slice(r * start, r * t)
        w1_Mt = self.w1[new, :t] * (pos_t[None, :] <= unit_M[new, None])  # new units read positions <= theirs
        h_BCm = F.gelu(torch.matmul(x_BCt, w1_Mt.t()) + self.b1[new])
        h_BCM = cache_append(state, "h", h_BCm, r * start, dim=2, limit=r * self.seq_len)
        w2_kM = self.w2[start:t, :r * t] * (unit_M[None, :] <= pos_t[start:, None])  # output s reads units <= s
        return (torch.matmul(h_BCM, w2_kM.t()) + self.b2[start:t]).transpose(1, 2)


class MixerSubUnit(nn.Module):
    """One MLP-Mixer layer: x + TokenMLP(LN(x)), then + ChannelMLP(LN(.)) (NiNformer's inner network)."""

    def __init__(self, cfg: NiNformerConfig):
        super().__init__()
        C = cfg.gated_dim
        self.token_norm = nn.LayerNorm(C)
        self.token_mlp = CausalTokenMLP(cfg.seq_len, cfg.token_expansion, cfg.causal)
        self.channel_norm = nn.LayerNorm(C)
        self.channel_mlp = _MLP(C, cfg.channel_hidden, C)

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
        """Cached decoding (smlp/decoding.py): the causal token MLP keeps its inputs and hidden units."""
        z1_BkC, z2_BkC = z_BkF.chunk(2, dim=-1)
        with record_function(RANGES["token_mixing"]):
            return z1_BkC * self.mixer.step(z2_BkC, state, start)


def make_token_mixer(cfg: HyperMixerConfig | NiNformerConfig) -> nn.Module:
    if isinstance(cfg, HyperMixerConfig):
        return HyperMixingUnit(cfg)
    if isinstance(cfg, NiNformerConfig):
        return NiNformerGatingUnit(cfg)
    raise TypeError(f"no token mixer for a config of type {type(cfg).__name__}")
