"""fairseq registrations: smlp_lm, gmlp_lm, moe_transformer_lm and their size presets.

The models are thin wrappers around `smlp.lm.LanguageModel`; the fairseq-specific parts are
the expert-parallel contract (expert parameters marked, legacy_ddp required, gradient scale), the
expert-data-parallel process groups (--expert-parallel-size, smlp/expert_data_parallel.py) and checkpoint
loading across world sizes.
"""
from __future__ import annotations

import contextlib
import logging
import sys

import torch
from fairseq.models import FairseqIncrementalDecoder, FairseqLanguageModel, register_model, register_model_architecture

from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
from smlp.expert_data_parallel import ExpertDataLayout, average_expert_gradients, expert_data_groups
from smlp.lm import LanguageModel
from smlp.process_group import collective_device, rank_and_world
from smlp.routing.registry import TOKEN_ROUTERS

from . import step_profiler
from .checkpoints import adapt_expert_state
from .config import (
    FAMILIES_BY_MODEL,
    GMLPConfig,
    MoETransformerConfig,
    PluginSettings,
    SMLPConfig,
    expert_layout,
    plugin_settings,
    to_core_config,
)
from .errors import FlagError

logger = logging.getLogger(__name__)

EXPERT_PARALLEL_DDP_BACKENDS = ("legacy_ddp", "no_c10d")
OUR_CRITERION = "smlp_lm_loss"


class CoreLMDecoder(FairseqIncrementalDecoder):
    """Wraps the framework-free LanguageModel as a fairseq decoder.

    Incremental (fairseq's SequenceGenerator: fairseq-interactive, fairseq-generate, the hub's
    sample): with `incremental_state`, only the positions after those already decoded go through
    the core, with its decoding cache (smlp/decoding_cache.py) kept under one key of incremental_state;
    beam search and finished sentences reorder it. Without it (training, validation, scoring) the
    whole sequence runs through the core's full forward, as before.

    `with decoder.routing_prefix(fill):` (generation only, fairseq_plugins/generation_patches.py)
    puts the tokens `fill` before every row the core reads, without showing them to fairseq:
    partial prediction's routing-prefix fill for prompts shorter than the prefix.
    """

    STATE_KEY = "decoding"

    def __init__(self, dictionary, core: LanguageModel):
        super().__init__(dictionary)
        self.core = core
        self._fill = None  # LongTensor (f,) while a routing-prefix fill is active
        self._warned_recompute = False

    @contextlib.contextmanager
    def routing_prefix(self, fill):
        previous, self._fill = self._fill, (torch.as_tensor(list(fill), dtype=torch.long) if len(fill) else None)
        try:
            yield
        finally:
            self._fill = previous

    def _with_fill(self, tokens):
        fill = self._fill.to(tokens.device)
        return torch.cat([fill.expand(tokens.shape[0], -1), tokens], dim=1)

    def forward(self, prev_output_tokens, src_lengths=None, incremental_state=None, **unused):
        f = 0 if self._fill is None else self._fill.numel()
        if incremental_state is not None and not self.core.supports_cached_decoding:
            if not self._warned_recompute:
                logger.warning("this model has no cached decoding step (%s): generation recomputes the whole prefix "
                               "at every position", self.core.no_cached_decoding)
                self._warned_recompute = True
            incremental_state = None
        if incremental_state is None:
            tokens = prev_output_tokens if not f else self._with_fill(prev_output_tokens)
            return self.core(tokens)[:, f:], {"attn": [None], "inner_states": None}
        state = self.get_incremental_state(incremental_state, self.STATE_KEY)
        if state is None:  # the first call of a generation: the fill (if any) goes first, once
            state = {"cache": self.core.new_cache(), "offset": f}
            self.set_incremental_state(incremental_state, self.STATE_KEY, state)
        cache, offset = state["cache"], state["offset"]
        seen, N = max(cache.length - offset, 0), prev_output_tokens.shape[1]
        if N <= seen and prev_output_tokens.shape[0]:
            raise ValueError(f"incremental decoding: {N} positions given but {seen} are decoded already; "
                             f"feed the whole prefix, one position (or more) longer at each call")
        new = prev_output_tokens[:, seen:]
        if cache.length == 0 and offset:
            return self.core(self._with_fill(new), cache=cache)[:, offset:], {"attn": [None], "inner_states": None}
        return self.core(new, cache=cache), {"attn": [None], "inner_states": None}

    def reorder_incremental_state(self, incremental_state, new_order):
        state = self.get_incremental_state(incremental_state, self.STATE_KEY)
        if state is not None:
            state["cache"].reorder(new_order)

    def max_positions(self):
        return self.core.cfg.seq_len


