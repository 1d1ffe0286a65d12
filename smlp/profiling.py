"""Where a training step's time goes, from torch.profiler ranges.

The model marks its regions with `record_function` ranges named in RANGES. A backward op runs
outside any range, so `breakdown` gives it the range of the forward op that created it, through the
sequence number the profiler records on both. Nested ranges count for the innermost one.

    routing       router scores and the routing rule (gates, balanced assignment, hash lookup)
    all2all       the dispatcher's collectives (counts, rows, Base Layers' shuffle), both directions
    experts       FFN experts (tMoE, GShard, Switch, Base Layers, HASH)
    token_mixing  spatial gating (dense SGU and the sMoE's spatial experts), self-attention
    rest          the rest of the step: dense projections, embeddings, loss, optimizer, data loading
"""
from __future__ import annotations

from collections import defaultdict

__all__ = ["RANGES", "CATEGORIES", "breakdown"]

RANGES = {
    "routing": "smlp/routing",
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
