"""Single-machine launcher for distributed `fairseq-train` (console script `smlp-launch`).

    smlp-launch --nproc 2 --cpu -- DATA_DIR --task language_modeling --arch ... --user-dir fairseq_plugins

starts one fairseq-train worker per rank. Everything after `--` is passed to fairseq-train untouched;
the launcher appends the distributed flags of each rank:

    CPU: --cpu --distributed-backend gloo --ddp-backend legacy_ddp
    GPU: one worker per GPU, --distributed-backend nccl --ddp-backend legacy_ddp
    both: --distributed-init-method tcp://ADDR:PORT --distributed-world-size W --distributed-rank R
          --device-id R --distributed-no-spawn

Why not torchrun: on CPU fairseq-train under torchrun divides by torch.cuda.device_count() (a crash),
and without --distributed-world-size it silently runs W independent trainings. Explicit per-rank flags
make fairseq's `infer_init_method` return at once (it never looks at SLURM or torchrun variables).
`--ddp-backend legacy_ddp` is the default because it is the only fairseq DDP backend that leaves
expert parameters (`param.expert = True`) out of the gradient all-reduce; a user's --ddp-backend wins.

Each worker gets max(1, cores // W) OpenMP/MKL threads: W ranks left at the default thread count
oversubscribe the cores (2 ranks on 2 cores trained 3.9x slower here).

Failure handling: every worker runs in its own process group and dies with the launcher
(PR_SET_PDEATHSIG). If a worker exits non-zero, the launcher sends SIGTERM to every other worker's
process group, SIGKILL after --grace seconds, prints the tail of the failed rank's log (only its last
line when that is a one-line error, `fairseq-train: error: ...`) and exits non-zero naming the rank.
Ctrl-C / SIGTERM / SIGHUP to the launcher stop all workers the same way (a second Ctrl-C kills at once).
SIGUSR1 to the launcher is forwarded: the workers save a checkpoint after the current update and stop
(smlp_launch.worker), and the launcher exits 0.
Rank 0 writes to the console; rank R > 0 writes to LOG_DIR/rankR.log. On a terminal the launcher shows
rank 0's training as a progress bar over --max-update (updates, loss, words/s, time left; smlp_launch.progress),
prints its other lines above the bar and keeps all of them in LOG_DIR/rank0.log (--log-interval 10 unless
given; --no-progress lets rank 0's output through as it is). At the end the launcher
prints each rank's peak resident memory (the kernel's ru_maxrss of the reaped worker; while they
run, `smlp_launch.memory` reads VmHWM), and --peak-rss-json FILE writes it as JSON.

Flags the model cannot take: each worker checks the fairseq-train arguments before it joins the others
(smlp_launch.preflight: the model's flags, the data folder, --batch-size); if they are refused, the launcher
prints the one line that says why, once (`smlp-launch: error: --decoder-ffn-embed-dim 127 must be even ...`),
stops the workers and exits 2. A --save-dir that cannot be created or that another job trains in (its lock,
smlp.folder_lock) and a --restore-file or --finetune-from-model that does not exist are refused before any
worker starts.

Timeouts: a rank waits at most --timeout seconds (default $SMLP_DIST_TIMEOUT, else 600) in one
collective or in the rendezvous before it fails, so a hung peer ends the job instead of blocking it
(why and how: smlp_launch.worker). Worker mode (`smlp-launch --worker -- FAIRSEQ_ARGS`) runs one
fairseq-train in this process with a graceful stop on SIGUSR1, as the launcher's workers and
launch/slurm/train.sbatch's tasks do; that side is smlp_launch.worker.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from smlp.folder_lock import FolderInUse, probe
from smlp_eval.files import deepest_parent

from .sessions import group_alive, launcher_nice, signal_group, worker_preexec
from .worker import DEFAULT_TIMEOUT_S, PREFLIGHT_ENV, TIMEOUT_ENV, LaunchError, collective_timeout, run_worker

PROG = "smlp-launch"

# fairseq-train flags whose values the launcher decides for every rank. fairseq parses with
# allow_abbrev=False, so only the exact spellings (and "--flag=value") can reach these fields.
CONTROLLED_FLAGS = {
    "--distributed-world-size": "set by --nproc",
    "--distributed-rank": "set per worker",
    "--device-id": "set per worker",
    "--local_rank": "set per worker (alias of --device-id)",
    "--distributed-init-method": "the launcher's rendezvous, see --master-addr/--master-port",
    "--distributed-port": "the launcher's rendezvous, see --master-port",
    "--distributed-no-spawn": "the launcher starts one process per rank",
    "--distributed-num-procs": "the launcher starts one process per rank",
    "--nprocs-per-node": "set by --nproc",
    "--distributed-backend": "gloo on CPU, nccl on GPU",
}
TAIL_LINES = 40
SETTLE_S = 0.3  # how long the ranks are polled again before a failure is blamed on a rank (Launcher._cause)


@dataclass
class Plan:
    """Everything needed to start the workers (built and validated before anything starts)."""

    nproc: int
    device: str  # "cpu" | "gpu"
    master_addr: str
    master_port: int
    threads: int
    log_dir: Path
    grace: float
    fairseq_args: list[str]
    timeout: float = DEFAULT_TIMEOUT_S
    peak_rss_json: Path | None = None
    commands: list[list[str]] = field(default_factory=list)
    envs: list[dict[str, str]] = field(default_factory=list)
    progress: bool = False  # rank 0's output read by the launcher, shown as a bar (smlp_launch.progress)
    max_update: int | None = None


# ----------------------------------------------------------------------------- command line


def _split_at_dashdash(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] -- FAIRSEQ_TRAIN_ARGS...",
        description="Start W distributed fairseq-train workers on this machine "
        "(CPU: gloo, GPU: nccl, one worker per GPU). Arguments after `--` go to fairseq-train "
        "untouched; the launcher adds the per-rank --distributed-* flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""example:
  {PROG} --nproc 2 --cpu -- data-bin --task language_modeling --arch transformer_lm \\
      --max-update 100 --save-dir ckpt

signals to the launcher:
  Ctrl-C, SIGTERM, SIGHUP  stop every worker (SIGTERM, then SIGKILL after --grace s); exit 128+signal
  SIGUSR1                  workers save a checkpoint after the current update and stop; exit 0
A worker that fails stops all others; the launcher exits with its code and shows its log's tail.""",
    )
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="number of workers (default: all visible GPUs in GPU mode, else 1)")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                     help="auto (default): GPU if torch sees CUDA and fairseq args lack --cpu")
    dev.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="same as --device cpu")
    dev.add_argument("--gpu", dest="device", action="store_const", const="gpu", help="same as --device gpu")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free port)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP/MKL threads per worker (default: max(1, usable cores // nproc))")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where ranks > 0 write rankR.log (default: SAVE_DIR/launch-logs, SAVE_DIR "
                   "from fairseq's --save-dir, else checkpoints/launch-logs)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default 10)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds a rank waits in one collective (or the rendezvous) for its peers before it "
                   f"fails (default ${TIMEOUT_ENV}, else {DEFAULT_TIMEOUT_S:g}); gloo and NCCL")
    p.add_argument("--peak-rss-json", type=Path, default=None,
                   help="write each rank's peak resident memory (bytes) to this JSON file at the end")
    p.add_argument("--no-progress", action="store_true",
                   help="let rank 0's output through as it is on a terminal too (by default a terminal gets a "
                        "progress bar: updates, loss, words/s, time left, with rank 0's lines in LOG_DIR/rank0.log)")
    p.add_argument("--dry-run", action="store_true", help="print the worker commands and exit")
    p.add_argument("--worker", action="store_true",
                   help="run ONE fairseq-train in this process with the graceful-stop hook "
                   "(used by the launcher's workers and by launch/slurm/train.sbatch)")
    return p


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def _has_flag(args: Sequence[str], name: str) -> bool:
    return any(_flag_name(a) == name for a in args)


def _flag_value(args: Sequence[str], name: str) -> str | None:
    """Value of the last `name VALUE` / `name=VALUE` in args (argparse: the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cuda_device_count() -> int:
    """GPUs torch can use; 0 if torch or CUDA is missing (the launcher never requires CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" here
        return 0


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_fairseq_args(fairseq_args: Sequence[str], device: str) -> None:
    """Reject flags the launcher sets itself, and cheap-to-detect mistakes, before starting anything."""
    for a in fairseq_args:
        name = _flag_name(a)
        if name in CONTROLLED_FLAGS:
            raise LaunchError(
                f"{name} is controlled by {PROG} ({CONTROLLED_FLAGS[name]}); remove it from the "
                f"fairseq-train arguments")
    if device == "gpu" and _has_flag(fairseq_args, "--cpu"):
        raise LaunchError("--cpu is among the fairseq-train arguments but the launcher is in GPU mode; "
                          f"use `{PROG} --cpu` (or drop --device gpu)")
    if fairseq_args and not fairseq_args[0].startswith("-"):
        # fairseq-train's positional argument is the data directory; ':' separates shards.
        for part in fairseq_args[0].split(":"):
            if "://" in fairseq_args[0]:
                break  # a remote path (s3://, manifold://): not checkable here
            if part and not os.path.isdir(part):
                raise LaunchError(f"data directory {part!r} does not exist (first fairseq-train argument)")
    user_dir = _flag_value(fairseq_args, "--user-dir")
    if user_dir is not None and not os.path.isdir(user_dir):
        raise LaunchError(f"--user-dir {user_dir!r} is not a directory")
    _check_paths(fairseq_args)


def _check_paths(fairseq_args: Sequence[str]) -> None:
    """--save-dir that cannot be created, --restore-file / --finetune-from-model that do not exist: said before
    any worker starts (fairseq would fail at its first save, or start from scratch and overwrite the run)."""
    save_dir = _flag_value(fairseq_args, "--save-dir") or "checkpoints"
    parent, problem = deepest_parent(Path(save_dir, "x").absolute())  # the save dir itself may exist
    if problem == "file":
        raise LaunchError(f"--save-dir {save_dir} cannot be created: {parent} is a file; choose a folder path")
    if problem == "read-only":
        raise LaunchError(f"--save-dir {save_dir} cannot be written: {parent} is not writable")
    try:  # another job training in this folder: refused before any log or worker is made (rank 0 locks it)
        if "--no-save" not in fairseq_args:  # a run that saves nothing takes no lock
            probe(save_dir)
    except FolderInUse as exc:
        raise LaunchError(str(exc)) from None
    restore = _flag_value(fairseq_args, "--restore-file")
    if restore and restore != "checkpoint_last.pt" and not os.path.exists(restore) and not _rank_shards_of(restore):
        raise LaunchError(f"--restore-file {restore} does not exist (nor its rank shards {restore[:-3]}-rank-R.pt): "
                          f"fairseq would silently start from scratch and then overwrite the checkpoints in "
                          f"--save-dir; pass an existing checkpoint")
    finetune = _flag_value(fairseq_args, "--finetune-from-model")
    if finetune and not os.path.exists(finetune) and not _rank_shards_of(finetune):
        raise LaunchError(f"--finetune-from-model {finetune} does not exist; pass an existing checkpoint")


def _rank_shards_of(path: str) -> list[str]:
    import glob

    stem = path[:-3] if path.endswith(".pt") else path
    return glob.glob(glob.escape(stem) + "-rank-*.pt")


def plan_launch(opts: argparse.Namespace, fairseq_args: list[str]) -> Plan:
    device = opts.device
    if device == "auto":
        device = "cpu" if _has_flag(fairseq_args, "--cpu") else ("gpu" if _cuda_device_count() > 0 else "cpu")
    n_gpus = _cuda_device_count() if device == "gpu" else 0
    if device == "gpu" and n_gpus == 0:
        raise LaunchError("--device gpu: torch sees no CUDA device (use --cpu)")
    nproc = opts.nproc if opts.nproc is not None else (n_gpus if device == "gpu" else 1)
    if nproc < 1:
        raise LaunchError(f"--nproc must be >= 1, got {nproc}")
    if device == "gpu" and nproc > n_gpus:
        raise LaunchError(f"--nproc {nproc} but only {n_gpus} GPU(s) visible: one worker per GPU")
    check_fairseq_args(fairseq_args, device)
    if opts.threads is not None and opts.threads < 1:
        raise LaunchError(f"--threads must be >= 1, got {opts.threads}")
    if opts.grace < 0:
        raise LaunchError(f"--grace must be >= 0, got {opts.grace}")
    timeout = opts.timeout if opts.timeout is not None else collective_timeout()
    if not timeout > 0:
        raise LaunchError(f"--timeout must be > 0 seconds, got {timeout:g}")
    threads = opts.threads or max(1, usable_cores() // nproc)
    port = opts.master_port if opts.master_port is not None else free_port(opts.master_addr)
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {port}")
    save_dir = _flag_value(fairseq_args, "--save-dir") or "checkpoints"
    log_dir = opts.log_dir or Path(save_dir) / "launch-logs"

    progress = not opts.no_progress and sys.stderr.isatty()
    if progress and not _has_flag(fairseq_args, "--log-interval"):
        fairseq_args = [*fairseq_args, "--log-interval", "10"]  # the bar moves every 10 updates
    max_update = _flag_value(fairseq_args, "--max-update")
    plan = Plan(nproc=nproc, device=device, master_addr=opts.master_addr, master_port=port,
                threads=threads, log_dir=Path(log_dir), grace=opts.grace, fairseq_args=fairseq_args,
                timeout=timeout, peak_rss_json=opts.peak_rss_json, progress=progress,
                max_update=int(max_update) if max_update and max_update.isdigit() else None)
    common = [
        "--distributed-init-method", f"tcp://{opts.master_addr}:{port}",
        "--distributed-world-size", str(nproc),
        "--distributed-no-spawn",
        "--distributed-backend", "nccl" if device == "gpu" else "gloo",
    ]
    if device == "cpu" and not _has_flag(fairseq_args, "--cpu"):
        common.append("--cpu")
    if not _has_flag(fairseq_args, "--ddp-backend"):
        common += ["--ddp-backend", "legacy_ddp"]
    for rank in range(nproc):
        cmd = [sys.executable, "-m", "smlp_launch.local", "--worker", "--", *fairseq_args, *common,
               "--distributed-rank", str(rank), "--device-id", str(rank)]
        env = dict(os.environ)
        env.update({
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",  # fairseq logs to stdout: keep the rank logs live
            TIMEOUT_ENV: f"{timeout:g}",
            "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        })
        plan.commands.append(cmd)
        plan.envs.append(env)
    return plan


# ----------------------------------------------------------------------------- running workers


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    log_path: Path | None
    log_file: IO | None
    peak_rss: int | None = None  # bytes: ru_maxrss once reaped, the highest VmHWM sampled before

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the worker leads its own process group

    def poll(self) -> int | None:
        """Popen.poll(), but reaping with wait4 so the worker's peak RSS (ru_maxrss) is kept."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        from .memory import vmhwm_bytes

        live = vmhwm_bytes(self.proc.pid)
        if live is not None:
            self.peak_rss = max(self.peak_rss or 0, live)
        try:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere
            return self.proc.poll()
        if pid == 0:
            return None
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = max(self.peak_rss or 0, usage.ru_maxrss * 1024)  # Linux reports KiB
        return self.proc.returncode

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _ranks_text(nproc: int) -> str:
    return "1" if nproc == 2 else f"1-{nproc - 1}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else (code if 0 < code < 256 else 1)


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


class Launcher:
    def __init__(self, plan: Plan, out: IO = sys.stderr):
        self.plan = plan
        self.out = out
        self.workers: list[Worker] = []
        self.stop_signal: int | None = None
        self.forwarded_usr1 = False
        self.kill_now = False
        self.refusals: Path | None = None  # where the workers write the one line refusing their flags
        self.refused = False
        self.created: list[Path] = []  # the folders start() made for the rank logs
        self.progress = None  # smlp_launch.progress.Progress of rank 0's output, on a terminal

    def say(self, msg: str) -> None:
        print(f"{PROG}: {msg}", file=self.out, flush=True)

    # signal handlers only set flags; the poll loop acts on them
    def _on_stop(self, signum, _frame) -> None:
        if self.stop_signal is not None:
            self.kill_now = True
        self.stop_signal = signum

    def _on_usr1(self, _signum, _frame) -> None:
        for w in self.workers:
            if w.proc.returncode is None:
                try:
                    os.kill(w.proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        self.forwarded_usr1 = True

    def start(self) -> None:
        p = self.plan
        if p.nproc > 1 or p.progress:
            from smlp_eval.files import make_parents

            self.created = make_parents(p.log_dir / "rank1.log")  # taken away again if the flags are refused
        preexec = worker_preexec(os.getpid(), launcher_nice())
        import tempfile

        self.refusals = Path(tempfile.mkdtemp(prefix="smlp-launch-"))
        for rank, (cmd, env) in enumerate(zip(p.commands, p.envs)):
            env = {**env, PREFLIGHT_ENV: str(self.refusals / f"rank{rank}")}
            log_path = log_file = None
            if rank > 0:
                log_path = p.log_dir / f"rank{rank}.log"
                log_file = open(log_path, "wb")
            piped = rank == 0 and p.progress
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if piped else log_file,
                                    stderr=subprocess.STDOUT if log_file or piped else None,
                                    start_new_session=True, preexec_fn=preexec,
                                    text=piped or None, errors="replace" if piped else None)
            if piped:
                from .progress import Progress

                self.progress = Progress(p.max_update, p.log_dir / "rank0.log", self.out)
                self.progress.follow(proc.stdout)
                log_path = p.log_dir / "rank0.log"
            self.workers.append(Worker(rank, proc, log_path, log_file))

    def stop_all(self, reason: str, quiet: bool = False) -> None:
        """SIGTERM every live worker's process group, SIGKILL after the grace period, reap all."""
        live = [w for w in self.workers if group_alive(w.pgid)]
        if live and not quiet:
            self.say(f"{reason}: stopping {len(live)} worker(s) (SIGTERM, SIGKILL after {self.plan.grace:g}s)")
        for w in live:
            signal_group(w.pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.plan.grace
        while time.monotonic() < deadline and not self.kill_now:
            for w in live:
                w.poll()
            if not any(group_alive(w.pgid) for w in live):
                break
            time.sleep(0.05)
        for w in self.workers:
            if group_alive(w.pgid):
                signal_group(w.pgid, signal.SIGKILL)
        for w in self.workers:
            if w.wait(timeout=30) is None:  # unkillable (D state); report, never hang
                self.say(f"rank {w.rank} (pid {w.proc.pid}) did not die after SIGKILL")

    def run(self) -> int:
        p = self.plan
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_stop) for s in handled}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        try:
            self.say(f"{p.nproc} worker(s) on {p.device.upper()} "
                     f"({'nccl' if p.device == 'gpu' else 'gloo'}, {p.threads} thread(s) each), "
                     f"rendezvous tcp://{p.master_addr}:{p.master_port}"
                     + (f", output of rank(s) {_ranks_text(p.nproc)} in {p.log_dir}" if p.nproc > 1 else ""))
            if p.progress and _flag_value(p.fairseq_args, "--log-format") == "none":
                self.say("--log-format none: fairseq-train logs no training or validation figures, so the progress "
                         "bar cannot move; use --log-format simple or json to see them")
            self.start()
            return self._watch()
        finally:
            # whatever happened (exception included), no worker outlives the launcher
            if any(group_alive(w.pgid) for w in self.workers):
                self.stop_all("cleaning up")
            if self.progress is not None:
                self.progress.close()
            for w in self.workers:
                if w.log_file:
                    w.log_file.close()
            for s, h in previous.items():
                signal.signal(s, h)
            if self.refusals is not None:
                import shutil

                shutil.rmtree(self.refusals, ignore_errors=True)
            if not self.refused:
                self.report_memory()

    def report_memory(self) -> None:
        from .memory import format_bytes

        peaks = {w.rank: w.peak_rss for w in self.workers if w.peak_rss}
        if not peaks:
            return
        self.say("peak RSS per rank: " + ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(peaks.items())))
        if self.plan.peak_rss_json is not None:
            import json

            from smlp.files import write_atomic

            write_atomic(self.plan.peak_rss_json, json.dumps(
                {"peak_rss_bytes": {str(r): b for r, b in sorted(peaks.items())},
                 "source": "ru_maxrss / VmHWM"}) + "\n")

    def _watch(self) -> int:
        while True:
            if self.stop_signal is not None:
                name = signal.Signals(self.stop_signal).name
                self.stop_all(f"got {name}")
                self.say(f"stopped by {name}")
                return 128 + self.stop_signal
            codes = [w.poll() for w in self.workers]
            if any(c not in (None, 0) for c in codes):
                return self._fail(self._cause())
            if all(c == 0 for c in codes):
                # stragglers in a worker's group (e.g. an orphaned DataLoader process) go too
                for w in self.workers:
                    if group_alive(w.pgid):
                        signal_group(w.pgid, signal.SIGKILL)
                if self.forwarded_usr1:
                    self.say("workers saved a checkpoint and stopped (SIGUSR1)")
                else:
                    self.say(f"all {len(self.workers)} worker(s) finished")
                return 0
            time.sleep(0.1)

    def _cause(self) -> Worker:
        """The rank whose failure ended the run. A rank killed by a signal (the OOM killer, a node's kill, a
        segfault) makes its peers fail a moment later (their collectives see its sockets close), often within
        the same poll: a signal death is never caused by the peers (the launcher has signalled no one yet), so
        it is the cause; the others are named after it. The ranks are polled again for SETTLE_S before a rank
        that exited with a code is blamed, so a peer's death seen a poll late is still found."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            codes = [w.poll() for w in self.workers]
            killed = [w for w, c in zip(self.workers, codes) if c is not None and c < 0]
            if killed or None not in codes or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return (killed or [w for w, c in zip(self.workers, codes) if c not in (None, 0)])[0]

    def _refusal(self) -> str | None:
        """The line a worker wrote refusing the run's flags (smlp_launch.preflight), if any did."""
        for w in self.workers:
            path = self.refusals / f"rank{w.rank}" if self.refusals else None
            if path is not None and path.is_file():
                return path.read_text().strip()
        return None

    def _remove_logs(self) -> None:
        """A refused run leaves nothing: the rank logs and the folders made for them go."""
        from smlp_eval.files import remove_folders

        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for w in self.workers:
            if w.log_file:
                w.log_file.close()
            if w.log_path is not None:
                w.log_path.unlink(missing_ok=True)
        remove_folders(self.created)

    def _fail(self, w: Worker) -> int:
        message = self._refusal() if w.proc.returncode == 2 else None
        if message:  # the same for every rank: said once, without the ranks' logs
            self.refused = True
            self.stop_all("refused", quiet=True)
            self._remove_logs()
            print(f"{PROG}: error: {message}", file=self.out, flush=True)
            return 2
        code = w.proc.returncode
        what = f"rank {w.rank} {_describe(code)}"
        self.stop_all(what)
        shown = self.progress is not None and w.rank == 0  # its lines are on the console already
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        others = [f"rank {o.rank} {_describe(o.proc.returncode)}" for o in self.workers
                  if o is not w and o.proc.returncode is not None]
        if others:
            self.say("then: " + ", ".join(others))
        if w.log_path is not None and not shown:
            tail = _tail(w.log_path)
            # a one-line error (fairseq_plugins.errors) says it all; torch prefixes a rank's lines with [rankR]:
            error = re.match(r"^(?:\[rank\d+\]: )?([\w.-]+: error: .*)$", tail.rstrip().rsplit("\n", 1)[-1])
            if error:
                self.say(f"rank {w.rank}: {error.group(1)}")
            else:
                self.say(f"last lines of {w.log_path}:")
                print(tail, file=self.out, flush=True)
        where = f" (log: {w.log_path})" if w.log_path else " (its output is above)"
        self.say(f"FAILED: {what}{where}")
        return _exit_status(code)


# ----------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, fairseq_args = _split_at_dashdash(argv)
    parser = _parser()
    opts, unknown = parser.parse_known_args(own)
    if unknown or fairseq_args is None:
        parser.error(("unrecognized arguments: " + " ".join(unknown) + "; " if unknown else "")
                     + "put the fairseq-train arguments after `--`, e.g. "
                     f"{PROG} --nproc 2 --cpu -- data-bin --arch transformer_lm ...")
    if opts.worker:
        given = [a for a in own if a != "--worker"]
        if given:
            parser.error(f"--worker runs one fairseq-train in this process and takes no other option (got {given})")
    try:
        if opts.worker:
            return run_worker(fairseq_args)
        plan = plan_launch(opts, fairseq_args)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if opts.dry_run:
        for rank, cmd in enumerate(plan.commands):
            print(f"OMP_NUM_THREADS={plan.threads} MKL_NUM_THREADS={plan.threads} RANK={rank} "
                  + shlex.join(cmd))
        return 0
    return Launcher(plan).run()


if __name__ == "__main__":
    sys.exit(main())
