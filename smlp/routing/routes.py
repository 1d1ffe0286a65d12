"""Route functions without a capacity, logits in and plan out: Base Layers (Lewis et al. 2021), HASH
Layers (Roller et al. 2021) and the sMoE's deterministic and partial-prediction routings (sMLP sec.
3.2.1 and 3.2.2).

The balanced routings' experts are decided by their layer's prices (prices.RouterPrices.experts: the
balanced assignment in training, which makes a row's expert depend on the other rows of the batch;
argmax of score minus price at inference, row by row) and passed in as `expert_S`; without one a row
goes to the argmax of its scores (greedy, fairseq's BaseLayer at inference).
Non-finite scores raise NonFiniteScoresError naming `layer`, at once or, with `defer_checks`, where
the dispatcher reads the plan's check (plan.py). Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .plan import RoutingPlan, score_check, token_id_check

__all__ = ["base_route", "hash_route", "smoe_deterministic_experts", "smoe_partial_route"]


def base_route(scores_SE: Tensor, *, layer: str = "base router", defer_checks: bool | str = False,
               expert_S: Tensor | None = None) -> RoutingPlan:
    """Base Layers (Lewis et al. 2021): the rows' experts as their layer decided (`expert_S`: the balanced
    assignment in training, priced routing at inference; token_routers.BaseLayersRouter), else greedy top-1.

    The combine weight is sigmoid(x . c_e) of the chosen expert, so the layer output
    sigmoid * expert(x) + (1 - sigmoid) * x gives the centroids a gradient.
    """
    scores_SE = scores_SE.float()
    fault = score_check(scores_SE, layer, defer_checks)
    if expert_S is not None:
        expert_S = expert_S.reshape(-1).long()
    else:
        with torch.no_grad():
            expert_S = scores_SE.detach().argmax(dim=-1)
    chosen_S = scores_SE.gather(1, expert_S[:, None]).squeeze(1)
    weight_S = torch.sigmoid(chosen_S)
    return RoutingPlan(expert_S[:, None], weight_S[:, None], fault=fault)


def hash_route(token_ids_S: Tensor, table_V: Tensor, *, layer: str = "hash router",
               defer_checks: bool | str = False) -> RoutingPlan:
    """HASH Layers (Roller et al. 2021): a fixed token-id -> expert table, weight 1.

    Token ids outside the table raise ValueError; with defer_checks the lookup clamps them until
    then, so no out-of-range index reaches the device."""
    V = table_V.numel()
    fault = token_id_check(token_ids_S, V, layer, defer_checks)
    ids_S = token_ids_S.long()
    if defer_checks:
        ids_S = ids_S.clamp(0, max(V - 1, 0))  # valid ids are unchanged
    expert_S = table_V[ids_S]
    return RoutingPlan(expert_S[:, None], torch.ones(expert_S.shape[0], 1, device=expert_S.device), fault=fault)


def smoe_deterministic_experts(num_channels: int, num_experts: int, device=None) -> Tensor:
    """sMoE deterministic routing (sec. 3.2.1): hidden chunk i -> expert i. Returns expert per channel."""
    if num_channels % num_experts:
        raise ValueError(
            f"sMoE deterministic routing splits {num_channels} hidden dimensions into {num_experts} "
            f"equal chunks: the number of experts must divide the hidden size"
        )
    return torch.arange(num_experts, device=device).repeat_interleave(num_channels // num_experts)


def smoe_partial_route(logits_SE: Tensor, *, layer: str = "sMoE router", defer_checks: bool | str = False,
                       expert_S: Tensor | None = None) -> RoutingPlan:
    """sMoE partial prediction routing (sec. 3.2.2, eq. 5).

    logits_SE: the router logits of each hidden-dimension vector, read from the first P positions.
    expert_S: the vectors' experts as the layer decided (moe.SMoE.balanced_experts: training assigns every
    expert the same number of vectors, inference routes each by its logits minus the prices); without
    one, each vector to its most probable expert (greedy). The combine weight is that expert's softmax
    probability (eq. 7), which trains the router.
    """
    logits_SE = logits_SE.float()
    fault = score_check(logits_SE, layer, defer_checks)
    probs_SE = torch.softmax(logits_SE, dim=-1)
    if expert_S is not None:
        expert_S = expert_S.reshape(-1).long()
    else:
        with torch.no_grad():
            expert_S = logits_SE.detach().argmax(dim=-1)
    weight_S = probs_SE.gather(1, expert_S[:, None]).squeeze(1)
    return RoutingPlan(expert_S[:, None], weight_S[:, None], fault=fault)
