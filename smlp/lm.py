"""Language models: sMLP, dense gMLP and (MoE) Transformer, and their one config `LMConfig`.

    smlp         N1 dense gMLP blocks + N2 sparse blocks (sMoE + tMoE)
    gmlp         N1 dense gMLP blocks; with token_routed_experts, gMLP with token-level routing
                 (sMLP Appendix A, token_routed.py)
    transformer  N1 dense + N2 sparse Transformer blocks (attention + a tMoE in the FFN's place)

A sparse Transformer block keeps its attention for every router: that reading reproduces the
paper's Base Layers figures (Table 10's 642.6M non-expert parameters and Table 5's 2.0T FLOPs;
without attention they would be 508M and 1.66T). `layer_plan` places the sparse blocks, and
`model(tokens_Bk, cache=model.new_cache())` decodes incrementally (decoding_cache.py).

Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .config import (
    ACTIVATIONS,
    GMLPConfig,
    SparseBlockConfig,
    TMoEConfig,
    TokenRoutedGMLPConfig,
    _choice,
    _positive,
    _probability,
)
from .decoding_cache import DecodingCache
from .dispatch import LocalDispatcher
from .flop_forms import flag_set
from .gmlp import TOKEN_MIXERS, GMLPBlock
from .hypermixer import HyperMixerConfig, HyperMixingUnit
from .moe import SMoE, SparseBlock, TMoE
from .ninformer import NiNformerConfig, NiNformerGatingUnit
from .routing.prices import BALANCED_EVAL_ROUTINGS
from .routing.registry import LEAKY_SMOE_ROUTING, SMOE_ROUTINGS, TOKEN_ROUTERS
from .spatial import check_length
from .token_routed import TokenRoutedGMLPBlock
from .transformer import TransformerBlock, sinusoidal_positions

__all__ = ["FAMILIES", "HEAD_DIM", "PLACEMENTS", "LMConfig", "LanguageModel", "attention_heads_for", "layer_plan",
           "make_token_mixer"]

FAMILIES = ("smlp", "gmlp", "transformer")


PLACEMENTS = ("paper", "every_other", "fairseq")


def layer_plan(num_dense: int, num_sparse: int, placement: str) -> list[str]:
    """Order of 'dense' and 'sparse' layers in the stack.

    paper        sMLP sec. 4.1 (the Base Layers setting): the k-th of N2 sparse blocks at index
                 floor(k (N1 + N2) / (N2 + 1)), spread evenly over the depth.
    every_other  GShard and Switch (sec. 4.1): dense, sparse, dense, sparse, ...
    fairseq      as fairseq's transformer_lm `--base-layers`, inserting into a growing list; it
                 matches `paper` only while N2 is small against N1 (12 + 12: 12 sparse, then 12 dense).
    """
    if num_dense < 0 or num_sparse < 0:
        raise ValueError(f"layer counts must be >= 0, got {num_dense} dense and {num_sparse} sparse")
    if placement == "paper":
        total = num_dense + num_sparse
        sparse_at = {(k * total) // (num_sparse + 1) for k in range(1, num_sparse + 1)}
        return ["sparse" if i in sparse_at else "dense" for i in range(total)]
    if placement == "fairseq":
        layers = ["dense"] * num_dense
        for i in range(num_sparse):
            layers.insert(((i + 1) * num_dense) // (num_sparse + 1), "sparse")
        return layers
    if placement == "every_other":
        if num_sparse > num_dense:
            raise ValueError(
                f"every-other placement needs at least as many dense as sparse layers, got "
                f"{num_dense} dense and {num_sparse} sparse"
            )
        return ["dense", "sparse"] * num_sparse + ["dense"] * (num_dense - num_sparse)
    raise ValueError(f"placement={placement!r} is unknown: valid values are {', '.join(PLACEMENTS)}")


# the paper's attention head width: 16 heads at D=1024 (Tables 8-10)
HEAD_DIM = 64


def attention_heads_for(d_model: int) -> int:
    """The default number of attention heads at width D: heads of the paper's width, D / HEAD_DIM (2 at
    D=128, 4 at D=256, 16 at D=1024); below it one head; when HEAD_DIM does not divide D, the most heads of
    at least HEAD_DIM channels that divide D."""
    if d_model < 1:
        raise ValueError(f"d_model={d_model} is invalid: a width >= 1")
    return next(h for h in range(max(1, d_model // HEAD_DIM), 0, -1) if d_model % h == 0)


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    family: str
    vocab_size: int
    d_model: int
    d_ffn: int
    seq_len: int
    dense_layers: int
    sparse_layers: int = 0
    heads: int = 1
    num_experts: int = 1
    smoe_experts: int = 0  # smlp only: the sMoE's experts; 0 = num_experts (the paper's tie, SparseBlockConfig)
    smoe_routing: str = "deterministic"
    moe_router: str = "base"
    capacity_factor: float = 1.0
    eval_capacity_factor: float | None = None  # None: no capacity limit at evaluation (routing/gates.py)
    dropout: float = 0.0
    activation: str = "gelu"
    prefix_fraction: float = 0.2
    padding_idx: int = 1
    hash_seed: int = 0
    sparse_placement: str = "auto"   # "auto" = every_other for gshard/switch, paper otherwise
    gshard_aux_loss: str = "normalized"
    base_shuffle: bool = True
    # how balanced routers (Base Layers, sMLP's tMoE, sMLP-partial's sMoE) route at evaluation: priced or greedy
    balanced_eval_routing: str = "priced"
    # token mixer of the dense gMLP blocks (smlp, gmlp): sgu, or hypermixer / ninformer (hypermixer.py, ninformer.py)
    token_mixer: str = "sgu"
    mixer_dim: int = 0  # HyperMixer d' / NiNformer channel-MLP hidden width; 0 = the gated width F/2
    hypermixer_tied: bool = True
    # gmlp only: 0 = dense gMLP blocks; E >= 1 = every block routes each token to one of E gMLP experts
    # (Appendix A, Figure 6 right, Table 7); 1 expert is the dense block
    token_routed_experts: int = 0
    # activation checkpointing (fairseq's --checkpoint-activations): each block's activations recomputed in
    # backward, a sparse layer's between its exchanges (recompute.py); the same outputs and gradients
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        _choice("family", self.family, FAMILIES)
        for name in ("vocab_size", "d_model", "d_ffn", "seq_len", "heads", "num_experts"):
            _positive(name, getattr(self, name))
        if self.dense_layers < 0 or self.sparse_layers < 0 or self.dense_layers + self.sparse_layers == 0:
            raise ValueError(
                f"dense_layers={self.dense_layers}, sparse_layers={self.sparse_layers}: both must be >= 0 "
                f"and the model needs at least one layer"
            )
        _choice("smoe_routing", self.smoe_routing, tuple(SMOE_ROUTINGS))
        _choice("moe_router", self.moe_router, tuple(TOKEN_ROUTERS))
        _choice("balanced_eval_routing", self.balanced_eval_routing, BALANCED_EVAL_ROUTINGS)
        _choice("activation", self.activation, ACTIVATIONS)
        _probability("dropout", self.dropout)
        _choice("sparse_placement", self.sparse_placement, ("auto",) + PLACEMENTS)
        if self.family == "gmlp" and self.sparse_layers:
            raise ValueError(f"sparse_layers={self.sparse_layers}: the dense gMLP family has no sparse layers")
        if self.smoe_experts and self.family != "smlp":
            raise ValueError(f"smoe_experts={self.smoe_experts} sets the experts of sMLP's sMoE: the {self.family} "
                             f"family has none (valid: smlp, or 0)")
        if self.family == "transformer" and self.d_model % self.heads:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")
        if self.family in ("smlp", "gmlp"):
            _ = self.dense_block  # validates widths and heads
        if self.family == "smlp" and self.sparse_layers:
            _ = self.sparse_block
        if self.family == "transformer" and self.sparse_layers:
            _ = self.tmoe
        _ = self.plan  # validates the placement against the layer counts
        self._check_token_mixer()
        self._check_token_routing()
        if not isinstance(self.checkpoint_activations, bool):
            raise ValueError(f"checkpoint_activations={self.checkpoint_activations!r} is invalid: True or False")

    def _check_token_routing(self) -> None:
        E = self.token_routed_experts
        if not isinstance(E, int) or isinstance(E, bool) or E < 0:
            raise ValueError(f"token_routed_experts={E!r} is invalid: 0 (dense gMLP) or a positive number of experts")
        if not E:
            return
        if self.family != "gmlp":
            raise ValueError(f"token_routed_experts={E} routes the tokens of gMLP blocks: the {self.family} family "
                             f"has none (valid: gmlp)")
        if self.heads != 1 or self.token_mixer != "sgu":
            raise ValueError(f"token_routed_experts={E} needs single-head SGU experts (heads=1, token_mixer='sgu'), "
                             f"got heads={self.heads}, token_mixer={self.token_mixer!r}")
        _ = self.token_routed_block  # validates

    @property
    def token_routed_block(self) -> TokenRoutedGMLPConfig:
        return TokenRoutedGMLPConfig(d_model=self.d_model, d_ffn=self.d_ffn, seq_len=self.seq_len,
                                     num_experts=self.token_routed_experts, dropout=self.dropout)

    @property
    def placement(self) -> str:
        """The placement in effect: `sparse_placement`, or the family's default for "auto"."""
        if self.sparse_placement != "auto":
            return self.sparse_placement
        if self.family == "transformer":
            return TOKEN_ROUTERS[self.moe_router].placement  # the router registry (routing/registry.py)
        return "paper"  # sMLP's sparse blocks: sec. 4.1

    @property
    def plan(self) -> list[str]:
        """'dense' / 'sparse' per layer, in stack order."""
        return layer_plan(self.dense_layers, self.sparse_layers, self.placement)

    @property
    def dense_block(self) -> GMLPConfig:
        return GMLPConfig(d_model=self.d_model, d_ffn=self.d_ffn, seq_len=self.seq_len, heads=self.heads,
                          dropout=self.dropout)

    def _check_token_mixer(self) -> None:
        _choice("token_mixer", self.token_mixer, TOKEN_MIXERS)
        if self.token_mixer == "sgu":
            return
        if self.family not in ("smlp", "gmlp"):
            raise ValueError(f"token_mixer={self.token_mixer!r} replaces the SGU of gMLP blocks: the "
                             f"{self.family} family has none (valid: smlp, gmlp)")
        if self.heads != 1:
            raise ValueError(f"heads={self.heads}: heads split the SGU; token_mixer={self.token_mixer!r} needs heads=1")
        if not isinstance(self.mixer_dim, int) or self.mixer_dim < 0:
            raise ValueError(f"mixer_dim={self.mixer_dim!r} is invalid: it must be 0 (the gated width) or positive")
        _ = self.dense_mixer  # validates

    @property
    def dense_mixer(self) -> HyperMixerConfig | NiNformerConfig | None:
        """The token mixer of the dense blocks in the SGU's place (None: the SGU itself)."""
        C = self.d_ffn // 2
        if self.token_mixer == "hypermixer":
            # hypernetworks MLP([C, C, d']) as HyperMixer's Algorithm 1 (d = the mixer's input width)
            return HyperMixerConfig(dim=self.d_ffn, hidden_dim=self.mixer_dim or C, hyper_hidden=C,
                                    tied=self.hypermixer_tied)
        if self.token_mixer == "ninformer":
            return NiNformerConfig(dim=self.d_ffn, seq_len=self.seq_len, channel_hidden=self.mixer_dim or C)
        return None

    @property
    def sparse_block(self) -> SparseBlockConfig:
        return SparseBlockConfig(d_model=self.d_model, d_ffn=self.d_ffn, seq_len=self.seq_len,
                                 num_experts=self.num_experts, smoe_experts=self.smoe_experts,
                                 smoe_routing=self.smoe_routing,
                                 activation=self.activation, dropout=self.dropout,
                                 prefix_fraction=self.prefix_fraction, base_shuffle=self.base_shuffle,
                                 eval_routing=self.balanced_eval_routing)

    @property
    def smoe_num_experts(self) -> int:
        """The sMoE's experts (smoe_experts, else num_experts); 0 for a model without an sMoE."""
        return (self.smoe_experts or self.num_experts) if self.family == "smlp" and self.sparse_layers else 0

    @property
    def tmoe(self) -> TMoEConfig:
        return TMoEConfig(d_model=self.d_model, d_ffn=self.d_ffn, num_experts=self.num_experts,
                          router=self.moe_router, activation=self.activation,
                          capacity_factor=self.capacity_factor, eval_capacity_factor=self.eval_capacity_factor,
                          vocab_size=self.vocab_size,
                          hash_seed=self.hash_seed, gshard_aux_loss=self.gshard_aux_loss,
                          shuffle=self.base_shuffle, eval_routing=self.balanced_eval_routing)

    @property
    def prediction_start(self) -> int:
        """First position whose prediction is trained and scored (partial prediction skips the prefix)."""
        if self.family == "smlp" and self.sparse_layers and self.smoe_routing == "partial":
            return self.sparse_block.smoe.prefix_len
        return 0

    def with_layers(self, dense: int, sparse: int) -> LMConfig:
        return replace(self, dense_layers=dense, sparse_layers=sparse)


