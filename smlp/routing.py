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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .assignment import balanced_assignment

__all__ = [
    "RoutingPlan",
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


def base_route(scores_SE: Tensor, *, training: bool) -> RoutingPlan:
    """Base Layers (Lewis et al. 2021): balanced assignment in training, greedy top-1 at inference.

    The combine weight is sigmoid(x . c_e) of the chosen expert, so the layer output
    sigmoid * expert(x) + (1 - sigmoid) * x gives the centroids a gradient.
    """
    scores_SE = scores_SE.float()
    with torch.no_grad():
        clean = sanitize_scores(scores_SE.detach())
        expert_S = balanced_assignment(clean) if training else clean.argmax(dim=-1)
    chosen_S = scores_SE.gather(1, expert_S[:, None]).squeeze(1)
    weight_S = torch.sigmoid(torch.nan_to_num(chosen_S))
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


def smoe_partial_route(logits_SE: Tensor, *, training: bool) -> RoutingPlan:
    """sMoE partial prediction routing (sec. 3.2.2, eq. 5).

    logits_SE are the router logits of each hidden-dimension vector, computed from the first
    20% of positions only. Training uses balanced assignment (every expert gets the same number
    of hidden dimensions); inference routes each vector to its most probable expert, so the
    result does not depend on the batch. The combine weight is the softmax probability of the
    chosen expert (eq. 7), which trains the router.
    """
    probs_SE = torch.softmax(torch.nan_to_num(logits_SE.float()), dim=-1)
    with torch.no_grad():
        clean = sanitize_scores(logits_SE.detach().float())
        expert_S = balanced_assignment(clean) if training else clean.argmax(dim=-1)
    weight_S = probs_SE.gather(1, expert_S[:, None]).squeeze(1)
    return RoutingPlan(expert_S[:, None], weight_S[:, None])
