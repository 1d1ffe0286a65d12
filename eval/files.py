"""Files the tools write: a finished folder installed in one rename, and output paths checked before the work.

`install_dir`: a build written under a hidden sibling name becomes the real folder at once, so a reader finds a
complete folder or none (data preparation, `smlp_launch.data`, and the Hugging Face export,
`smlp_eval.hf_export`). `check_output_path` runs before a tool's work starts: an output that cannot be written
(a parent that is a file, a folder without write permission) is refused then, not after the work, and
`write_atomic` creates the missing parent folders when the result is written."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["OutputPathError", "check_output_path", "deepest_parent", "install_dir", "make_parents", "remove_folders",
           "write_atomic"]


class OutputPathError(ValueError):
    """An output path the tool cannot write; the message names the option, the path and what is wrong."""


def install_dir(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the finished folder `tmp` to `out`. Without `replace` this fails rather than overwrite an `out`
    that appeared meanwhile; with it the old folder is swapped out and put back if the rename fails."""
    if not replace or not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_output_path(path: str | os.PathLike, option: str, *, folder: bool = False) -> Path:
    """The absolute path `path` given to `option`, refused (OutputPathError) when it cannot be written: it is
    a folder where a file is wanted (or the reverse), one of its parents is a file, or the deepest existing
    parent is not writable. Missing parents are fine: `write_atomic` (or the caller) creates them."""
    out = Path(path).expanduser().absolute()
    if out.exists() and out.is_dir() != folder:
        raise OutputPathError(f"{option} {path}: {out} is {'a file' if folder else 'a folder'}; give the "
                              f"{'folder' if folder else 'file'} to write")
    parent, problem = deepest_parent(out)
    if problem == "file":
        raise OutputPathError(f"{option} {path}: {parent} is a file, not a folder; choose a path under a folder")
    if problem == "read-only":
        raise OutputPathError(f"{option} {path}: the folder {parent} is not writable; choose another path")
    return out


def deepest_parent(path: Path) -> tuple[Path, str | None]:
    """The deepest existing parent of `path` (the folder its missing parents would be made in) and what
    prevents writing there: "file" (it is not a folder), "read-only", or None."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return parent, "file"
    return parent, None if os.access(parent, os.W_OK | os.X_OK) else "read-only"


def make_parents(path: str | os.PathLike) -> list[Path]:
    """Create the missing parent folders of `path`; returns those created, deepest last (`remove_folders`
    takes them away again if the work fails)."""
    missing = []
    parent = Path(path).expanduser().absolute().parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        folder.mkdir()
    return list(reversed(missing))


def remove_folders(created: list[Path]) -> None:
    """Remove the folders `make_parents` created, deepest first, where they are still empty."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()


def write_atomic(path: str | os.PathLike, write: Callable[[object], None], mode: str = "w") -> None:
    """write(f) into a temporary file beside `path` (its missing parent folders created), renamed over `path`:
    the file is whole or absent, and no temporary file is left if anything fails."""
    out = Path(path).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
