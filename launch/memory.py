"""Peak resident memory of processes, read from /proc (Linux): per rank, for the launcher and benchmarks.

    from smlp_launch.memory import peak_rss, PeakRSSMonitor

    peak_rss([pid0, pid1])                  # {pid: VmHWM bytes} of processes still alive
    with PeakRSSMonitor({0: pid0, 1: pid1}) as mon:
        ...                                 # the processes run
    mon.peaks                               # {0: bytes, 1: bytes}: highest VmHWM seen per label

VmHWM ("high water mark") is the kernel's own record of a process's peak resident set size, so a
sample taken any time before the process exits gives its peak so far; sampling only has to happen
once more before exit to see the final peak. A process that has exited (or been reaped) has no
/proc entry: the monitor keeps the last value it read. For a process that is this process's child
and has been reaped, `resource.getrusage(RUSAGE_CHILDREN)` only gives the maximum over all children,
which is why the launcher samples instead.

Peak RSS per rank means the VmHWM of the rank's own process: DataLoader workers (--num-workers > 0)
are forked children that share most pages with it; `tree=True` adds their peaks (an upper bound).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping

__all__ = ["vmhwm_bytes", "vmrss_bytes", "children_of", "process_tree", "peak_rss", "PeakRSSMonitor", "format_bytes"]


def _status_field(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None  # a zombie has no memory fields


def vmhwm_bytes(pid: int) -> int | None:
    """Peak resident set size of `pid` so far (VmHWM), or None if it is gone (or a zombie)."""
    return _status_field(pid, "VmHWM")


def vmrss_bytes(pid: int) -> int | None:
    """Current resident set size of `pid` (VmRSS), or None if it is gone."""
    return _status_field(pid, "VmRSS")


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/*/stat)."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(d))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children_of(p))
    return out


def peak_rss(pids: Iterable[int], tree: bool = False) -> dict[int, int]:
    """{pid: peak RSS in bytes} for the processes still alive; tree=True sums each one's descendants too."""
    out = {}
    for pid in pids:
        members = process_tree(pid) if tree else [pid]
        values = [v for v in (vmhwm_bytes(p) for p in members) if v is not None]
        if values:
            out[pid] = sum(values)
    return out


class PeakRSSMonitor:
    """Samples the VmHWM of labelled processes every `interval` s in a thread; keeps the highest seen.

    `sample()` can also be called by hand (the launcher calls it from its own poll loop and again
    right before it reaps a worker, so the final peak is never missed).
    """

    def __init__(self, pids: Mapping[object, int] | None = None, interval: float = 1.0, tree: bool = False):
        self.pids = dict(pids or {})
        self.interval = interval
        self.tree = tree
        self.peaks: dict[object, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, label, pid: int) -> None:
        self.pids[label] = pid

    def sample(self) -> dict[object, int]:
        for label, pid in list(self.pids.items()):
            value = peak_rss([pid], tree=self.tree).get(pid)
            if value is not None and value > self.peaks.get(label, 0):
                self.peaks[label] = value
        return self.peaks

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakRSSMonitor:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2 ** 20:.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"
