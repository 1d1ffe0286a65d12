"""fairseq model flags: ONE table from every fairseq model field to the core `LMConfig` field it sets.

`FIELDS` lists each field of the three model configurations (smlp_lm, gmlp_lm, moe_transformer_lm)
once: its name (the flag is --name-with-dashes), type, default, help, the valid values (taken from
the core's constants: the router registry smlp/routing/registry.py, smlp/lm.py PLACEMENTS, ...), the core
field it sets and how its value converts each way. Everything else is derived from it:

    SMLPConfig, GMLPConfig, MoETransformerConfig  the FairseqDataclasses fairseq registers
    to_core_config(cfg, family, ...)               fairseq config -> LMConfig (the one translation)
    plugin_settings(cfg)                           the fields the plugin reads itself (layout, checks)
    fairseq_flags(core)                            LMConfig -> the fairseq-train flags that build it
                                                   (the benchmark's commands, the FLOPs calculator)

This is the only module that reads fields of a fairseq model config (`read`); models.py gets what it
needs from `to_core_config` and `plugin_settings`. Flags use fairseq's names where fairseq has one
(--decoder-embed-dim, --decoder-layers, ...). tests/test_config_table.py checks that every field is
consumed and that flags -> config -> flags round-trips for every architecture and option.
"""

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from omegaconf import II

from smlp.config import ACTIVATIONS
from smlp.expert_data_parallel import ExpertDataLayout, expert_parallel_layout, valid_ep_sizes
from smlp.gmlp import TOKEN_MIXERS
from smlp.lm import PLACEMENTS, LMConfig, attention_heads_for
from smlp.routing.gates import GSHARD_AUX_LOSSES
from smlp.routing.prices import BALANCED_EVAL_ROUTINGS
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS

from .errors import FlagError

logger = logging.getLogger(__name__)

FAMILIES_BY_MODEL = {"smlp_lm": "smlp", "gmlp_lm": "gmlp", "moe_transformer_lm": "transformer"}
SMOE_PARALLEL_CHOICES = ("auto", "expert", "replicated")  # --smoe-parallel (models.smoe_layout)
ALL, MIXER, SPARSE = ("smlp", "gmlp", "transformer"), ("smlp", "gmlp"), ("smlp", "transformer")
# LMConfig fields that no flag sets: the model class gives the family, the dictionary the other two.
CORE_FIELDS_NOT_FLAGS = ("family", "vocab_size", "padding_idx")


@dataclass(frozen=True)
class Field:
    """One fairseq model field.

    core:       the LMConfig field it sets; None for a field the plugin reads itself (`plugin_settings`)
                or that only fairseq reads (`base_layers`)
    families:   the model families whose configuration has it
    choices:    the valid values (from the core's constants); fairseq's parser refuses the others
    to_core:    (value, read) -> the core value; `read(name)` reads another field of the same config
                (--seq-len 0 means --tokens-per-sample); it raises ValueError for a bad value
    from_core:  core config -> the value that gives the core field back (fairseq_flags)
    always:     fairseq_flags writes it even at its default (widths, layers, the router: commands that
                read as the model); other fields only when they differ from the default
    sparse:     only meaningful with sparse layers: fairseq_flags leaves it out of dense models
    flag:       the flag fairseq_flags writes, when it is not --name (a task flag)
    """

    name: str
    type: Any
    default: Any
    help: str
    core: str | None
    families: tuple[str, ...]
    choices: tuple[str, ...] | None = None
    to_core: Callable[[Any, Callable[[str], Any]], Any] | None = None
    from_core: Callable[[LMConfig], Any] | None = None
    always: bool = False
    sparse: bool = False
    flag: str | None = None

    @property
    def interpolated(self) -> bool:
        """The value comes from another part of fairseq's config (the task, the trainer)."""
        return isinstance(self.default, str) and self.default.startswith("${")

    def core_value(self, value, read):
        if self.to_core is not None:
            return self.to_core(value, read)
        return str(value) if self.choices is not None else value

    def fairseq_value(self, core: LMConfig):
        return self.from_core(core) if self.from_core is not None else getattr(core, self.core)


