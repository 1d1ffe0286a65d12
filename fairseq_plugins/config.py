"""fairseq model configurations and their one translation into the core `LMConfig`.

One FairseqDataclass per model; `to_core_config` is the only place that reads fairseq fields.
Flags use fairseq's names where fairseq has one (--decoder-embed-dim, --decoder-layers, ...).
"""

import logging
from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from omegaconf import II

from smlp.config import GSHARD_AUX_LOSSES, SMOE_ROUTING_CHOICES as CORE_SMOE_ROUTINGS
from smlp.dispatch import expert_parallel_layout
from smlp.lm import PLACEMENTS, LMConfig
from smlp.parallel import ExpertDataLayout, valid_ep_sizes

logger = logging.getLogger(__name__)

SMOE_ROUTING_CHOICES = ChoiceEnum(list(CORE_SMOE_ROUTINGS))
MOE_ROUTER_CHOICES = ChoiceEnum(["gshard", "switch", "base", "hash"])
ACTIVATION_CHOICES = ChoiceEnum(["gelu", "relu"])
PLACEMENT_CHOICES = ChoiceEnum(["auto", *PLACEMENTS])
GSHARD_AUX_LOSS_CHOICES = ChoiceEnum(list(GSHARD_AUX_LOSSES))
TOKEN_MIXER_CHOICES = ChoiceEnum(["sgu", "hypermixer", "ninformer"])


