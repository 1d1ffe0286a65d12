"""Profile a window of training steps inside a real fairseq-train run (used by smlp-bench).

    SMLP_PROFILE_STEPS=START:COUNT:PATH fairseq-train ... --user-dir fairseq_plugins

Training steps START .. START+COUNT-1 (0-based training forward calls of this rank, one per
update at --update-freq 1) run under torch.profiler; then each rank writes PATH.rank<R>.json:
the wall time of the window, the seconds per category of `smlp.profiling.breakdown` (routing,
all2all, experts, token_mixing, rest) and the top operators. The window spans whole steps: it
opens before the forward of step START and closes before the forward of step START+COUNT, so it
covers forward, backward, the gradient all-reduce and the optimizer step of each.

The hook is a forward pre-hook on the decoder installed only when the variable is set: nothing
runs otherwise, and fairseq itself is not modified.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from smlp.files import write_atomic
from smlp.process_group import rank_and_world
from smlp.profiling import CATEGORIES, breakdown

ENV = "SMLP_PROFILE_STEPS"


def parse_spec(spec: str) -> tuple[int, int, Path]:
    try:
        start, count, path = spec.split(":", 2)
        start, count = int(start), int(count)
    except ValueError:
        raise ValueError(f"{ENV}={spec!r} is invalid: use START:COUNT:PATH, e.g. 10:3:/tmp/profile") from None
    if start < 0 or count < 1 or not path:
        raise ValueError(f"{ENV}={spec!r} is invalid: START >= 0, COUNT >= 1 and a PATH are needed")
    return start, count, Path(path)


class StepProfiler:
    def __init__(self, start: int, count: int, path: Path):
        self.start, self.count, self.path = start, count, path
        self.calls = 0
        self.prof = None
        self.t0 = 0.0

    def __call__(self, module, args):
        if not module.training:
            return
        if self.calls == self.start:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.calls == self.start + self.count and self.prof is not None:
            seconds = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self._write(seconds)
            self.prof = None
        self.calls += 1

    def _write(self, seconds: float) -> None:
        events = self.prof.events()
        parts = breakdown(events, seconds)
        top = sorted(self.prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        rank = rank_and_world()[0]
        record = {
            "steps": self.count, "seconds": seconds, "seconds_per_step": seconds / self.count,
            "breakdown_seconds": {c: parts[c] for c in CATEGORIES},
            "breakdown": {c: parts[c] / seconds for c in CATEGORIES},
            "top_ops": [{"name": e.key, "self_seconds": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top],
        }
        write_atomic(f"{self.path}.rank{rank}.json", json.dumps(record, indent=1), make_parents=True)


def install(module: torch.nn.Module) -> StepProfiler | None:
    """Attach a StepProfiler to `module` when SMLP_PROFILE_STEPS is set."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    profiler = StepProfiler(*parse_spec(spec))
    module.register_forward_pre_hook(profiler)
    return profiler
