"""The router registry: every token router and sMoE routing, with all its facts in one place.

sMLP sections 2.2 and 4.1 (the Transformer-MoE baselines) and 3.2 (the sMoE routings). A router's
facts used to be spread over the layer, the configs, the fairseq plugin, the FLOPs calculator, the
step-time model and the benchmark; each of them now reads this table:

    the layer          smlp/moe.py `TMoE`: parameters (`init`), `route`, `drops`; `SMoE`: the routing's
                       entry (`router_reads`, `route`, `causal`); smlp/config.py: the valid names, the
                       expert-norm / zero-init / shuffle defaults, vocab_size for a table router
    the core config    smlp/lm.py `LMConfig.placement`: the default sparse placement; the valid names
    the plugin         fairseq_plugins/config.py FIELDS: --moe-router / --smoe-routing choices and help;
                       fairseq_plugins/models.py `criterion_needs`: the auxiliary loss
    the calculator     eval/flops/counting.py: router and expert multiply-adds (`router_macs`, `top_k`),
                       display names (`title`); eval/flops/matching.py: the sparse families
    the step-time model eval/flops/steptime.py `sparse_exchanges`: rows each all2all moves
                       (`exchange_rows`), the shuffle's exchanges (`shuffle`);
                       `padding_macs_per_sequence` (`padding_rows`)
    the benchmark      smlp_bench: MOE_BASELINES (the models run) and their names

Adding a token router means one `TokenRouter(...)` entry here plus its route function (a pure
function in routes.py or gates.py); tests/test_router_registry.py checks that every consumer sees
it (and registers a test router that the layer, the calculator and the step-time model take as is).

Token routers (Transformer-MoE baselines; the sMLP sparse block's tMoE is always `base`):
    gshard  top-2 softmax gate, capacity ceil(2S/E), load-balancing loss (gates.py)
    switch  top-1 softmax gate, capacity max(ceil(cf S/E), 4), load-balancing loss (gates.py)
    base    Base Layers: balanced assignment in training, greedy top-1 at inference (routes.py)
    hash    HASH Layers: a fixed random token-id -> expert table (routes.py)
sMoE routings (sMLP sec. 3.2; the rows are hidden-dimension vectors, one per sequence and channel):
    deterministic        hidden chunk i -> expert i (3.2.1); no router
    partial              a router over the first P = round(prefix_fraction * T) positions (3.2.2);
                         positions < P are not predicted
    leaky-full-sequence  Appendix B: the router reads all T positions, future ones included (NOT
                         causal; only to reproduce Figure 7)

Shapes: the core's legend (smlp/__init__.py); here S rows, D model width, E experts, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor, nn

    from .plan import RoutingPlan

__all__ = ["TokenRouter", "SMoERouting", "TOKEN_ROUTERS", "SMOE_ROUTINGS", "LEAKY_SMOE_ROUTING", "hash_table"]

# The registry is read by programs that never build a model (the benchmark's planner, argument
# checks): importing it must not import torch. The functions below import the tensor code they
# call when they run (a sys.modules lookup after the first call).


# ---------------------------------------------------------------- token routers


def hash_table(vocab_size: int, num_experts: int, seed: int) -> Tensor:
    """A fixed random token-id -> expert table with (almost) equal ids per expert (HASH Layers)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    table = torch.empty(vocab_size, dtype=torch.long)
    table[torch.randperm(vocab_size, generator=g)] = torch.arange(vocab_size) % num_experts
    return table


def _init_centroids(layer: nn.Module, cfg) -> None:
    import torch

    layer.centroids = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
    torch.nn.init.orthogonal_(layer.centroids, gain=0.1)


def _init_gate(layer: nn.Module, cfg) -> None:
    import torch

    layer.gate = torch.nn.Linear(cfg.d_model, cfg.num_experts, bias=False)


def _init_hash_table(layer: nn.Module, cfg) -> None:
    layer.register_buffer("hash_table", hash_table(cfg.vocab_size, cfg.num_experts, cfg.hash_seed))


def _gshard_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    from .gates import gshard_capacity

    return gshard_capacity(num_tokens, num_experts, capacity_factor)


def _switch_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    from .gates import switch_capacity

    return switch_capacity(num_tokens, num_experts, capacity_factor)


# Route functions: (layer, rows x_SD, their token ids, defer_checks) -> RoutingPlan, as Megatron-Core's
# router: `gating` (the logits, logits.router_logits: the gate projection in fp32 whatever the model
# dtype) then `routing` (the rule, routes.py or gates.py). The softmax gates keep their logits on the
# layer (`logits_SE`): the router z-loss reads them when asked.


def _route_base(layer, x_SD: Tensor, token_ids_S: Tensor | None, defer_checks: bool) -> RoutingPlan:
    from .logits import router_logits
    from .routes import base_route

    scores_SE = router_logits(x_SD, layer.centroids.t())
    return base_route(scores_SE, training=layer.training or layer.assign_as_in_training, layer=layer.layer_name,
                      defer_checks=defer_checks, expert_S=layer.balanced_experts(scores_SE))


