"""The benchmark's schedule, its run store, and speed ratios from runs adjacent in time.

Why: on a shared machine the load changes while a benchmark runs. Run one model after another
and a change of load lands on one model: a quick run here once gave sMLP-det 0.75x of Switch
under light background load, 0.93x and 0.99x on a quiet machine. Three things keep the load
from biasing the comparison:

1. rotating order. Every seed is one round that trains each model once. Round 0 runs the models
   in the given order, round 1 in reverse, every later round in an order shuffled with
   `random.Random(order_seed * 1009 + round)`; `order_seed` is recorded with the results.
2. a load meter adjacent to every run. A short run of the reference model (a probe: the same
   fairseq-train command, `probe_updates` updates, no validation) goes before the first training
   run, between every two training runs and after the last. A training run's words/s divided by
   the mean of the two probes right before and after it is its *normalized speed*: its speed
   relative to the reference measured under the same load. Dividing by the before or the after
   probe alone gives the run's range.
3. ratios from normalized speeds. The speed ratio of model A over model B is the median over
   every pair of their runs (a, b) of norm(a) / norm(b), with the range over all pairs and both
   probe bounds as its spread. Every factor in it comes from runs adjacent in time, so a load
   change between two runs cancels; what is left is the load change within one run and its
   neighbouring probes, which the spread shows.

Resume: every finished run (training or probe) is recorded in `runs.json` at once, by writing a
temporary file, fsyncing it and renaming it over the old one, so a stop at any moment leaves the
previous complete record. `--resume` skips recorded runs and starts the first unrecorded one from
scratch (an interrupted run is restarted). Its probe before it is measured again, since the load
before a stop says nothing about the load after it.

Pure functions (no training) so the tests can check the schedule, the pairing and resume fast.
"""
from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

STORE_FORMAT = "smlp-bench-runs/1"
TRAIN, PROBE = "train", "probe"


class ScheduleError(Exception):
    pass


# ---------------------------------------------------------------- order and slots


def round_order(keys: Sequence[str], round_index: int, order_seed: int) -> list[str]:
    """The order of one round: as given, then reversed, then shuffled with a recorded seed."""
    keys = list(keys)
    if round_index == 0:
        return keys
    if round_index == 1:
        return keys[::-1]
    rng = random.Random(order_seed * 1009 + round_index)
    rng.shuffle(keys)
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
        if self.kind == PROBE:
            return f"probe{self.index:03d}.{self.key}"
        return f"{self.key}.seed{self.seed}"

    def as_dict(self) -> dict:
        return {**asdict(self), "run_id": self.run_id}

    @classmethod
    def from_dict(cls, d: dict) -> Slot:
        return cls(index=d["index"], kind=d["kind"], key=d["key"], seed=d["seed"], phase=d["phase"],
                   round=d["round"])


def extend_schedule(slots: Sequence[Slot], rounds: Iterable[tuple[int, int, int, Sequence[str]]],
                    reference: str | None) -> list[Slot]:
    """Append rounds (phase, round index, seed, ordered keys) to a schedule, with a probe of
    `reference` before the first training run (unless the schedule already ends with one),
    between every two training runs and after the last; no probes with reference None (a
    schedule that measures no speed)."""
    out = list(slots)

    def add(kind, key, seed, phase, rnd):
        out.append(Slot(len(out), kind, key, seed, phase, rnd))

    for phase, rnd, seed, keys in rounds:
        for key in keys:
            if reference is not None and (not out or out[-1].kind != PROBE):
                add(PROBE, reference, 1, phase, rnd)
            add(TRAIN, key, seed, phase, rnd)
        if keys and reference is not None:
            add(PROBE, reference, 1, phase, rnd)
    seen = set()
    for s in out:
        if s.kind == TRAIN and s.run_id in seen:
            raise ScheduleError(f"{s.run_id} is scheduled twice")
        seen.add(s.run_id)
    return out


def seed_rounds(keys: Sequence[str], seeds: Sequence[int], order_seed: int, *, phase: int = 1,
                first_round: int = 0) -> list[tuple[int, int, int, list[str]]]:
    """One round per seed, each in its rotated order."""
    return [(phase, first_round + i, seed, round_order(keys, first_round + i, order_seed))
            for i, seed in enumerate(seeds)]


# ---------------------------------------------------------------- the store


