"""Experts: the parameters that live on one rank only.

Shape legend: R rows received (grouped by local expert), L local experts, D model width,
F FFN width, M row length of an sMoE row (positions), T expert spatial size.

Initialization does not depend on the world size: expert e of a layer gets the same initial
weights whether it lives in a single process holding all experts or on any rank of an
expert-parallel group, and building a layer advances the global RNG by the same single draw
either way, so every later parameter is the same too. That makes a seeded W-rank run start from
exactly the model a seeded single-process run starts from (tests compare the two).

Every expert parameter carries `param.expert = True`: fairseq's legacy_ddp then skips it in the
gradient all-reduce and clip_grad_norm_ treats it per rank (DESIGN.md, fairseq facts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .mixers import causal_weight, check_length, init_spatial_, uniform_per_slice_

__all__ = ["mark_expert", "FFNExperts", "SpatialExperts"]


def mark_expert(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.expert = True
    return module


def _expert_generators(num_local_experts: int, first_expert: int) -> list[torch.Generator]:
    """One CPU generator per local expert, seeded from one draw of the global RNG plus the expert's
    global index."""
    base = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))  # the CPU RNG even under a default-device context
    return [torch.Generator().manual_seed(base + first_expert + l) for l in range(num_local_experts)]


def _split_rows(x_RD: Tensor, counts_L: list[int]) -> list[Tensor]:
    if sum(counts_L) != x_RD.shape[0]:
        raise ValueError(f"expert counts {counts_L} do not add up to the {x_RD.shape[0]} rows received")
    return list(torch.split(x_RD, counts_L, dim=0))


class FFNExperts(nn.Module):
    """L feed-forward experts D -> F -> D, optionally with their own input LayerNorm (Base Layers).

    zero_output: the second projection's weight starts at zero (fairseq's Base Layers expert,
    `BaseSublayer.ff2.weight.data.zero_()`), so each expert starts as a constant (its bias) and
    the layer close to the identity. The RNG draws are the same either way.

    Weights are stacked with the local-expert index first (like every expert parameter here), so
    moving experts between world sizes is slicing and concatenating along dim 0.
    """

    def __init__(self, num_local_experts: int, d_model: int, d_ffn: int, *, activation: str = "gelu",
                 norm: bool = False, zero_output: bool = False, first_expert: int = 0):
        super().__init__()
        L, D, Fw = num_local_experts, d_model, d_ffn
        self.activation = F.gelu if activation == "gelu" else F.relu
        self.w1 = nn.Parameter(torch.empty(L, D, Fw))
        self.b1 = nn.Parameter(torch.empty(L, Fw))
        self.w2 = nn.Parameter(torch.empty(L, Fw, D))
        self.b2 = nn.Parameter(torch.empty(L, D))
        gens = _expert_generators(L, first_expert)
        for param, bound in ((self.w1, D ** -0.5), (self.b1, D ** -0.5), (self.w2, Fw ** -0.5), (self.b2, Fw ** -0.5)):
            uniform_per_slice_(param, bound, gens)
        if zero_output:
            with torch.no_grad():
                self.w2.zero_()
        if norm:
            self.norm_weight = nn.Parameter(torch.ones(L, D))
            self.norm_bias = nn.Parameter(torch.zeros(L, D))
        else:
            self.norm_weight = self.norm_bias = None
        mark_expert(self)

    def forward(self, x_RD: Tensor, counts_L: list[int]) -> Tensor:
        D = x_RD.shape[-1]
        outs = []
        for l, chunk in enumerate(_split_rows(x_RD, counts_L)):
            if self.norm_weight is not None:
                chunk = F.layer_norm(chunk, (D,), self.norm_weight[l], self.norm_bias[l])
            h = self.activation(chunk @ self.w1[l] + self.b1[l])  # (R_l, F)
            outs.append(h @ self.w2[l] + self.b2[l])
        return torch.cat(outs, dim=0)


class SpatialExperts(nn.Module):
    """L sMoE experts, each one causal spatial projection over positions (one SGU head).

    A row is one hidden dimension of one sequence: a vector over M <= T positions. An expert
    returns its gate minus one, W x + (b - 1), as the SGU's projection does (mixers.py): at the
    near-identity init W x is ~1e-5 and 1 + W x would round to exactly 1 in bf16 and fp16, in
    the expert and in the all2all that carries the rows back. The sMoE adds the one.
    """

    def __init__(self, num_local_experts: int, size: int, init_eps: float = 1e-3, first_expert: int = 0):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(num_local_experts, size, size))
        self.bias = nn.Parameter(torch.empty(num_local_experts, size))
        init_spatial_(self.weight, self.bias, init_eps, _expert_generators(num_local_experts, first_expert))
        mark_expert(self)

    def forward(self, x_RM: Tensor, counts_L: list[int]) -> Tensor:
        M = x_RM.shape[-1]
        check_length(M, self.size, "sMoE row")
        w_LMM = causal_weight(self.weight, M)
        outs = [chunk @ w_LMM[l].t() + (self.bias[l, :M] - 1)
                for l, chunk in enumerate(_split_rows(x_RM, counts_L))]
        return torch.cat(outs, dim=0)

    def step(self, x_RM: Tensor, counts_LW: list[list[int]], spans_W: list[tuple[int, int]]) -> Tensor:
        """Cached decoding: only the positions each row's source rank asked for, (R, K).

        Rows arrive grouped by local expert, then by source rank (counts_LW[l][w] rows); the rows
        of source rank w hold its positions 0..hi_w-1 (zero-padded to the common width) and want
        outputs at positions lo_w..hi_w-1: W[lo:hi, :hi] (diagonal shifted by lo) times the row,
        O(hi) per output position. K = the widest span; narrower spans are zero-padded on the right.
        Like `forward` it returns the gate minus one, W x + (b - 1).
        """
        K = max((hi - lo for lo, hi in spans_W), default=0)
        if sum(map(sum, counts_LW)) != x_RM.shape[0]:
            raise ValueError(f"expert counts {counts_LW} do not add up to the {x_RM.shape[0]} rows received")
        y_RK = x_RM.new_zeros(x_RM.shape[0], K)
        r = 0
        for l, counts_W in enumerate(counts_LW):
            for (lo, hi), c in zip(spans_W, counts_W):
                if c and hi > lo:
                    check_length(hi, self.size, "sMoE row")
                    w_kM = torch.tril(self.weight[l, lo:hi, :hi], diagonal=lo)
                    y_RK[r:r + c, :hi - lo] = x_RM[r:r + c, :hi] @ w_kM.t() + (self.bias[l, lo:hi] - 1)
                r += c
        return y_RK
