"""The worker side of smlp-launch: what runs inside each worker process (`smlp-launch --worker`).

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

Timeouts, on purpose: a rank waits at most --timeout seconds (default $SMLP_DIST_TIMEOUT, else 600)
in one collective or in the rendezvous before it fails with an error, so a peer that hangs (stopped,
deadlocked, its node gone without closing its sockets) ends the job instead of blocking it; a peer
that dies is noticed at once (gloo: "Connection closed by peer"; the launcher: its exit status).
The value is passed to torch.distributed.init_process_group (gloo and NCCL) in worker mode, and
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (unless set) makes a timed-out NCCL collective abort the process
rather than hang. It must exceed the longest time one rank can legitimately run ahead of the
others: a checkpoint save, a validation pass, the first step's warm-up.

Before fairseq-train starts, a worker checks its flags (smlp_launch.preflight): a flag the model cannot take
ends it with status 2 and one line, written to $SMLP_PREFLIGHT_FILE when the launcher set it (the launcher
prints it once for all ranks), else printed. At the end a worker prints its own peak resident memory
(ru_maxrss). The parent launcher, which
starts the workers and stops them, is `smlp_launch.local`; this module imports nothing of it.
"""
from __future__ import annotations

import os
import signal
import sys

from smlp.files import write_atomic

GRACEFUL_DEFAULT = "USR1"
DEFAULT_TIMEOUT_S = 600.0  # a collective or the rendezvous waits at most this long for a peer
TIMEOUT_ENV = "SMLP_DIST_TIMEOUT"
PREFLIGHT_ENV = "SMLP_PREFLIGHT_FILE"  # where a worker writes the one line refusing its flags (smlp_launch.preflight)


class LaunchError(Exception):
    """A problem found before any worker (or, in worker mode, its fairseq-train) started; the message is for the
    user."""


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

    log = logging.getLogger("smlp_launch.worker")
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


def needs_deepspeed(fairseq_args: list[str]) -> bool:
    """fairseq imports DeepSpeed for its cpu_adam optimizer alone (fairseq/optim/cpu_adam.py); a run with any
    other optimizer starts without importing it (about 0.4 s of every rank's start-up)."""
    return any("cpu_adam" in arg for arg in fairseq_args)


def run_worker(fairseq_args: list[str]) -> int:
    """One fairseq-train in this process; graceful stop on the SMLP_STOP_SIGNALS (default USR1). Ends the process
    (end_finished_run, exit_after_failure); returns only a refusal of its flags, 2, before fairseq-train starts."""
    stop = _StopFlag()
    # handlers first: a signal that arrives while fairseq imports must not kill the worker
    for sig in _stop_signals():
        signal.signal(sig, stop.handler)
    from smlp.third_party import quiet_imports

    quiet_imports(deepspeed=needs_deepspeed(fairseq_args))  # before fairseq's import: no start-up warnings, no sklearn
    install_collective_timeout(collective_timeout())
    _install_stop_hook(stop)
    from fairseq_cli.train import cli_main

    from .preflight import refusal

    message = refusal(fairseq_args)
    if message is not None:  # before this rank joins the others or writes anything
        report = os.environ.get(PREFLIGHT_ENV)
        if report:  # the launcher prints it, once for all ranks
            write_atomic(report, message + "\n")
        else:
            print(f"smlp-launch: error: {message}", file=sys.stderr, flush=True)
        return 2
    sys.argv = ["fairseq-train", *fairseq_args]
    try:
        cli_main()
    except (Exception, SystemExit) as exc:  # KeyboardInterrupt keeps Python's own exit (by SIGINT)
        exit_after_failure(exc)
    _report_own_peak_rss()
    status_file = os.environ.get("SMLP_STATUS_FILE")
    if stop.stopped_at is not None and status_file:
        from smlp.process_group import rank_and_world

        if rank_and_world()[0] == 0:
            write_atomic(status_file, f"stopped num_updates={stop.stopped_at}\n")
    end_finished_run()


def exit_after_failure(exc: BaseException) -> None:
    """A failed fairseq-train: report `exc` as the interpreter would (a refusal in one line, else its traceback),
    run the Python exit handlers, then exit without the C++ static destructors.

    Every worker ends this way, a finished run too (run_worker). torch's process groups may still own threads at
    interpreter exit (gloo's work threads, a peer that went away; fairseq never destroys its groups), and so may
    torch's profiler (kineto); their destructors aborted ranks after their work was done: a rank that had printed
    its one-line error (a full disk on one rank), a profiled 1-process run, and a CI run's 2-rank run that had
    finished training (SIGABRT, "terminate called without an active exception", status 134 where 0 or 1 was due)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        status = 0 if code is None else code if isinstance(code, int) else 1
    else:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
    _exit_now(status)


def end_finished_run() -> None:
    """A finished fairseq-train: as the interpreter's own exit (its other non-daemon threads, then the Python exit
    handlers), then status 0 without the C++ static destructors (see exit_after_failure)."""
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    _exit_now(0)


def _exit_now(status: int) -> None:
    """What a normal exit runs first (the atexit handlers: fairseq's writers, logging), then os._exit."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
