"""Token routers of the tMoE, as modules that own their parameters (Megatron-Core's `TopKRouter`).

`gating` computes the rows' logits in fp32 (logits.py), `routing` applies the rule (routes.py, gates.py)
and returns a `RoutingPlan`; `forward` is the two. The registry (registry.py) names each router's class
and keeps the facts other parts read (top-k, capacity, balance, FLOP accounting).

Shapes: the core's legend (smlp/__init__.py); here S rows, D their width, E experts, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from . import logits
from .assignment import balanced_assignment
from .gates import gshard_top2, switch_top1
from .plan import RoutingPlan
from .prices import RouterPrices
from .routes import base_route, hash_route

__all__ = ["Router", "BaseLayersRouter", "SwitchRouter", "GShardRouter", "HashRouter", "hash_table"]


def hash_table(vocab_size: int, num_experts: int, seed: int) -> Tensor:
    """A fixed random token-id -> expert table with (almost) equal ids per expert (HASH Layers)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.empty(vocab_size, dtype=torch.long)
    table[torch.randperm(vocab_size, generator=g)] = torch.arange(vocab_size) % num_experts
    return table


class Router(nn.Module):
    """A token router of a tMoE with config `cfg` (TMoEConfig); `dispatcher` is its layer's."""

    def __init__(self, cfg, dispatcher):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = dispatcher  # not a module: the layer's, for the routers that exchange metadata

    def gating(self, x_SD: Tensor) -> Tensor | None:
        """(S, E) fp32 logits of the rows, or None for a router that reads no scores."""
        raise NotImplementedError

    def routing(self, logits_SE: Tensor | None, token_ids_S: Tensor | None, *, layer: str,
                defer_checks: bool | str) -> RoutingPlan:
        raise NotImplementedError

    def forward(self, x_SD: Tensor, token_ids_S: Tensor | None = None, *, layer: str = "router",
                defer_checks: bool | str = False) -> RoutingPlan:
        """The rows' plan. `layer` names the layer in errors; defer_checks leaves the input check in the
        plan for the dispatcher to read (a DeferredCheck, plan.py), or with FLAG_ONLY its bare verdict.

        Returns:
            RoutingPlan: experts_SK (S, K), weights_SK (S, K), aux_loss (scalar or None), fault
        """
        return self.routing(self.gating(x_SD), token_ids_S, layer=layer, defer_checks=defer_checks)


