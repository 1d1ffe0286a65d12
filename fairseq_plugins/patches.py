"""Every change our plugins make to fairseq, in the order they are applied.

Written against fairseq 0.12.x (installed: fairseq-fixed 0.12.3.1, `FAIRSEQ_VERSION`). fairseq's own
files are never edited: each patch replaces module attributes (functions, methods) with wrappers that
keep the original as `__wrapped__`, and applying a patch twice changes nothing. Importing the plugin
package (`--user-dir fairseq_plugins`, or `import fairseq_plugins`) calls `apply_patches()` once;
nothing else installs a patch. The code of each patch lives with the concept it serves (the module
named in the table); the small ones without such a module live here.

Order matters in one place: the logging repair runs last, after every import that could have configured logging.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from dataclasses import dataclass

from .errors import DataError, FlagError

__all__ = ["FAIRSEQ_VERSION", "PATCHES", "Patch", "apply_patches", "check_batch_limits", "check_binarized_split",
           "check_data_dir", "ddp_on_cpu", "evaluate_every_sequence", "gather_lists_off_cuda",
           "fold_router_prices", "guard_language_modeling_data", "refuse_unlimited_batches",
           "restore_fairseq_cli_logging"]

FAIRSEQ_VERSION = "0.12"  # the release these patches were written against (fairseq-fixed 0.12.3.1)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    module: str  # the module of fairseq_plugins that holds its code
    function: str  # installs it (idempotent)
    fixes: str

    def install(self):
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.function)()


# ------------------------------------------------------------------ the patches that live here


def check_data_dir(data) -> None:
    """A clear error for a language-modeling data directory that is missing or not binarized."""
    if not data:
        return
    for part in str(data).split(os.pathsep):
        if not part or "://" in part:
            continue
        expected = ("the output folder of smlp-prepare-data or fairseq-preprocess: dict.txt, train.bin/.idx, "
                    "valid.bin/.idx")
        if not os.path.isdir(part):
            raise DataError(f"data directory {part} does not exist; pass {expected}")
        if not os.path.isfile(os.path.join(part, "dict.txt")):
            raise DataError(f"data directory {part} has no dict.txt; pass {expected}")
        break  # fairseq reads the dictionary from the first shard only


def check_binarized_split(split_path: str, dictionary_size: int, dictionary_file: str) -> None:
    """DataError naming the file when the binarized split `split_path` (.bin/.idx, fairseq's mmap format) is cut
    short of what its index describes, or holds a token id its dictionary does not have (a dict.txt smaller
    than the one it was binarized with: an IndexError deep inside the embedding, then a crash.pt)."""
    import numpy as np
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    idx, binary = split_path + ".idx", split_path + ".bin"
    if not (os.path.isfile(idx) and os.path.isfile(binary)):
        return  # fairseq names a missing split itself
    with open(idx, "rb") as f:
        if f.read(9) != MMapIndexedDataset.Index._HDR_MAGIC:
            return  # another of fairseq's formats
    try:
        index = MMapIndexedDataset.Index(idx)
    except Exception as exc:  # a cut .idx
        raise DataError(f"{idx} cannot be read ({type(exc).__name__}: {str(exc)[:120]}): the index is damaged or "
                        f"cut short; binarize the data again (smlp-prepare-data --force) or copy it whole") from None
    itemsize = np.dtype(index.dtype).itemsize
    n = len(index)
    expected = int(index._pointers[-1]) + int(index.sizes[-1]) * itemsize if n else 0
    actual = os.path.getsize(binary)
    if actual < expected:
        raise DataError(f"{binary} holds {actual} bytes but its index {os.path.basename(idx)} describes {expected} "
                        f"({n} sentences): the file is cut short (an interrupted copy or binarization?); binarize the "
                        f"data again (smlp-prepare-data --force) or copy it whole")
    if not expected:
        return
    tokens = np.memmap(binary, dtype=index.dtype, mode="r", shape=(expected // itemsize,))
    largest = max(int(tokens[i:i + 2 ** 26].max()) for i in range(0, len(tokens), 2 ** 26))
    if largest >= dictionary_size:
        raise DataError(f"{binary} holds token id {largest} but {dictionary_file} has {dictionary_size} symbols (ids "
                        f"0-{dictionary_size - 1}): the data was binarized with another, larger dictionary; put the "
                        f"dict.txt written with it in the data directory")


def guard_language_modeling_data() -> bool:
    """Check --data before fairseq's language_modeling task reads it, and each split it loads (wrappers of
    setup_task and load_dataset; fairseq is unchanged)."""
    from fairseq.tasks.language_modeling import LanguageModelingTask

    original = LanguageModelingTask.setup_task.__func__
    if getattr(original, "_smlp_checked", False):
        return False
    original_load = LanguageModelingTask.load_dataset

    def setup_task(cls, args, **kwargs):
        check_data_dir(getattr(args, "data", None))
        return original(cls, args, **kwargs)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        from fairseq import utils

        paths = utils.split_paths(self.args.data)
        if paths and "://" not in paths[0]:
            data_path = paths[(epoch - 1) % len(paths)]
            check_binarized_split(os.path.join(data_path, split), len(self.dictionary),
                                  os.path.join(paths[0], "dict.txt"))
        return original_load(self, split, epoch, combine, **kwargs)

    for fn, wrapped in ((setup_task, original), (load_dataset, original_load)):
        fn._smlp_checked = True
        fn.__wrapped__ = wrapped
    LanguageModelingTask.setup_task = classmethod(setup_task)
    LanguageModelingTask.load_dataset = load_dataset
    return True


def check_batch_limits(max_sentences, max_tokens) -> None:
    """FlagError for --batch-size or --max-tokens below 1: fairseq's batching takes 0 (and -1) as no limit, so
    one batch, and one update, would hold the whole epoch."""
    for flag, value, example in (("--batch-size", max_sentences, "8"), ("--max-tokens", max_tokens, "4096")):
        if value is not None and value < 1:
            raise FlagError(f"{flag} {value} is not a batch size: fairseq would take it as no limit and make one "
                            f"batch (one update) of the whole epoch; give a number >= 1 (e.g. {flag} {example})")


def refuse_unlimited_batches() -> bool:
    """Check --batch-size / --max-tokens where fairseq batches any dataset (FairseqTask.get_batch_iterator: the
    training, validation and evaluation iterators of every program), before the first batch is formed."""
    from fairseq.tasks.fairseq_task import FairseqTask

    original = FairseqTask.get_batch_iterator
    if getattr(original, "_smlp_checked", False):
        return False

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, *args, **kwargs):
        check_batch_limits(max_sentences, max_tokens)
        return original(self, dataset, max_tokens, max_sentences, *args, **kwargs)

    get_batch_iterator._smlp_checked = True
    get_batch_iterator.__wrapped__ = original
    FairseqTask.get_batch_iterator = get_batch_iterator
    return True


@contextlib.contextmanager
def _batches_of_any_size(cfg):
    """cfg.dataset.required_batch_size_multiple = 1 for the block (restored after)."""
    from omegaconf import open_dict

    dataset = cfg.dataset
    saved = dataset.required_batch_size_multiple
    with open_dict(dataset):
        dataset.required_batch_size_multiple = 1
    try:
        yield
    finally:
        with open_dict(dataset):
            dataset.required_batch_size_multiple = saved


def fold_router_prices() -> bool:
    """The balanced routers' evaluation prices (smlp/routing/prices.py) are folded once per optimizer step that
    updates the model, for every layer in one all-reduce over the data-parallel group (every rank holds a copy
    of the routers, whatever --expert-parallel-size), so all ranks evaluate with the same prices whatever the
    layout, --update-freq or precision: a wrapper of FairseqTask.optimizer_step, which the trainer calls once
    per update on every rank. A step that does not update the model folds nothing and its rows stay recorded
    for the next, and in the checkpoint: --fp16 raises its overflow before the step, --amp steps anyway (the
    GradScaler skips the update; its agreed skip decision, `precision.update_applied`, masks the fold on the
    device). fairseq's dummy batch (ignore_grad: a rank with no batch left at an uneven epoch end runs its first
    batch again with the loss zeroed) does not count: a wrapper of FairseqTask.train_step (`prices.uncounted`)."""
    from fairseq.distributed import utils as distributed_utils
    from fairseq.tasks import FairseqTask

    from smlp.routing import prices

    from .precision import update_applied

    if getattr(FairseqTask.optimizer_step, "_smlp_prices", False):
        return False
    original, original_train = FairseqTask.optimizer_step, FairseqTask.train_step

    def optimizer_step(self, optimizer, model, update_num):
        prices.fold_prices(model, distributed_utils.get_data_parallel_group(), update_applied(optimizer))
        return original(self, optimizer, model, update_num)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        with prices.uncounted(model) if ignore_grad else contextlib.nullcontext():
            return original_train(self, sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)

    for fn, wrapped in ((optimizer_step, original), (train_step, original_train)):
        fn._smlp_prices = True
        fn.__wrapped__ = wrapped
    FairseqTask.optimizer_step, FairseqTask.train_step = optimizer_step, train_step
    return True


def evaluate_every_sequence() -> bool:
    """fairseq 0.12's `data_utils.batch_by_size` drops the last batch when its number of sequences is not a
    multiple of --required-batch-size-multiple (default 8), although fairseq's validation iterators ask to
    keep the remainder (skip_remainder_batch=False): fairseq-validate and the validation inside fairseq-train
    left out up to 7 sequences, how many depending on --batch-size (2 of the 74 tiny validation blocks, 64 of
    2364 tokens: 4.7e-3 of loss apart from fairseq-eval-lm after 50 updates, which batches with multiple 1).
    Validation batches with multiple 1, as fairseq-eval-lm: every sequence is scored, whatever the batch size.
    Training batches are left as fairseq makes them. Wrappers of Trainer.get_valid_iterator and, for
    fairseq-validate, of call_main (its program module is not imported here)."""
    from fairseq.distributed import utils as distributed_utils
    from fairseq.trainer import Trainer

    if getattr(Trainer.get_valid_iterator, "_smlp_checked", False):
        return False
    original_valid, original_call_main = Trainer.get_valid_iterator, distributed_utils.call_main

    def get_valid_iterator(self, subset, disable_iterator_cache=False):
        with _batches_of_any_size(self.cfg):
            return original_valid(self, subset, disable_iterator_cache)

    def call_main(cfg, main, **kwargs):
        if getattr(main, "__module__", None) == "fairseq_cli.validate":
            with _batches_of_any_size(cfg):
                return original_call_main(cfg, main, **kwargs)
        return original_call_main(cfg, main, **kwargs)

    for fn, original in ((get_valid_iterator, original_valid), (call_main, original_call_main)):
        fn._smlp_checked = True
        fn.__wrapped__ = original
    Trainer.get_valid_iterator = get_valid_iterator
    distributed_utils.call_main = call_main
    return True


def gather_lists_off_cuda() -> bool:
    """fairseq-validate on several ranks gathers the logging outputs with `all_gather_list`, which builds
    `torch.cuda.ByteTensor` buffers and so fails on CPU (gloo) ranks: off NCCL, the lists are gathered with
    `torch.distributed.all_gather_object` (the same result, pickled objects in rank order). A wrapper:
    NCCL groups keep fairseq's function."""
    from fairseq.distributed import utils as distributed_utils

    original = distributed_utils.all_gather_list
    if getattr(original, "_smlp_checked", False):
        return False

    def all_gather_list(data, group=None, max_size=16384):
        import torch.distributed as dist

        from smlp.process_group import collective_device

        group = distributed_utils.get_global_group() if group is None else group
        if collective_device(group).type == "cuda":
            return original(data, group=group, max_size=max_size)
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, data, group=group)
        return out

    all_gather_list._smlp_checked = True
    all_gather_list.__wrapped__ = original
    distributed_utils.all_gather_list = all_gather_list
    return True


