"""What every micro-benchmark's JSON record carries besides its figures, and how it is written.

`smlp_bench.causal_product` and `smlp_bench.local_experts` use it; `smlp_bench.sparse_profile` keeps
its own copy on purpose: it also runs against an older checkout put on PYTHONPATH, which has no
such module.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

from .schedule import atomic_write_json


def environment() -> dict:
    """The machine (with its load average: absolute times on a shared machine are noise) and versions."""
    import torch

    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "loadavg": os.getloadavg()},
            "versions": {"torch": torch.__version__, "python": platform.python_version()}}


def write_record(path: str | Path, record: dict) -> Path:
    """Write the record atomically (creating its directory) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    print(f"wrote {path}")
    return path