def make_token_mixer(cfg: HyperMixerConfig | NiNformerConfig) -> nn.Module:
    """The token mixer a dense gMLP block holds in the SGU's place, from its config."""
    if isinstance(cfg, HyperMixerConfig):
        return HyperMixingUnit(cfg)
    if isinstance(cfg, NiNformerConfig):
        return NiNformerGatingUnit(cfg)
    raise TypeError(f"no token mixer for a config of type {type(cfg).__name__}")


class LanguageModel(nn.Module):
    """Token ids (B, N) -> next-token logits (B, N, V); embeddings tied with the output projection."""

    def __init__(self, cfg: LMConfig, dispatcher=None, *, smoe_dispatcher=None):
        super().__init__()
        self.cfg = cfg
        if cfg.sparse_layers:
            dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(cfg.num_experts)
            if smoe_dispatcher is None and cfg.smoe_num_experts not in (0, cfg.num_experts):
                # the sMoE's own expert count: the same layout over the same group, for its experts
                smoe_dispatcher = dispatcher.with_experts(cfg.smoe_num_experts)
        self.dispatcher = dispatcher
        self.smoe_dispatcher = smoe_dispatcher  # the sMoE's own layout (SparseBlock), or None: `dispatcher`
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.padding_idx)
        nn.init.normal_(self.embed.weight, mean=0.0, std=cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[cfg.padding_idx].zero_()
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.family == "transformer" else 1.0
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(self._build(kind) for kind in cfg.plan)
        self.final_norm = nn.LayerNorm(cfg.d_model)
        for name, module in self.moe_modules():  # errors (e.g. non-finite router scores) name the layer
            module.layer_name = f"{name} ({type(module).__name__})"
        # the tMoEs that shuffle their rows in training (Base Layers): `_prepare_exchanges`
        self._shuffling = [m for _, m in self.moe_modules() if isinstance(m, TMoE) and m.cfg.uses_shuffle]
        for module in self.modules():  # activation checkpointing: the blocks and the tMoEs' experts
            if hasattr(module, "recompute"):
                module.recompute = cfg.checkpoint_activations

    def _build(self, kind: str) -> nn.Module:
        cfg = self.cfg
        if cfg.family == "gmlp" and cfg.token_routed_experts:
            return TokenRoutedGMLPBlock(cfg.token_routed_block)
        if cfg.family in ("smlp", "gmlp"):
            if kind == "dense":
                mixer = cfg.dense_mixer
                return GMLPBlock(cfg.dense_block, None if mixer is None else make_token_mixer(mixer))
            return SparseBlock(cfg.sparse_block, self.dispatcher, self.smoe_dispatcher)
        moe = cfg.tmoe if kind == "sparse" else None
        return TransformerBlock(cfg.d_model, cfg.d_ffn, cfg.heads, dropout=cfg.dropout, activation=cfg.activation,
                                moe=moe, dispatcher=self.dispatcher if moe else None)

    def features(self, tokens_BN: Tensor) -> Tensor:
        B, n = tokens_BN.shape
        check_length(n, self.cfg.seq_len)
        x = self.embed(tokens_BN) * self.embed_scale
        if self.cfg.family == "transformer":
            x = x + sinusoidal_positions(n, self.cfg.d_model, x.device, x.dtype)
        x = self.dropout(x)
        with self.one_forward():
            self._prepare_exchanges(B * n)
            for layer in self.layers:
                x = layer(x, tokens_BN) if isinstance(layer, TransformerBlock) else layer(x)
        return self.final_norm(x)

    def _prepare_exchanges(self, rows: int) -> None:
        """At the start of a forward: every tMoE that shuffles in training gets `rows` rows (the batch's tokens),
        so the shuffle's split sizes begin their exchange now (dispatch.py, `prepare_shuffle`)."""
        shuffling = {id(m.dispatcher): m.dispatcher for m in self._shuffling if m.router.training}
        for dispatcher in shuffling.values():
            dispatcher.prepare_shuffle(rows)

    def one_forward(self) -> contextlib.ExitStack:
        """The dispatchers' `one_forward` blocks (smlp/dispatch.py): every sparse layer of a forward routes the
        same rows (the batch's B x N tokens, or sMoE rows of its sequences), so what their exchanges' split
        sizes depend on is exchanged once per forward instead of once per layer."""
        stack = contextlib.ExitStack()
        for dispatcher in {id(d): d for d in (self.dispatcher, self.smoe_dispatcher) if d is not None}.values():
            stack.enter_context(dispatcher.one_forward())
        return stack

    def forward(self, tokens_BN: Tensor, cache: DecodingCache | None = None) -> Tensor:
        """Logits (B, N, V); with `cache`, of the N new positions that follow the cached ones (`step`)."""
        if cache is not None:
            return self.step(tokens_BN, cache)
        return self.features(tokens_BN) @ self.embed.weight.t()

    def new_cache(self) -> DecodingCache:
        """An empty decoding cache for this model (smlp/decoding_cache.py)."""
        return DecodingCache(len(self.layers))

    @property
    def supports_cached_decoding(self) -> bool:
        """False for the two paper experiments without a per-position step (the token-routed gMLP,
        token_routed_experts, and the non-causal leaky sMoE routing) and for a tMoE with a capacity
        at evaluation (eval_capacity_factor): they generate by recomputing (`no_cached_decoding`)."""
        return self.no_cached_decoding is None

    @property
    def no_cached_decoding(self) -> str | None:
        """Why this model has no cached decoding step, or None."""
        if self.cfg.token_routed_experts:
            return "the token-routed gMLP experiment (token_routed_experts)"
        if not SMOE_ROUTINGS[self.cfg.smoe_routing].causal:
            return f"sMoE routing {LEAKY_SMOE_ROUTING!r}, whose router reads future positions (not causal)"
        capped = [m for _, m in self.moe_modules()
                  if isinstance(m, TMoE) and m.token_router.drops and m.cfg.eval_capacity_factor is not None]
        if capped:
            return (f"a capacity at evaluation (eval_capacity_factor={capped[0].cfg.eval_capacity_factor}, "
                    f"--eval-capacity-factor): whether a token is dropped depends on the other tokens of the batch, "
                    f"later positions of other sequences included, and a decoding step's capacity would be counted "
                    f"over its B x k new tokens instead of the B x N of the full forward, so cached steps could "
                    f"not drop what the full forward drops; evaluate without --eval-capacity-factor for a "
                    f"cached step")
        return None

    def step(self, tokens_Bk: Tensor, cache: DecodingCache) -> Tensor:
        """Cached decoding: the logits of positions cache.length..cache.length+k-1, (B, k, V).

        Equal to the full forward's logits at those positions (eval mode). A batch of B = 0 rows
        only joins the expert exchanges (expert-parallel lockstep): it neither reads nor advances
        the cache's position.
        """
        if self.training:
            raise RuntimeError("cached decoding needs eval mode (model.eval()): training-time routing (balanced "
                               "assignment, capacities, token shuffle) and dropout couple the rows of a batch")
        # whether the model has a step at all is a fact of its layers: read on a cache's first step (a walk
        # over every module, a tenth of a small model's step)
        what = self.no_cached_decoding if cache.length == 0 else None
        if what is not None:
            raise NotImplementedError(f"cached decoding is not available for {what}: generate with the full "
                                      f"forward (generate(..., use_cache=False))")
        if tokens_Bk.dim() != 2 or tokens_Bk.shape[1] < 1:
            raise ValueError(f"cached decoding expects token ids of shape (batch, k >= 1), "
                             f"got {tuple(tokens_Bk.shape)}")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model {len(self.layers)}: "
                             f"make it with this model's new_cache()")
        B, k = tokens_Bk.shape
        if cache.batch_size is not None and B != cache.batch_size:
            raise ValueError(f"the cache holds {cache.batch_size} sequences but {B} were given; "
                             f"use cache.reorder(new_order) to change the batch")
        T = self.cfg.seq_len
        start = cache.length if B else 0
        if B and start + k > T:
            raise ValueError(
                f"cached decoding: {start} cached + {k} new positions = {start + k} exceeds the model's "
                f"{T} positions (seq_len, the size of its spatial weights): at most {T - start} more tokens "
                f"fit; shorten the prompt or the number of tokens to generate")
        x = self.embed(tokens_Bk) * self.embed_scale
        if self.cfg.family == "transformer":
            x = x + sinusoidal_positions(k, self.cfg.d_model, x.device, x.dtype, start=start)
        for layer, state in zip(self.layers, cache.layers):
            if isinstance(layer, TransformerBlock):
                x = layer.step(x, state, start, tokens_Bk)
            else:
                x = layer.step(x, state, start)
        if B:
            cache.length = start + k
        cache.batch_size = B
        return self.final_norm(x) @ self.embed.weight.t()

    def moe_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every sMoE, tMoE and token-routed gMLP block, in layer order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, (SMoE, TMoE, TokenRoutedGMLPBlock))]

    @property
    def has_balanced_routers(self) -> bool:
        """Whether a router of this model assigns with exact balance in training and by its averaged prices at
        evaluation (Base Layers and sMLP's tMoE, sMLP-partial's sMoE: the registry's `balanced`)."""
        return any((isinstance(m, TMoE) and TOKEN_ROUTERS[m.cfg.router].balanced)
                   or (isinstance(m, SMoE) and SMOE_ROUTINGS[m.cfg.routing].balanced) for _, m in self.moe_modules())

    def assigning_as_in_training(self):
        """Within the block, evaluation routes with the training-time rule: every balanced router assigns with
        exact balance over the rows of the batch (without Base Layers' random shuffle of ranks) instead of
        by its prices. The balance couples the tokens of a batch (not causal, docs/training.md); it measures how
        much the change of rule between training and evaluation costs."""
        return flag_set(self, "assign_as_in_training")

    def routing_greedily(self):
        """Within the block, evaluation routes every balanced router's rows greedily (argmax of the scores,
        fairseq's BaseLayer) instead of by its averaged training prices (smlp/routing/prices.py)."""
        return flag_set(self, "route_greedily")

    def aux_loss(self) -> Tensor | None:
        losses = [m.aux_loss for _, m in self.moe_modules() if getattr(m, "aux_loss", None) is not None]
        return torch.stack([l.float() for l in losses]).sum() if losses else None

    def z_loss(self) -> Tensor | None:
        """The routers' z-loss (ST-MoE) summed over the layers whose router has one (Switch, GShard)."""
        losses = [z for z in (getattr(m, "z_loss", None) for _, m in self.moe_modules()) if z is not None]
        return torch.stack([l.float() for l in losses]).sum() if losses else None