def ddp_on_cpu() -> bool:
    """--ddp-backend pytorch_ddp (fairseq's default) or c10d on CPU ranks: fairseq builds torch's
    DistributedDataParallel with device_ids=[--device-id], which torch refuses for a module on the CPU
    ("device_ids and output_device arguments only work with single-device/multiple-device GPU modules").
    A subclass that leaves them out for a CPU module replaces the class fairseq uses; GPU modules are
    built as fairseq builds them."""
    from fairseq.models import distributed_fairseq_model

    original = distributed_fairseq_model.DistributedDataParallel
    if getattr(original, "_smlp_checked", False):
        return False

    class DistributedDataParallel(original):
        _smlp_checked = True
        __wrapped__ = original

        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            if all(p.device.type == "cpu" for p in module.parameters()):  # torch takes no device ids here
                device_ids = output_device = None
            super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)

    distributed_fairseq_model.DistributedDataParallel = DistributedDataParallel
    return True


# fairseq's command-line programs that configure logging only after importing fairseq
_CLI_MODULES = ("fairseq_cli.eval_lm", "fairseq_cli.validate", "fairseq_cli.generate", "fairseq_cli.interactive")


def restore_fairseq_cli_logging() -> bool:
    """Give fairseq-eval-lm / fairseq-validate back the INFO logging they ask for.

    Importing fairseq runs `logging.debug(...)` in `fairseq.file_io` (its FB-only S3 handler is
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


# ------------------------------------------------------------------ the list


PATCHES = (
    Patch("allow_fairseq_checkpoints", "checkpoints", "allow_fairseq_checkpoints",
          "torch >= 2.6 loads with weights_only=True and refuses the omegaconf, numpy and argparse objects fairseq "
          "stores in a checkpoint: they are allowlisted"),
    Patch("pin_sequence_length", "checkpoints", "pin_sequence_length",
          "fairseq-validate applies its --tokens-per-sample to the saved model, which then has spatial weights of "
          "another size (PyTorch's size mismatch): a checkpoint's model keeps the T it was trained with"),
    Patch("checkpoint_sets", "checkpoint_sets", "install",
          "fairseq writes rank shards non-atomically (asynchronously: untagged, never copied to checkpoint_last), "
          "probes --save-dir with a file named dummy, prunes only each rank's own suffix and drops "
          "--checkpoint-suffix: atomic tagged writes named only once every rank has written its own, --save-async "
          "and --checkpoint-suffix on rank shards refused, one job per save folder (a lock), whole saves pruned"),
    Patch("checkpoint_sources", "checkpoint_sources", "install",
          "fairseq resumes each rank from whatever file it finds, only on the world size that wrote it, and loads "
          "--finetune-from-model as one file on every rank: the newest complete save of any world size, a "
          "--restore-file or --finetune-from-model of any layout, each rank its own experts (resharded beside, "
          "under --save-dir)"),
    Patch("guard_language_modeling_data", "patches", "guard_language_modeling_data",
          "language_modeling reads a missing or unbinarized --data with an obscure error, a truncated .bin with a "
          "numpy error and ids beyond its dict.txt with an IndexError in the embedding (and a crash.pt): checked "
          "first, naming the file"),
    Patch("refuse_unlimited_batches", "patches", "refuse_unlimited_batches",
          "fairseq takes --batch-size 0 (or --max-tokens 0) as no limit: one update of the whole epoch, exit 0; "
          "refused where any program batches a dataset"),
    Patch("torchrun", "torchrun", "install",
          "fairseq-train under torchrun on CPU divides by torch.cuda.device_count() (ZeroDivisionError), and without "
          "--distributed-world-size runs independent trainings that write the same checkpoint: the ranks are taken "
          "from torchrun's environment (gloo on CPU); fairseq-eval-lm there is refused (it reports per rank)"),
    Patch("hydra_presets", "hydra_presets", "install",
          "fairseq-hydra-train with `model: {_name: smlp_lm_tiny}` filled the model from the dataclass defaults (512 "
          "wide, 6 layers) instead of the preset: the preset fills what the configuration leaves out, as --arch does"),
    Patch("zero_optimizer", "zero_optimizer", "install",
          "--zero-sharding os (fairscale OSS) would overwrite every rank's experts with one rank's: expert "
          "parameters keep their optimizer state on their rank"),
    Patch("precision", "precision", "install",
          "--fp16/--bf16/--amp break with expert parameters and off CUDA, and fairseq's gradient norm leaves the "
          "experts out (six patches, listed in precision.py; at import only the wrappers that install, when a run's "
          "configuration is known, the ones it needs)"),
    Patch("generation_patches", "generation_patches", "install",
          "numpy 2 in fairseq-interactive, rank-shard checkpoints on one process, generation limits and the "
          "routing-prefix fill (listed in generation_patches.py)"),
    Patch("fold_router_prices", "patches", "fold_router_prices",
          "the balanced routers' evaluation prices must advance once per update and agree on every rank: folded "
          "before each optimizer step that updates the model (not on an --amp overflow, which fairseq steps "
          "too), all layers in one all-reduce over the data-parallel group; fairseq's dummy batch does not count"),
    Patch("evaluate_every_sequence", "patches", "evaluate_every_sequence",
          "fairseq-validate and fairseq-train's validation drop the last batch when its size is not a multiple of "
          "--required-batch-size-multiple, so the figure left out sequences and depended on --batch-size: "
          "validation batches with multiple 1, as fairseq-eval-lm"),
    Patch("gather_lists_off_cuda", "patches", "gather_lists_off_cuda",
          "fairseq-validate on several CPU (gloo) ranks gathers its logging outputs into torch.cuda.ByteTensor "
          "buffers and fails: gathered as Python objects off NCCL"),
    Patch("ddp_on_cpu", "patches", "ddp_on_cpu",
          "--ddp-backend pytorch_ddp (fairseq's default) and c10d fail on CPU ranks: torch's DistributedDataParallel "
          "refuses the device ids fairseq passes for a CPU module"),
    Patch("restore_fairseq_cli_logging", "patches", "restore_fairseq_cli_logging",
          "fairseq-eval-lm / fairseq-validate log nothing at INFO after fairseq's import set up logging"),
    Patch("print_refusals", "errors", "print_refusals",
          "fairseq's programs print a refused input (a bad flag, data folder or checkpoint) inside a 20-30 line "
          "traceback: the plugins' refusals (errors.RefusedInput) are printed as one line, PROG: error: MESSAGE"),
)


def apply_patches() -> tuple[Patch, ...]:
    """Apply every patch of `PATCHES`, in order (idempotent); warns once if fairseq is not 0.12.x."""
    import fairseq

    version = getattr(fairseq, "__version__", "?")
    if not version.startswith(FAIRSEQ_VERSION + "."):
        logger.warning("fairseq %s is installed; the sMLP plugins' patches were written against %s.x "
                       "(fairseq_plugins/patches.py)", version, FAIRSEQ_VERSION)
    for patch in PATCHES:
        patch.install()
    return PATCHES
