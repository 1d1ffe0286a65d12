"""Start-up settings for the third-party libraries our console programs import through fairseq.

Importing fairseq imports DeepSpeed (`fairseq.optim.cpu_adam`), which on a machine without an
accelerator logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
detect it." from its own accelerator detection, and fairscale, whose offload module raises a
FutureWarning for torch.cuda.amp's decorators. Neither concerns a run: the warnings are silenced at
their source, before fairseq is imported, and nothing of ours is hidden:

- DeepSpeed is told the accelerator it would pick anyway (`DS_ACCELERATOR=cpu`, its documented
  override) when torch sees none, so its detection does not run; with an accelerator, or a value
  already set by the user, nothing changes.
- fairscale's FutureWarnings (only those, by module) are ignored.
- A program that needs no optimizer (the FLOPs calculator) imports fairseq without DeepSpeed at all:
  fairseq 0.12 treats DeepSpeed as optional (cpu_adam catches its ImportError), which saves its
  import time. fairseq itself cannot be imported without its optimizers and tasks (its __init__
  imports them, scikit-learn included, without a guard).

Core code never calls this (it imports no fairseq); the console programs call `quiet_imports()`
first.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["quiet_imports"]


def quiet_imports(*, deepspeed: bool = True) -> None:
    """Silence DeepSpeed's and fairscale's import-time warnings in this process (module docstring);
    `deepspeed=False` also keeps DeepSpeed from being imported. Call before fairseq is imported."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairscale\.")
    if "deepspeed" in sys.modules:
        return
    if not deepspeed:
        sys.modules["deepspeed"] = None  # `import deepspeed` raises ImportError: fairseq goes on without it
        return
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if torch.accelerator.current_accelerator() is None:
            os.environ["DS_ACCELERATOR"] = "cpu"
