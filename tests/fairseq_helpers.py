"""Helpers for tests that run the real fairseq entry points on tiny data."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = str(REPO / "fairseq_plugins")
BIN = Path(sys.executable).parent

TINY_TRAIN = [
    "--task", "language_modeling", "--criterion", "smlp_lm_loss", "--tokens-per-sample", "32",
    "--batch-size", "8", "--optimizer", "adam", "--lr", "3e-3", "--log-format", "simple", "--log-interval", "1",
    "--seed", "1", "--no-progress-bar", "--num-workers", "0",
]


def smlp_tiny_flags(data, routing: str) -> list[str]:
    """The flags of the shared 2-rank run (`smlp_tiny_two_ranks`) and of the runs compared with it. The learning
    rate is fixed (no schedule) and fairseq reseeds every update, so --max-update, saving and validation decide
    only where a run stops and what it writes, not the losses of its updates."""
    return [str(data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TINY_TRAIN, "--smoe-routing", routing,
            "--validate-interval-updates", "10"]


SHARED_RUN_UPDATES = 50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(threads: int = 1) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def run_fairseq(program: str, args: list[str], *, world: int = 1, timeout: int = 300,
                cwd=None) -> list[subprocess.CompletedProcess]:
    """Run a fairseq console program on `world` CPU gloo ranks (--cpu, gloo, legacy_ddp, env:// rendezvous)."""
    exe = str(BIN / program)
    if world == 1:
        return [subprocess.run([exe, *args, "--cpu"], capture_output=True, text=True, timeout=timeout,
                               env=worker_env(2), cwd=cwd)]
    port = free_port()
    procs = []
    for rank in range(world):
        dist = ["--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
                "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(world),
                "--distributed-rank", str(rank), "--device-id", str(rank), "--distributed-no-spawn"]
        procs.append(subprocess.Popen([exe, *args, *_merge_flags(args, dist)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=worker_env(1), cwd=cwd))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def run_in_process(program: str, args: list[str], *, threads: int = 2) -> list[subprocess.CompletedProcess]:
    """`program` (fairseq-train, fairseq-validate or fairseq-eval-lm) on one CPU process as run_fairseq runs it,
    but in this process: its console script's cli_main with these arguments. Returns what run_fairseq
    returns, the log lines fairseq would print as stdout; an error is raised here. A one-process run this way
    pays no process start-up (the ~5 s of fairseq imports each fairseq subprocess pays here)."""
    import importlib
    import logging

    import torch

    module = importlib.import_module("fairseq_cli." + {"fairseq-train": "train", "fairseq-validate": "validate",
                                                       "fairseq-eval-lm": "eval_lm"}[program])
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):  # fairseq's progress bar names its records after their tag (train_inner, valid)
            lines.append(f"{record.levelname} | {record.name} | {record.getMessage()}")  # as fairseq prints

    # collected below the root: fairseq-validate replaces the root logger's handlers (fairseq.utils.reset_logging),
    # and the root's handlers and level are put back afterwards for the rest of the session
    collected = [logging.getLogger(name) for name in ("fairseq", "fairseq_cli", "fairseq_plugins", "smlp")]
    root = logging.getLogger()
    handler, root_handlers, level, torch_threads, argv = (Collect(logging.INFO), root.handlers[:], root.level,
                                                          torch.get_num_threads(), sys.argv)
    for logger in collected:
        logger.addHandler(handler)
    root.setLevel(logging.INFO)
    torch.set_num_threads(threads)  # as run_fairseq's one process
    sys.argv = [program, *args, "--cpu"]
    try:
        module.cli_main()
    finally:
        sys.argv = argv
        for logger in collected:
            logger.removeHandler(handler)
        root.handlers[:] = root_handlers
        root.setLevel(level)
        torch.set_num_threads(torch_threads)
    return [subprocess.CompletedProcess([program, *args, "--cpu"], 0, "\n".join(lines) + "\n", "")]


def _merge_flags(args: list[str], dist: list[str]) -> list[str]:
    """Distributed flags, minus those the caller already set (e.g. --ddp-backend c10d in a negative test)."""
    out, i = [], 0
    while i < len(dist):
        flag = dist[i]
        takes_value = i + 1 < len(dist) and not dist[i + 1].startswith("--")
        if flag not in args:
            out.extend(dist[i:i + 2] if takes_value else [flag])
        i += 2 if takes_value else 1
    return out


def train_losses(log: str) -> dict[int, float]:
    """num_updates -> training loss from fairseq's simple log format."""
    from smlp_launch.fairseq_log import train_records

    return {int(f["num_updates"]): float(f["loss"]) for f in train_records(log) if {"loss", "num_updates"} <= f.keys()}


def valid_losses(log: str) -> list[float]:
    from smlp_launch.fairseq_log import valid_records

    return [float(f["loss"]) for f in valid_records(log) if "loss" in f]


def output(results) -> str:
    return "\n".join((r.stdout or "") + (r.stderr or "") for r in results)


def assert_ok(results) -> str:
    text = output(results)
    codes = [r.returncode for r in results]
    assert all(c == 0 for c in codes), f"exit codes {codes}\n{text[-4000:]}"
    return text
