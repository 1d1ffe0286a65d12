"""A model given as fairseq flags: `--arch NAME` + model and training flags -> the core config
training would build (`parse_model`, through fairseq's own parser and our registered presets, then
`fairseq_plugins.config.to_core_config`), and back (`fairseq_flags`: the fairseq-train flags that
build a core config; the benchmark and the FLOP matches print them).

Used by the FLOPs calculator (counting.py, matching.py), the step-time model (steptime.py) and the
benchmarks. fairseq is imported on first use, not at import.
"""
from __future__ import annotations

import contextlib
import functools
import io
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from smlp.lm import LMConfig

from .counting import Count, count, warnings_off

__all__ = ["DEFAULT_VOCAB", "ModelSpec", "count_spec", "fairseq_flags", "parse_model", "plugin_archs"]

DEFAULT_VOCAB = 51200  # reproduces Table 9's non-expert parameters (41 gMLP blocks + 51200 x 1024 embedding)
PADDING_IDX = 1  # fairseq's dictionary puts <pad> at 1


@dataclass(frozen=True)
class ModelSpec:
    """A model given as fairseq flags, translated to the core config (plus the training flags the
    step-time model reads: --batch-size, --update-freq, --fp16, --zero-sharding)."""

    arch: str
    cfg: LMConfig
    tokens: int
    experts_per_gpu: int
    world_size: int
    ep_size: int = 1
    batch_size: int | None = None
    update_freq: int = 1
    fp16: bool = False
    zero_sharding: bool = False
    all2all_chunks: int = 1  # --all2all-chunks: each sparse layer's exchanges overlapped with its experts


def _flag_given(flags: Sequence[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def _fairseq_parse(argv: list[str]):
    """fairseq's training parser; its usage dump is replaced by the one error line."""
    from fairseq import options

    parser = options.get_training_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), warnings_off():
            return options.parse_args_and_arch(parser, argv)
    except SystemExit as exc:
        lines = [l for l in err.getvalue().splitlines() if "error:" in l]
        msg = lines[-1].split("error:", 1)[1].strip() if lines else err.getvalue().strip()[-500:]
        raise ValueError(f"fairseq flags: {msg}") from exc


def plugin_archs() -> dict[str, str]:
    """Registered architecture -> model name, for our plugin models."""
    # fairseq's first import brings DeepSpeed, whose logger writes to stdout: keep stdout for our output (--json)
    with warnings_off(), contextlib.redirect_stdout(sys.stderr):
        from fairseq.models import ARCH_MODEL_NAME_REGISTRY

        import fairseq_plugins  # noqa: F401  (registration)
        from fairseq_plugins.config import FAMILIES_BY_MODEL  # our models (the flag table's)

    return {a: m for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m in FAMILIES_BY_MODEL}


def parse_model(arch: str, flags: Sequence[str] = (), *, vocab_size: int = DEFAULT_VOCAB) -> ModelSpec:
    """--arch NAME + fairseq model flags -> the LMConfig training would build (fairseq's own parsing).

    Remembered per (arch, flags, vocab_size): fairseq's parse (argparse, then hydra's compose) takes
    seconds and gives the same frozen ModelSpec every time; the benchmarks and the FLOP matches ask
    for the same models again and again."""
    return _parse_model(arch, tuple(flags), vocab_size)


@functools.lru_cache(maxsize=512)
def _parse_model(arch: str, flags: tuple[str, ...], vocab_size: int) -> ModelSpec:
    archs = plugin_archs()
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.models import MODEL_REGISTRY

    if arch not in archs:
        raise ValueError(f"--arch {arch!r} is not one of our registered architectures: {', '.join(sorted(archs))}")
    if vocab_size < 2:
        raise ValueError(f"--vocab-size {vocab_size} is invalid: it must be at least 2")
    plugins = str(Path(sys.modules["fairseq_plugins"].__file__).parent)
    with tempfile.TemporaryDirectory() as data, contextlib.redirect_stdout(sys.stderr):
        args = _fairseq_parse([data, "--user-dir", plugins, "--task", "language_modeling", "--arch", arch,
                               "--cpu", *flags])
        with warnings_off():
            cfg = convert_namespace_to_omegaconf(args)
    model_cls = MODEL_REGISTRY[archs[arch]]
    world_given = _flag_given(flags, "--distributed-world-size")
    from fairseq_plugins.config import configured_ep_size, expert_layout, read, to_core_config

    if read(cfg.model, "sparse_layers", default=0) and not world_given:  # gmlp_lm has no sparse layers
        if read(cfg.model, "num_experts") <= 0:
            raise ValueError("--num-experts 0 means one expert per rank: give --num-experts or "
                             "--distributed-world-size")
        # the paper: one expert per GPU
        cfg.distributed_training.distributed_world_size = read(cfg.model, "num_experts")

    core = to_core_config(cfg.model, model_cls.family, vocab_size, PADDING_IDX)
    tokens = int(cfg.task.tokens_per_sample)
    if tokens > core.seq_len:
        raise ValueError(f"--tokens-per-sample {tokens} exceeds the model's sequence length {core.seq_len}")
    world = int(cfg.distributed_training.distributed_world_size)
    if core.sparse_layers:
        layout = expert_layout(core.num_experts, world, configured_ep_size(cfg.model))
        ep_size, experts_per_gpu = layout.ep_size, layout.num_local_experts
    else:
        world = world if world_given else 1
        ep_size, experts_per_gpu = 1, 0
    batch = cfg.dataset.batch_size
    return ModelSpec(arch, core, tokens, experts_per_gpu, world, ep_size=ep_size,
                     batch_size=int(batch) if batch else None, update_freq=int(cfg.optimization.update_freq[0]),
                     fp16=bool(cfg.common.fp16 or cfg.common.memory_efficient_fp16 or cfg.common.bf16),
                     zero_sharding=str(cfg.distributed_training.zero_sharding) == "os",
                     all2all_chunks=int(read(cfg.model, "all2all_chunks", default=1) or 1))


def count_spec(spec: ModelSpec, method: str = "fvcore") -> Count:
    return count(spec.cfg, spec.tokens, experts_per_gpu=max(spec.experts_per_gpu, 1), method=method)


def fairseq_flags(cfg: LMConfig) -> str:
    """Flags for fairseq-train that build `cfg` (widths, layers, experts, routing, placement, dropout,
    activation, mixer, capacities, seeds): derived from the plugin's flag table, the same table
    `to_core_config` reads (fairseq_plugins/config.py); `parse_model` of them gives `cfg` back
    (tests/test_config_table.py)."""
    with warnings_off(), contextlib.redirect_stdout(sys.stderr):  # fairseq's import (DeepSpeed logs to stdout)
        from fairseq_plugins.config import fairseq_flags as table_flags

    return table_flags(cfg)