def sequence_tokens(read) -> int:
    """Positions of the task's sequences: --tokens-per-sample, plus one with --add-bos-token (fairseq's
    language_modeling task puts a beginning-of-sentence token before every block)."""
    return read("tokens_per_sample") + (1 if read("add_bos_token") else 0)


def _seq_len(value, read):
    return value if value > 0 else sequence_tokens(read)


def _base_shuffle(value, read):
    if value not in (0, 1):
        raise ValueError(f"--base-shuffle {value} is invalid: use 1 (shuffle, the default) or 0")
    return bool(value)


def _eval_capacity_factor(value, read):
    if value < 0:
        raise ValueError(f"--eval-capacity-factor {value} is invalid: give a factor > 0 (e.g. 1.0 or 2.0), or 0 "
                         f"for no capacity limit at evaluation")
    return value or None


def _attention_heads(value, read):
    if value < 0:
        raise ValueError(f"--decoder-attention-heads {value} is invalid: give a number of heads that divides "
                         f"--decoder-embed-dim, or 0 for D / 64")
    return value or attention_heads_for(read("decoder_embed_dim"))


def _num_experts(value, read):
    return resolve_num_experts(value, read("distributed_world_size"), int(read("expert_parallel_size") or 0))


FIELDS: tuple[Field, ...] = (
    Field("decoder_embed_dim", int, 512, "model width D", "d_model", ALL, always=True),
    Field("decoder_ffn_embed_dim", int, 2048, "channel-projection / FFN width F", "d_ffn", ALL, always=True),
    Field("decoder_layers", int, 6, "number of dense blocks N1", "dense_layers", ALL, always=True),
    Field("dropout", float, 0.1, "dropout probability", "dropout", ALL, always=True),
    Field("activation_fn", str, "gelu", "activation of FFN experts", "activation", ALL, choices=ACTIVATIONS),
    # The task's block length: the sequence length unless --seq-len says otherwise. fairseq_flags writes
    # --tokens-per-sample T (a task flag) and leaves --seq-len at 0.
    Field("tokens_per_sample", int, II("task.tokens_per_sample"), "", "seq_len", ALL, always=True,
          to_core=lambda value, read: _seq_len(read("seq_len"), read), flag="--tokens-per-sample"),
    Field("seq_len", int, 0, "longest sequence the model accepts (size T of the spatial weights); "
          "0 means --tokens-per-sample (plus one with --add-bos-token)", "seq_len", ALL, to_core=_seq_len,
          from_core=lambda core: 0),
    # the task's beginning-of-sentence token makes every sequence one position longer: the spatial weights
    # are sized for it (`sequence_tokens`)
    Field("add_bos_token", bool, II("task.add_bos_token"), "", None, ALL),
    # transformer_lm's flag, in many fairseq recipes: every model here ties its input embedding and output
    # projection (smlp/lm.py), so the flag is accepted and changes nothing; nothing reads it.
    Field("share_decoder_input_output_embed", bool, False, "accepted for fairseq's transformer_lm recipes: the "
          "input embedding and the output projection are always tied here", None, ALL),
    # Read from the trainer's config so the model can refuse a wrong setup before training starts.
    Field("ddp_backend", str, II("distributed_training.ddp_backend"), "", None, ALL),
    Field("distributed_world_size", int, II("distributed_training.distributed_world_size"), "", None, ALL),
    Field("checkpoint_activations", bool, False, "activation checkpointing (fairseq's flag): each block's "
          "activations are recomputed in backward instead of kept; a sparse layer recomputes its experts between "
          "its exchanges, never an all2all or a routing (smlp/recompute.py). The same gradients, less memory, "
          "about one more forward of compute", "checkpoint_activations", ALL),
    # the token mixer of the dense gMLP blocks (smlp/gmlp.py TOKEN_MIXERS)
    Field("token_mixer", str, "sgu", "token mixer of the dense gMLP blocks: sgu (gMLP's spatial gating unit), "
          "hypermixer (causal HyperMixing) or ninformer (NiNformer's gating unit, causal token MLP)",
          "token_mixer", MIXER, choices=TOKEN_MIXERS),
    Field("mixer_dim", int, 0, "HyperMixer hidden width d' / NiNformer channel-MLP hidden width; 0 means half of "
          "--decoder-ffn-embed-dim", "mixer_dim", MIXER),
    Field("hypermixer_untied", bool, False, "HyperMixer with two hypernetworks (W1, W2) instead of one tied",
          "hypermixer_tied", MIXER, to_core=lambda value, read: not value,
          from_core=lambda core: not core.hypermixer_tied),
    # the sparse layers (smlp_lm, moe_transformer_lm)
    Field("sparse_layers", int, 2, "number of sparse (expert) layers N2", "sparse_layers", SPARSE, always=True),
    Field("num_experts", int, 0, "experts per sparse layer; 0 means one per rank of an expert-parallel group "
          "(--expert-parallel-size, else the world size)", "num_experts", SPARSE, to_core=_num_experts,
          always=True, sparse=True),
    Field("smoe_experts", int, 0,
          "experts of each sMoE (sMLP's sparse token mixing); 0 (the default) means --num-experts, the paper's tie. "
          "Deterministic routing gives each sMoE expert D / N channels (32 in the paper's models); the tMoE keeps "
          "--num-experts. Expert-parallel where the group size divides N, else replicated (--smoe-parallel)",
          "smoe_experts", ("smlp",), sparse=True),
    Field("expert_parallel_size", int, 0,
          "G, ranks of one expert-parallel group: the experts are spread over G ranks (all2all inside the group) "
          "and replicated W/G times, the replicas' expert gradients averaged (expert-data parallelism, as "
          "DeepSpeed's ep_size); must divide the world size and --num-experts; 0 means min(world size, "
          "--num-experts)", None, SPARSE),
    Field("all2all_chunks", int, 1,
          "each sparse layer's rows in this many chunks, one chunk's all2all overlapped with another's experts "
          "(async collectives: gloo runs them on its own thread, NCCL on its own stream); 1: no overlap. Measured "
          "on 2 CPU gloo ranks (loaded) it did not pay (docs/benchmarks.md); the step-time model predicts "
          "what it hides on GPUs (smlp-flops --step-time ... --all2all-chunks 2)", None, SPARSE),
    Field("sparse_placement", str, "auto",
          "where the sparse blocks sit: paper (sec. 4.1, spread evenly over the depth), every_other (GShard, "
          "Switch), fairseq (fairseq's --base-layers insertion); auto = the router's default "
          "(smlp/routing/registry.py: every_other for gshard/switch, paper otherwise)", "sparse_placement", SPARSE,
          choices=("auto", *PLACEMENTS), sparse=True),
    Field("base_shuffle", int, 1, "Base Layers tMoE: in training, shuffle tokens to random ranks before the "
          "balanced assignment (fairseq's --base-shuffle); 0 turns it off", "base_shuffle", SPARSE,
          to_core=_base_shuffle, from_core=lambda core: int(core.base_shuffle), sparse=True),
    Field("balanced_eval_routing", str, "priced",
          "how the balanced routers (Base Layers, the sMLP tMoE, sMLP-partial's sMoE) route at evaluation and in "
          "generation: priced (each token to argmax of its score minus the expert's price, the balanced "
          "assignment's prices averaged over training: per token, causal, and as training assigns on average) or "
          "greedy (argmax of its score, fairseq's BaseLayer); training always assigns with exact balance",
          "balanced_eval_routing", SPARSE, choices=BALANCED_EVAL_ROUTINGS, sparse=True),
    # fairseq writes per-rank checkpoints and loads them on every rank when cfg.model.base_layers > 0
    # (fairseq.trainer, fairseq.distributed.utils): it must equal the number of sparse layers. Only fairseq reads it.
    Field("base_layers", int, II("model.sparse_layers"), "", None, SPARSE),
    # Read so the model can warn when the criterion would ignore its auxiliary loss or prefix.
    Field("criterion_name", str, II("criterion._name"), "", None, SPARSE),
    # smlp_lm
    Field("smoe_routing", str, "deterministic",
          "sMoE routing: deterministic (hidden chunk i -> expert i) or partial (router over the first "
          "--prefix-fraction positions; loss on the rest); leaky-full-sequence is the paper's Appendix B router "
          "over all positions, which SEES THE FUTURE (not causal; only to reproduce Figure 7)",
          "smoe_routing", ("smlp",), choices=tuple(SMOE_ROUTINGS), always=True),
    Field("prefix_fraction", float, 0.2, "routing prefix of partial prediction", "prefix_fraction", ("smlp",)),
    Field("smoe_parallel", str, "auto",
          "where the sMoE's experts live: expert (spread over the expert-parallel group, the rows travel by "
          "all2all, as the paper), replicated (every rank holds all E spatial weights and mixes its own sequences: "
          "no sMoE all2all; their gradients join the data-parallel all-reduce), or auto (the layout the step-time "
          "model predicts faster for this run's ranks, batch and update frequency where it is clear-cut, "
          "expert otherwise; logged at start). The tMoE stays expert-parallel", None, ("smlp",),
          choices=SMOE_PARALLEL_CHOICES),
    # Read so that --smoe-parallel auto can weigh the sMoE's all2all (per micro-batch) against the replicated
    # weights' all-reduce (per update). Only the plugin reads them.
    Field("batch_size", Any, II("dataset.batch_size"), "", None, ("smlp",)),
    Field("max_tokens", Any, II("dataset.max_tokens"), "", None, ("smlp",)),
    Field("update_freq", Any, II("optimization.update_freq"), "", None, ("smlp",)),
    # gmlp_lm
    Field("sgu_heads", int, 1, "heads of the spatial gating unit (multi-head SGU)", "heads", ("gmlp",),
          always=True),
    Field("token_routed_experts", int, 0,
          "gMLP extended to token-level routing (sMLP Appendix A, Table 7): every block sends each token to one "
          "of N gMLP experts, whose SGU mixes only the earlier tokens routed to it; 0 = dense gMLP. The experts "
          "are replicated on every rank (no all2all)", "token_routed_experts", ("gmlp",)),
    # moe_transformer_lm
    Field("decoder_attention_heads", int, 0, "attention heads; 0 (the default): D / 64, heads of the paper's width "
          "(16 at D=1024, 2 at D=128)", "heads", ("transformer",), always=True,
          to_core=lambda value, read: _attention_heads(value, read)),
    Field("moe_router", str, "switch", "token router of the sparse FFN layers: " + ", ".join(
          f"{r.name} ({r.title}, top-{r.top_k})" for r in TOKEN_ROUTERS.values()) + " (smlp/routing/registry.py)",
          "moe_router", ("transformer",), choices=tuple(TOKEN_ROUTERS), always=True, sparse=True),
    Field("capacity_factor", float, 1.0, "capacity factor in training: Switch's expert capacity is cf x S/E "
          "tokens, GShard's cf x 2S/E (1: the paper's 2S/E)", "capacity_factor", ("transformer",), sparse=True),
    Field("eval_capacity_factor", float, 0.0, "capacity factor at evaluation (Switch, GShard); 0: no capacity "
          "limit, every token routed on its own scores (causal per position)", "eval_capacity_factor",
          ("transformer",), to_core=_eval_capacity_factor, from_core=lambda core: core.eval_capacity_factor or 0.0,
          sparse=True),
    Field("gshard_aux_loss", str, "normalized", "GShard load-balancing loss: normalized = E^2 * mean(m_e c_e), 1 "
          "when balanced like Switch's (fairseq MoE branch, DeepSpeed); fairscale = mean(m_e c_e)",
          "gshard_aux_loss", ("transformer",), choices=GSHARD_AUX_LOSSES, sparse=True),
    Field("hash_seed", int, 0, "seed of the HASH layers' token-id table", "hash_seed", ("transformer",),
          sparse=True),
)
FIELDS_BY_NAME = {f.name: f for f in FIELDS}


