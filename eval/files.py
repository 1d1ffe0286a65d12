"""Output paths checked before the work: `check_output_path` runs before a tool's work starts, so an output that
cannot be written (a parent that is a file, a folder without write permission) is refused then, not after the
work; the missing parent folders are created when the result is written (`make_parents`, or smlp.files'
`write_atomic(..., make_parents=True)`, the one writer of every result and folder)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["OutputPathError", "check_output_path", "deepest_parent", "make_parents", "remove_folders"]


class OutputPathError(ValueError):
    """An output path the tool cannot write; the message names the option, the path and what is wrong."""


def check_output_path(path: str | os.PathLike, option: str, *, folder: bool = False) -> Path:
    """The absolute path `path` given to `option`, refused (OutputPathError) when it cannot be written: it is
    a folder where a file is wanted (or the reverse), one of its parents is a file, or the deepest existing
    parent is not writable. Missing parents are fine: the writer creates them."""
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
