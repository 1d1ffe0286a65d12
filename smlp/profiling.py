"""Where a training step's time goes, from torch.profiler ranges.

The model marks its regions with `record_function` ranges named in RANGES. A backward op runs
outside any range, so `breakdown` gives it the range of the forward op that created it, through the
sequence number the profiler records on both. Nested ranges count for the innermost one.

    routing       router scores and the routing rule (gates, hash lookup, the balanced assignment's shuffle)
    auction       the balanced assignment's auction (keys, rounds, fill; numpy on the CPU), inside routing
    all2all       the dispatcher's collectives (counts, rows, Base Layers' shuffle), both directions
    experts       FFN experts (tMoE, GShard, Switch, Base Layers, HASH)
    token_mixing  spatial gating (dense SGU and the sMoE's spatial experts), self-attention
    rest          the rest of the step: dense projections, embeddings, loss, optimizer, data loading

A whole step is broken down by `step_parts` (benchmarks/micro/step_breakdown.py): the training loop
marks its phases (STEP_RANGES), its `block_ranges` opens a range around every block's forward and
decoding step (BLOCKS; the model itself marks none), and each event's own time goes to the phase, block and
range around it. A collective's own time goes to the collective (COLLECTIVE, opened by the caller).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["RANGES", "CATEGORIES", "BLOCKS", "STEP", "STEP_RANGES", "COLLECTIVE", "StepParts", "breakdown",
           "routing_and_all2all", "step_parts"]

RANGES = {
    "routing": "smlp/routing",
    "auction": "smlp/routing/auction",
    "all2all": "smlp/all2all",
    "experts": "smlp/experts",
    "token_mixing": "smlp/token_mixing",
}
CATEGORIES = (*RANGES, "rest")
_CATEGORY_OF = {name: category for category, name in RANGES.items()}
_BACKWARD = "autograd::engine::evaluate_function:"


def _walk(event, category, seq_category):
    own = _CATEGORY_OF.get(event.name, category)
    if own is not None and event.sequence_nr is not None and event.sequence_nr >= 0:
        seq_category.setdefault((event.thread, event.sequence_nr), own)
        seq_category.setdefault(event.sequence_nr, own)
    for child in event.cpu_children:
        _walk(child, own, seq_category)


def breakdown(events, step_seconds: float) -> dict[str, float]:
    """Seconds per category per step, from a profiler's `events()` over one or more steps.

    step_seconds: the wall time of the profiled steps (the sum, not the mean); the result is per
    profiled window, and "rest" is what the categories leave of it.
    """
    top = [e for e in events if e.cpu_parent is None]
    seq_category: dict = {}
    seconds = defaultdict(float)
    for event in top:
        _walk(event, None, seq_category)
    # forward: the innermost range's own time, minus nested ranges (counted for themselves)
    for event in events:
        category = _CATEGORY_OF.get(event.name)
        if category is None:
            continue
        nested = sum(c.cpu_time_total for c in _ranged_descendants(event))
        seconds[category] += (event.cpu_time_total - nested) / 1e6
    # backward: autograd nodes whose forward op sat in a range (top-level engine calls only)
    for event in events:
        if not event.name.startswith(_BACKWARD) or _inside_backward(event):
            continue
        category = seq_category.get(event.sequence_nr)
        if category is not None:
            seconds[category] += event.cpu_time_total / 1e6
    out = {c: seconds.get(c, 0.0) for c in RANGES}
    out["rest"] = max(step_seconds - sum(out.values()), 0.0)
    return out


def routing_and_all2all(parts: dict) -> float:
    """Routing and all2all together, the auction's own range counted in (records made before it had one lack
    it): the share of a step the benchmarks' targets bound."""
    return parts["routing"] + parts.get("auction", 0.0) + parts["all2all"]


def _ranged_descendants(event):
    """The nearest descendants of `event` that are ranges themselves."""
    found = []
    for child in event.cpu_children:
        if child.name in _CATEGORY_OF:
            found.append(child)
        else:
            found.extend(_ranged_descendants(child))
    return found


def _inside_backward(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_BACKWARD):
            return True
        parent = parent.cpu_parent
    return False


# ---------------------------------------------------------------- a whole step, block by block