def runtime_layout(core_cfg, settings: PluginSettings, world: int) -> ExpertDataLayout:
    """The layout on the ranks actually running. --expert-parallel-size binds the world it was set for;
    a checkpoint evaluated on another number of ranks gets the default group size min(W, E)."""
    ep_size = settings.ep_size if settings.world_size in (None, world) else 0
    return expert_layout(core_cfg.num_experts, world, ep_size)


def smoe_layout(core_cfg, settings: PluginSettings, layout: ExpertDataLayout | None) -> tuple[str, str]:
    """(the sMoE's layout, why): --smoe-parallel, or for auto the step-time model's choice for this run
    (smlp.steptime.choose_smoe_layout: the ranks, the expert-parallel group, the batch, the
    update frequency and the collectives' device)."""
    if core_cfg.family != "smlp" or not core_cfg.sparse_layers or layout is None:
        return "expert", "one process holds every expert" if layout is None else "no sMoE"
    check_smoe_layout(core_cfg, settings, layout)
    if settings.smoe_parallel != "auto":
        return settings.smoe_parallel, f"--smoe-parallel {settings.smoe_parallel}"
    from smlp.steptime import choose_smoe_layout

    choice, why = choose_smoe_layout(core_cfg, world_size=layout.world_size, ep_size=layout.ep_size,
                                     batch_size=settings.batch_size, tokens=core_cfg.seq_len,
                                     update_freq=settings.update_freq, device_type=collective_device().type)
    return choice, f"--smoe-parallel auto: {why}"


def check_smoe_layout(core_cfg, settings: PluginSettings, layout: ExpertDataLayout) -> None:
    """FlagError for --smoe-parallel expert where the expert-parallel group does not divide the sMoE's experts
    (--smoe-experts; auto then replicates them, smlp.steptime.choose_smoe_layout)."""
    N, G = core_cfg.smoe_num_experts, layout.ep_size
    if core_cfg.family == "smlp" and N and settings.smoe_parallel == "expert" and N % G:
        raise FlagError(f"--smoe-parallel expert spreads the sMoE's {N} experts (--smoe-experts {core_cfg.smoe_experts}"
                        f") over expert-parallel groups of {G} ranks, which must divide them: give --smoe-experts a "
                        f"multiple of {G}, or --smoe-parallel replicated (every rank holds all {N})")


# why each of fairseq's other DDP backends cannot train experts (each rank holds different ones)
_DDP_BACKEND_REASONS = {
    "c10d": "would average expert weights across ranks (each rank holds different experts)",
    "pytorch_ddp": "would average expert weights across ranks (each rank holds different experts)",
    "fully_sharded": "shards every parameter over the ranks as if all of them held the same weights: fairscale's "
                     "FSDP would flatten each rank's own experts in with the shared weights and average their "
                     "gradients across ranks (to shard the optimizer state, add --zero-sharding os instead)",
    "slowmo": "averages every parameter across ranks every few updates (SlowMo), each rank's own experts included",
}


def check_ddp_backend(settings: PluginSettings) -> None:
    """FlagError, with the backend's own reason, unless --ddp-backend leaves expert parameters out of the
    gradient exchange (legacy_ddp, no_c10d)."""
    if settings.ddp_backend not in EXPERT_PARALLEL_DDP_BACKENDS:
        reason = _DDP_BACKEND_REASONS.get(settings.ddp_backend, "would exchange expert parameters across ranks")
        raise FlagError(f"--ddp-backend {settings.ddp_backend} {reason}; expert-parallel training needs "
                        f"--ddp-backend legacy_ddp")