def family_fields(family: str) -> tuple[Field, ...]:
    return tuple(f for f in FIELDS if family in f.families)


def _dataclass(cls_name: str, family: str) -> type:
    """The FairseqDataclass of one model family, field by field from the table."""
    specs = []
    for f in family_fields(family):
        ftype = ChoiceEnum(list(f.choices)) if f.choices is not None else f.type
        meta = {"help": f.help} if f.help else {}
        specs.append((f.name, ftype, dataclasses.field(default=f.default, metadata=meta)))
    return dataclasses.make_dataclass(cls_name, specs, bases=(FairseqDataclass,), namespace={"__module__": __name__})


SMLPConfig = _dataclass("SMLPConfig", "smlp")
GMLPConfig = _dataclass("GMLPConfig", "gmlp")
MoETransformerConfig = _dataclass("MoETransformerConfig", "transformer")


_TABLE_DEFAULT = object()


def read(cfg, name: str, default=_TABLE_DEFAULT):
    """The value of table field `name` in a fairseq model config. When the config lacks it: `default`,
    else the table's default (a config saved before the field existed), or None for an interpolation
    with nothing to resolve against."""
    f = FIELDS_BY_NAME[name]  # KeyError: a field the table does not know
    try:  # a config object (omegaconf, argparse) or a mapping (a checkpoint's saved configuration)
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name)
    except Exception:  # omegaconf: missing key, or an interpolated node (e.g. criterion) absent here
        value = None
    if value is not None:
        return value
    if default is not _TABLE_DEFAULT:
        return default
    return None if f.interpolated else f.default