# what each block range holds; a block inside another counts for itself
BLOCKS = {
    "embedding_head": "smlp/block/embedding_head",  # embeddings, positions, final norm, output projection
    "gmlp_block": "smlp/block/gmlp",                # a dense gMLP block (or a token-routed one)
    "smoe": "smlp/block/smoe",                      # a sparse block's sMoE, with the block's norm and residuals
    "tmoe": "smlp/block/tmoe",                      # a tMoE (sMLP's, or a Transformer-MoE's FFN with its norm)
    "attention": "smlp/block/attention",            # a Transformer block's norm and self-attention
    "ffn": "smlp/block/ffn",                        # a Transformer block's dense FFN, its norm and residuals
}
STEP = "smlp/step"  # one training step
# the phases of a training step, as the loop marks them
STEP_RANGES = {"forward": "smlp/step/forward", "loss": "smlp/step/loss", "backward": "smlp/step/backward",
               "grad_all_reduce": "smlp/step/grad_all_reduce", "optimizer": "smlp/step/optimizer"}
COLLECTIVE = "smlp/collective/"  # + the collective's name: one call of a torch.distributed collective
_BLOCK_OF = {name: kind for kind, name in BLOCKS.items()}
_PHASE_OF = {name: phase for phase, name in STEP_RANGES.items()}


@dataclass
class StepParts:
    """Seconds of one or more profiled steps by part (`step_parts`).

    forward:     (block kind, range of RANGES or "other") -> seconds of the forward and the loss
    backward:    (block kind of the forward op that made the autograd node, range) -> seconds; ("engine",
                 "other") for the engine's own work outside any node
    phases:      grad_all_reduce and optimizer: their local work (their collectives excluded)
    collectives: every collective call in order, (name, phase, seconds)
    loop:        the loop's own time between the phases
    total:       the steps' time as profiled (every part together)
    """

    forward: dict = field(default_factory=lambda: defaultdict(float))
    backward: dict = field(default_factory=lambda: defaultdict(float))
    phases: dict = field(default_factory=lambda: defaultdict(float))
    collectives: list = field(default_factory=list)
    loop: float = 0.0
    total: float = 0.0


def step_parts(events) -> StepParts:
    """Each event's own time within the STEP ranges of a profiler's `events()`, by part (StepParts).

    An event's own time is its time less its children's, so the parts add up to the steps' time. Forward
    time goes to the innermost block range and, inside it, the innermost RANGES range; a backward
    autograd node (and what it runs) to the block and range of the forward op that created it, found
    through the sequence number the profiler records on both."""
    steps = [e for e in events if e.name == STEP]
    seq_place: dict = {}
    for step in steps:  # the forward ops' places first: the backward nodes look them up
        _forward_places(step, None, _MODEL, seq_place)
    parts = StepParts()
    for step in steps:
        parts.total += step.cpu_time_total / 1e6
        _attribute(step, None, _MODEL, None, parts, seq_place)
    return parts


_MODEL = ("embedding_head", "other")  # the place of the model's own ops, outside every block


def _forward_places(event, phase, place, seq_place) -> None:
    phase = _PHASE_OF.get(event.name, phase)
    place = _place(event.name, place)
    if phase in ("forward", "loss") and event.sequence_nr is not None and event.sequence_nr >= 0:
        seq_place.setdefault(event.sequence_nr, ("loss", "other") if phase == "loss" else place)
    for child in event.cpu_children:
        _forward_places(child, phase, place, seq_place)


def _place(name: str, place: tuple) -> tuple[str, str]:
    """(block kind, range) of an event named `name` inside `place`."""
    if name in _BLOCK_OF:
        return _BLOCK_OF[name], "other"
    if name in _CATEGORY_OF:
        return place[0], _CATEGORY_OF[name]
    return place


def _attribute(event, phase, place, node_place, parts: StepParts, seq_place) -> None:
    name = event.name
    own = event.self_cpu_time_total / 1e6
    if name.startswith(COLLECTIVE):  # the collective and everything it runs
        parts.collectives.append((name[len(COLLECTIVE):], phase, event.cpu_time_total / 1e6))
        return
    phase = _PHASE_OF.get(name, phase)
    place = _place(name, place)
    if name.startswith(_BACKWARD) and node_place is None:
        node_place = seq_place.get(event.sequence_nr, ("unknown", "other"))
    if phase in ("forward", "loss"):
        parts.forward["loss" if phase == "loss" else place[0], place[1]] += own
    elif phase == "backward":
        parts.backward[node_place or ("engine", "other")] += own
    elif phase is not None:
        parts.phases[phase] += own
    else:
        parts.loop += own
    for child in event.cpu_children:
        _attribute(child, phase, place, node_place, parts, seq_place)
