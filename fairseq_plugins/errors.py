"""Refused input: the errors the plugins raise for a user's mistake, and how fairseq's programs print them.

`RefusedInput` marks an exception whose message is complete for the user (the offending value, the flag or
file, what would be valid). fairseq's programs (fairseq-train, fairseq-validate, fairseq-eval-lm) let it
reach the interpreter, which would print a traceback of 20-30 lines around that one line; `print_refusals`
(installed by patches.py) prints such an exception as `PROG: error: MESSAGE` and nothing else, exit status 1.
Any other exception keeps its traceback, and SMLP_TRACEBACK=1 keeps it for refusals too.
"""
from __future__ import annotations

import os
import sys

__all__ = ["RefusedInput", "FlagError", "DataError", "print_refusals", "refusal_line"]


class RefusedInput(Exception):
    """Mixin of the plugins' user-facing errors: the message says what is wrong and what would be valid."""


class FlagError(ValueError, RefusedInput):
    """A fairseq flag (or a combination of flags) that cannot build or train the model."""


class DataError(FileNotFoundError, RefusedInput):
    """A data directory or data file that is missing, incomplete or inconsistent."""


def refusal_line(exc: BaseException, prog: str | None = None) -> str:
    prog = prog or os.path.basename(sys.argv[0] or "fairseq") or "fairseq"
    text = " ".join(str(exc).split("\n"))
    return f"{prog}: error: {text}"


def print_refusals() -> bool:
    """sys.excepthook prints a RefusedInput as one line (see the module docstring); idempotent."""
    original = sys.excepthook
    if getattr(original, "_smlp_refusals", False):
        return False

    def excepthook(exc_type, exc, tb):
        if isinstance(exc, RefusedInput) and not os.environ.get("SMLP_TRACEBACK"):
            sys.stdout.flush()
            print(refusal_line(exc), file=sys.stderr, flush=True)
            return
        original(exc_type, exc, tb)

    excepthook._smlp_refusals = True
    excepthook.__wrapped__ = original
    sys.excepthook = excepthook
    return True