@dataclass(frozen=True)
class PluginSettings:
    """The fields the plugin reads itself (fairseq_plugins/models.py), not the core."""

    ddp_backend: str
    world_size: int | None  # the world --expert-parallel-size was set for (None: not recorded)
    ep_size: int
    criterion_name: str | None
    smoe_parallel: str = "auto"  # --smoe-parallel (sMLP); "auto" where the config has no such field
    all2all_chunks: int = 1  # --all2all-chunks
    batch_size: int | None = None  # sequences per rank and micro-batch (--batch-size, else --max-tokens / T)
    update_freq: int = 1  # micro-batches per update (--update-freq, its first value)


def _sequences_per_batch(cfg) -> int | None:
    batch, max_tokens = read(cfg, "batch_size", default=None), read(cfg, "max_tokens", default=None)
    if batch:
        return int(batch)
    tokens = read(cfg, "tokens_per_sample", default=None)
    return int(max_tokens) // int(tokens) if max_tokens and tokens and int(max_tokens) >= int(tokens) else None


def plugin_settings(cfg) -> PluginSettings:
    criterion, world = read(cfg, "criterion_name"), read(cfg, "distributed_world_size")
    update_freq = read(cfg, "update_freq", default=None)
    if update_freq is not None and not isinstance(update_freq, int):  # fairseq's is a list (one per epoch)
        update_freq = list(update_freq)[0] if len(update_freq) else 1
    return PluginSettings(ddp_backend=str(read(cfg, "ddp_backend") or "legacy_ddp"),
                          world_size=None if world is None else int(world),
                          ep_size=configured_ep_size(cfg),
                          criterion_name=None if criterion is None else str(criterion),
                          smoe_parallel=str(read(cfg, "smoe_parallel", default=None) or "auto"),
                          batch_size=_sequences_per_batch(cfg), update_freq=int(update_freq or 1),
                          all2all_chunks=_all2all_chunks(read(cfg, "all2all_chunks")))


