"""Records: the run store (`RunStore`, runs.json, rewritten atomically after every run), other records written whole or
not at all, and `read_record`, the one reader of every record kind (tests/test_records.py)."""
from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path

from smlp.files import write_atomic

from .presets import BenchError
from .schedule import Slot

STORE_FORMAT = "smlp-bench-runs/1"
# record kind -> the fields its readers use
KINDS = {"runs": ("plan", "schedule", "records"), "preset": ("models", "settings", "nproc", "machine"),
         "experiment": ("experiment", "claims", "models"), "fair": ("stages", "stages_complete", "target", "rule"),
         "fair-budget": ("stages", "stages_complete", "budgets", "pairs", "rule"),
         "speed": ("targets", "settings", "complete"), "measurement": ()}


def write_text(path: Path, text: str) -> None:
    """Write a file so that a stop at any moment leaves either the old file or the whole new one (smlp.files, the
    one atomic writer: the mode open() would give)."""
    write_atomic(path, text, text=True)


def atomic_write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def environment(versions: Mapping | None = None) -> dict:
    """A measurement's machine (with its load average: absolute times on a shared machine are noise) and versions."""
    import torch

    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "loadavg": os.getloadavg(), "platform": platform.platform()},
            "versions": {"torch": torch.__version__, "python": platform.python_version(), **(versions or {})}}


def write_record(path: str | Path, record: dict) -> Path:
    """Write a measurement's record atomically (creating its folder) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    print(f"wrote {path}")
    return path


def read_record(path: Path) -> tuple[str, dict]:
    """(kind, record) of a JSON record of any kind (KINDS); a run store is checked slot by slot."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read the benchmark record {path}: {exc}") from exc
    if "format" in d and d["format"] != STORE_FORMAT:
        raise BenchError(f"{path} is not a benchmark record of this version (format {d['format']!r}, expected "
                         f"{STORE_FORMAT!r})")
    if d.get("format") == STORE_FORMAT:
        kind = "runs"
    elif d.get("kind") in KINDS:
        kind = d["kind"]
    elif "table_md" in d and "models" in d:
        kind = "preset"  # written before records named their kind
    elif "rows" in d and "targets" in d:
        kind = "speed"  # one side (2 ranks), written before issue 47
    elif "question" in d or "benchmark" in d:
        kind = "measurement"
    else:
        raise BenchError(f"not a benchmark record: fields {sorted(d)[:8]}")
    if kind == "measurement" and not {"machine", "environment", "runs"} & set(d):
        raise BenchError(f"{path}: a measurement without its machine")
    if missing := [k for k in KINDS[kind] if k not in d]:
        raise BenchError(f"{path}: a {kind} record without {', '.join(missing)}")
    if kind == "runs":
        for s in d["schedule"]:
            Slot.from_dict(s)
        if unknown := set(d["records"]) - {s["run_id"] for s in d["schedule"]}:
            raise BenchError(f"{path}: records of runs not in its schedule: {sorted(unknown)[:4]}")
    return kind, d


def check_started(out: Path, started: Sequence[str], resume: bool) -> None:
    """A benchmark of several run stores in `out` (`started`: those that exist) is continued with --resume only."""
    if started and not resume:
        raise BenchError(f"{out} holds a started benchmark ({', '.join(started)}); pass --resume to continue it, "
                         f"or choose another --output-dir")


def final_ppl(record: dict, metric: str = "ppl") -> float | None:
    """The last validation perplexity of a run record (None: it never validated, or did not log `metric`:
    `suffix_ppl`, `trained_routing_ppl`, `greedy_routing_ppl`; fairseq_plugins/criterion.py)."""
    return record["valid"][-1].get(metric) if record.get("valid") else None


class RunStore:
    """`runs.json`: the plan, the schedule and every finished run's record, rewritten atomically."""

    def __init__(self, path: Path, plan: dict, slots: Sequence[Slot] = (), records: dict | None = None,
                 extra: dict | None = None):
        self.path, self.plan, self.slots = Path(path), plan, list(slots)
        self.records: dict[str, dict] = dict(records or {})
        self.extra: dict = dict(extra or {})

    def save(self) -> None:
        atomic_write_json(self.path, {"format": STORE_FORMAT, "plan": self.plan,
                                      "schedule": [s.as_dict() for s in self.slots],
                                      "records": self.records, "extra": self.extra})

    @classmethod
    def load(cls, path: Path) -> RunStore:
        kind, d = read_record(path)
        if kind != "runs":
            raise BenchError(f"{path} is not a run store (a {kind} record)")
        return cls(path, d["plan"], [Slot.from_dict(s) for s in d["schedule"]], d["records"], d.get("extra"))

    @staticmethod
    def check_start(path: Path, *, resume: bool) -> None:
        """A store at `path` is continued with --resume only, and --resume needs one."""
        if not resume and path.exists():
            old = RunStore.load(path)
            raise BenchError(f"{path.parent} holds a benchmark with {len(old.finished())} of {len(old.slots)} "
                             f"runs recorded; pass --resume to continue it, or choose another --output-dir")
        if resume and not path.exists():
            raise BenchError(f"--resume: no benchmark record at {path}; start one without --resume")

    @classmethod
    def open(cls, path: Path, plan: dict, *, resume: bool) -> RunStore:
        """A new store, or with resume the recorded one, whose plan must equal `plan` (models a stage added to its
        own plan while it ran, extra["added_models"], aside)."""
        path = Path(path)
        cls.check_start(path, resume=resume)
        if not resume:
            return cls(path, plan)
        old = cls.load(path)
        added = set(old.extra.get("added_models", ()))
        started = {**old.plan, "models": [m for m in old.plan["models"] if m["key"] not in added]} if added \
            else old.plan
        if diff := [f"{k}: recorded {started.get(k)!r}, now {plan.get(k)!r}" for k in sorted(set(started) | set(plan))
                    if started.get(k) != plan.get(k)]:
            raise BenchError(f"--resume: the recorded benchmark in {path.parent} was planned differently "
                             f"({'; '.join(diff)}); rerun with its settings, or choose another --output-dir")
        return old

    def record(self, slot: Slot, record: dict) -> None:
        self.records[slot.run_id] = {**record, "slot": slot.as_dict()}
        self.save()

    def finished(self) -> list[Slot]:
        return [s for s in self.slots if s.run_id in self.records]

    def pending(self) -> list[Slot]:
        """Unrecorded slots, in order."""
        return [s for s in self.slots if s.run_id not in self.records]

    def prepare_resume(self) -> list[str]:
        """Drop the record of the probe right before the first unrecorded training run (it is measured again, as
        the load before a stop says nothing of the load after it); returns the run ids dropped."""
        if not (todo := self.pending()) or todo[0].index == 0:
            return []
        if (prev := self.slots[todo[0].index - 1]).kind == "probe" and todo[0].kind == "train" and \
                prev.run_id in self.records:
            del self.records[prev.run_id]
            self.save()
            return [prev.run_id]
        return []
