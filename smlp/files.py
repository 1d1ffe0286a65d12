"""Files written whole: the one writer of every checkpoint, record, result, export and data folder.

`write_atomic` writes into a temporary file beside its target (`temp_name`: `.NAME.smlp-tmp-<16 hex digits>`, a
hidden name no user file plausibly has, the one form of every writer), fsyncs it, renames it over the target and
fsyncs the folder: a reader sees the old file or the whole new one, never a part, and a failure at any step (the
temporary file's creation included) removes the temporary file and leaves the target as it was. A writer killed
partway leaves its temporary file; `stale_temp_files` finds exactly those of a folder.
The file gets the mode a plain `open(path, "w")` would give it: the temporary file is created with 0666 and the
kernel applies the umask and the folder's default ACL (a mode computed from the umask would contradict the ACL);
a target that exists keeps its own mode. `tempfile.mkstemp` would give 0600, which a teammate cannot read.
`install_dir` is its twin for a folder built under a hidden sibling name (`temp_dir`): one rename installs it.

Stdlib only: the core, the fairseq plugins, the launcher, the evaluator and the benchmarks all write through it.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["TEMP_NAME", "fsync_dir", "install_dir", "open_mode", "stale_temp_files", "temp_dir", "temp_name",
           "umask", "write_atomic", "write_atomic_by_name", "write_figure"]

# the temporary file of target NAME: hidden, the project's word, 16 random hex digits (no user names a file so)
TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.smlp-tmp-[0-9a-f]{16}$")


def temp_name(target: str) -> str:
    """A new temporary name for the file `target` (a base name) of the one writer (module docstring)."""
    return f".{target}.smlp-tmp-{secrets.token_hex(8)}"


def stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """The temporary files of the one writer in `folder` (every writer's: checkpoints, copies, resharded sets,
    merged files, crash files, records), sorted; only plain files of the `temp_name` form, nothing else."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    return [Path(e.path) for e in entries if TEMP_NAME.match(e.name) and e.is_file(follow_symlinks=False)]


def umask() -> int:
    """The process's umask: read from /proc on Linux (no change at all, so no other thread can create a file
    under a wrong mask meanwhile), else set and restored at once."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_mode(path: str | os.PathLike) -> int:
    """The permission bits `open(path, "w")` gives: those of `path` when it exists, else 0666 less the umask
    (in a folder without a default ACL; with one, only creating a file tells: `write_atomic` does)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~umask()


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a folder, so that a rename in it survives a power cut (some filesystems refuse: the rename is still
    atomic)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _FirstWriteError:
    """The file a writer gets: keeps the first OSError of its writes (a full disk), which some writers swallow
    (torch.save's zip writer fails later with `unexpected pos N vs M`)."""

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


def _existing_mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def _temp_file(out: Path) -> tuple[int, Path, int]:
    """Create `out`'s temporary file (O_EXCL, so never another's) as open() would (0666; the kernel applies the
    umask and the folder's default ACL), then give it the mode of an existing `out`. Returns (fd, path, mode)."""
    for _ in range(100):
        tmp = out.with_name(temp_name(out.name))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        try:
            mode = _existing_mode(out)
            if mode is not None:
                os.fchmod(fd, mode)
            else:
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, tmp, mode
    raise FileExistsError(f"no free temporary name beside {out}")


def _finish(tmp: Path, out: Path, commit: Callable[[], None] | None) -> None:
    if commit is not None:
        commit()  # e.g. every rank of a save has its file whole: only then is any of them named
    os.replace(tmp, out)
    fsync_dir(out.parent)


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[object], None], *, text: bool = False,
                 make_parents: bool = False, commit: Callable[[], None] | None = None) -> Path:
    """Write `path` whole (module docstring): `content` is the text or bytes, or a function that writes into the
    file it is given (opened for text with `text`, else binary). `make_parents` creates missing parent folders;
    `commit` runs once the data is on disk, just before the rename, and stops it by raising. Returns the path.

    An error raised while writing is re-raised, after the temporary file is removed; when a write failed with an
    OSError that the writer turned into another error, that OSError is raised (its errno: ENOSPC, EDQUOT, EIO)."""
    out = Path(path).expanduser().absolute()
    if make_parents:
        out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (str, bytes)):
        text, data = isinstance(content, str), content
        content = lambda f: f.write(data)  # noqa: E731
    tmp, f = None, None
    try:
        fd, tmp, _ = _temp_file(out)
        with os.fdopen(fd, "w" if text else "wb") as real:
            f = _FirstWriteError(real)
            content(f)
            real.flush()
            os.fsync(real.fileno())
        _finish(tmp, out, commit)
    except BaseException as caught:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if f is not None and f.error is not None and not isinstance(caught, OSError):
            raise f.error from caught
        raise
    return out


def write_atomic_by_name(path: str | os.PathLike, write_to: Callable[[str], None], *,
                         commit: Callable[[], None] | None = None) -> Path:
    """`write_atomic` for a library that opens the file itself by name (safetensors' save_file):
    `write_to(temporary path)`, then the same mode, fsync, rename and folder fsync."""
    out = Path(path).expanduser().absolute()
    tmp = None
    try:
        fd, tmp, mode = _temp_file(out)
        os.close(fd)
        write_to(str(tmp))
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # a library replaced the file (safetensors wrote 0600)
            os.chmod(tmp, mode)  # (in a folder with a default ACL this also restores the ACL's mask)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _finish(tmp, out, commit)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    return out


def write_figure(path: str | os.PathLike, fig, **savefig_kwargs) -> Path:
    """`write_atomic` for a matplotlib figure: drawn whole in memory (the format from the name's suffix), then
    written, so a figure that fails to draw leaves the old file and a reader never sees half an image."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **savefig_kwargs)
    return write_atomic(path, buf.getvalue())


def temp_dir(out: Path) -> Path:
    """A new empty folder `.NAME.tmp-PID` beside `out` (a build of `out` before `install_dir`), with the mode
    `mkdir` gives (`tempfile.mkdtemp` gives 0700); a leftover of a killed build of this pid is removed first."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def install_dir(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the finished folder `tmp` to `out`, so a reader finds a complete folder or none. Without `replace`
    this fails rather than overwrite an `out` that appeared meanwhile; with it the old folder is swapped out
    (`.NAME.old-PID`) and put back if the rename fails."""
    if not replace or not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