@dataclass
class _LMBase(FairseqDataclass):
    decoder_embed_dim: int = field(default=512, metadata={"help": "model width D"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "channel-projection / FFN width F"})
    decoder_layers: int = field(default=6, metadata={"help": "number of dense blocks N1"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    activation_fn: ACTIVATION_CHOICES = field(default="gelu", metadata={"help": "activation of FFN experts"})
    tokens_per_sample: int = II("task.tokens_per_sample")
    seq_len: int = field(
        default=0,
        metadata={"help": "longest sequence the model accepts (size T of the spatial weights); "
                          "0 means --tokens-per-sample"},
    )
    # Read from the trainer's config so the model can refuse a wrong setup before training starts.
    ddp_backend: str = II("distributed_training.ddp_backend")
    distributed_world_size: int = II("distributed_training.distributed_world_size")


@dataclass
class _TokenMixerFlags(FairseqDataclass):
    """The token mixer of the dense gMLP blocks (smlp_lm, gmlp_lm); smlp/token_mixers.py."""

    token_mixer: TOKEN_MIXER_CHOICES = field(
        default="sgu",
        metadata={"help": "token mixer of the dense gMLP blocks: sgu (gMLP's spatial gating unit), hypermixer "
                          "(causal HyperMixing) or ninformer (NiNformer's gating unit, causal token MLP)"},
    )
    mixer_dim: int = field(
        default=0, metadata={"help": "HyperMixer hidden width d' / NiNformer channel-MLP hidden width; "
                                     "0 means half of --decoder-ffn-embed-dim"})
    hypermixer_untied: bool = field(
        default=False, metadata={"help": "HyperMixer with two hypernetworks (W1, W2) instead of one tied"})


@dataclass
class _SparseBase(_LMBase):
    sparse_layers: int = field(default=2, metadata={"help": "number of sparse (expert) layers N2"})
    num_experts: int = field(
        default=0, metadata={"help": "experts per sparse layer; 0 means one per rank of an expert-parallel group "
                                     "(--expert-parallel-size, else the world size)"}
    )
    expert_parallel_size: int = field(
        default=0,
        metadata={"help": "G, ranks of one expert-parallel group: the experts are spread over G ranks (all2all "
                          "inside the group) and replicated W/G times, the replicas' expert gradients averaged "
                          "(expert-data parallelism, as DeepSpeed's ep_size); must divide the world size and "
                          "--num-experts; 0 means min(world size, --num-experts)"},
    )
    sparse_placement: PLACEMENT_CHOICES = field(
        default="auto",
        metadata={"help": "where the sparse blocks sit: paper (sec. 4.1, spread evenly over the depth), "
                          "every_other (GShard, Switch), fairseq (fairseq's --base-layers insertion); "
                          "auto = every_other for gshard/switch, paper otherwise"},
    )
    base_shuffle: int = field(
        default=1,
        metadata={"help": "Base Layers tMoE: in training, shuffle tokens to random ranks before the balanced "
                          "assignment (fairseq's --base-shuffle); 0 turns it off"},
    )
    # fairseq writes per-rank checkpoints and loads them on every rank when cfg.model.base_layers > 0
    # (trainer.py, distributed/utils.py): it must equal the number of sparse layers.
    base_layers: int = II("model.sparse_layers")
    # Read so the model can warn when the criterion would ignore its auxiliary loss or prefix.
    criterion_name: str = II("criterion._name")


@dataclass
class SMLPConfig(_SparseBase, _TokenMixerFlags):
    smoe_routing: SMOE_ROUTING_CHOICES = field(
        default="deterministic",
        metadata={"help": "sMoE routing: deterministic (hidden chunk i -> expert i) or partial "
                          "(router over the first --prefix-fraction positions; loss on the rest); "
                          "leaky-full-sequence is the paper's Appendix B router over all positions, which SEES "
                          "THE FUTURE (not causal; only to reproduce Figure 7)"},
    )
    prefix_fraction: float = field(default=0.2, metadata={"help": "routing prefix of partial prediction"})


@dataclass
class GMLPConfig(_LMBase, _TokenMixerFlags):
    sgu_heads: int = field(default=1, metadata={"help": "heads of the spatial gating unit (multi-head SGU)"})
    token_routed_experts: int = field(
        default=0,
        metadata={"help": "gMLP extended to token-level routing (sMLP Appendix A, Table 7): every block sends each "
                          "token to one of N gMLP experts, whose SGU mixes only the earlier tokens routed to it; "
                          "0 = dense gMLP. The experts are replicated on every rank (no all2all)"})


@dataclass
class MoETransformerConfig(_SparseBase):
    decoder_attention_heads: int = field(default=8, metadata={"help": "attention heads"})
    moe_router: MOE_ROUTER_CHOICES = field(
        default="switch",
        metadata={"help": "token router of the sparse FFN layers: gshard (top-2), switch (top-1), "
                          "base (balanced assignment), hash (fixed token-id table)"},
    )
    capacity_factor: float = field(
        default=1.0, metadata={"help": "capacity factor in training: Switch's expert capacity is cf x S/E tokens, "
                                       "GShard's cf x 2S/E (1: the paper's 2S/E)"})
    eval_capacity_factor: float = field(
        default=0.0, metadata={"help": "capacity factor at evaluation (Switch, GShard); 0: no capacity limit, every "
                                       "token routed on its own scores (causal per position)"})
    gshard_aux_loss: GSHARD_AUX_LOSS_CHOICES = field(
        default="normalized",
        metadata={"help": "GShard load-balancing loss: normalized = E^2 * mean(m_e c_e), 1 when balanced like "
                          "Switch's (fairseq MoE branch, DeepSpeed); fairscale = mean(m_e c_e)"},
    )
    hash_seed: int = field(default=0, metadata={"help": "seed of the HASH layers' token-id table"})


def resolve_num_experts(requested: int, world_size: int, ep_size: int = 0) -> int:
    """--num-experts 0: one expert per rank of an expert-parallel group (G if given, else W)."""
    if requested < 0:
        raise ValueError(f"--num-experts {requested} is invalid: give a positive number, or 0 for one per rank")
    return requested if requested > 0 else max(1, ep_size or world_size)


def configured_ep_size(cfg) -> int:
    """--expert-parallel-size of a model config (0 in configs written before the flag existed)."""
    return int(getattr(cfg, "expert_parallel_size", 0) or 0)


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
    """Translate a fairseq model config into the core LMConfig (the only such translation)."""
    seq_len = cfg.seq_len if cfg.seq_len > 0 else cfg.tokens_per_sample
    if cfg.tokens_per_sample > seq_len:
        raise ValueError(
            f"--tokens-per-sample {cfg.tokens_per_sample} exceeds the model's sequence length {seq_len} "
            f"(--seq-len, the size of the spatial weights): lower --tokens-per-sample or raise --seq-len"
        )
    common = dict(
        family=family, vocab_size=vocab_size, padding_idx=padding_idx,
        d_model=cfg.decoder_embed_dim, d_ffn=cfg.decoder_ffn_embed_dim, seq_len=seq_len,
        dense_layers=cfg.decoder_layers, dropout=cfg.dropout, activation=str(cfg.activation_fn),
    )
    if family in ("gmlp", "smlp"):  # configs saved before the token-mixer flags lack them
        common.update(token_mixer=str(getattr(cfg, "token_mixer", "sgu")), mixer_dim=getattr(cfg, "mixer_dim", 0),
                      hypermixer_tied=not getattr(cfg, "hypermixer_untied", False))
    if family == "gmlp":
        return LMConfig(**common, heads=cfg.sgu_heads, token_routed_experts=getattr(cfg, "token_routed_experts", 0))
    num_experts = resolve_num_experts(cfg.num_experts, cfg.distributed_world_size, configured_ep_size(cfg))
    if cfg.sparse_layers:  # experts must fit the ranks: refuse a bad layout before any weight is built
        expert_layout(num_experts, cfg.distributed_world_size, configured_ep_size(cfg))
    if cfg.base_shuffle not in (0, 1):
        raise ValueError(f"--base-shuffle {cfg.base_shuffle} is invalid: use 1 (shuffle, the default) or 0")
    sparse = dict(sparse_layers=cfg.sparse_layers, num_experts=num_experts,
                  sparse_placement=str(cfg.sparse_placement), base_shuffle=bool(cfg.base_shuffle))
    if family == "smlp":
        core = LMConfig(**common, **sparse, smoe_routing=str(cfg.smoe_routing), prefix_fraction=cfg.prefix_fraction)
        _explain_prefix(core, cfg.tokens_per_sample)
        return core
    eval_cf = getattr(cfg, "eval_capacity_factor", 0.0)  # configs saved before the flag existed lack it
    if eval_cf < 0:
        raise ValueError(f"--eval-capacity-factor {eval_cf} is invalid: give a factor > 0 (e.g. 1.0 or 2.0), or 0 "
                         f"for no capacity limit at evaluation")
    return LMConfig(**common, **sparse, heads=cfg.decoder_attention_heads, moe_router=str(cfg.moe_router),
                    capacity_factor=cfg.capacity_factor, eval_capacity_factor=eval_cf or None,
                    hash_seed=cfg.hash_seed, gshard_aux_loss=str(cfg.gshard_aux_loss))


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
