"""Start-up settings for the third-party libraries our console programs import through fairseq.

Importing fairseq imports DeepSpeed, whose accelerator detection logs a warning on a machine without
one, and fairscale, whose offload module raises a FutureWarning; neither concerns a run. They are
silenced at their source before fairseq is imported: DeepSpeed gets its documented override
`DS_ACCELERATOR=cpu` where torch sees no accelerator and the user set none, and fairscale's
FutureWarnings alone are ignored. A program that needs no optimizer can skip DeepSpeed's import
altogether: fairseq 0.12 treats it as optional. The core never calls this.
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
