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

Several experts on one rank (more experts than ranks, or a consolidated model evaluated on one
process) run as one product, not one small matmul each: with equal counts (balanced routing,
deterministic sMoE) the L experts' rows are an (L, c, ...) batch for one batched matmul; with
unequal counts the FFN experts pad every expert's rows to the largest count (`_pad_rows`) when
the padding costs less than the loop's per-matmul overhead would, and loop otherwise; the spatial
experts loop (each a blocked causal product, causal.py). benchmarks/local_experts.py measures
32 experts of the paper-small shapes (scaled down) before and after.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .causal import causal_product
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


def _check_counts(x_RD: Tensor, counts_L: list[int]) -> None:
    if sum(counts_L) != x_RD.shape[0]:
        raise ValueError(f"expert counts {counts_L} do not add up to the {x_RD.shape[0]} rows received")


def _split_rows(x_RD: Tensor, counts_L: list[int]) -> list[Tensor]:
    _check_counts(x_RD, counts_L)
    return list(torch.split(x_RD, counts_L, dim=0))


def _equal_count(counts_L: list[int]) -> int | None:
    """The common count when every local expert got the same number of rows, else None."""
    return counts_L[0] if counts_L and all(c == counts_L[0] for c in counts_L) else None


# Padding unequal counts to the largest one wastes (L * max - R) rows of work; below this share of
# the real rows it costs less than looping over the experts (measured, benchmarks/local_experts.py).
PAD_WASTE_LIMIT = 0.5


def _pad_rows(x_RD: Tensor, counts_L: list[int]) -> tuple[Tensor, Tensor]:
    """x's rows as an (L, max count, D) batch, zero rows after each expert's own, and the index of
    each real row in the flattened batch (to gather the outputs back)."""
    L, c_max = len(counts_L), max(counts_L)
    counts = torch.tensor(counts_L, device=x_RD.device)
    starts = torch.cumsum(counts, 0) - counts
    expert_R = torch.repeat_interleave(torch.arange(L, device=x_RD.device), counts, output_size=x_RD.shape[0])
    slot_R = expert_R * c_max + torch.arange(x_RD.shape[0], device=x_RD.device) - starts[expert_R]
    padded = x_RD.new_zeros(L * c_max, x_RD.shape[-1]).index_copy(0, slot_R, x_RD)
    return padded.view(L, c_max, -1), slot_R


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
        _check_counts(x_RD, counts_L)
        L, R = len(counts_L), x_RD.shape[0]
        c = _equal_count(counts_L)
        if torch.jit.is_tracing():  # FLOP counters (fvcore) count the loop's matmuls, never padding
            return self.forward_loop(x_RD, counts_L)
        if L > 1 and c is not None:  # balanced: one batched product
            return self._batched(x_RD.reshape(L, c, x_RD.shape[-1])).reshape(R, x_RD.shape[-1])
        if L > 1 and R and L * max(counts_L) - R <= PAD_WASTE_LIMIT * R:  # grouped: padded to the largest count
            x_LcD, slot_R = _pad_rows(x_RD, counts_L)
            return self._batched(x_LcD).flatten(0, 1).index_select(0, slot_R)
        return self.forward_loop(x_RD, counts_L)

    def _batched(self, x_LcD: Tensor) -> Tensor:
        if self.norm_weight is not None:  # each expert's own affine LayerNorm
            x_LcD = F.layer_norm(x_LcD, x_LcD.shape[-1:]) * self.norm_weight[:, None] + self.norm_bias[:, None]
        h_LcF = self.activation(torch.baddbmm(self.b1[:, None], x_LcD, self.w1))
        return torch.baddbmm(self.b2[:, None], h_LcF, self.w2)

    def forward_loop(self, x_RD: Tensor, counts_L: list[int]) -> Tensor:
        """One matmul per local expert (the reference the batched and padded forms are tested against)."""
        D = x_RD.shape[-1]
        outs = []
        for l, chunk in enumerate(_split_rows(x_RD, counts_L)):
            if self.norm_weight is not None:
                chunk = F.layer_norm(chunk, (D,), self.norm_weight[l], self.norm_bias[l])
            h = self.activation(chunk @ self.w1[l] + self.b1[l])  # (R_l, F)
            outs.append(h @ self.w2[l] + self.b2[l])
        return torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]


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
        self.explicit_spatial = False  # the masked dense product, for FLOP counting (causal.explicit_spatial)

    def forward(self, x_RM: Tensor, counts_L: list[int]) -> Tensor:
        M = x_RM.shape[-1]
        check_length(M, self.size, "sMoE row")
        if self.explicit_spatial:
            return self.forward_dense(x_RM, counts_L)
        _check_counts(x_RM, counts_L)
        L, c = len(counts_L), _equal_count(counts_L)
        # the product runs positions first: a row block (c, M) is read as its transpose (M, c), in place
        if c is not None:  # equal counts: the L experts in one blocked product
            x_1MLc = x_RM.reshape(L, c, M).permute(2, 0, 1)[None]
            y_LcM = causal_product(self.weight, x_1MLc)[0].permute(1, 2, 0)
            return (y_LcM + (self.bias[:, None, :M] - 1)).reshape(L * c, M)
        outs = [causal_product(self.weight[l:l + 1], chunk.t()[None, :, None])[0, :, 0].t() + (self.bias[l, :M] - 1)
                for l, chunk in enumerate(_split_rows(x_RM, counts_L))]
        return torch.cat(outs, dim=0)

    def forward_dense(self, x_RM: Tensor, counts_L: list[int]) -> Tensor:
        """The masked dense form, one matmul per expert (the paper's FLOP convention, and the reference)."""
        M = x_RM.shape[-1]
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
