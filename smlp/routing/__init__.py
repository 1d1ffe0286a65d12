"""Where a row goes: the routers of the tMoE and sMoE layers and their registry.

As Megatron-Core's router separates `gating()` (the fp32 projection to logits) from `routing()` (the rule
that turns logits into a plan):

    registry.py        every token router and sMoE routing with the facts other parts read
    token_routers.py   the tMoE's routers as modules that own their parameters
    logits.py          the router logits: the gate projection in fp32, the one place they are computed
    plan.py            `RoutingPlan`, row counts, and the routers' input checks (verdicts, fault records)
    routes.py          rules without a capacity: Base Layers, HASH Layers, the sMoE routings
    gates.py           capacity-limited softmax gates: Switch top-1, GShard top-2, the router z-loss
    assignment.py      balanced assignment (Base Layers' auction) and its expert prices
    auction_arrays.py  the auction's array operations on numpy (CPU) and torch (accelerators)
    prices.py          the balanced routers' evaluation routing: greedy on score minus the averaged prices

The rules never call a collective; the dispatcher (smlp/dispatch.py) moves the rows.
"""
from .assignment import balanced_assignment, expert_capacities
from .plan import (
    FAULT_WIDTH,
    DeferredCheck,
    NonFiniteScoresError,
    RoutingPlan,
    hash_fault,
    nonfinite_fault,
    routing_error,
)
from .routes import base_route, hash_route, smoe_partial_route

__all__ = ["balanced_assignment", "expert_capacities", "FAULT_WIDTH", "DeferredCheck", "NonFiniteScoresError",
           "RoutingPlan", "hash_fault", "nonfinite_fault", "routing_error", "base_route", "hash_route",
           "smoe_partial_route"]