def atomic_write_json(path: Path, obj) -> None:
    """Write JSON so that a stop at any moment leaves either the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # the rename itself survives a power cut only once the directory is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class RunStore:
    """`runs.json`: the plan, the schedule and every finished run's record, rewritten atomically."""

    def __init__(self, path: Path, plan: dict, slots: Sequence[Slot] = (), records: dict | None = None,
                 extra: dict | None = None):
        self.path = Path(path)
        self.plan = plan
        self.slots = list(slots)
        self.records: dict[str, dict] = dict(records or {})
        self.extra: dict = dict(extra or {})

    # --- persistence
    def save(self) -> None:
        atomic_write_json(self.path, {"format": STORE_FORMAT, "plan": self.plan,
                                      "schedule": [s.as_dict() for s in self.slots],
                                      "records": self.records, "extra": self.extra})

    @classmethod
    def load(cls, path: Path) -> RunStore:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"cannot read the benchmark record {path}: {exc}") from exc
        if d.get("format") != STORE_FORMAT:
            raise ScheduleError(f"{path} is not a benchmark record of this version (format {d.get('format')!r}, "
                                f"expected {STORE_FORMAT!r})")
        return cls(path, d["plan"], [Slot.from_dict(s) for s in d["schedule"]], d["records"], d.get("extra"))

    @classmethod
    def open(cls, path: Path, plan: dict, *, resume: bool) -> RunStore:
        """A new store, or with resume the recorded one (whose plan must equal `plan`)."""
        path = Path(path)
        if not resume:
            if path.exists():
                old = cls.load(path)
                raise ScheduleError(
                    f"{path.parent} holds a benchmark with {len(old.finished())} of {len(old.slots)} runs recorded; "
                    f"pass --resume to continue it, or choose another --output-dir")
            return cls(path, plan)
        if not path.exists():
            raise ScheduleError(f"--resume: no benchmark record at {path}; start one without --resume")
        old = cls.load(path)
        diff = plan_differences(old.plan, plan)
        if diff:
            raise ScheduleError(f"--resume: the recorded benchmark in {path.parent} was planned differently "
                                f"({'; '.join(diff)}); rerun with its settings, or choose another --output-dir")
        return old

    # --- progress
    def record(self, slot: Slot, record: dict) -> None:
        self.records[slot.run_id] = {**record, "slot": slot.as_dict()}
        self.save()

    def finished(self) -> list[Slot]:
        return [s for s in self.slots if s.run_id in self.records]

    def pending(self) -> list[Slot]:
        """Unrecorded slots, in order."""
        return [s for s in self.slots if s.run_id not in self.records]

    def prepare_resume(self) -> list[str]:
        """Drop the record of the probe right before the first unrecorded training run (it is
        measured again); returns the run ids dropped."""
        todo = self.pending()
        if not todo or todo[0].index == 0:
            return []
        prev = self.slots[todo[0].index - 1]
        if prev.kind == PROBE and todo[0].kind == TRAIN and prev.run_id in self.records:
            del self.records[prev.run_id]
            self.save()
            return [prev.run_id]
        return []


def plan_differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: recorded {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


# ---------------------------------------------------------------- speeds from adjacent runs


def adjacent_probes(slots: Sequence[Slot], index: int) -> tuple[Slot | None, Slot | None]:
    """The probes right before and right after training slot `index` (None where there is none)."""
    before = slots[index - 1] if index > 0 and slots[index - 1].kind == PROBE else None
    after = slots[index + 1] if index + 1 < len(slots) and slots[index + 1].kind == PROBE else None
    return before, after


def normalized_speeds(slots: Sequence[Slot], wps: dict[str, float]) -> dict[str, dict]:
    """run id -> {norm, lo, hi, probes}: each training run's words/s over its adjacent probes'.

    `wps` maps run ids to measured words/s (missing: not run yet). norm uses the mean of the two
    probes, lo/hi the larger / smaller of them alone; a run with one recorded probe uses it."""
    out = {}
    for s in slots:
        if s.kind != TRAIN or s.run_id not in wps:
            continue
        probes = [p for p in adjacent_probes(slots, s.index) if p is not None and wps.get(p.run_id)]
        if not probes:
            continue
        meters = [wps[p.run_id] for p in probes]
        w = wps[s.run_id]
        out[s.run_id] = {"key": s.key, "seed": s.seed, "norm": w / statistics.mean(meters),
                         "lo": w / max(meters), "hi": w / min(meters), "probes": [p.run_id for p in probes],
                         "probe_wps": meters}
    return out


def speed_ratio(norms: dict[str, dict], a: str, b: str) -> dict | None:
    """Model a's speed over model b's from their normalized speeds: median over run pairs, with the
    range over pairs and probe bounds. None when either has no normalized run."""
    ra = [v for v in norms.values() if v["key"] == a]
    rb = [v for v in norms.values() if v["key"] == b]
    if not ra or not rb:
        return None
    samples = [x["norm"] / y["norm"] for x in ra for y in rb]
    lo = min(x["lo"] / y["hi"] for x in ra for y in rb)
    hi = max(x["hi"] / y["lo"] for x in ra for y in rb)
    return {"ratio": statistics.median(samples), "lo": lo, "hi": hi, "pairs": len(samples),
            "std": statistics.stdev(samples) if len(samples) > 1 else 0.0}


def model_speed(norms: dict[str, dict], key: str) -> float | None:
    """Mean normalized speed of a model (relative to the reference probe)."""
    vals = [v["norm"] for v in norms.values() if v["key"] == key]
    return statistics.mean(vals) if vals else None