def _all2all_chunks(value) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"--all2all-chunks {value} is invalid: give 1 (no overlap) or more chunks")
    return value


def resolve_num_experts(requested: int, world_size: int, ep_size: int = 0) -> int:
    """--num-experts 0: one expert per rank of an expert-parallel group (G if given, else W)."""
    if requested < 0:
        raise ValueError(f"--num-experts {requested} is invalid: give a positive number, or 0 for one per rank")
    return requested if requested > 0 else max(1, ep_size or world_size)


def configured_ep_size(cfg) -> int:
    """--expert-parallel-size of a model config (0 in configs written before the flag existed)."""
    return int(read(cfg, "expert_parallel_size") or 0)


def expert_layout(num_experts: int, world_size: int, ep_size: int = 0) -> ExpertDataLayout:
    """The expert-data-parallel layout of E experts on W ranks with --expert-parallel-size (0: min(W, E));
    ValueError naming the valid group sizes when it does not fit."""
    world = max(int(world_size), 1)
    ep_size = int(ep_size or 0)
    if ep_size < 0:
        raise ValueError(f"--expert-parallel-size {ep_size} is invalid: give a positive group size or 0 for "
                         f"min(world size, --num-experts)")
    valid = ", ".join(map(str, valid_ep_sizes(world, num_experts))) or "none: change --num-experts"
    if ep_size > num_experts:
        raise ValueError(f"--expert-parallel-size {ep_size} exceeds --num-experts {num_experts}: a group holds at "
                         f"most one rank per expert; valid sizes for {num_experts} experts on {world} ranks: {valid}")
    if ep_size and world % ep_size:
        raise ValueError(f"--expert-parallel-size {ep_size} does not divide the world size {world}: the expert-"
                         f"parallel groups must tile the ranks; valid sizes for {num_experts} experts on {world} "
                         f"ranks: {valid}")
    G = ep_size or min(world, num_experts)
    try:
        expert_parallel_layout(num_experts, G)
    except ValueError as exc:  # e.g. "num_experts=3 cannot be spread evenly over 2 ranks"
        raise ValueError(f"{exc}; --expert-parallel-size values that fit {num_experts} experts on {world} ranks: "
                         f"{valid}") from None
    if world % G:
        raise ValueError(f"the default expert-parallel group size min(world size {world}, --num-experts "
                         f"{num_experts}) = {G} does not divide the world size; set --expert-parallel-size to one "
                         f"of: {valid}")
    return ExpertDataLayout(world_size=world, ep_size=G, num_experts=num_experts)


