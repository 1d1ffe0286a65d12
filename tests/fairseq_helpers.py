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


TRAIN = [*TINY_TRAIN, "--cpu", "--max-update", "2"]  # the in-process runs of the bad-input tests


def fairseq_train(argv: list[str], world: int = 1) -> None:
    """fairseq-train's main() in this process; rank 0 of a fake `world`-rank group when world > 1 (only the
    world size matters to the checks that run before training)."""
    import torch.distributed as dist
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import train as fairseq_cli_train

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        fairseq_cli_train.main(cfg)
    finally:
        from smlp import folder_lock

        folder_lock.release()  # the save folder's lock, as fairseq-train's call_main releases it
        if dist.is_initialized():
            dist.destroy_process_group()


def fairseq_preprocess(*argv: str) -> None:
    """fairseq-preprocess with these arguments in this process, as its console script runs them (a new process pays
    ~4 s of imports for a second of binarizing the tests' data); the log file handler it adds to its logger
    (DESTDIR/preprocess.log) is closed and removed afterwards."""
    from fairseq import options
    from fairseq_cli import preprocess

    args = options.get_preprocessing_parser().parse_args(list(argv))
    handlers = list(preprocess.logger.handlers)
    try:
        preprocess.main(args)
    finally:
        for handler in [h for h in preprocess.logger.handlers if h not in handlers]:
            preprocess.logger.removeHandler(handler)
            handler.close()


def in_process_trainer(args: list[str], *, world: int = 1, rank: int = 0, port: int | None = None):
    """(trainer, epoch iterator, grouped batches) of fairseq's own Trainer for the fairseq-train arguments `args`,
    built in this process as fairseq_cli.train builds it, on CPU; on `world` gloo ranks (this process is `rank`,
    rendezvous on `port`) when world > 1. For tests that drive train_step themselves."""
    from fairseq import options, tasks, utils
    from fairseq.data import iterators
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq.trainer import Trainer

    from fairseq_plugins.precision import bf16_without_tpu

    args = [*args, "--cpu"]
    save_dir = args[args.index("--save-dir") + 1] if "--save-dir" in args else None
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    if world > 1:
        args += ["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp", "--distributed-init-method",
                 f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(world), "--distributed-rank", str(rank),
                 "--device-id", str(rank), "--distributed-no-spawn"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), input_args=args))
    bf16_without_tpu(cfg, argv=args)  # what fairseq-train's call_main does
    if world > 1:
        distributed_utils.distributed_init(cfg)  # once per process (later calls only warn), and the rank suffix
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    epoch_itr = trainer.get_train_iterator(epoch=1)
    batches = iterators.GroupedIterator(epoch_itr.next_epoch_itr(shuffle=True), cfg.optimization.update_freq[0])
    return trainer, epoch_itr, batches


def spawn_and_collect(worker, nprocs: int, *args) -> list:
    """Run worker(i, tmp, *args) in `nprocs` processes forked from the session's server (torch.multiprocessing,
    "forkserver") and return what each saved to `result_path(tmp, i)`, in process order."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp, *args), nprocs=nprocs, join=True, start_method="forkserver")
        return [torch.load(result_path(tmp, i), weights_only=False) for i in range(nprocs)]


def result_path(tmp: str, i: int) -> str:
    return os.path.join(tmp, f"result-{i}.pt")


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


CLI_MODULES = {"fairseq-train": "train", "fairseq-validate": "validate", "fairseq-eval-lm": "eval_lm"}
# What every fairseq rank imports before its first update: fairseq with its tasks and models (~4 s of CPU per
# process on this machine) and torch._dynamo (imported by torch.optim.Optimizer's constructor: ~3 s). A fork
# server imports them once per session; each rank is then a fork of it (run_fairseq). The plugins (0.1 s)
# are imported by each rank, from --user-dir, as in a fresh process.
FORK_PRELOAD = ["torch", "torch._dynamo", "fairseq_cli.train", "fairseq_cli.validate", "fairseq_cli.eval_lm"]
# read once, when the preloaded modules are imported: a run that sets them otherwise starts a fresh process
IMPORT_TIME_ENV = ("ATEN_CPU_CAPABILITY", "LOGLEVEL", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")
_fork_env: dict = {}


def start_fork_server() -> None:
    """Start the session's fork server (multiprocessing's 'forkserver', FORK_PRELOAD imported once in it) with
    the session's environment: run_fairseq's ranks and the tests' torch.multiprocessing.spawn(...,
    start_method="forkserver") workers are forks of it. A forked worker has the server's environment, not the
    test's (run_fairseq passes its own); tests that change the environment of their workers start processes."""
    import multiprocessing
    from multiprocessing import forkserver

    if not _fork_env:
        multiprocessing.set_forkserver_preload(FORK_PRELOAD)
        forkserver.ensure_running()
        _fork_env.update({k: os.environ.get(k) for k in IMPORT_TIME_ENV})