def check_model_flags(model_cfg, dictionary_size: int, padding_idx: int = 1) -> None:
    """The checks `build_model` makes of a run's flags, without building the model: what smlp-launch's workers
    run before they join the others (smlp_launch.preflight). FlagError names the flag; nothing for a model
    that is not ours."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    model = ARCH_MODEL_NAME_REGISTRY.get(model_cfg._name, model_cfg._name)
    family = FAMILIES_BY_MODEL.get(model)
    if family is None:
        return
    core_cfg = to_core_config(model_cfg, family, dictionary_size, padding_idx)
    settings = plugin_settings(model_cfg)
    world = settings.world_size or 1
    if core_cfg.sparse_layers and world > 1:
        check_ddp_backend(settings)
        check_smoe_layout(core_cfg, settings, runtime_layout(core_cfg, settings, world))


def make_dispatcher(core_cfg, settings: PluginSettings):
    """(dispatcher, sMoE dispatcher or None, layout, replica group): LocalDispatcher on one process (or when
    each group is one rank holding every expert), otherwise all2all inside this rank's expert-parallel
    group; the sMoE gets its own replicated LocalDispatcher when its layout is "replicated" (`smoe_layout`,
    logged on rank 0)."""
    if not core_cfg.sparse_layers:
        return None, None, None, None
    rank, world = rank_and_world()
    if world == 1:  # the sMoE's own count, if any: LanguageModel derives its dispatcher (with_experts)
        return LocalDispatcher(core_cfg.num_experts), None, None, None
    check_ddp_backend(settings)
    layout = runtime_layout(core_cfg, settings, world)  # clear error when experts do not fit
    ep_group, replica_group = expert_data_groups(layout, rank)
    smoe_dispatcher = None
    if core_cfg.family == "smlp":
        choice, why = smoe_layout(core_cfg, settings, layout)
        N = core_cfg.smoe_num_experts
        if rank == 0:
            logger.info("sMoE experts: %s (%s); tMoE experts: spread over expert-parallel groups of %d (%d sMoE, "
                        "%d tMoE experts per sparse layer)", "replicated on every rank" if choice == "replicated"
                        else f"spread over expert-parallel groups of {layout.ep_size}", why, layout.ep_size, N,
                        core_cfg.num_experts)
        if choice == "replicated":
            smoe_dispatcher = LocalDispatcher(N, replicated=True)
    dispatcher = LocalDispatcher(core_cfg.num_experts) if layout.ep_size == 1 else \
        AllToAllDispatcher(core_cfg.num_experts, ep_group=ep_group, chunks=settings.all2all_chunks)
    return dispatcher, smoe_dispatcher, layout, replica_group


def scale_expert_gradients(model: torch.nn.Module, layout: ExpertDataLayout, replica_group=None) -> None:
    """Make expert gradients follow fairseq's normalization.

    legacy_ddp divides shared gradients by W before summing them over ranks, then the trainer
    multiplies every gradient by W / sample_size. Expert gradients skip that all-reduce: each already
    sums the tokens of its expert-parallel group through the all2all backward, and
    `average_expert_gradients` sums them over the W / G replicas and divides by W, as legacy_ddp
    does for the shared ones.
    """
    average_expert_gradients(model, world_size=layout.world_size, replica_group=replica_group,
                             replicas=layout.replicas)


def criterion_needs(core_cfg) -> list[str]:
    """What only smlp_lm_loss does for this model: the reasons another criterion would train it wrong."""
    needs = []
    router = TOKEN_ROUTERS[core_cfg.moe_router]  # the registry says which routers have an auxiliary loss
    if core_cfg.family == "transformer" and core_cfg.sparse_layers and router.aux_loss is not None:
        needs.append(f"adds the {router.name} routers' load-balancing loss (without it they train unbalanced)")
    if core_cfg.prediction_start:
        needs.append(f"skips the {core_cfg.prediction_start} routing-prefix positions that partial prediction "
                     f"does not predict")
    return needs


def warn_if_criterion_ignores_routing(core_cfg, criterion_name) -> str | None:
    """A clear warning when the configured criterion cannot train this model as the paper does."""
    needs = criterion_needs(core_cfg)
    if criterion_name is None or str(criterion_name) == OUR_CRITERION or not needs:
        return None
    message = (f"--criterion {criterion_name} ignores what this model needs: {OUR_CRITERION} "
               f"{'; it also '.join(needs)}. Train with --criterion {OUR_CRITERION}.")
    logger.warning(message)
    return message


def _fairseq_eval_lm_frame():
    """The frame of `fairseq_cli.eval_lm` on the call stack (its `main`, whose local `cfg` holds
    --context-window), or None when another program builds the model.

    Why the stack: fairseq 0.12 tells a model nothing about the program that builds it.
    `build_model(cfg, task)` receives the checkpoint's model config and a task built from the
    program's --task flags, the same under fairseq-eval-lm, fairseq-validate and fairseq-generate;
    --context-window reaches no hook before the model is built (`prepare_for_inference_(cfg)` gets
    the whole config later, but fairseq-generate and fairseq-interactive call it with the same
    config type). Refusing there, before any data is read, needs the program's own frame. Tested:
    tests/test_patches.py (the walk), tests/test_bad_inputs.py and tests/test_fairseq.py (the
    refusals through fairseq-eval-lm itself)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "fairseq_cli.eval_lm":
            return frame
        frame = frame.f_back
    return None


