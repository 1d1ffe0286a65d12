"""Checkpoint files written atomically: a reader sees the old file or the whole new one, never a part.

`atomic_write` writes through the project's one atomic writer (smlp/files.py: a temporary file next to its
target, fsync, rename, fsync of the folder, the mode open() would give). A failed write (disk full or quota,
when the temporary file is created or while it is written) removes its temporary file, keeps the previous file
and raises `CheckpointWriteError`, one line naming the file and its folder. A write killed partway (SIGKILL, a
lost node) cannot remove its temporary file: `remove_stale_temp_files` removes them when training starts again
(rank 0, holding the save folder's lock, before anything is loaded or written).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable

import torch

from smlp.files import stale_temp_files, write_atomic
from smlp.process_group import gather_objects

from .errors import RefusedInput

logger = logging.getLogger(__name__)

# a rank shard's name: NAME-rank-R.pt (checkpoint_sets.py)
RANK_FILE = re.compile(r"^(?P<stem>.*)-rank-(?P<rank>\d+)\.pt$")


class CheckpointWriteError(OSError, RefusedInput):
    """A checkpoint could not be written (disk full, quota): said in one line, naming the file and its folder."""

    def __str__(self) -> str:
        return str(self.strerror)  # without OSError's "[Errno 28] " prefix


def disk_full_error(path: str, errno_: int) -> CheckpointWriteError:
    """The one line of a checkpoint write that ran out of space (or quota), wherever it failed."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(directory).free / 2 ** 20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return CheckpointWriteError(
        errno_, f"could not write checkpoint {path}: {os.strerror(errno_)} ({free} in {directory}). The previous "
                f"{os.path.basename(path)} is unchanged and no partial file was left; free space (or use "
                f"--keep-interval-updates / --no-epoch-checkpoints) and resume")


def atomic_write(path: str, write: Callable[[object], None], commit: Callable[[], None] | None = None) -> None:
    """write(f) into `path` through the one atomic writer (smlp/files.py), with the mode open() would give.

    A reader sees the old file or the whole new one, never a part. If anything fails (disk full or quota when
    the temporary file is created or written, an I/O error) the temporary file is removed, `path` is left as it
    was, and a full disk is said in one line naming the file and the free space (`CheckpointWriteError`).
    `commit` runs before the rename (checkpoint_sets.py: every rank of a save has written its file).
    """
    try:
        write_atomic(path, write, commit=commit)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, CheckpointWriteError):
            raise disk_full_error(path, exc.errno) from exc
        raise


def remove_stale_temp_files(save_dir: str) -> list[str]:
    """Delete the one writer's temporary files in `save_dir` (smlp.files.stale_temp_files: every writer's, of
    checkpoints, their copies, resharded sets, merged files and crash files, and nothing else): partial writes
    of a run killed while it saved, each up to a checkpoint in size. Rank 0 calls it when training starts,
    holding the save folder's lock (save_dir.py), so no writer of this folder is running."""
    removed = []
    for path in stale_temp_files(save_dir):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed.append(str(path))
        logger.warning("removed %s (%.1f MiB): a write that never finished (the run was stopped while it saved)",
                       path.name, size / 2 ** 20)
    return removed


def atomic_torch_save(obj, path: str, commit: Callable[[], None] | None = None) -> None:
    atomic_write(path, lambda f: torch.save(obj, f), commit)


def atomic_copy(src: str, dst: str, commit: Callable[[], None] | None = None) -> None:
    def write(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 16 * 2 ** 20)
    atomic_write(dst, write, commit)


class _SaveAgreement:
    """The commit of a file that every rank of a save writes (its rank shard): no rank renames its file before
    every rank has its own whole, and a rank that could not write stops every rank with its one line. A save
    that did not complete on every rank is then never named as a set."""

    def __init__(self, path: str):
        self.path, self.asked = path, False

    def __call__(self, error: BaseException | None = None) -> None:
        self.asked = True
        mine = None
        if error is not None:
            mine = (getattr(error, "errno", None) or errno.EIO,
                    str(error) if isinstance(error, CheckpointWriteError)
                    else f"could not write checkpoint {self.path}: {type(error).__name__}: {error}")
        failures = [f for f in gather_objects(mine) if f]
        if failures and error is None:  # another rank failed: this rank's file is not named either
            raise CheckpointWriteError(*failures[0])


def write_on_every_rank(path: str, write: Callable[[Callable[[], None] | None], None], every_rank: bool) -> None:
    """write(commit) of one file of a save. With `every_rank` (a save in which every rank of the run writes its
    shard `-rank-R.pt` at the same moment: checkpoint_sets.py) all ranks agree before any renames its file."""
    if not (every_rank and RANK_FILE.match(os.path.basename(path))):
        return write(None)
    agreement = _SaveAgreement(path)
    try:
        write(agreement)
    except Exception as exc:
        if not agreement.asked:
            agreement(exc)  # the others wait for this rank's answer
        raise
