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
process group, SIGKILL after --grace seconds, prints the tail of the failed rank's log and exits
non-zero naming the rank. Ctrl-C / SIGTERM / SIGHUP to the launcher stop all workers the same way
(a second Ctrl-C kills at once). SIGUSR1 to the launcher is forwarded: the workers save a checkpoint
after the current update and stop (see "worker mode"), and the launcher exits 0.
Rank 0 writes to the console; rank R > 0 writes to LOG_DIR/rankR.log. At the end the launcher
prints each rank's peak resident memory (the kernel's ru_maxrss of the reaped worker; while they
run, `smlp_launch.memory` reads VmHWM), and --peak-rss-json FILE writes it as JSON.

Timeouts, on purpose: a rank waits at most --timeout seconds (default $SMLP_DIST_TIMEOUT, else 600)
in one collective or in the rendezvous before it fails with an error, so a peer that hangs (stopped,
deadlocked, its node gone without closing its sockets) ends the job instead of blocking it; a peer
that dies is noticed at once (gloo: "Connection closed by peer"; the launcher: its exit status).
The value is passed to torch.distributed.init_process_group (gloo and NCCL) in worker mode, and
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (unless set) makes a timed-out NCCL collective abort the process
rather than hang. It must exceed the longest time one rank can legitimately run ahead of the
others: a checkpoint save, a validation pass, the first step's warm-up.

