"""fairseq plugins for sMLP: `fairseq-train --user-dir fairseq_plugins --arch smlp_lm_tiny ...`.

Registers the models smlp_lm, gmlp_lm, moe_transformer_lm with their presets, and the criterion
smlp_lm_loss; allows torch's safe checkpoint loader to read fairseq checkpoints; reshards a training
checkpoint when it resumes on another number of ranks (`elastic`); keeps expert parameters out of
--zero-sharding os (`sharded_optim`); restores the
logging of fairseq's evaluation programs (see `restore_fairseq_cli_logging`).
"""
import logging
import os
import sys

from . import criterion, elastic, models, sharded_optim  # noqa: F401  (registration)
from .checkpoints import allow_fairseq_checkpoints

# fairseq's command-line programs that configure logging only after importing fairseq
_CLI_MODULES = ("fairseq_cli.eval_lm", "fairseq_cli.validate", "fairseq_cli.generate", "fairseq_cli.interactive")


def restore_fairseq_cli_logging() -> bool:
    """Give fairseq-eval-lm / fairseq-validate back the INFO logging they ask for.

    Importing fairseq runs `logging.debug(...)` in fairseq/file_io.py (its FB-only S3 handler is
    missing), which installs Python's default root handler at WARNING. Programs that call
    `logging.basicConfig` after importing fairseq (eval_lm, validate, ...) then log nothing at INFO,
    results included ("Loss (base 2): ..."). This redoes their configuration, only when the
    running program is one of them and the root logger holds exactly that default handler.
    """
    root = logging.getLogger()
    if not any(m in sys.modules for m in _CLI_MODULES) or root.level != logging.WARNING or len(root.handlers) != 1:
        return False
    handler = root.handlers[0]
    fmt = getattr(handler.formatter, "_fmt", None)
    if type(handler) is not logging.StreamHandler or handler.stream is not sys.stderr or fmt != logging.BASIC_FORMAT:
        return False
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stdout, force=True)
    return True


allow_fairseq_checkpoints()
elastic.install()  # install after any other wrapper of checkpoint_utils.load_checkpoint: resharding goes first
sharded_optim.install()  # --zero-sharding os keeps expert parameters and their Adam state rank-local
restore_fairseq_cli_logging()
