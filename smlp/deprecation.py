"""Old module paths, kept for one release after a move: each old file is a declaration naming its new home.

A module that moved whole leaves behind

    import sys
    from smlp.deprecation import moved

    sys.modules[__name__] = moved(__name__)

with its new home in `MOVED` (here "smlp.gates": "smlp.routing.gates"). `moved` warns (a
DeprecationWarning naming the new path, attributed to the code that imported the old one) and
returns the new module, which then stands for the old name as well: `smlp.gates` and
`smlp.routing.gates` are one module object, so its functions and classes, anything pickled under
either name, and a monkeypatch through either name are the same. A module whose contents went to
several homes re-exports them by name and calls `warn_moved(__name__)`; a name that left a module
that stays is served by that module's `__getattr__` through `moved_name`. tests/test_imports.py
imports every old path of `MOVED`, `SPLIT` and `MOVED_NAMES` and checks its warning.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "MOVED_NAMES", "SPLIT", "moved", "moved_name", "warn_moved"]

# For one release. Old path -> the module it moved to whole (the old file: `moved`) ...
MOVED = {
    "smlp.routers": "smlp.routing.registry",
    "smlp.gates": "smlp.routing.gates",
    "smlp.assignment": "smlp.routing.assignment",
    "smlp.decoding": "smlp.decoding_cache",
}
# ... or -> {name: the module it went to}, for a module split over several homes (the old file re-exports
# the names and calls `warn_moved`)
SPLIT = {
    "smlp.numerics": {"router_logits": "smlp.routing.logits", "no_autocast": "smlp.precision"},
    "smlp.causal": {**dict.fromkeys(("BLOCK", "causal_product", "causal_product_rows", "default_block",
                                     "executed_pairs", "masked_dense_product"), "smlp.spatial"),
                    "explicit_spatial": "smlp.flop_forms"},
    "smlp.mixers": {**dict.fromkeys(("check_length", "causal_weight", "init_spatial_", "uniform_per_slice_"),
                                    "smlp.spatial"),
                    **dict.fromkeys(("SpatialProjection", "SpatialGatingUnit", "GMLPBlock"), "smlp.gmlp")},
    "smlp.token_mixers": {
        **dict.fromkeys(("CHUNK_ELEMENTS", "HyperMixerConfig", "hypermixing", "hypermixing_step", "HyperMixingUnit"),
                        "smlp.hypermixer"),
        **dict.fromkeys(("NiNformerConfig", "CausalTokenMLP", "MixerSubUnit", "NiNformerGatingUnit"),
                        "smlp.ninformer"),
        "TOKEN_MIXERS": "smlp.gmlp", "make_token_mixer": "smlp.lm"},
}
# ... and names that left a module that stays: module -> {name: the module it went to} (the module's
# `__getattr__` calls `moved_name`)
MOVED_NAMES = {
    "smlp.transformer": {"explicit_attention": "smlp.flop_forms"},
}


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


def warn_moved(old: str) -> None:
    """DeprecationWarning: the old path `old` is removed in the next release; the message names the new home."""
    if old in MOVED:
        new = MOVED[old]
    else:
        new = ", ".join(f"{name} from {home}" for name, home in SPLIT[old].items())
    warnings.warn(f"{old} is deprecated and will be removed in the next release: import {new} instead",
                  DeprecationWarning, stacklevel=_importer_stacklevel())


def moved(old: str) -> ModuleType:
    """Warn that `old` moved whole to MOVED[old] and return that module (to stand in sys.modules for both)."""
    warn_moved(old)
    return importlib.import_module(MOVED[old])


def moved_name(module: str, name: str):
    """`name` from its new home, with a DeprecationWarning, if it left `module` (MOVED_NAMES); otherwise
    the AttributeError of a missing name (for a module-level `__getattr__`)."""
    home = MOVED_NAMES.get(module, {}).get(name)
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release: import {name} from "
                  f"{home} instead", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)
