"""A model given as fairseq flags: `--arch NAME` + model and training flags -> the core config
training would build (`parse_model`, through fairseq's own parser and our registered presets, then
`fairseq_plugins.config.to_core_config`), and back (`fairseq_flags`: the fairseq-train flags that
build a core config; the benchmark and the FLOP matches print them).

Used by the FLOPs calculator (eval/flops.py), the step-time model (eval/steptime.py) and the
benchmarks. fairseq is imported on first use, not at import.
"""
from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from smlp.lm import LMConfig

from .flop_count import Count, count, warnings_off

__all__ = ["DEFAULT_VOCAB", "ModelSpec", "count_spec", "fairseq_flags", "parse_model", "plugin_archs"]

DEFAULT_VOCAB = 51200  # reproduces Table 9's non-expert parameters (41 gMLP blocks + 51200 x 1024 embedding)
PADDING_IDX = 1  # fairseq's dictionary puts <pad> at 1
PLUGIN_MODELS = ("smlp_lm", "gmlp_lm", "moe_transformer_lm")


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
    import fairseq_plugins  # noqa: F401  (registration)
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return {a: m for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m in PLUGIN_MODELS}


def parse_model(arch: str, flags: Sequence[str] = (), *, vocab_size: int = DEFAULT_VOCAB) -> ModelSpec:
    """--arch NAME + fairseq model flags -> the LMConfig training would build (fairseq's own parsing)."""
    # fairseq imports DeepSpeed, whose logger writes to stdout: keep stdout for our output (--json).
    with warnings_off(), contextlib.redirect_stdout(sys.stderr):
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
    sparse = getattr(cfg.model, "sparse_layers", 0)
    if sparse and not world_given:
        if cfg.model.num_experts <= 0:
            raise ValueError("--num-experts 0 means one expert per rank: give --num-experts or "
                             "--distributed-world-size")
        cfg.distributed_training.distributed_world_size = cfg.model.num_experts  # the paper: one expert per GPU
    from fairseq_plugins.config import to_core_config

    core = to_core_config(cfg.model, model_cls.family, vocab_size, PADDING_IDX)
    tokens = int(cfg.task.tokens_per_sample)
    if tokens > core.seq_len:
        raise ValueError(f"--tokens-per-sample {tokens} exceeds the model's sequence length {core.seq_len}")
    world = int(cfg.distributed_training.distributed_world_size)
    if core.sparse_layers:
        from fairseq_plugins.config import configured_ep_size, expert_layout

        layout = expert_layout(core.num_experts, world, configured_ep_size(cfg.model))
        ep_size, experts_per_gpu = layout.ep_size, layout.num_local_experts
    else:
        world = world if world_given else 1
        ep_size, experts_per_gpu = 1, 0
    batch = cfg.dataset.batch_size
    return ModelSpec(arch, core, tokens, experts_per_gpu, world, ep_size=ep_size,
                     batch_size=int(batch) if batch else None, update_freq=int(cfg.optimization.update_freq[0]),
                     fp16=bool(cfg.common.fp16 or cfg.common.memory_efficient_fp16 or cfg.common.bf16),
                     zero_sharding=str(cfg.distributed_training.zero_sharding) == "os")


def count_spec(spec: ModelSpec, method: str = "fvcore") -> Count:
    return count(spec.cfg, spec.tokens, experts_per_gpu=max(spec.experts_per_gpu, 1), method=method)



def _mixer_flags(cfg: LMConfig) -> str:
    if cfg.token_mixer == "sgu":
        return ""
    flags = f" --token-mixer {cfg.token_mixer}" + (f" --mixer-dim {cfg.mixer_dim}" if cfg.mixer_dim else "")
    return flags + ("" if cfg.hypermixer_tied or cfg.token_mixer != "hypermixer" else " --hypermixer-untied")


def _if_not_default(cfg: LMConfig, pairs: Sequence[tuple[str, str]]) -> str:
    """` --flag value` for each core field whose value differs from LMConfig's default."""
    defaults = LMConfig.__dataclass_fields__
    out = ""
    for name, flag in pairs:
        value = getattr(cfg, name)
        if value != defaults[name].default:
            out += f" {flag} {int(value) if isinstance(value, bool) else value}"
    return out


def fairseq_flags(cfg: LMConfig) -> str:
    """Flags for fairseq-train that build `cfg`: every field of the core config reaches the command
    (widths, layers, experts, routing, placement, dropout, activation, mixer); `parse_model` of
    them gives `cfg` back (tested). Fields at LMConfig's default are left out where the fairseq
    default is the same, so the common commands stay short; dropout is always given (fairseq's
    default is 0.1, the core's 0)."""
    base = (f"--decoder-embed-dim {cfg.d_model} --decoder-ffn-embed-dim {cfg.d_ffn} "
            f"--decoder-layers {cfg.dense_layers} --tokens-per-sample {cfg.seq_len} --dropout {cfg.dropout}")
    base += _if_not_default(cfg, [("activation", "--activation-fn")])
    if cfg.family == "gmlp":
        return (f"--arch gmlp_lm {base} --sgu-heads {cfg.heads}{_mixer_flags(cfg)}"
                f"{_if_not_default(cfg, [('token_routed_experts', '--token-routed-experts')])}")
    sparse = _if_not_default(cfg, [("sparse_placement", "--sparse-placement"), ("base_shuffle", "--base-shuffle")])
    if cfg.family == "smlp":
        return (f"--arch smlp_lm {base} --sparse-layers {cfg.sparse_layers} --num-experts {cfg.num_experts} "
                f"--smoe-routing {cfg.smoe_routing}{_mixer_flags(cfg)}"
                f"{_if_not_default(cfg, [('prefix_fraction', '--prefix-fraction')])}{sparse}")
    flags = (f"--arch moe_transformer_lm {base} --decoder-attention-heads {cfg.heads} "
             f"--sparse-layers {cfg.sparse_layers}")
    if cfg.sparse_layers:
        flags += f" --num-experts {cfg.num_experts} --moe-router {cfg.moe_router}" + sparse + _if_not_default(
            cfg, [("capacity_factor", "--capacity-factor"), ("gshard_aux_loss", "--gshard-aux-loss"),
                  ("hash_seed", "--hash-seed")])
    return flags
