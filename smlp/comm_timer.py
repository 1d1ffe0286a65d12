"""All2all time of a dispatcher, measured only when asked (`--log-a2a-time`): timing events on an
accelerator, which nothing waits for inside a forward, and wall-clock readings on the CPU.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from .profiling import RANGES

__all__ = ["CommTimer", "CommTime"]


def _host_clock(device: torch.device) -> bool:
    # Collectives on host tensors (gloo) return when done: the wall clock measures them.
    return device.type in ("cpu", "meta")


class CommTime:
    """The timed sections of one layer's forward; `seconds` reads them (waits for the last event)."""

    def __init__(self, records: list):
        self.records = records

    @property
    def seconds(self) -> float:
        total = 0.0
        for record in self.records:
            if isinstance(record, float):
                total += record
            else:  # (start, end) events: elapsed_time needs the end event to have happened
                start, end = record
                end.synchronize()
                total += start.elapsed_time(end) / 1000.0
        return total


class CommTimer:
    """All2all time of one dispatcher, measured only when `enabled` (off by default).

        with timer(device):   # a profiler range; if enabled, a start mark
            ...collectives... # if enabled, an end mark

    On an accelerator the marks are timing events (`torch.Event`) recorded on the device's
    current stream: nothing waits, and the time is read later, when the logs are written
    (`CommTime.seconds`). On the CPU they are wall-clock readings. A layer takes the records of
    its own forward with `mark()` / `take(mark)`.
    """

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.records: list = []

    def __call__(self, device: torch.device) -> _TimedSection:
        return _TimedSection(self, device)

    def mark(self) -> int:
        return len(self.records)

    def take(self, mark: int) -> CommTime:
        """The records since `mark`, removed from the timer (so it holds nothing between steps)."""
        taken = self.records[mark:]
        del self.records[mark:]
        return CommTime(taken)

    @property
    def seconds(self) -> float:
        """Time of the sections not taken by a layer yet."""
        return CommTime(self.records).seconds


class _TimedSection:
    """One timed communication section, also a torch.profiler range (smlp/profiling.py)."""

    def __init__(self, timer: CommTimer, device: torch.device):
        self.timer, self.device = timer, device
        self.range = record_function(RANGES["all2all"])

    def __enter__(self):
        self.range.__enter__()
        if self.timer.enabled:
            if _host_clock(self.device):
                self.start = time.perf_counter()
            else:
                self.start = torch.Event(device=self.device, enable_timing=True)
                self.start.record()
        return self

    def __exit__(self, *exc):
        if self.timer.enabled and exc[0] is None:
            if _host_clock(self.device):
                self.timer.records.append(time.perf_counter() - self.start)
            else:
                end = torch.Event(device=self.device, enable_timing=True)
                end.record()
                self.timer.records.append((self.start, end))
        self.range.__exit__(*exc)
        return False