def to_core_config(cfg, family: str, vocab_size: int, padding_idx: int) -> LMConfig:
    """Translate a fairseq model config into the core LMConfig (the only such translation): every
    table field of the family with a core field, converted by the table. A value the model cannot take is
    refused with a FlagError naming the flag (`flag_wording`), not the core's field."""
    def _read(name):
        return read(cfg, name)

    values = {}
    try:
        for f in family_fields(family):
            if f.core is not None:
                values[f.core] = f.core_value(_read(f.name), _read)
        tokens = sequence_tokens(_read)
        _check_flags(family, values, tokens, bos=bool(_read("add_bos_token")))
        if values.get("sparse_layers"):  # experts must fit the ranks: refuse a bad layout before any weight is built
            expert_layout(values["num_experts"], _read("distributed_world_size"), configured_ep_size(cfg))
        core = LMConfig(family=family, vocab_size=vocab_size, padding_idx=padding_idx, **values)
        if family == "smlp":
            _explain_prefix(core, tokens)
    except FlagError:
        raise
    except ValueError as exc:
        raise FlagError(flag_wording(str(exc), family)) from None
    return core


def _check_flags(family: str, values: dict, tokens: int, bos: bool = False) -> None:
    """The mistakes whose core message would name a field of an inner block (the SGU's `dim`), said in flags.
    `tokens`: the positions of a sequence (`sequence_tokens`), one more than --tokens-per-sample with `bos`."""
    T = values["seq_len"]
    if tokens > T:
        given = (f"--tokens-per-sample {tokens - 1} with --add-bos-token ({tokens} positions)" if bos else
                 f"--tokens-per-sample {tokens}")
        raise FlagError(f"{given} exceeds the model's sequence length {T} (--seq-len, the size of its spatial "
                        f"weights): give --tokens-per-sample {T - int(bos)} or less, or (training a new model) raise "
                        f"--seq-len to {tokens}")
    dense, sparse = values["dense_layers"], values.get("sparse_layers", 0)
    if dense < 0 or sparse < 0 or dense + sparse == 0:
        layers = f"--decoder-layers {dense}" + (f" and --sparse-layers {sparse}" if "sparse_layers" in values else "")
        raise FlagError(f"{layers}: the model needs at least one layer and no count can be negative")
    if family in ("smlp", "gmlp") and values["d_ffn"] % 2:
        raise FlagError(f"--decoder-ffn-embed-dim {values['d_ffn']} must be even: the gMLP block splits it into a "
                        f"gate half and a value half (e.g. --decoder-ffn-embed-dim {values['d_ffn'] + 1})")