def _forks():
    import multiprocessing

    start_fork_server()
    return multiprocessing.get_context("forkserver")


def _rank_main(program: str, argv: list[str], env: dict, out_path: str, threads: int, cwd, umask=None) -> None:
    """One rank in a fork of the preloaded server: the console program's cli_main, as its console script would
    run it (its environment, arguments, working directory, umask, stdout and stderr into one file, its exit
    code)."""
    if umask is not None:
        os.umask(umask)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as PYTHONUNBUFFERED: a killed rank leaves its last lines
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import importlib

    import torch

    torch.set_num_threads(threads)
    sys.argv = [program, *argv]
    importlib.import_module("fairseq_cli." + CLI_MODULES[program]).cli_main()


def _start_rank(program: str, argv: list[str], env: dict, threads: int, cwd, out_path: str, umask=None):
    """A rank of `program`: forked from the session's preloaded server where it runs the same code as a fresh
    process would, else a fresh process (another interpreter's environment at import time, or no cli_main)."""
    if program in CLI_MODULES and all(env.get(k) == _fork_env.get(k, os.environ.get(k)) for k in IMPORT_TIME_ENV):
        proc = _forks().Process(target=_rank_main, args=(program, argv, env, out_path, threads, cwd, umask),
                                daemon=False)
        proc.start()
        return proc
    out = open(out_path, "w")
    with out:
        return subprocess.Popen([str(BIN / program), *argv], stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd, umask=-1 if umask is None else umask)


def _wait(proc, timeout: float) -> int | None:
    """The rank's exit code, None if it was still running after `timeout` seconds."""
    if isinstance(proc, subprocess.Popen):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    proc.join(timeout)
    return proc.exitcode


def run_fairseq(program: str, args: list[str], *, world: int = 1, timeout: int = 300,
                cwd=None, umask: int | None = None) -> list[subprocess.CompletedProcess]:
    """Run a fairseq console program on `world` CPU gloo ranks (--cpu, gloo, legacy_ddp, tcp rendezvous), each
    rank's stdout and stderr in its CompletedProcess.stdout. Each rank is a fork of a server that imported
    fairseq once for the session (FORK_PRELOAD: ~8 s of CPU less per rank than a fresh interpreter, the same
    code after that); tests/test_launch.py and tests/test_faults.py start real processes through smlp-launch.
    `umask`: the ranks' umask (default: the fork server's, the session's at its start)."""
    import tempfile
    import time

    if world == 1:
        dists = [["--cpu"]]
        threads = 2
    else:
        port = free_port()
        dists = [["--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
                  "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(world),
                  "--distributed-rank", str(rank), "--device-id", str(rank), "--distributed-no-spawn"]
                 for rank in range(world)]
        threads = 1
    with tempfile.TemporaryDirectory(prefix="fairseq-ranks-") as tmp:
        outs = [os.path.join(tmp, f"rank{rank}.log") for rank in range(world)]
        argvs = [[*args, *_merge_flags(args, dist)] for dist in dists]
        procs = [_start_rank(program, argv, worker_env(threads), threads, cwd, out, umask)
                 for argv, out in zip(argvs, outs)]
        codes, deadline = [], time.monotonic() + timeout
        try:
            for proc in procs:
                codes.append(_wait(proc, max(0.0, deadline - time.monotonic())))
        finally:
            for proc in procs:
                if _wait(proc, 0) is None:
                    proc.kill()
                    _wait(proc, 10)
        if None in codes:
            raise subprocess.TimeoutExpired([program, *args], timeout, output=Path(outs[0]).read_text())
        return [subprocess.CompletedProcess([program, *argv], code, Path(out).read_text(errors="replace"), "")
                for argv, code, out in zip(argvs, codes, outs)]


def run_in_process(program: str, args: list[str], *, threads: int = 2) -> list[subprocess.CompletedProcess]:
    """`program` (fairseq-train, fairseq-validate or fairseq-eval-lm) on one CPU process as run_fairseq runs it,
    but in this process: its console script's cli_main with these arguments. Returns what run_fairseq
    returns, the log lines fairseq would print as stdout; an error is raised here. A one-process run this way
    pays no process start-up (the ~5 s of fairseq imports each fairseq subprocess pays here)."""
    import importlib
    import logging

    import torch

    module = importlib.import_module("fairseq_cli." + CLI_MODULES[program])
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
