"""configs/*.args: the paper's training recipes (Tables 8-10) and the tiny CPU recipe.

Each file must parse through fairseq-train's own parser with our plugins and translate into a
valid core config, with the paper's sizes, on the world size the paper trained on (32 GPUs).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fairseq_helpers import PLUGINS, REPO

CONFIGS = sorted((REPO / "configs").glob("*.args"))
PAPER_GPUS = 32


def parse(data: Path, flags: list[str], world: int):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.utils import import_user_module

    import fairseq_plugins  # noqa: F401

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, [str(data), "--user-dir", PLUGINS, *flags, "--cpu", "--distributed-world-size", str(world)])
    import_user_module(args)
    return convert_namespace_to_omegaconf(args)


def test_every_paper_model_has_a_recipe():
    names = {p.stem for p in CONFIGS}
    assert {"smlp_small", "smlp_large", "base_layers_small", "transformer_small", "gmlp_small",
            "base_layers_large", "gshard_large", "switch_large", "switch_enlarge_large", "hash_layers_large",
            "smlp_tiny"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_parses_and_builds_a_core_config(path, tiny_lm_data):
    from fairseq.models import ARCH_MODEL_REGISTRY

    from fairseq_plugins.config import to_core_config

    flags = path.read_text().split()
    tiny = path.stem.endswith("tiny")
    cfg = parse(tiny_lm_data, flags, 2 if tiny else PAPER_GPUS)
    model_cls = ARCH_MODEL_REGISTRY[flags[flags.index("--arch") + 1]]
    core = to_core_config(cfg.model, model_cls.family, vocab_size=51200, padding_idx=1)
    assert cfg.criterion._name == "smlp_lm_loss"
    assert cfg.distributed_training.ddp_backend == "legacy_ddp" or tiny
    if not tiny:  # the paper's context length and optimizer (Tables 8-10)
        assert core.seq_len == cfg.task.tokens_per_sample == 1024
        assert ast.literal_eval(cfg.optimizer.adam_betas) == (0.9, 0.98)
        assert cfg.optimizer.weight_decay == 0.1 and cfg.model.dropout == 0.1
        assert cfg.lr_scheduler.warmup_updates == 4000
        if core.sparse_layers:
            assert core.num_experts in (32, 64)
            assert core.num_experts % PAPER_GPUS == 0
