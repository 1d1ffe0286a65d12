"""The router registry: every token router and sMoE routing, with the facts other parts read.

sMLP sections 2.2 and 4.1 (the Transformer-MoE baselines) and 3.2 (the sMoE routings). The layers build
the router a name stands for (`TokenRouter.router_class`, token_routers.py); the configs take the valid
names and per-router defaults from here, the fairseq plugin its --moe-router choices, the FLOPs calculator
and the step-time model the multiply-adds and exchanged rows, the benchmarks the families. Adding a token
router is one entry here and its class (tests/test_router_registry.py registers a test router).

Token routers (the sMLP sparse block's tMoE is always `base`):
    gshard  top-2 softmax gate, capacity ceil(2S/E), load-balancing loss (gates.py)
    switch  top-1 softmax gate, capacity max(ceil(cf S/E), 4), load-balancing loss (gates.py)
    base    Base Layers: balanced assignment in training, per-row routing at inference (routes.py, prices.py)
    hash    HASH Layers: a fixed random token-id -> expert table
sMoE routings (the rows are hidden-dimension vectors, one per sequence and channel):
    deterministic        hidden chunk i -> expert i (3.2.1); no router
    partial              a router over the first P = round(prefix_fraction * T) positions (3.2.2)
    leaky-full-sequence  Appendix B: the router reads all T positions (NOT causal; Figure 7 only)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .gates import gshard_capacity, switch_capacity
from .routes import smoe_deterministic_experts, smoe_partial_route
from .token_routers import BaseLayersRouter, GShardRouter, HashRouter, Router, SwitchRouter, hash_table

__all__ = ["TokenRouter", "SMoERouting", "TOKEN_ROUTERS", "SMOE_ROUTINGS", "LEAKY_SMOE_ROUTING", "hash_table"]


@dataclass(frozen=True)
class TokenRouter:
    """One token router (tMoE) and everything the rest of the project needs to know about it.

    name:             --moe-router value, TMoEConfig.router, LMConfig.moe_router
    title:            display name (FLOPs tables, benchmark records)
    top_k:            expert slots per token: expert FLOPs and all2all rows are top_k x tokens
    aux_loss:         the load-balancing loss the criterion must add, in words (None: the router has
                      none); `LanguageModel.aux_loss` collects it from the layers
    capacity:         (tokens S, experts E, capacity factor) -> slots per expert in training, or None
                      when nothing is dropped; implementations that pad to capacity (GShard's and
                      Switch's own code) send and compute E x capacity rows (eval/flops/steptime.py, padding)
    placement:        the default sparse placement (`LMConfig.placement` for sparse_placement="auto")
    learned_scores:   the layer scores tokens with a D x E projection (router multiply-adds S x D x E);
                      False: a fixed table of token ids (no multiply-adds; TMoEConfig needs vocab_size)
    router_class:     the module the layer builds, (TMoEConfig, dispatcher) -> Router (token_routers.py):
                      it owns the router's parameters, and its `forward` makes the plan
    expert_norm, zero_init_output, shuffle: defaults of the tMoE for this router (TMoEConfig):
                      experts normalize their own input, their second projection starts at zero,
                      tokens go through a random shuffle of ranks before the assignment (Base Layers)
    balanced:         training assigns with exact balance and evaluation routes each row on its own, by
                      its score minus the experts' averaged training prices (prices.py; greedy top-1 with
                      eval_routing="greedy"); `LanguageModel.assigning_as_in_training()` evaluates with the
                      training rule (without the shuffle)
    reference:        where the rule comes from
    """

    name: str
    title: str
    top_k: int
    aux_loss: str | None
    capacity: Callable[[int, int, float], int] | None
    placement: str
    learned_scores: bool
    router_class: type[Router]
    expert_norm: bool = False
    zero_init_output: bool = False
    shuffle: bool = False
    balanced: bool = False
    reference: str = ""

    @property
    def drops(self) -> bool:
        """Slots over capacity are dropped (counted in `TMoE.dropped`)."""
        return self.capacity is not None

    def router_macs(self, rows: int, d_model: int, num_experts: int) -> int:
        """Multiply-adds of scoring `rows` tokens (fvcore's count of the gate projection)."""
        return rows * d_model * num_experts if self.learned_scores else 0

    def exchange_rows(self, tokens: int, num_experts: int, capacity_factor: float, *, padding: bool) -> int:
        """Rows one rank puts into each all2all for `tokens` tokens: the routed slots, or E x capacity
        when the implementation pads to capacity."""
        if padding and self.capacity is not None:
            return num_experts * self.capacity(tokens, num_experts, capacity_factor)
        return self.top_k * tokens

    def padding_rows(self, tokens: int, num_experts: int, capacity_factor: float) -> int:
        """Rows a capacity-padded implementation computes beyond the routed slots (0 without capacity)."""
        return max(self.exchange_rows(tokens, num_experts, capacity_factor, padding=True) - self.top_k * tokens, 0)


TOKEN_ROUTERS: dict[str, TokenRouter] = {r.name: r for r in (
    TokenRouter("gshard", "GShard", top_k=2, aux_loss="GShard's load-balancing loss (GSHARD_AUX_LOSSES)",
                capacity=gshard_capacity, placement="every_other", learned_scores=True, router_class=GShardRouter,
                reference="Lepikhin et al. 2020, sec. 2.2"),
    TokenRouter("switch", "Switch", top_k=1, aux_loss="Switch's E sum_e f_e P_e",
                capacity=switch_capacity, placement="every_other", learned_scores=True, router_class=SwitchRouter,
                reference="Fedus et al. 2021, sec. 2.1-2.2"),
    TokenRouter("base", "Base Layers", top_k=1, aux_loss=None, capacity=None, placement="paper",
                learned_scores=True, router_class=BaseLayersRouter, expert_norm=True, zero_init_output=True,
                shuffle=True, balanced=True, reference="Lewis et al. 2021; fairseq BaseLayer"),
    TokenRouter("hash", "HASH Layers", top_k=1, aux_loss=None, capacity=None, placement="paper",
                learned_scores=False, router_class=HashRouter, reference="Roller et al. 2021"),
)}


# ---------------------------------------------------------------- sMoE routings


@dataclass(frozen=True)
class SMoERouting:
    """One way the sMoE assigns hidden dimensions to spatial experts (sMLP sec. 3.2).

    name:           --smoe-routing value, SMoEConfig.routing
    title:          display name
    router_reads:   positions the router reads: "none" (no router), "prefix" (the first P =
                    round(prefix_fraction T)) or "all" (all T, future ones included)
    causal:         the output at position t depends on positions <= t only
    route:          the pure routing function (routes.py): deterministic's channel -> expert
                    table, or the router's logits -> plan
    balanced:       training assigns hidden dimensions with exact balance, evaluation routes each by its
                    logits minus the averaged training prices (prices.py; greedy with eval_routing="greedy";
                    `LanguageModel.assigning_as_in_training()` evaluates with the training rule)
    reference:      where the rule comes from

    Accounting (FLOPs, step time) follows from `router_reads`: the experts mix the positions after
    the prefix (M = n - P; P = 0 unless the router reads the prefix, whose positions are not
    predicted), the router multiplies the positions it reads by its (positions x E) weight.
    """

    name: str
    title: str
    router_reads: str
    causal: bool
    route: Callable
    balanced: bool = False
    reference: str = ""

    def prefix_len(self, prefix_fraction: float, seq_len: int) -> int:
        """Positions before the first predicted one: the routing prefix of partial prediction."""
        return int(round(prefix_fraction * seq_len)) if self.router_reads == "prefix" else 0

    def router_len(self, prefix_fraction: float, seq_len: int) -> int:
        """Rows of the router weight (positions it reads); 0 without a router."""
        return seq_len if self.router_reads == "all" else self.prefix_len(prefix_fraction, seq_len)

    def router_macs(self, rows: int, n: int, prefix: int, num_experts: int) -> int:
        """Multiply-adds of routing `rows` hidden-dimension vectors of a length-n sequence."""
        if self.router_reads == "all":
            return rows * n * num_experts
        if self.router_reads == "prefix" and n > prefix:  # a sequence within the prefix sends no rows
            return rows * prefix * num_experts
        return 0


LEAKY_SMOE_ROUTING = "leaky-full-sequence"
SMOE_ROUTINGS: dict[str, SMoERouting] = {r.name: r for r in (
    SMoERouting("deterministic", "sMLP-deterministic", router_reads="none", causal=True,
                route=smoe_deterministic_experts, reference="sMLP sec. 3.2.1"),
    SMoERouting("partial", "sMLP-partial", router_reads="prefix", causal=True, route=smoe_partial_route, balanced=True,
                reference="sMLP sec. 3.2.2, eq. 5-7"),
    # Appendix B / Figure 7: the paper's first sMoE router. Never a default, accepted only under this
    # exact name (no alias).
    SMoERouting(LEAKY_SMOE_ROUTING, "sMLP, full-sequence router (leaky)", router_reads="all", causal=False,
                route=smoe_partial_route, balanced=True, reference="sMLP Appendix B, Figure 7"),
)}

