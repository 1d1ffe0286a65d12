"""Old import paths, kept for one release after a move: each old file is a declaration naming the new home.

A module that moved whole leaves behind

    import sys
    from smlp.deprecation import moved

    sys.modules[__name__] = moved(__name__, "smlp.routing.gates")

`moved` warns (a DeprecationWarning naming the new path, attributed to the code that imported the
old one) and returns the new module, which then stands for the old name as well: `smlp.gates` and
`smlp.routing.gates` are one module object, so its functions and classes, anything pickled under
either name, and a monkeypatch through either name are the same. A module whose contents went to
several homes re-exports them by name and calls `warn_moved(__name__, "where they went")`. A name
that left a module that stays is served by that module's `__getattr__ = moved_names(__name__,
{name: new home})`. tests/test_imports.py lists every old path and checks each one.
"""
from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType

__all__ = ["moved", "moved_names", "warn_moved"]


def _importer_stacklevel() -> int:
    """The stacklevel of the code that imported the old path: the first frame outside this module, the
    old module itself and importlib. warnings.warn does not count the import system's own frames
    (importlib._bootstrap), so neither does this."""
    frame, level, old_module_seen = sys._getframe(1), 1, False
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("importlib"):
            if old_module_seen:
                return level
            old_module_seen = True
        if not module.startswith("importlib._bootstrap"):
            level += 1
        frame = frame.f_back
    return level


def warn_moved(old: str, new: str) -> None:
    """DeprecationWarning: the old path `old` is removed in the next release; `new` says where to import from."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release: import {new} instead",
                  DeprecationWarning, stacklevel=_importer_stacklevel())


def moved(old: str, new: str, *, main: bool = False) -> ModuleType:
    """Warn that the module `old` moved whole to `new`; return `new` (to stand in sys.modules for both).

    main: the old module runs as a program (`python -m old`, its `__name__ == "__main__"`): then `new`
    runs as the main module instead, with the same arguments, after the warning."""
    if main:
        warnings.warn(f"{old} is deprecated and will be removed in the next release: run {new} instead",
                      DeprecationWarning, stacklevel=2)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
    else:
        warn_moved(old, new)
    return importlib.import_module(new)


def moved_names(module: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `module` serving the names that left it ({name: new home}), each with
    a DeprecationWarning; any other missing name is the usual AttributeError."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release: import {name} from "
                      f"{homes[name]} instead", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
