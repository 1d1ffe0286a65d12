"""fairseq plugins for sMLP: `fairseq-train --user-dir fairseq_plugins --arch smlp_lm_tiny ...`.

Registers the models smlp_lm, gmlp_lm, moe_transformer_lm with their presets, and the criterion
smlp_lm_loss; allows torch's safe checkpoint loader to read fairseq checkpoints; makes checkpoint
writes atomic and loads only whole sets of rank shards (`shard_sets`); reshards a training
checkpoint when it resumes on another number of ranks (`elastic`); keeps expert parameters out of
--zero-sharding os (`sharded_optim`); makes --fp16, --bf16 and --amp train expert-parallel models
(`precision`); checks the data directory before the language_modeling task reads it; makes
fairseq-interactive, fairseq-generate and the hub's sample work on our checkpoints
(`generation_patches`); restores the
logging of fairseq's evaluation programs (see `restore_fairseq_cli_logging`).
"""
import logging
import os
import sys

from . import criterion, elastic, generation_patches, models, precision, shard_sets, sharded_optim  # noqa: F401
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


def check_data_dir(data) -> None:
    """A clear error for a language-modeling data directory that is missing or not binarized."""
    if not data:
        return
    for part in str(data).split(os.pathsep):
        if not part or "://" in part:
            continue
        expected = "the output folder of smlp-prepare-data or fairseq-preprocess: dict.txt, train.bin/.idx, valid.bin/.idx"
        if not os.path.isdir(part):
            raise FileNotFoundError(f"data directory {part} does not exist; pass {expected}")
        if not os.path.isfile(os.path.join(part, "dict.txt")):
            raise FileNotFoundError(f"data directory {part} has no dict.txt; pass {expected}")
        break  # fairseq reads the dictionary from the first shard only


def guard_language_modeling_data() -> bool:
    """Check --data before fairseq's language_modeling task reads it (a wrapper; fairseq is unchanged)."""
    from fairseq.tasks.language_modeling import LanguageModelingTask

    original = LanguageModelingTask.setup_task.__func__
    if getattr(original, "_smlp_checked", False):
        return False

    def setup_task(cls, args, **kwargs):
        check_data_dir(getattr(args, "data", None))
        return original(cls, args, **kwargs)

    setup_task._smlp_checked = True
    setup_task.__wrapped__ = original
    LanguageModelingTask.setup_task = classmethod(setup_task)
    return True


allow_fairseq_checkpoints()
shard_sets.install()  # atomic saves, whole sets of rank shards at load
guard_language_modeling_data()
elastic.install()  # after shard_sets: resharding to this run's layout goes first, then the set is checked
sharded_optim.install()  # --zero-sharding os keeps expert parameters and their Adam state rank-local
precision.install()  # mixed precision with experts and off CUDA (patches listed in precision.py)
generation_patches.install()  # numpy 2 in fairseq-interactive, rank-shard sets, generation limits and prefix fill
restore_fairseq_cli_logging()