def _inside_fairseq_eval_lm() -> bool:
    return _fairseq_eval_lm_frame() is not None


def refuse_eval_lm_longer_than_model(core_cfg, task) -> None:
    """fairseq-eval-lm drops (ignore_invalid_inputs=True) every block longer than the model accepts and
    reports the loss over the rest, with only a warning: a figure over part of the data. Refuse it."""
    frame = _fairseq_eval_lm_frame()
    if frame is None:
        return
    task_cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
    block = getattr(task_cfg, "tokens_per_sample", None)
    eval_cfg = frame.f_locals.get("cfg")
    context = getattr(getattr(eval_cfg, "eval_lm", None), "context_window", 0) or 0
    if block is None or block + context + bool(getattr(task_cfg, "add_bos_token", False)) <= core_cfg.seq_len:
        return
    raise FlagError(
        f"fairseq-eval-lm would feed blocks of {block + context} tokens (--tokens-per-sample"
        f"{' + --context-window' if context else ''}) to a model whose spatial weights cover {core_cfg.seq_len} "
        f"positions; it would skip every longer block and report the loss over the rest. Use --tokens-per-sample "
        f"{core_cfg.seq_len} or less (with --context-window N, --tokens-per-sample {core_cfg.seq_len} at most)"
    )


def refuse_eval_lm_on_partial_prediction(core_cfg) -> None:
    """fairseq-eval-lm scores every position; partial prediction predicts only those after the prefix."""
    P = core_cfg.prediction_start
    if not P or not _inside_fairseq_eval_lm():
        return
    raise FlagError(
        f"fairseq-eval-lm scores every position, but this partial-prediction sMLP routes on the first {P} positions "
        f"of each sequence and predicts only positions >= {P} (sMLP sec. 3.2.2); its figure would include "
        f"{P} positions per sequence that training never predicts. Report the loss over predicted positions with "
        f"the training criterion instead: fairseq-validate DATA --user-dir fairseq_plugins --path CHECKPOINT "
        f"--task language_modeling --tokens-per-sample {core_cfg.seq_len} --valid-subset test --batch-size 8"
    )


class _CoreLanguageModel(FairseqLanguageModel):
    family = ""

    @classmethod
    def build_model(cls, cfg, task):
        dictionary = task.target_dictionary
        core_cfg = to_core_config(cfg, cls.family, len(dictionary), dictionary.pad())
        settings = plugin_settings(cfg)
        refuse_eval_lm_on_partial_prediction(core_cfg)
        refuse_eval_lm_longer_than_model(core_cfg, task)
        if rank_and_world()[0] == 0:
            warn_if_criterion_ignores_routing(core_cfg, settings.criterion_name)
        dispatcher, smoe_dispatcher, layout, replica_group = make_dispatcher(core_cfg, settings)
        model = cls(CoreLMDecoder(dictionary, LanguageModel(core_cfg, dispatcher, smoe_dispatcher=smoe_dispatcher)))
        step_profiler.install(model.decoder)  # only when SMLP_PROFILE_STEPS is set (smlp-bench)
        rank, world = rank_and_world()
        if layout is not None:
            scale_expert_gradients(model, layout, replica_group)
        # which experts this rank holds: position expert_rank of an expert-parallel group of expert_world
        model.expert_rank, model.expert_world = (layout.ep_rank(rank), layout.ep_size) if layout else (0, 1)
        model.expert_layout = layout
        return model

    @property
    def core(self) -> LanguageModel:
        return self.decoder.core

    def max_positions(self):
        return self.core.cfg.seq_len

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        state_dict = adapt_expert_state(self, state_dict, self.expert_rank, self.expert_world)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


