"""How smlp-launch starts and stops its workers as processes: each worker leads a session (and so a process group)
of its own, so that the launcher can signal a worker's whole process tree; the worker dies with the launcher, starts
with SIGUSR1 ignored, and keeps the launcher's CPU priority in its new session's scheduler autogroup."""
from __future__ import annotations

import ctypes
import os
import signal

AUTOGROUP = "/proc/self/autogroup"  # Linux with CONFIG_SCHED_AUTOGROUP: "/autogroup-N nice K"


def launcher_nice() -> int:
    """The lower of the launcher's priorities (the larger nice value): its own, and its session's autogroup's."""
    nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    try:
        with open(AUTOGROUP) as f:
            nice = max(nice, int(f.read().split()[-1]))
    except (OSError, ValueError, IndexError):
        pass
    return nice


def worker_preexec(parent_pid: int, nice: int = 0):
    """preexec_fn: the worker gets SIGKILL if the launcher dies, even by SIGKILL (Linux only), and
    starts with SIGUSR1 ignored (kept across exec) until worker mode installs its handler, so a
    forwarded SIGUSR1 can never kill a worker that is still starting.

    `nice` > 0 (the launcher's, `nice -n 19 smlp-launch ...`): the worker's new session gets a scheduler autogroup
    of its own where the kernel has them, at nice 0 against every other session, so the worker would compete at the
    default priority whatever its own nice value; it gets `nice` there too (raising a nice value needs no privilege).
    """
    def preexec() -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
        if nice > 0:
            try:
                with open(AUTOGROUP, "w") as f:
                    f.write(str(nice))
            except OSError:  # no autogroups here: the process's own nice value already holds
                pass
    return preexec


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
