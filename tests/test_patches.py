"""fairseq_plugins/patches.py is the one list of our changes to fairseq (issue 20): importing the plugins
applies them through it, in its order, and applying them again changes nothing."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import fairseq_plugins
from fairseq_plugins import patches

PLUGINS = Path(fairseq_plugins.__file__).parent


def _patched():
    """The fairseq attributes our patches replace (one or more per patch)."""
    from fairseq import checkpoint_utils, optim, trainer
    from fairseq.data import token_block_dataset
    from fairseq.distributed import utils as distributed_utils
    from fairseq.models import distributed_fairseq_model
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.tasks.language_modeling import LanguageModelingTask

    return {"load_checkpoint": checkpoint_utils.load_checkpoint, "save_checkpoint": checkpoint_utils.save_checkpoint,
            "torch_persistent_save": checkpoint_utils.torch_persistent_save,
            "setup_task": LanguageModelingTask.__dict__["setup_task"].__func__,
            "inference_step": LanguageModelingTask.inference_step, "shard_": optim.shard_,
            "train_step": trainer.Trainer.train_step, "clip_grad_norm": trainer.Trainer.clip_grad_norm,
            "token_block_np": token_block_dataset.np, "get_valid_iterator": trainer.Trainer.get_valid_iterator,
            "call_main": distributed_utils.call_main, "all_gather_list": distributed_utils.all_gather_list,
            "DistributedDataParallel": distributed_fairseq_model.DistributedDataParallel,
            "get_batch_iterator": FairseqTask.get_batch_iterator,
            "load_checkpoint_to_cpu": checkpoint_utils.load_checkpoint_to_cpu,
            "load_dataset": LanguageModelingTask.load_dataset, "optimizer_step": FairseqTask.optimizer_step}


def test_every_listed_patch_names_code_that_exists_and_says_what_it_fixes():
    assert [p.name for p in patches.PATCHES] == [
        "allow_fairseq_checkpoints", "pin_sequence_length", "checkpoint_sets", "checkpoint_sources",
        "guard_language_modeling_data", "refuse_unlimited_batches", "torchrun", "hydra_presets", "zero_optimizer",
        "precision", "generation_patches", "fold_router_prices", "evaluate_every_sequence", "gather_lists_off_cuda",
        "ddp_on_cpu", "restore_fairseq_cli_logging", "print_refusals"]
    for p in patches.PATCHES:
        assert callable(getattr(importlib.import_module(f"fairseq_plugins.{p.module}"), p.function)), p
        assert len(p.fixes) > 40, p
    import fairseq

    assert fairseq.__version__.startswith(patches.FAIRSEQ_VERSION + ".")


def test_the_import_applied_them_in_order_and_again_changes_nothing():
    from fairseq import checkpoint_utils

    # one wrapper decides what loads (the newest save of any layout, resharded beside it) around fairseq's own
    outer = checkpoint_utils.load_checkpoint
    assert outer.__module__ == "fairseq_plugins.checkpoint_sources"
    assert outer.__wrapped__.__module__ == "fairseq.checkpoint_utils"
    before = _patched()
    # wrappers defined by our modules (train_step is wrapped only by runs that need it, precision.py patch 3)
    assert all(v.__module__.startswith("fairseq_plugins.") for k, v in before.items()
               if k not in ("train_step", "token_block_np")), before
    assert before["token_block_np"].compat.long is __import__("numpy").int64
    patches.apply_patches()
    assert _patched() == before


def test_only_the_patch_list_installs_at_import():
    """No plugin module calls an install function at import time except __init__, through apply_patches."""
    for path in sorted(PLUGINS.glob("*.py")):
        tree = ast.parse(path.read_text())
        calls = [ast.unparse(node.value.func) for node in tree.body
                 if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
        assert calls == (["apply_patches"] if path.name == "__init__.py" else []), (path.name, calls)


def test_the_eval_lm_frame_is_found_only_under_fairseq_cli_eval_lm():
    """fairseq_plugins.models reads fairseq-eval-lm's `cfg` from its frame (documented there): the walk
    finds a frame of module fairseq_cli.eval_lm below the caller, with its locals, and nothing elsewhere."""
    from fairseq_plugins.models import _fairseq_eval_lm_frame

    assert _fairseq_eval_lm_frame() is None
    def build_model():  # our code, called from deep inside the program
        return _fairseq_eval_lm_frame()

    scope = {"__name__": "fairseq_cli.eval_lm", "build_model": build_model}
    exec("def main(cfg):\n    return build_model()\n", scope)
    frame = scope["main"]("the eval-lm config")
    assert frame is not None and frame.f_locals["cfg"] == "the eval-lm config"