class BaseLayersRouter(Router):
    """Base Layers (Lewis et al. 2021): balanced assignment in training, per-row routing at evaluation.

    The combine weight is sigmoid(x . c_e). Training assigns with exact balance, after the shuffle of
    rows to random ranks when the layer shuffles (fairseq's --base-shuffle; only the scores travel);
    the assignment's expert prices are recorded in `eval_prices` (folded once per optimizer step,
    prices.fold_prices). Evaluation routes as `eval_prices.experts` decides: argmax(score - price)
    (`cfg.eval_routing` "priced"), argmax(score) ("greedy", fairseq's BaseLayer), or the assignment
    over the batch (`assign_as_in_training`, a diagnostic: not causal).
    """

    def __init__(self, cfg, dispatcher):
        super().__init__(cfg, dispatcher)
        self.centroids = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
        nn.init.orthogonal_(self.centroids, gain=0.1)
        self.eval_prices = RouterPrices(cfg.num_experts, cfg.eval_routing)
        self.assign_as_in_training = False  # LanguageModel.assigning_as_in_training

    def gating(self, x_SD: Tensor) -> Tensor:
        return logits.router_logits(x_SD, self.centroids.t())

    def routing(self, logits_SE, token_ids_S, *, layer, defer_checks):
        if self.training and self.cfg.uses_shuffle:
            expert_S, counts_X = self._shuffled_assignment(logits_SE)
            plan = base_route(logits_SE, layer=layer, defer_checks=defer_checks, expert_S=expert_S)
            return plan if counts_X is None else plan._replace(dispatch_counts=counts_X)
        return base_route(logits_SE, layer=layer, defer_checks=defer_checks,
                          expert_S=self.balanced_experts(logits_SE))

    def balanced_experts(self, scores_SE: Tensor) -> Tensor | None:
        """The rows' experts (S,) without the shuffle, or None for greedy routing (the rule takes the argmax
        of the scores)."""
        return self.eval_prices.experts(scores_SE, assign=self.training or self.assign_as_in_training,
                                        observe=self.training)

    def _shuffled_assignment(self, scores_SE: Tensor) -> tuple[Tensor, Tensor | None]:
        """Base Layers' training-time assignment (fairseq's `base_shuffle`), moving routing metadata only.

        fairseq's BaseLayer sends every token to a random rank, assigns there, then sends it to its
        expert; the assignment reads only the scores, so:
        1. send the scores (S x E, fp32, no gradient) through the shuffle: fairseq's permutation and split;
        2. assign with exact balance over the rows that arrive (fairseq's assignment); its prices are
           recorded for the evaluation prices;
        3. send each row's expert back to its home rank, with the rows per (rank, expert) that the
           dispatch needs (the plan's dispatch_counts; None in one process).
        The tokens then go from home straight to their expert and back (one exchange each way, not two).
        """
        with torch.no_grad():
            shuffled_SE, shuffle = self.dispatcher.shuffle(scores_SE.detach())
            expert_S, price_E = balanced_assignment(shuffled_SE, with_prices=True,
                                                    check_every=self.eval_prices.auction_checks)
            self.eval_prices.observe(price_E, shuffled_SE.shape[0])
            return self.dispatcher.unshuffle_assignment(expert_S, shuffle, shuffled_SE)


class _SoftmaxGate(Router):
    """A learned gate (D -> E, no bias); keeps the logits of its last forward for the z-loss."""

    def __init__(self, cfg, dispatcher):
        super().__init__(cfg, dispatcher)
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.logits_SE: Tensor | None = None

    def gating(self, x_SD: Tensor) -> Tensor:
        self.logits_SE = logits.router_logits(x_SD, self.gate.weight.t())
        return self.logits_SE


class SwitchRouter(_SoftmaxGate):
    """Switch Transformer top-1 with a capacity (gates.switch_top1)."""

    def routing(self, logits_SE, token_ids_S, *, layer, defer_checks):
        return switch_top1(logits_SE, capacity_factor=self.cfg.capacity_factor,
                           eval_capacity_factor=self.cfg.eval_capacity_factor, training=self.training, layer=layer,
                           defer_checks=defer_checks)


class GShardRouter(_SoftmaxGate):
    """GShard top-2 with a capacity (gates.gshard_top2)."""

    def routing(self, logits_SE, token_ids_S, *, layer, defer_checks):
        return gshard_top2(logits_SE, training=self.training, capacity_factor=self.cfg.capacity_factor,
                           eval_capacity_factor=self.cfg.eval_capacity_factor, aux_loss=self.cfg.gshard_aux_loss,
                           layer=layer, defer_checks=defer_checks)


class HashRouter(Router):
    """HASH Layers (Roller et al. 2021): a fixed random token-id -> expert table, kept in the checkpoint."""

    def __init__(self, cfg, dispatcher):
        super().__init__(cfg, dispatcher)
        self.register_buffer("hash_table", hash_table(cfg.vocab_size, cfg.num_experts, cfg.hash_seed))

    def gating(self, x_SD: Tensor) -> None:
        return None

    def routing(self, logits_SE, token_ids_S, *, layer, defer_checks):
        if token_ids_S is None:
            raise ValueError("router='hash' needs the token ids of the rows it routes")
        return hash_route(token_ids_S.reshape(-1), self.hash_table, layer=layer, defer_checks=defer_checks)
