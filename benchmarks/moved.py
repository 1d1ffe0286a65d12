"""Module paths that moved in issue 27, kept for one release: each old module warns and stands for its new one.

    smlp_bench.<name> -> smlp_bench.micro.<name>   the micro-benchmarks (and `records` -> `micro.harness`)
    smlp_bench.suite                                 cut into presets, training, plan, ... (suite.py itself)
"""
from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def moved(old: str, new: str, *, main: bool) -> None:
    """Called by the old module `old` as it is imported: it becomes `new` (the same module object, so its
    names, and monkeypatches of them, reach the code that runs). Run as `python -m old` (`main`), it runs
    `new` as the main module instead, with the same arguments."""
    # attributed to the importer's line, or to the old module itself when it is __main__ (shown by default)
    warnings.warn(f"{old} is deprecated and will be removed: use {new}", DeprecationWarning,
                  stacklevel=2 if main else 3)
    if main:
        runpy.run_module(new, run_name="__main__", alter_sys=True)
    else:
        sys.modules[old] = importlib.import_module(new)