@register_model("smlp_lm", dataclass=SMLPConfig)
class SMLPLanguageModel(_CoreLanguageModel):
    """Sparse all-MLP (Yu et al. 2022): N1 gMLP blocks + N2 sparse blocks (sMoE + tMoE)."""

    family = "smlp"


@register_model("gmlp_lm", dataclass=GMLPConfig)
class GMLPLanguageModel(_CoreLanguageModel):
    """Dense causal gMLP (Liu et al. 2021), optionally with a multi-head SGU."""

    family = "gmlp"


@register_model("moe_transformer_lm", dataclass=MoETransformerConfig)
class MoETransformerLanguageModel(_CoreLanguageModel):
    """Transformer decoder with sparse FFN layers: GShard, Switch, Base Layers or HASH routing."""

    family = "transformer"


# ---------------------------------------------------------------- size presets
# Architecture functions only set sizes (as fairseq's transformer_lm_gpt); flags given on the
# command line win. Paper presets: sMLP Tables 5, 8, 9, 10 (D, F, layer counts, 32 experts).


def _preset(args, **values):
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


@register_model_architecture("smlp_lm", "smlp_lm_paper_small")
def smlp_lm_paper_small(args):
    """Table 8/9: D=1024, F=4096, 28 dense + 12 sparse blocks, 32 experts, T=1024."""
    _preset(args, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_layers=28, sparse_layers=12,
            num_experts=32, dropout=0.1)


@register_model_architecture("smlp_lm", "smlp_lm_paper_large")
def smlp_lm_paper_large(args):
    """Table 10: D=2048, F=8192, 22 dense + 8 sparse blocks (the counts that reproduce its parameters)."""
    _preset(args, decoder_embed_dim=2048, decoder_ffn_embed_dim=8192, decoder_layers=22, sparse_layers=8,
            num_experts=32, dropout=0.1)


@register_model_architecture("smlp_lm", "smlp_lm_tiny")
def smlp_lm_tiny(args):
    """Trains in minutes on 2 CPU ranks."""
    _preset(args, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=2, sparse_layers=2, dropout=0.0)


@register_model_architecture("gmlp_lm", "gmlp_lm_paper_small")
def gmlp_lm_paper_small(args):
    """Table 9: 41 gMLP layers, D=1024, F=4096, one head (FLOP-matched to the small sMLP)."""
    _preset(args, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_layers=41, sgu_heads=1, dropout=0.1)


@register_model_architecture("gmlp_lm", "gmlp_lm_tiny")
def gmlp_lm_tiny(args):
    _preset(args, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=4, dropout=0.0)


# The SGU of the dense gMLP blocks replaced (smlp/hypermixer.py, smlp/ninformer.py). Paper-small presets: D=1024,
# F=4096, T=1024 and the layer counts `smlp-flops --arch smlp_lm_paper_small --match` picks (HyperMixer
# within 1.5% of the small sMLP's FLOPs, NiNformer the nearest at -2.2%); tests/test_token_mixers.py
# re-derives them.


@register_model_architecture("gmlp_lm", "hypermixer_lm_paper_small")
def hypermixer_lm_paper_small(args):
    """Causal HyperMixer (tied), d' = 2048, FLOP-matched to smlp_lm_paper_small."""
    _preset(args, token_mixer="hypermixer", decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
            decoder_layers=15, dropout=0.1)


@register_model_architecture("gmlp_lm", "hypermixer_untied_lm_paper_small")
def hypermixer_untied_lm_paper_small(args):
    """Causal HyperMixer with untied hypernetworks, FLOP-matched to smlp_lm_paper_small."""
    _preset(args, token_mixer="hypermixer", hypermixer_untied=True, decoder_embed_dim=1024,
            decoder_ffn_embed_dim=4096, decoder_layers=11, dropout=0.1)


@register_model_architecture("gmlp_lm", "ninformer_lm_paper_small")
def ninformer_lm_paper_small(args):
    """NiNformer gating units (causal token MLP), FLOP-matched to smlp_lm_paper_small."""
    _preset(args, token_mixer="ninformer", decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
            decoder_layers=18, dropout=0.1)


