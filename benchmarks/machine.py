"""The machine a benchmark runs on, the dense matmul peak that MFU divides by (measured in the same run with the
ranks' own layout: W concurrent processes with one thread each), and the code a run executes."""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

CODE_ROOT = Path(__file__).resolve().parents[1]
# what decides a run's perplexity: the model, the plugins, the data pipeline, the models' flags and the command
PERPLEXITY_PATHS = ("smlp/", "fairseq_plugins/", "launch/", "benchmarks/presets.py", "benchmarks/training.py",
                    "pyproject.toml")


def machine_info() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "processor": platform.processor()}
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in
                                 Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for pkg, dist in (("fairseq", "fairseq-fixed"), ("fvcore", "fvcore")):
        try:
            info[pkg] = version(dist)
        except Exception:
            pass
    return info


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU time of the machine since boot, in clock ticks (/proc/stat; None where there is none).
    Between two readings, steal / total is the share of the CPUs' time the hypervisor gave to other guests."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[7], sum(ticks)) if len(ticks) == 8 else None


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two `cpu_ticks` readings (None: unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def matmul_rate(n: int, seconds: float, device=None, dtype=None) -> float:
    """Dense matmul FLOP/s of n x n products on `device` (the CPU by default) in `dtype` (fp32 by default, no TF32)."""
    import torch

    from smlp.dispatch import synchronize

    device = device or torch.device("cpu")
    prev, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        for _ in range(3):  # warm-up
            a @ b
        synchronize(device)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                a @ b
            synchronize(device)
            done += 10
        return 2 * n ** 3 * done / (time.perf_counter() - start)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _matmul_worker(n: int, seconds: float, queue) -> None:
    import torch

    torch.set_num_threads(1)
    queue.put(matmul_rate(n, seconds))


def matmul_peak(nproc: int, n: int = 1024, seconds: float = 4.0) -> dict:
    """Dense fp32 matmul FLOP/s of `nproc` concurrent single-thread processes (as the training ranks run)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_matmul_worker, args=(n, seconds, queue)) for _ in range(nproc)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join()
    return {"per_rank": rates, "total": sum(rates), "n": n, "threads_per_rank": 1}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(CODE_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_identity() -> dict:
    """The commit of the code running (None outside a git checkout) and whether files that decide a run's
    perplexity differ from it (uncommitted changes under PERPLEXITY_PATHS)."""
    commit = _git("rev-parse", "HEAD")
    return {"commit": commit, "dirty": bool(commit and _git("status", "--porcelain", "--", *PERPLEXITY_PATHS))}


def perplexity_changes(old: str, new: str) -> list[str] | None:
    """The files under PERPLEXITY_PATHS that differ between two commits (None when git cannot tell)."""
    if old == new:
        return []
    out = _git("diff", "--name-only", old, new, "--", *PERPLEXITY_PATHS)
    return None if out is None else [line for line in out.splitlines() if line]