Worker mode (`smlp-launch --worker -- FAIRSEQ_ARGS`) runs one fairseq-train in this process, as
the launcher's workers and launch/slurm/train.sbatch's tasks do, adding one thing fairseq-fixed
lacks: a graceful stop. fairseq-fixed installs no signal handler (its SIGUSR1 requeue logic is gone);
SIGUSR1 just kills it, wherever it is, possibly while it copies checkpoint_last.pt. In worker mode
SIGUSR1 (or the signals named in $SMLP_STOP_SIGNALS, e.g. "USR1,USR2") only sets a flag. After each
update, where fairseq itself decides whether to validate and save, the ranks agree on the flag
(one all-reduce of one number) and all of them save a checkpoint at the same update and return
from training. The hook wraps `fairseq_cli.train.validate_and_save` at run time; no fairseq file
is changed. If $SMLP_STATUS_FILE is set, rank 0 writes "stopped num_updates=N" to it, which is how
train.sbatch tells a signal stop (requeue) from a finished training. SIGTERM is deliberately not a
graceful-stop signal: SLURM sends it to every process of a step, torch's DataLoader workers die of
it, and the trainer then fails on "DataLoader worker ... killed"; SIGTERM means stop now.
"""
from __future__ import annotations

import argparse
import ctypes
import os
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
GRACEFUL_DEFAULT = "USR1"
TAIL_LINES = 40
DEFAULT_TIMEOUT_S = 600.0  # a collective or the rendezvous waits at most this long for a peer
TIMEOUT_ENV = "SMLP_DIST_TIMEOUT"


class LaunchError(Exception):
    """A problem found before any worker started; the message is for the user."""


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

    plan = Plan(nproc=nproc, device=device, master_addr=opts.master_addr, master_port=port,
                threads=threads, log_dir=Path(log_dir), grace=opts.grace, fairseq_args=fairseq_args,
                timeout=timeout, peak_rss_json=opts.peak_rss_json)
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


def _worker_preexec(parent_pid: int):
    """preexec_fn: the worker gets SIGKILL if the launcher dies, even by SIGKILL (Linux only), and
    starts with SIGUSR1 ignored (kept across exec) until worker mode installs its handler, so a
    forwarded SIGUSR1 can never kill a worker that is still starting."""
    def preexec() -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    def __init__(self, plan: Plan, out: IO = sys.stderr):
        self.plan = plan
        self.out = out
        self.workers: list[Worker] = []
        self.stop_signal: int | None = None
        self.forwarded_usr1 = False
        self.kill_now = False

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
        if p.nproc > 1:
            p.log_dir.mkdir(parents=True, exist_ok=True)
        preexec = _worker_preexec(os.getpid())
        for rank, (cmd, env) in enumerate(zip(p.commands, p.envs)):
            log_path = log_file = None
            if rank > 0:
                log_path = p.log_dir / f"rank{rank}.log"
                log_file = open(log_path, "wb")
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                                    start_new_session=True, preexec_fn=preexec)
            self.workers.append(Worker(rank, proc, log_path, log_file))

    def stop_all(self, reason: str) -> None:
        """SIGTERM every live worker's process group, SIGKILL after the grace period, reap all."""
        live = [w for w in self.workers if _group_alive(w.pgid)]
        if live:
            self.say(f"{reason}: stopping {len(live)} worker(s) (SIGTERM, SIGKILL after {self.plan.grace:g}s)")
        for w in live:
            _signal_group(w.pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.plan.grace
        while time.monotonic() < deadline and not self.kill_now:
            for w in live:
                w.poll()
            if not any(_group_alive(w.pgid) for w in live):
                break
            time.sleep(0.05)
        for w in self.workers:
            if _group_alive(w.pgid):
                _signal_group(w.pgid, signal.SIGKILL)
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
            self.start()
            return self._watch()
        finally:
            # whatever happened (exception included), no worker outlives the launcher
            if any(_group_alive(w.pgid) for w in self.workers):
                self.stop_all("cleaning up")
            for w in self.workers:
                if w.log_file:
                    w.log_file.close()
            for s, h in previous.items():
                signal.signal(s, h)
            self.report_memory()

    def report_memory(self) -> None:
        from .memory import format_bytes

        peaks = {w.rank: w.peak_rss for w in self.workers if w.peak_rss}
        if not peaks:
            return
        self.say("peak RSS per rank: " + ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(peaks.items())))
        if self.plan.peak_rss_json is not None:
            import json

            self.plan.peak_rss_json.write_text(json.dumps(
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
            failed = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
            if failed:
                return self._fail(failed[0])
            if all(c == 0 for c in codes):
                # stragglers in a worker's group (e.g. an orphaned DataLoader process) go too
                for w in self.workers:
                    if _group_alive(w.pgid):
                        _signal_group(w.pgid, signal.SIGKILL)
                if self.forwarded_usr1:
                    self.say("workers saved a checkpoint and stopped (SIGUSR1)")
                else:
                    self.say(f"all {len(self.workers)} worker(s) finished")
                return 0
            time.sleep(0.1)

    def _fail(self, w: Worker) -> int:
        code = w.proc.returncode
        what = f"rank {w.rank} {_describe(code)}"
        self.stop_all(what)
        others = [f"rank {o.rank} {_describe(o.proc.returncode)}" for o in self.workers
                  if o is not w and o.proc.returncode is not None]
        if others:
            self.say("then: " + ", ".join(others))
        if w.log_path is not None:
            self.say(f"last lines of {w.log_path}:")
            print(_tail(w.log_path), file=self.out, flush=True)
        where = f" (log: {w.log_path})" if w.log_path else " (its output is above)"
        self.say(f"FAILED: {what}{where}")
        return _exit_status(code)


# ----------------------------------------------------------------------------- worker mode


class _StopFlag:
    """Set by a signal in this process; `agreed` is True on every rank once any rank has it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopped_at: int | None = None
        self.pid = os.getpid()

    def handler(self, signum, _frame) -> None:
        if os.getpid() != self.pid:
            return  # a forked DataLoader worker inherited the handler: the trainer process decides
        if self.signum is not None:  # a second signal: stop now, the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        os.write(2, f"[smlp worker {os.getpid()}] got {signal.Signals(signum).name}: will save a "
                    f"checkpoint after the current update and stop\n".encode())

    def agreed(self, trainer) -> bool:
        import torch
        import torch.distributed as dist

        local = 1.0 if self.signum is not None else 0.0
        if not (dist.is_available() and dist.is_initialized()):
            return local > 0
        flag = torch.tensor([local], device=trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


def _stop_signals() -> list[int]:
    names = os.environ.get("SMLP_STOP_SIGNALS", GRACEFUL_DEFAULT)
    sigs = []
    for name in filter(None, (n.strip().upper() for n in names.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        if name in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, name):
            raise LaunchError(f"SMLP_STOP_SIGNALS: {name} cannot be a graceful-stop signal")
        sigs.append(signal.Signals[name])
    return sigs


def _install_stop_hook(stop: _StopFlag) -> bool:
    import inspect
    import logging
    import math

    import fairseq_cli.train as fairseq_train
    from fairseq import checkpoint_utils

    log = logging.getLogger("smlp_launch.local")
    original = fairseq_train.validate_and_save
    expected = ["cfg", "trainer", "task", "epoch_itr", "valid_subsets", "end_of_epoch"]
    if list(inspect.signature(original).parameters) != expected:
        print("[smlp worker] fairseq_cli.train.validate_and_save changed its signature; graceful stop "
              "on signals is disabled", file=sys.stderr)
        return False

    def validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        if not stop.agreed(trainer):
            return original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)
        num_updates = trainer.get_num_updates()
        if num_updates >= (cfg.optimization.max_update or math.inf):
            return original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)  # finished anyway
        log.info(f"stop requested by signal: saving a checkpoint at {num_updates} updates, then stopping")
        checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
        stop.stopped_at = num_updates
        return [None], True

    fairseq_train.validate_and_save = validate_and_save
    return True


def collective_timeout() -> float:
    """Seconds a rank waits for its peers in one collective: $SMLP_DIST_TIMEOUT, else the default."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise LaunchError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds (e.g. 600)") from None
    if not seconds > 0:
        raise LaunchError(f"{TIMEOUT_ENV}={value!r} must be > 0 seconds")
    return seconds


def install_collective_timeout(seconds: float) -> None:
    """Give every process group this process creates a timeout of `seconds` unless one is passed.

    fairseq calls torch.distributed.init_process_group without a timeout (torch's defaults: 30 min
    for gloo, 10 min for NCCL, and NCCL only honours it with async error handling), and runs its
    gradient all-reduce and logging exchanges in a group of its own (`get_global_group`:
    `new_group()`, "WORLD causes random NCCL hangs"), which torch creates with the backend's
    default timeout, not the default group's: a rank waiting there for a hung peer waited 30
    minutes while one waiting in the all2all (default group) failed after `seconds`. Both
    `init_process_group` and `new_group` are wrapped. Installed in worker mode only; fairseq's
    files are not changed.
    """
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a timed-out NCCL op aborts, not hangs
    timeout = datetime.timedelta(seconds=seconds)
    for name in ("init_process_group", "new_group"):
        original = getattr(dist, name)
        if getattr(original, "_smlp_timeout", None) is not None:
            continue
        setattr(dist, name, _with_default_timeout(original, timeout))


def _with_default_timeout(original, timeout):
    import inspect

    signature = inspect.signature(original)

    def with_timeout(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        if bound.arguments.get("timeout") is None:
            bound.arguments["timeout"] = timeout
        return original(*bound.args, **bound.kwargs)

    with_timeout._smlp_timeout = timeout.total_seconds()
    with_timeout.__wrapped__ = original
    with_timeout.__name__ = original.__name__
    return with_timeout


def _report_own_peak_rss() -> None:
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    print(f"[smlp worker rank {rank}] peak RSS {kib / 1024:.1f} MiB", file=sys.stderr, flush=True)


def run_worker(fairseq_args: list[str]) -> int:
    """One fairseq-train in this process; graceful stop on the SMLP_STOP_SIGNALS (default USR1)."""
    stop = _StopFlag()
    # handlers first: a signal that arrives while fairseq imports must not kill the worker
    for sig in _stop_signals():
        signal.signal(sig, stop.handler)
    from smlp.third_party import quiet_imports

    quiet_imports()  # before fairseq's import: no DeepSpeed / fairscale start-up warnings
    install_collective_timeout(collective_timeout())
    _install_stop_hook(stop)
    from fairseq_cli.train import cli_main

    sys.argv = ["fairseq-train", *fairseq_args]
    cli_main()
    _report_own_peak_rss()
    status_file = os.environ.get("SMLP_STATUS_FILE")
    if stop.stopped_at is not None and status_file:
        from smlp.process_group import rank_and_world

        if rank_and_world()[0] == 0:
            Path(status_file).write_text(f"stopped num_updates={stop.stopped_at}\n")
    return 0


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