@register_model_architecture("gmlp_lm", "hypermixer_lm_tiny")
def hypermixer_lm_tiny(args):
    """Causal HyperMixer (tied) in gMLP blocks; trains in minutes on 2 CPU ranks."""
    _preset(args, token_mixer="hypermixer", decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=4,
            dropout=0.0)


@register_model_architecture("gmlp_lm", "ninformer_lm_tiny")
def ninformer_lm_tiny(args):
    """NiNformer gating units in gMLP blocks; trains in minutes on 2 CPU ranks."""
    _preset(args, token_mixer="ninformer", decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=4,
            dropout=0.0)


@register_model_architecture("moe_transformer_lm", "transformer_lm_paper_small")
def transformer_lm_paper_small(args):
    """Table 9: dense Transformer, 24 layers, D=1024, F=4096, 16 heads."""
    _preset(args, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_layers=24, sparse_layers=0,
            decoder_attention_heads=16, dropout=0.1)


@register_model_architecture("moe_transformer_lm", "base_layers_lm_paper_small")
def base_layers_lm_paper_small(args):
    """Table 8: Base Layers, 12 dense + 12 sparse, D=1024, F=4096, 16 heads, 32 experts."""
    _preset(args, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_layers=12, sparse_layers=12,
            decoder_attention_heads=16, moe_router="base", num_experts=32, dropout=0.1)


def _large_moe(args, router, dense, sparse, experts=32):
    _preset(args, decoder_embed_dim=2048, decoder_ffn_embed_dim=8192, decoder_layers=dense, sparse_layers=sparse,
            decoder_attention_heads=16, moe_router=router, num_experts=experts, dropout=0.1)


@register_model_architecture("moe_transformer_lm", "gshard_lm_paper_large")
def gshard_lm_paper_large(args):
    """Table 5: GShard, 7 sparse + 7 dense, 64 experts."""
    _large_moe(args, "gshard", 7, 7, experts=64)


@register_model_architecture("moe_transformer_lm", "switch_lm_paper_large")
def switch_lm_paper_large(args):
    """Table 5: Switch Transformer, 7 sparse + 7 dense, 32 experts."""
    _large_moe(args, "switch", 7, 7)


@register_model_architecture("moe_transformer_lm", "switch_enlarge_lm_paper_large")
def switch_enlarge_lm_paper_large(args):
    """Table 5: Switch Transformer - Enlarge, 8 sparse + 8 dense."""
    _large_moe(args, "switch", 8, 8)


@register_model_architecture("moe_transformer_lm", "base_layers_lm_paper_large")
def base_layers_lm_paper_large(args):
    """Table 5/10: Base Layers, 8 sparse + 8 dense."""
    _large_moe(args, "base", 8, 8)


@register_model_architecture("moe_transformer_lm", "hash_layers_lm_paper_large")
def hash_layers_lm_paper_large(args):
    """Table 5: HASH Layers, 8 sparse + 8 dense."""
    _large_moe(args, "hash", 8, 8)


def _tiny_moe(args, router):
    _preset(args, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=2, sparse_layers=2,
            decoder_attention_heads=4, moe_router=router, dropout=0.0)


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_tiny")
def moe_transformer_lm_tiny(args):
    _tiny_moe(args, getattr(args, "moe_router", None) or "switch")


@register_model_architecture("moe_transformer_lm", "gshard_lm_tiny")
def gshard_lm_tiny(args):
    _tiny_moe(args, "gshard")


@register_model_architecture("moe_transformer_lm", "switch_lm_tiny")
def switch_lm_tiny(args):
    _tiny_moe(args, "switch")


@register_model_architecture("moe_transformer_lm", "base_layers_lm_tiny")
def base_layers_lm_tiny(args):
    _tiny_moe(args, "base")


@register_model_architecture("moe_transformer_lm", "hash_layers_lm_tiny")
def hash_layers_lm_tiny(args):
    _tiny_moe(args, "hash")


@register_model_architecture("moe_transformer_lm", "transformer_lm_tiny")
def transformer_lm_tiny(args):
    _preset(args, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=3, sparse_layers=0,
            decoder_attention_heads=4, dropout=0.0)
