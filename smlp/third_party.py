"""Start-up settings for the third-party libraries our console programs import through fairseq.

Importing fairseq imports DeepSpeed, whose accelerator detection logs a warning on a machine without
one, and fairscale, whose offload module raises a FutureWarning; neither concerns a run. They are
silenced at their source before fairseq is imported: DeepSpeed gets its documented override
`DS_ACCELERATOR=cpu` where torch sees no accelerator and the user set none, and fairscale's
FutureWarnings alone are ignored. A program that needs no optimizer can skip DeepSpeed's import
altogether: fairseq 0.12 treats it as optional. The core never calls this.

It also arranges that fairseq, when this process imports it, imports without scikit-learn and scipy.stats: fairseq
imports every task and criterion at its own import, and two of them (audio_classification, sentence_prediction)
import scikit-learn and scipy.stats at module level, about 1.3 s of CPU of a 3.6 s import here, paid by every rank
of every run for metrics a language model never computes. While fairseq's package executes, those modules are
placeholders whose functions import the real module at their first call; afterwards the placeholders leave
sys.modules, so any later import (a --user-dir plugin, lm-eval) gets the real modules.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

__all__ = ["quiet_imports"]

# what fairseq's audio_classification task and sentence_prediction criterion import at module level
DEFERRED = ("sklearn", "sklearn.metrics", "scipy.stats")


def quiet_imports(*, deepspeed: bool = True) -> None:
    """Silence DeepSpeed's and fairscale's import-time warnings in this process (module docstring);
    `deepspeed=False` also keeps DeepSpeed from being imported. Call before fairseq is imported."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairscale\.")
    if "fairseq" not in sys.modules and not any(isinstance(f, _FairseqFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FairseqFinder())
    if "deepspeed" in sys.modules:
        return
    if not deepspeed:
        sys.modules["deepspeed"] = None  # `import deepspeed` raises ImportError: fairseq goes on without it
        return
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if torch.accelerator.current_accelerator() is None:
            os.environ["DS_ACCELERATOR"] = "cpu"


class _Later:
    """A deferred module's attribute (fairseq imports functions): imports the real module when called."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.module}.{self.name}, imported at its first call>"


def _deferred_package(name: str) -> bool:
    return any(d.startswith(name + ".") for d in DEFERRED)


class _Placeholder(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in DEFERRED or _deferred_package(full):  # `from sklearn import metrics`
            return importlib.import_module(full)
        return _Later(self.__name__, name)


class _DeferringFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in DEFERRED:
            return None
        parent = name.rpartition(".")[0]
        if parent in DEFERRED and not isinstance(sys.modules.get(parent), _Placeholder):
            return None  # its package was imported for real: so is it
        return importlib.machinery.ModuleSpec(name, self, is_package=_deferred_package(name))

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module) -> None:
        pass


class _FairseqFinder(importlib.abc.MetaPathFinder):
    """Finds fairseq as the other finders do (once: it then leaves sys.meta_path), with a loader that executes
    fairseq's package inside deferred_imports()."""

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ExecutingDeferred(spec.loader)
        return spec


class _ExecutingDeferred(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with deferred_imports():
            self.loader.exec_module(module)

    def __getattr__(self, name: str):  # get_resource_reader, get_source, ...: the real loader's
        return getattr(self.loader, name)


@contextlib.contextmanager
def deferred_imports():
    """Within the block, importing a module of DEFERRED not yet imported gives a placeholder (its attributes:
    functions that import the real module at their first call); after it, the placeholders leave sys.modules
    and their real parents, so later imports get the real modules."""
    finder = _DeferringFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in DEFERRED:
            if isinstance(sys.modules.get(name), _Placeholder):
                del sys.modules[name]
                parent, _, child = name.rpartition(".")
                if parent and isinstance(getattr(sys.modules.get(parent), child, None), _Placeholder):
                    delattr(sys.modules[parent], child)
