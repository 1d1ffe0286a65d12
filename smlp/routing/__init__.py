"""Where does a row go: the routers of the tMoE and sMoE layers, as pure functions, and their registry.

As Megatron-Core's router (`megatron.core.transformer.moe.router`) separates `gating()` (the fp32
projection to logits) from `routing()` (the rule that turns logits into a plan), the logits are
computed in one place and each rule lives apart from it:

    registry.py        every token router and sMoE routing with all its facts (top-k, capacity,
                       auxiliary loss, placement, FLOP accounting): the one table the layers, the
                       configs, the plugin, the FLOPs calculator and the benchmarks read; no torch
                       at import
    logits.py          the router logits: the gate projection in fp32, the one place they are computed
    plan.py            `RoutingPlan` (expert and weight per row and slot), row counts, and the
                       routers' input checks (fault records the dispatcher reads with its counts)
    routes.py          rules without a capacity: Base Layers, HASH Layers, the sMoE routings
    gates.py           capacity-limited softmax gates: Switch top-1, GShard top-2, the router z-loss
    assignment.py      balanced assignment (Base Layers' auction), used by routes.py
    auction_arrays.py  the auction's array operations on numpy (CPU) and torch (accelerators)

A router never calls a collective and never owns parameters: the layer computes the logits with
its own weights, the rule turns them into a plan, and the dispatcher (smlp/dispatch.py) moves the
rows. The names below are importable from `smlp.routing` itself; each is loaded from its module
on first use, so that reading the registry imports no torch.
"""
from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_HOME = {
    **dict.fromkeys(("TokenRouter", "SMoERouting", "TOKEN_ROUTERS", "SMOE_ROUTINGS", "LEAKY_SMOE_ROUTING",
                     "hash_table"), "registry"),
    "router_logits": "logits",
    **dict.fromkeys(("RoutingPlan", "NonFiniteScoresError", "FAULT_WIDTH", "count_rows", "nonfinite_fault",
                     "hash_fault", "routing_error", "raise_on_fault", "check_finite_scores"), "plan"),
    **dict.fromkeys(("base_route", "hash_route", "smoe_deterministic_experts", "smoe_partial_route"), "routes"),
    **dict.fromkeys(("switch_top1", "gshard_top2", "switch_capacity", "gshard_capacity", "router_z_loss",
                     "GSHARD_AUX_LOSSES"), "gates"),
    **dict.fromkeys(("balanced_assignment", "expert_capacities", "sanitize_scores"), "assignment"),
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