def _route_switch(layer, x_SD: Tensor, token_ids_S: Tensor | None, defer_checks: bool) -> RoutingPlan:
    from .gates import switch_top1
    from .logits import router_logits

    cfg = layer.cfg
    layer.logits_SE = router_logits(x_SD, layer.gate.weight.t())
    return switch_top1(layer.logits_SE, capacity_factor=cfg.capacity_factor,
                       eval_capacity_factor=cfg.eval_capacity_factor, training=layer.training,
                       layer=layer.layer_name, defer_checks=defer_checks)


def _route_gshard(layer, x_SD: Tensor, token_ids_S: Tensor | None, defer_checks: bool) -> RoutingPlan:
    from .gates import gshard_top2
    from .logits import router_logits

    cfg = layer.cfg
    layer.logits_SE = router_logits(x_SD, layer.gate.weight.t())
    return gshard_top2(layer.logits_SE, training=layer.training, capacity_factor=cfg.capacity_factor,
                       eval_capacity_factor=cfg.eval_capacity_factor, aux_loss=cfg.gshard_aux_loss,
                       layer=layer.layer_name, defer_checks=defer_checks)


def _route_hash(layer, x_SD: Tensor, token_ids_S: Tensor | None, defer_checks: bool) -> RoutingPlan:
    from .routes import hash_route

    if token_ids_S is None:
        raise ValueError("router='hash' needs the token ids of the rows it routes")
    return hash_route(token_ids_S.reshape(-1), layer.hash_table, layer=layer.layer_name, defer_checks=defer_checks)


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
    init:             (layer, TMoEConfig) -> None: creates the router's parameters or buffers on the
                      layer (their names are the checkpoints' keys)
    route:            (layer, x_SD, token_ids_S, defer_checks) -> RoutingPlan
    expert_norm, zero_init_output, shuffle: defaults of the tMoE for this router (TMoEConfig):
                      experts normalize their own input, their second projection starts at zero,
                      tokens go through a random shuffle of ranks before the assignment (Base Layers)
    balanced:         training assigns with exact balance and evaluation greedily (top-1), so the two
                      route differently; `LanguageModel.assigning_as_in_training()` evaluates with the
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
    init: Callable[[nn.Module, object], None]
    route: Callable[..., RoutingPlan]
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
                capacity=_gshard_capacity, placement="every_other", learned_scores=True, init=_init_gate,
                route=_route_gshard, reference="Lepikhin et al. 2020, sec. 2.2"),
    TokenRouter("switch", "Switch", top_k=1, aux_loss="Switch's E sum_e f_e P_e",
                capacity=_switch_capacity, placement="every_other", learned_scores=True, init=_init_gate,
                route=_route_switch, reference="Fedus et al. 2021, sec. 2.1-2.2"),
    TokenRouter("base", "Base Layers", top_k=1, aux_loss=None, capacity=None, placement="paper",
                learned_scores=True, init=_init_centroids, route=_route_base, expert_norm=True,
                zero_init_output=True, shuffle=True, balanced=True, reference="Lewis et al. 2021; fairseq BaseLayer"),
    TokenRouter("hash", "HASH Layers", top_k=1, aux_loss=None, capacity=None, placement="paper",
                learned_scores=False, init=_init_hash_table, route=_route_hash, reference="Roller et al. 2021"),
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
    balanced:       training assigns hidden dimensions with exact balance, evaluation greedily
                    (`LanguageModel.assigning_as_in_training()` evaluates with the training rule)
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


def _smoe_deterministic(num_channels: int, num_experts: int, device=None) -> Tensor:
    from .routes import smoe_deterministic_experts

    return smoe_deterministic_experts(num_channels, num_experts, device)


def _smoe_routed(logits_SE: Tensor, **kw) -> RoutingPlan:
    from .routes import smoe_partial_route

    return smoe_partial_route(logits_SE, **kw)


LEAKY_SMOE_ROUTING = "leaky-full-sequence"
SMOE_ROUTINGS: dict[str, SMoERouting] = {r.name: r for r in (
    SMoERouting("deterministic", "sMLP-deterministic", router_reads="none", causal=True,
                route=_smoe_deterministic, reference="sMLP sec. 3.2.1"),
    SMoERouting("partial", "sMLP-partial", router_reads="prefix", causal=True, route=_smoe_routed, balanced=True,
                reference="sMLP sec. 3.2.2, eq. 5-7"),
    # Appendix B / Figure 7: the paper's first sMoE router. Never a default, accepted only under this
    # exact name (no alias).
    SMoERouting(LEAKY_SMOE_ROUTING, "sMLP, full-sequence router (leaky)", router_reads="all", causal=False,
                route=_smoe_routed, balanced=True, reference="sMLP Appendix B, Figure 7"),
)}

