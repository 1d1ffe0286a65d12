"""Routers as pure functions: scores in, a routing plan out.

Shape legend (as in torchtitan's moe.py):
    S  rows to route (tokens for tMoE, hidden-dimension vectors for sMoE)
    E  experts (global)
    K  expert slots per row (1 for top-1 routers, 2 for GShard)
    V  vocabulary size (HASH layers)

A router never calls a collective and never owns parameters: the layer computes the
scores with its own weights, the router turns them into a `RoutingPlan`, and the
dispatcher moves rows accordingly. That keeps every routing rule testable in one process.

Token routers that balance or cap load in training (balanced assignment, capacity dropping)
couple the tokens of a batch by design: the expert a token gets depends on the other tokens.
They are causal per position only in eval mode, where each row is routed on its own scores.

Non-finite router scores (NaN, +-inf) are refused with `NonFiniteScoresError`, which names the
layer: they come from a diverged model or an overflow, and any expert choice made from them would
be arbitrary (argmax of NaN) while training went on silently. The check is one host read per
layer, next to the one the dispatcher makes anyway for its split sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .assignment import balanced_assignment

__all__ = [
    "RoutingPlan",
    "NonFiniteScoresError",
    "check_finite_scores",
    "sanitize_scores",
    "greedy_top1",
    "base_route",
    "hash_route",
    "smoe_deterministic_experts",
    "smoe_partial_route",
]


@dataclass(frozen=True)
class RoutingPlan:
    """Where each row goes and how its expert output is weighted.

    experts_SK: expert index per (row, slot), -1 where the slot is dropped (over capacity).
    weights_SK: combine weight per (row, slot); differentiable w.r.t. the router's scores.
                A dropped slot has weight 0.
    aux_loss:   auxiliary load-balancing loss (scalar) or None when the router has none.
    """

    experts_SK: Tensor
    weights_SK: Tensor
    aux_loss: Tensor | None = None

    def __post_init__(self) -> None:
        if self.experts_SK.dim() != 2 or self.experts_SK.shape != self.weights_SK.shape:
            raise ValueError(
                f"RoutingPlan needs experts_SK and weights_SK of the same (S, K) shape, got "
                f"{tuple(self.experts_SK.shape)} and {tuple(self.weights_SK.shape)}"
            )

    def counts(self, num_experts: int) -> Tensor:
        """Rows per expert (dropped slots excluded): (E,) long."""
        kept = self.experts_SK[self.experts_SK >= 0]
        return torch.bincount(kept, minlength=num_experts)


class NonFiniteScoresError(FloatingPointError):
    """Router scores with NaN or +-inf entries; the message names the layer and what to check."""


def check_finite_scores(scores_SE: Tensor, layer: str, *, allow_neg_inf: bool = False) -> None:
    """Raise NonFiniteScoresError naming `layer` if any score is NaN or infinite.

    allow_neg_inf: -inf marks an expert a row may not use (a masked logit of a softmax gate);
    a row then still needs one finite score.
    """
    bad_SE = torch.isnan(scores_SE) | torch.isposinf(scores_SE)
    if not allow_neg_inf:
        bad_SE |= torch.isneginf(scores_SE)
    bad_rows_S = bad_SE.any(dim=-1)
    if allow_neg_inf and scores_SE.shape[-1]:
        bad_rows_S |= torch.isneginf(scores_SE).all(dim=-1)
    if not bool(bad_rows_S.any()):
        return
    S = scores_SE.shape[0]
    n_nan = int(torch.isnan(scores_SE).sum())
    n_pos = int(torch.isposinf(scores_SE).sum())
    n_neg = int(torch.isneginf(scores_SE).sum())
    first = int(bad_rows_S.nonzero()[0, 0])
    raise NonFiniteScoresError(
        f"{layer}: router scores are not finite in {int(bad_rows_S.sum())} of {S} rows (first: row {first}; "
        f"{n_nan} NaN, {n_pos} +inf, {n_neg} -inf entries). The layer's input or router weights have "
        f"diverged or overflowed; no expert choice can be made from them. Check the loss before this "
        f"step, lower the learning rate, or train in fp32 / with a smaller --fp16-init-scale."
    )


def sanitize_scores(scores_SE: Tensor) -> Tensor:
    """Replace NaN and +-inf by finite values so argmax/auction never see them.

    NaN and -inf become the smallest finite score (the expert is least wanted), +inf the
    largest. If nothing is finite the result is all zeros (every assignment is equally good).
    """
    finite = torch.isfinite(scores_SE)
    if bool(finite.all()):
        return scores_SE
    if not bool(finite.any()):
        return torch.zeros_like(scores_SE)
    lo = scores_SE[finite].min()
    hi = scores_SE[finite].max()
    out = torch.where(torch.isposinf(scores_SE), hi, scores_SE)
    return torch.where(torch.isnan(out) | torch.isneginf(out), lo, out)


def greedy_top1(scores_SE: Tensor) -> Tensor:
    """Inference-time routing: each row to its best expert, independently of the others."""
    return sanitize_scores(scores_SE).argmax(dim=-1)


def base_route(scores_SE: Tensor, *, training: bool, layer: str = "base router") -> RoutingPlan:
    """Base Layers (Lewis et al. 2021): balanced assignment in training, greedy top-1 at inference.

    The combine weight is sigmoid(x . c_e) of the chosen expert, so the layer output
    sigmoid * expert(x) + (1 - sigmoid) * x gives the centroids a gradient. Degenerate but
    finite scores (all equal, one expert preferred by every row) are still assigned with exact
    balance; non-finite scores raise NonFiniteScoresError naming `layer`.
    """
    scores_SE = scores_SE.float()
    check_finite_scores(scores_SE.detach(), layer)
    with torch.no_grad():
        expert_S = balanced_assignment(scores_SE.detach()) if training else scores_SE.detach().argmax(dim=-1)
    chosen_S = scores_SE.gather(1, expert_S[:, None]).squeeze(1)
    weight_S = torch.sigmoid(chosen_S)
    return RoutingPlan(expert_S[:, None], weight_S[:, None])


def hash_route(token_ids_S: Tensor, table_V: Tensor) -> RoutingPlan:
    """HASH Layers (Roller et al. 2021): a fixed token-id -> expert table, weight 1."""
    if token_ids_S.numel() and (int(token_ids_S.min()) < 0 or int(token_ids_S.max()) >= table_V.numel()):
        raise ValueError(
            f"hash routing got token ids in [{int(token_ids_S.min())}, {int(token_ids_S.max())}] "
            f"but the hash table covers ids 0..{table_V.numel() - 1}; the vocabulary does not match the table"
        )
    expert_S = table_V[token_ids_S.long()]
    return RoutingPlan(expert_S[:, None], torch.ones(expert_S.shape[0], 1, device=expert_S.device))


def smoe_deterministic_experts(num_channels: int, num_experts: int, device=None) -> Tensor:
    """sMoE deterministic routing (sec. 3.2.1): hidden chunk i -> expert i. Returns expert per channel."""
    if num_channels % num_experts:
        raise ValueError(
            f"sMoE deterministic routing splits {num_channels} hidden dimensions into {num_experts} "
            f"equal chunks: the number of experts must divide the hidden size"
        )
    return torch.arange(num_experts, device=device).repeat_interleave(num_channels // num_experts)


def smoe_partial_route(logits_SE: Tensor, *, training: bool, layer: str = "sMoE router") -> RoutingPlan:
    """sMoE partial prediction routing (sec. 3.2.2, eq. 5).

    logits_SE are the router logits of each hidden-dimension vector, computed from the first
    20% of positions only. Training uses balanced assignment (every expert gets the same number
    of hidden dimensions); inference routes each vector to its most probable expert, so the
    result does not depend on the batch. The combine weight is the softmax probability of the
    chosen expert (eq. 7), which trains the router. Non-finite logits raise
    NonFiniteScoresError naming `layer`.
    """
    logits_SE = logits_SE.float()
    check_finite_scores(logits_SE.detach(), layer)
    probs_SE = torch.softmax(logits_SE, dim=-1)
    with torch.no_grad():
        expert_S = balanced_assignment(logits_SE.detach()) if training else logits_SE.detach().argmax(dim=-1)
    weight_S = probs_SE.gather(1, expert_S[:, None]).squeeze(1)
    return RoutingPlan(expert_S[:, None], weight_S[:, None])
