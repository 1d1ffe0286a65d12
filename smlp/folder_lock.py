"""One job per save folder: an exclusive lock held for the whole run, released by the kernel when the job dies.

Two jobs writing one --save-dir (a resubmitted job while the first still runs, a copied sbatch line) would remove
each other's temporary files and mix their checkpoints. The first job's rank 0 holds `flock(LOCK_EX)` on
`SAVE_DIR/.smlp-save-dir.lock` while it trains; a second job finds it held and refuses in one line naming the
holder (host, pid, start time, written into the lock file by the holder) before it touches any other file.
A lock belongs to an open file, so SIGKILL or a lost node leaves nothing to clean: the kernel (or, on NFS, the
lock server once the client's lease expires) releases it. The lock file itself stays (removing it would let two
jobs lock two different files of one name). A filesystem without locks (Lustre mounted without `flock`) is
said once in a warning and the run goes on unguarded.

Stdlib only: training (fairseq_plugins/save_dir.py), smlp-launch and launch/slurm/train.sbatch's check use it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "FolderInUse", "hold", "holder", "probe", "release"]

LOCK_NAME = ".smlp-save-dir.lock"
logger = logging.getLogger(__name__)
_HELD: dict[str, int] = {}  # real path of a folder -> the fd of its lock file, held by this process
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FolderInUse(RuntimeError):
    """Another process holds the folder's lock; the message names it."""


def holder(folder: str | os.PathLike) -> str:
    """`host H, pid P, started T (PROGRAM)` as the lock's holder wrote it, or `holder unknown`."""
    try:
        info = json.loads((Path(folder) / LOCK_NAME).read_text() or "{}")
        return f"host {info['host']}, pid {info['pid']}, started {info['started']} ({info['program']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def _busy(folder: str, flag: str) -> FolderInUse:
    return FolderInUse(f"{flag} {folder} is in use by another training job ({holder(folder)}): two jobs in one save "
                       f"folder would overwrite each other's checkpoints; wait for that job to end (or cancel it), "
                       f"or pass another {flag}")


def hold(folder: str | os.PathLike, program: str, flag: str = "--save-dir") -> bool:
    """Take `folder`'s lock for the rest of this process (or until `release`); True once held, False when the
    filesystem has no locks (warned). Raises FolderInUse when another process holds it, OSError when the lock
    file cannot be created (a read-only folder). Holding it already in this process is not an error."""
    key = os.path.realpath(folder)
    if key in _HELD:
        return True
    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(str(folder), flag) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _UNSUPPORTED:
            raise
        logger.warning("%s %s: the filesystem has no file locks (%s), so a second job on this folder cannot be "
                       "refused; run one job per save folder", flag, folder, exc.strerror)
        return False
    info = {"host": socket.gethostname(), "pid": os.getpid(), "program": program,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[key] = fd
    return True


def release(folder: str | os.PathLike | None = None) -> None:
    """Release the lock of `folder` (every lock this process holds when None)."""
    keys = list(_HELD) if folder is None else [os.path.realpath(folder)]
    for key in keys:
        fd = _HELD.pop(key, None)
        if fd is not None:
            os.close(fd)


def probe(folder: str | os.PathLike, flag: str = "--save-dir") -> None:
    """Raise FolderInUse if another process holds `folder`'s lock now; creates nothing (a folder or lock file
    that does not exist is free)."""
    if os.path.realpath(folder) in _HELD:
        return
    fd = None
    for flags in (os.O_RDWR, os.O_RDONLY):  # NFS emulates flock with POSIX locks: exclusive needs write access
        with contextlib.suppress(OSError):
            fd = os.open(Path(folder) / LOCK_NAME, flags | getattr(os, "O_CLOEXEC", 0))
            break
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(str(folder), flag) from None
    except OSError:
        return
    finally:
        os.close(fd)
