"""Checkpoint files written atomically: a reader sees the old file or the whole new one, never a part.

`atomic_write` writes into a temporary file next to its target, fsyncs it, renames it over the target and fsyncs
the directory. A failed write (disk full, quota) removes its temporary file, keeps the previous file and raises
`CheckpointWriteError`, one line naming the file and its folder. A write killed partway (SIGKILL, a lost node)
cannot remove its temporary file: `remove_stale_temp_files` removes a rank's own when training starts again
(fairseq_plugins/checkpoint_sets.py calls it before anything is loaded or written).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable

import torch

from .errors import RefusedInput

logger = logging.getLogger(__name__)

# a rank shard's name: NAME-rank-R.pt (checkpoint_sets.py)
RANK_FILE = re.compile(r"^(?P<stem>.*)-rank-(?P<rank>\d+)\.pt$")


class CheckpointWriteError(OSError, RefusedInput):
    """A checkpoint could not be written (disk full, quota): said in one line, naming the file and its folder."""

    def __str__(self) -> str:
        return str(self.strerror)  # without OSError's "[Errno 28] " prefix


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[object], None]) -> None:
    """write(f) into a temporary file next to `path`, fsync it, rename it over `path`.

    A reader sees the old file or the whole new one, never a part. If anything fails (disk full,
    quota, I/O error) the temporary file is removed, `path` is left as it was, and the error names
    the file and the free space.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    f = None
    try:
        with os.fdopen(fd, "wb") as real:
            f = _WriteErrors(real)
            write(f)
            real.flush()
            os.fsync(real.fileno())
        os.replace(tmp, path)
    except BaseException as caught:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        exc = caught
        if f is not None and f.error is not None and not isinstance(caught, OSError):
            exc = f.error  # torch.save's zip writer reports a failed write as "unexpected pos N vs M"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = f"{shutil.disk_usage(directory).free / 2 ** 20:.1f} MiB free"
            except OSError:
                free = "free space unknown"
            raise CheckpointWriteError(
                exc.errno, f"could not write checkpoint {path}: {os.strerror(exc.errno)} ({free} in {directory}). "
                           f"The previous {os.path.basename(path)} is unchanged and no partial file was left; free "
                           f"space (or use --keep-interval-updates / --no-epoch-checkpoints) and resume") from caught
        if exc is not caught:
            raise exc from caught
        raise
    _fsync_dir(directory)


class _WriteErrors:
    """The file `atomic_write` hands to its writer: keeps the first OSError of its writes (a full disk), which
    torch.save's zip writer does not pass on: it fails later with `unexpected pos N vs M`."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


# atomic_write's temporary files: NAME.pt.XXXXXXXX.tmp (tempfile.mkstemp: 8 of [a-z0-9_])
_TEMP_FILE = re.compile(r"^(?P<name>checkpoint[^/]*\.pt)\.[a-z0-9_]{8}\.tmp$")


def stale_temp_files(save_dir: str, suffix: str) -> list[str]:
    """The temporary files atomic_write left in `save_dir` for checkpoint names ending in `suffix`.pt (this rank's
    names: `-rank-R`, or "" for a run that writes one file: then names with a rank suffix are not its own)."""
    try:
        names = sorted(os.listdir(save_dir))
    except OSError:
        return []
    out = []
    for name in names:
        m = _TEMP_FILE.match(name)
        if m and m.group("name").endswith(suffix + ".pt") and (suffix or not RANK_FILE.match(m.group("name"))):
            out.append(os.path.join(save_dir, name))
    return out


def remove_stale_temp_files(save_dir: str, suffix: str) -> list[str]:
    """Delete `stale_temp_files`: partial writes of a run killed while it saved (nothing else removes them, and
    each is up to a whole checkpoint in size). Called by each rank for its own names before training starts,
    when no rank of this run is writing."""
    removed = []
    for path in stale_temp_files(save_dir, suffix):
        try:
            size = os.path.getsize(path)
            os.remove(path)
        except OSError:
            continue
        removed.append(path)
        logger.warning("removed %s (%.1f MiB): a checkpoint write that never finished (the run was stopped while it "
                    "saved)", os.path.basename(path), size / 2 ** 20)
    return removed


def atomic_torch_save(obj, path: str) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_copy(src: str, dst: str) -> None:
    def write(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 16 * 2 ** 20)
    atomic_write(dst, write)
