"""The plan of a benchmark, its interleaved schedule of runs and probes, and speed ratios from runs adjacent in time
(docs/benchmarks.md says how and why). Pure functions: the tests check them without training."""
from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from .presets import BenchError

TRAIN, PROBE = "train", "probe"


def make_plan(name: str, settings: dict, models: Sequence, nproc: int, order_seed: int, reference: str,
              experiment: str | None = None) -> dict:
    """Everything that decides the runs (models: presets.Model); --resume refuses a store planned differently."""
    s = {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items() if k != "models"}
    return {"name": name, "experiment": experiment, "settings": json.loads(json.dumps(s)),
            "models": [m.as_dict() for m in models], "nproc": nproc, "order_seed": order_seed, "reference": reference}


def plan_seeds(settings: dict) -> list[int]:
    """The seeds of a plan: `seeds` is a count (1..N) or the list itself; a plan of explicit `rounds` (below) has
    the seeds of its rounds."""
    if settings.get("rounds"):
        return sorted({int(seed) for seed, _ in settings["rounds"]})
    seeds = settings["seeds"]
    return list(seeds) if isinstance(seeds, (list, tuple)) else list(range(1, seeds + 1))


def planned_rounds(settings: dict, keys: Sequence[str], order_seed: int) -> list[tuple[int, int, int, list[str]]]:
    """The rounds of a plan: every model at every seed (one round per seed), or, where the settings name them,
    explicit `rounds` ([seed, [model keys]], in execution order: a stage whose models run different seeds), each
    round's keys in its rotated order."""
    if not settings.get("rounds"):
        return seed_rounds(keys, plan_seeds(settings), order_seed)
    if unknown := sorted({k for _, ks in settings["rounds"] for k in ks} - set(keys)):
        raise BenchError(f"the plan's rounds name models it does not have: {', '.join(unknown)}")
    return [(1, i, int(seed), round_order(ks, i, order_seed)) for i, (seed, ks) in enumerate(settings["rounds"])]


def probe_reference(plan: dict) -> str | None:
    """The model the probes run, or None when the plan measures no speed (probe_updates 0)."""
    return plan["reference"] if plan["settings"].get("probe_updates") else None


def initial_schedule(plan: dict) -> list[Slot]:
    keys = [m["key"] for m in plan["models"]]
    return extend_schedule([], planned_rounds(plan["settings"], keys, plan["order_seed"]), probe_reference(plan))


def round_order(keys: Sequence[str], round_index: int, order_seed: int) -> list[str]:
    """The order of one round: as given, then reversed, then shuffled with a recorded seed."""
    keys = list(keys)
    if round_index < 2:
        return keys if round_index == 0 else keys[::-1]
    random.Random(order_seed * 1009 + round_index).shuffle(keys)
    return keys


@dataclass(frozen=True)
class Slot:
    """One run of the schedule, in execution order."""

    index: int
    kind: str        # TRAIN or PROBE
    key: str         # model key (the reference for a probe)
    seed: int
    phase: int
    round: int

    @property
    def run_id(self) -> str:
        return f"probe{self.index:03d}.{self.key}" if self.kind == PROBE else f"{self.key}.seed{self.seed}"

    def as_dict(self) -> dict:
        return {**asdict(self), "run_id": self.run_id}

    @classmethod
    def from_dict(cls, d: dict) -> Slot:
        return cls(**{k: d[k] for k in ("index", "kind", "key", "seed", "phase", "round")})


def extend_schedule(slots: Sequence[Slot], rounds: Iterable[tuple[int, int, int, Sequence[str]]],
                    reference: str | None) -> list[Slot]:
    """Append rounds (phase, round index, seed, ordered keys) with a probe of `reference` before the first training
    run (unless the schedule ends with one), between every two and after the last; no probes for reference None."""
    out = list(slots)
    for phase, rnd, seed, keys in rounds:
        for key in keys:
            if reference is not None and (not out or out[-1].kind != PROBE):
                out.append(Slot(len(out), PROBE, reference, 1, phase, rnd))
            out.append(Slot(len(out), TRAIN, key, seed, phase, rnd))
        if keys and reference is not None:
            out.append(Slot(len(out), PROBE, reference, 1, phase, rnd))
    ids = [s.run_id for s in out if s.kind == TRAIN]
    if twice := sorted({i for i in ids if ids.count(i) > 1}):
        raise BenchError(f"{twice[0]} is scheduled twice")
    return out


def seed_rounds(keys: Sequence[str], seeds: Sequence[int], order_seed: int, *, phase: int = 1,
                first_round: int = 0) -> list[tuple[int, int, int, list[str]]]:
    """One round per seed, each in its rotated order."""
    return [(phase, first_round + i, seed, round_order(keys, first_round + i, order_seed))
            for i, seed in enumerate(seeds)]


def adjacent_probes(slots: Sequence[Slot], index: int) -> tuple[Slot | None, Slot | None]:
    """The probes right before and right after training slot `index` (None where there is none)."""
    before = slots[index - 1] if index > 0 and slots[index - 1].kind == PROBE else None
    after = slots[index + 1] if index + 1 < len(slots) and slots[index + 1].kind == PROBE else None
    return before, after


def normalized_speeds(slots: Sequence[Slot], wps: dict[str, float]) -> dict[str, dict]:
    """run id -> {norm, lo, hi, probes, ...}: each training run's words/s (`wps`: run id -> words/s, missing: not
    run) over the mean of its adjacent probes' (lo / hi: over the larger / smaller alone; one probe will do)."""
    out = {}
    for s in slots:
        probes = [p for p in adjacent_probes(slots, s.index) if p is not None and wps.get(p.run_id)]
        if s.kind != TRAIN or s.run_id not in wps or not probes:
            continue
        meters = [wps[p.run_id] for p in probes]
        w = wps[s.run_id]
        out[s.run_id] = {"key": s.key, "seed": s.seed, "norm": w / statistics.mean(meters),
                         "lo": w / max(meters), "hi": w / min(meters), "probes": [p.run_id for p in probes],
                         "probe_wps": meters}
    return out


def speed_ratio(norms: dict[str, dict], a: str, b: str) -> dict | None:
    """Model a's speed over model b's: the median over run pairs, with the range over pairs and probe bounds."""
    ra = [v for v in norms.values() if v["key"] == a]
    rb = [v for v in norms.values() if v["key"] == b]
    if not ra or not rb:
        return None
    samples = [x["norm"] / y["norm"] for x in ra for y in rb]
    return {"ratio": statistics.median(samples), "lo": min(x["lo"] / y["hi"] for x in ra for y in rb),
            "hi": max(x["hi"] / y["lo"] for x in ra for y in rb), "pairs": len(samples),
            "std": statistics.stdev(samples) if len(samples) > 1 else 0.0}


def model_speed(norms: dict[str, dict], key: str) -> float | None:
    """Mean normalized speed of a model (relative to the reference probe)."""
    vals = [v["norm"] for v in norms.values() if v["key"] == key]
    return statistics.mean(vals) if vals else None