# core names that the core's messages print as `name=value`, when no table field of that name sets them
_INNER_NAMES = {"routing": "smoe_routing", "router": "moe_router", "placement": "sparse_placement"}


def flag_wording(message: str, family: str) -> str:
    """A core ValueError's message with each `field=value` of a field a flag sets written as `--flag value`
    (`num_experts=3 must divide ...` -> `--num-experts 3 must divide ...`), the inner blocks' widths named by
    the flags they come from."""

    message = re.sub(r"\(dim=(\d+), split=True\)", r"(half of --decoder-ffn-embed-dim \1)", message)
    message = re.sub(r"\(dim=(\d+), split=False\)", r"(--decoder-embed-dim \1)", message)
    flags = {}
    for f in family_fields(family):
        if f.core is not None and f.core not in flags and f.name != "tokens_per_sample":
            flags[f.core] = f.flag or "--" + f.name.replace("_", "-")
    for inner, core in _INNER_NAMES.items():
        if core in flags:
            flags.setdefault(inner, flags[core])
    flags.setdefault("d_model", "--decoder-embed-dim")

    def swap(m):
        name, value = m.group(1), m.group(3)
        return f"{flags[name]} {value}" if name in flags else m.group(0)

    return re.sub(r"\b([a-z_]+)=('?)([^\s,;:)']+)\2", swap, message)


def fairseq_flags(core: LMConfig) -> str:
    """The fairseq-train flags that build `core` (the reverse of `to_core_config`, derived from the
    same table): --arch of the family's model, then each field that is `always` written or differs
    from its fairseq default; sparse-only fields are left out of dense models. `to_core_config` of
    the parsed flags gives `core` back (tests/test_config_table.py)."""
    model = next(m for m, fam in FAMILIES_BY_MODEL.items() if fam == core.family)
    out = [f"--arch {model}"]
    for f in family_fields(core.family):
        if f.core is None or (f.sparse and not core.sparse_layers):
            continue
        value = f.fairseq_value(core)
        if not f.always and value == f.default:
            continue
        flag = f.flag or "--" + f.name.replace("_", "-")
        if f.type is bool:
            out.append(flag if value else "")  # store_true: the flag alone, at default False nothing
        else:
            out.append(f"{flag} {value}")
    return " ".join(o for o in out if o)


def _explain_prefix(core: LMConfig, tokens_per_sample: int) -> None:
    """Partial prediction routes on the first P = round(prefix_fraction * T) positions, T = --seq-len.

    The prefix is a fixed number of positions because the router W_r is a P x E weight. When the
    training sequences are shorter than T, P is a larger share of each of them than
    --prefix-fraction says; say so, with the flags that restore the paper's 20%.
    """
    P = core.prediction_start
    if P and P >= tokens_per_sample:
        raise ValueError(
            f"partial prediction routes on the first {P} positions (--prefix-fraction {core.prefix_fraction} of "
            f"--seq-len {core.seq_len}) but the sequences have only --tokens-per-sample {tokens_per_sample} tokens: "
            f"no position would be predicted; use --seq-len {tokens_per_sample}")
    if not P or tokens_per_sample == core.seq_len:
        return
    logger.warning(
        "partial prediction routes on the first %d positions (--prefix-fraction %g of --seq-len %d), which is "
        "%.0f%% of the %d-token training sequences (--tokens-per-sample); only positions >= %d are predicted. "
        "For a %g share of the training sequences, use --seq-len %d or --prefix-fraction %.4g.",
        P, core.prefix_fraction, core.seq_len, 100.0 * P / tokens_per_sample, tokens_per_sample, P,
        core.prefix_fraction, tokens_per_sample, core.prefix_fraction * tokens_per_sample / core.seq_len)
