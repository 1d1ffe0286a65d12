"""The skeleton every micro-benchmark shares: its command line, timing in turns, and its JSON record.

A micro-benchmark answers one question in one program (`python -m smlp_bench.micro.NAME`) and writes
one JSON record: the question, the config, the machine and versions (`environment`), the figures.

- `parser`: the options they share: --out (where the record goes) and, where the benchmark takes
  them, --iters, --warmup and --threads, each with the benchmark's own default;
- `time_in_turns`: the functions compared are called in turn (a, b, c, a, b, c, ...) so that a
  change of the machine's load during the run weighs on all of them alike; `warmup` untimed rounds,
  then at least `iters` timed rounds, more (up to `max_iters`) until each has run `min_seconds`;
  every call's wall time and this thread's CPU time (steadier when other processes share the cores)
  are kept;
- `summary_ms`: median, min and max of a list of seconds, in ms;
- `write_record`: the record, written atomically.

It imports no model code (torch, the standard library and the atomic writer of
benchmarks/schedule.py), so a benchmark that measures an older checkout put on PYTHONPATH
(smlp_bench.micro.sparse_profile) can use it too.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..schedule import atomic_write_json


def parser(module: str, description: str, *, out: str | Path, iters: int | None = None,
           warmup: int | None = None, threads: int | None = None, raw: bool = False,
           prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python -m smlp_bench.micro.<module>` (or of the console script `prog`) with the
    shared options (None: the benchmark has no such option). `raw`: keep the description's line breaks."""
    p = argparse.ArgumentParser(prog=prog or f"python -m smlp_bench.micro.{module}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)
    p.add_argument("--out", type=Path, default=Path(out), help=f"the JSON record (default {out})")
    if iters is not None:
        p.add_argument("--iters", type=int, default=iters, help=f"timed calls of each form ({iters})")
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls of each form first ({warmup})")
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help=f"torch threads ({threads})")
    return p


@dataclass
class Timings:
    """Seconds of every timed call of one function: wall clock and this thread's CPU time."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def timed(self, fn: Callable[[], object]) -> None:
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.thread_time() - c0)


def time_in_turns(fns: Mapping[str, Callable[[], object]], iters: int, warmup: int = 0, *,
                  min_seconds: float = 0.0, max_iters: int = 1000) -> dict[str, Timings]:
    """Time each function of `fns` (name -> function of no argument), calling them in turn (module docstring)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: Timings() for name in fns}
    while True:
        done = min(len(t.wall) for t in times.values())
        if done >= iters and (done >= max_iters or min(sum(t.wall) for t in times.values()) >= min_seconds):
            return times
        for name, fn in fns.items():
            times[name].timed(fn)


def summary_ms(seconds: list[float]) -> dict:
    """Median, min and max of the timed calls, in milliseconds."""
    return {"median_ms": 1000 * statistics.median(seconds), "min_ms": 1000 * min(seconds),
            "max_ms": 1000 * max(seconds)}


def environment(machine: Mapping | None = None, versions: Mapping | None = None) -> dict:
    """The machine (with its load average: absolute times on a shared machine are noise) and versions,
    with a benchmark's own additions."""
    import torch

    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "loadavg": os.getloadavg(), "platform": platform.platform(), **(machine or {})},
            "versions": {"torch": torch.__version__, "python": platform.python_version(), **(versions or {})}}


def write_record(path: str | Path, record: dict) -> Path:
    """Write the record atomically (creating its directory) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    print(f"wrote {path}")
    return path
