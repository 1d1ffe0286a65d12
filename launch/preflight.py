"""The checks a fairseq-train command passes before any of its ranks starts working (smlp-launch's workers).

A flag the model cannot take (heads that do not divide the width, experts that do not fit the world size, a
routing prefix covering the sequence, no layer, --batch-size 0, ...) would surface inside every rank's
fairseq-train as a 30-line traceback, once per rank. `refusal(fairseq_args)` parses the arguments as
fairseq-train does (its parser, with the plugins of --user-dir), checks the checkpoint flags, the data folder (its
train split whole and within its dictionary), the batch limits and the model's flags without building the model
(`fairseq_plugins.models.check_model_flags`), and returns the one line that says what is wrong, or None. A
worker runs it before it joins the others (no file is written, no rendezvous is made); the launcher prints the
line once and stops the other workers (smlp_launch.local).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

__all__ = ["refusal"]


def refusal(fairseq_args: list[str]) -> str | None:
    """The refusal of a fairseq-train command line (without a `PROG: error:` prefix), or None if it passes."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    err = io.StringIO()
    with warnings.catch_warnings():  # hydra's deprecation warnings: fairseq-train's own parse shows them
        warnings.simplefilter("ignore")
        try:
            with contextlib.redirect_stderr(err):
                args = options.parse_args_and_arch(parser, list(fairseq_args))
        except SystemExit as exc:  # argparse printed the usage and one "error:" line, and exits with 2
            lines = [line.split("error: ", 1)[1] for line in err.getvalue().splitlines() if "error: " in line]
            if exc.code != 2 or not lines:  # not argparse: e.g. a --user-dir module that exits on import
                sys.stderr.write(err.getvalue())
                raise
            return lines[-1]
        cfg = convert_namespace_to_omegaconf(args)
    from fairseq_plugins.checkpoint_sets import check_checkpoint_flags, check_checkpoint_suffix
    from fairseq_plugins.errors import RefusedInput
    from fairseq_plugins.models import check_model_flags
    from fairseq_plugins.patches import check_batch_limits, check_binarized_split, check_data_dir

    try:
        check_checkpoint_flags(cfg.checkpoint)
        check_checkpoint_suffix(cfg)
        data = getattr(cfg.task, "data", None)
        check_data_dir(data)
        check_batch_limits(cfg.dataset.batch_size, cfg.dataset.max_tokens)
        if data and "://" not in str(data):
            first = str(data).split(os.pathsep)[0]
            size = _dictionary_size(first)
            if getattr(cfg.model, "_name", None):
                check_model_flags(cfg.model, size)
            check_binarized_split(os.path.join(first, "train"), size, os.path.join(first, "dict.txt"))
    except (RefusedInput, ValueError) as exc:  # the model's own checks: a flag's value it cannot take
        return " ".join(str(exc).split("\n"))
    return None


def _dictionary_size(data_dir: str) -> int:
    from fairseq.data import Dictionary

    return len(Dictionary.load(os.path.join(data_dir, "dict.txt")))
