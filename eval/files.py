"""Installing a finished folder in one rename: a build written under a hidden sibling name becomes the
real folder at once, so a reader finds a complete folder or none. Used by data preparation
(`smlp_launch.data_dir`) and the Hugging Face export (`smlp_eval.hf_export`)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["install_dir"]


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
