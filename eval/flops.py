"""smlp-flops: FLOPs and parameters of our models, and FLOP-matched layer counts (sMLP section 4.1,
Tables 3, 5, 8-10).

    smlp-flops --arch NAME [fairseq model flags] [--tokens-per-sample T] [--vocab-size V]
               [--distributed-world-size W] [--method fvcore|fvcore-full|analytic] [--json | --markdown]
    smlp-flops --match --arch TARGET [flags] [--match-tolerance 0.015] [--smlp-sparse-layers N] [--json | --markdown]
    smlp-flops --paper-tables [--json | --markdown]
    smlp-flops --step-time --arch NAME [model and training flags] [--cluster v100-dgx1 ...] [--json]
    smlp-flops --table4 top|bottom|both [--cluster ...] [--json | --markdown]   (eval/steptime.py)

`--arch` and the model flags go through fairseq's own parser and our registered presets, then
`fairseq_plugins.config.to_core_config`, so they mean exactly what they mean in training.

FLOPs convention: the paper's figures are 2 x the multiply-adds of the forward pass of ONE
sequence of --tokens-per-sample tokens (fvcore counts 1 per multiply-add, so fvcore on a batch of
two sequences gives the paper's figure). We count with fvcore, whose rules are: a matmul, linear
or einsum counts its multiply-adds (full T x T spatial and attention products, the causal mask
saves nothing); a LayerNorm counts 5 per element; elementwise ops, softmax, GELU, embedding
lookups and bias adds count 0. The output projection onto the vocabulary is included.

Expert parallelism: "per GPU" is the paper's setting, one expert per sparse layer per GPU (world
size = number of experts, unless --distributed-world-size says otherwise; with
--expert-parallel-size G the experts are spread over G GPUs and replicated W / G times). The model counted
holds one GPU's experts; its dispatcher (`OneGPUDispatcher`) computes every routed row on them.
Since all experts of a layer have the same shapes, that spends the same multiply-adds as the whole
expert-parallel group spends on one sequence: each token goes through one expert per sparse layer
(two for GShard top-2), each sMoE hidden-dimension row through one spatial expert.

Routing, capacity and padding: the count runs in eval mode, as the paper's ("during evaluation").
Eval routes every token on its own scores and drops nothing, which equals the capacity-padded
training compute for Switch at capacity factor 1 (E x S/E slots) and GShard at capacity 2S/E
(2 slots per token); a Switch capacity factor c > 1 pads training to c x S expert rows, which is
not counted (tokens over capacity are dropped, never computed twice). Sequences are full
(--tokens-per-sample real tokens, no padding). sMoE partial prediction counts what it computes:
a router over the first 20% of positions and spatial experts over the remaining 80%.

Methods (per layer kind, cost(N1 dense, N2 sparse) = head + N1 dense + N2 sparse, exact because
every layer of a kind has the same shapes):
    fvcore       (default) fvcore on a real LanguageModel with one layer of each kind, composed
                 (traced on the meta device when no layer routes: no compute, same graph)
    fvcore-full  fvcore on the whole real LanguageModel (slow and memory hungry at paper sizes)
    analytic     closed-form per-layer formulas with fvcore's rules; tested within 1% of fvcore
Parameters always come from the real modules (built on the meta device: no memory, no time).

Matching (--match): for each family the number of layers whose FLOPs match the target's. A model
matches when its FLOPs are within --match-tolerance (default 1.5%) of the target; among matches the
one with the fewest layers (the cheapest FLOP-matched model) wins, with no match the nearest.
Why not simply the nearest: for the small sMLP (0.822T) gMLP 41 layers is -1.1% and 42 is +0.95%;
the paper chose 41 (Table 9 lists both at "0.83T", FLOPs given to two digits). Tolerances from
1.2% to 2.0% give the paper's Transformer 24, gMLP 41 and Base Layers 12 + 12 and keep the sMLP
at its own 28 + 12 (27 + 12 is -2.1%); 1.5% is the middle of that range.
Layers: Transformer and gMLP N dense blocks; GShard, Switch, Base Layers and HASH N blocks of
which N // 2 are sparse (the paper's 12 + 12, 8 + 8, 7 + 7); sMLP N dense blocks with the
target's sparse blocks (or --smlp-sparse-layers; without either the sMLP row is left out);
HyperMixer (tied, untied) and NiNformer N dense gMLP blocks with that token mixer in the SGU's place
(smlp/token_mixers.py; the target's --mixer-dim if the target uses the same mixer). Every
family keeps the target's D, F, T, V and experts (32, the paper's, for a dense target).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from smlp.causal import executed_pairs, explicit_spatial
from smlp.config import SGUConfig, SMoEConfig
from smlp.dispatch import DispatchState, LocalDispatcher
from smlp.lm import LanguageModel, LMConfig, layer_plan
from smlp.mixers import GMLPBlock, SpatialGatingUnit
from smlp.moe import SMoE, SparseBlock, TMoE
from smlp.token_mixers import HyperMixingUnit, NiNformerGatingUnit
from smlp.token_routed import TokenRoutedGMLPBlock
from smlp.transformer import CausalSelfAttention, DenseFFN, TransformerBlock, explicit_attention

from .paper_tables import MATCH_TOLERANCE, PAPER_MODELS, TABLE3_DIMS, TABLE3_ROWS, TABLE5

__all__ = [
    "CONVENTION", "METHODS", "OneGPUDispatcher", "LayerCost", "CostModel", "Count", "ModelSpec", "MatchRow",
    "parse_model", "cost_model", "count", "count_module", "match", "table3", "main",
]

PROG = "smlp-flops"
METHODS = ("fvcore", "fvcore-full", "analytic")
DEFAULT_VOCAB = 51200  # reproduces Table 9's non-expert parameters (41 gMLP blocks + 51200 x 1024 embedding)
PADDING_IDX = 1  # fairseq's dictionary puts <pad> at 1
CONVENTION = ("FLOPs = 2 x multiply-adds of the forward pass of one sequence of {T} tokens (the paper's "
              "convention; fvcore counts 1 per multiply-add, so fvcore on a batch of 2 sequences gives the same); "
              "eval-mode routing, one expert per routing choice per sparse layer")
FAMILY_NAMES = {"transformer": "Transformer", "gmlp": "gMLP", "gshard": "GShard", "switch": "Switch",
                "base": "Base Layers", "hash": "HASH Layers", "smlp": "sMLP",
                "hypermixer": "HyperMixer", "hypermixer_untied": "HyperMixer (untied)", "ninformer": "NiNformer",
                "gmlp_token_routed": "gMLP, token-routed"}
# dense gMLP models whose SGU is replaced (LMConfig.token_mixer): family key -> LMConfig fields
MIXER_FAMILIES = {"hypermixer": dict(token_mixer="hypermixer"),
                  "hypermixer_untied": dict(token_mixer="hypermixer", hypermixer_tied=False),
                  "ninformer": dict(token_mixer="ninformer")}
PLUGIN_MODELS = ("smlp_lm", "gmlp_lm", "moe_transformer_lm")


def _check_experts_per_gpu(num_experts: int, experts_per_gpu: int) -> None:
    if experts_per_gpu < 1 or num_experts % experts_per_gpu:
        raise ValueError(f"{experts_per_gpu} experts per GPU do not divide num_experts={num_experts}: the experts "
                         f"of a layer must spread evenly over the GPUs")


class OneGPUDispatcher(LocalDispatcher):
    """One GPU's view of expert parallelism: the routed rows all computed by this rank's experts.

    Holds `experts_per_gpu` local experts of `num_experts`; every row is computed by one of them
    (rows dealt out evenly), so each row costs one expert of its layer, as in the expert-parallel
    group, while the model holds only one GPU's expert weights. Outputs keep the rows' order.
    """

    def __init__(self, num_experts: int, experts_per_gpu: int = 1):
        super().__init__(num_experts)
        _check_experts_per_gpu(num_experts, experts_per_gpu)
        self.num_local_experts = experts_per_gpu
        self.world_size = num_experts // experts_per_gpu

    def dispatch(self, x_SD, expert_S, *, presorted: bool = False, **unused):
        # rows of dropped slots (expert -1, over capacity) are computed by no expert; the layers
        # hand them over since issue 19 (the dispatcher cuts them off), so this one does too
        kept_S = None if x_SD.device.type == "meta" else expert_S >= 0  # meta: nothing routed, nothing dropped
        if kept_S is not None and not bool(kept_S.all()):
            x_SD = x_SD[kept_S]
        S, L = x_SD.shape[0], self.num_local_experts
        counts_L = [S // L + (i < S % L) for i in range(L)]
        return x_SD, counts_L, DispatchState(kept_S)

    def combine(self, y_RD, state):
        kept_S = state.order_S
        if kept_S is None or y_RD.shape[0] == kept_S.shape[0]:
            return y_RD
        y_SD = y_RD.new_zeros((kept_S.shape[0],) + tuple(y_RD.shape[1:]))
        y_SD[kept_S] = y_RD
        return y_SD


# ---------------------------------------------------------------- costs


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding + final norm + output projection): multiply-adds for one
    sequence, parameters held by one GPU."""

    macs: int
    params_expert: int
    params_non_expert: int

    def __add__(self, other: "LayerCost") -> "LayerCost":
        return LayerCost(self.macs + other.macs, self.params_expert + other.params_expert,
                         self.params_non_expert + other.params_non_expert)

    def __mul__(self, k: int) -> "LayerCost":
        return LayerCost(self.macs * k, self.params_expert * k, self.params_non_expert * k)


ZERO = LayerCost(0, 0, 0)


@dataclass(frozen=True)
class Count:
    """FLOPs and parameters of one model for one sequence of `tokens` tokens."""

    cfg: LMConfig
    tokens: int
    experts_per_gpu: int
    world_size: int
    macs: int
    params_expert_per_gpu: int
    params_non_expert: int
    method: str
    head: LayerCost
    dense: LayerCost
    sparse: LayerCost | None

    @property
    def flops(self) -> int:
        """The paper's convention: 2 per multiply-add."""
        return 2 * self.macs

    @property
    def params_per_gpu(self) -> int:
        return self.params_expert_per_gpu + self.params_non_expert

    @property
    def params_total(self) -> int:
        """All parameters of the model: the non-expert ones plus every GPU's experts."""
        return self.params_non_expert + self.params_expert_per_gpu * self.world_size

    def as_dict(self) -> dict:
        c = self.cfg
        layers = {"head": asdict(self.head), "dense": asdict(self.dense)}
        if self.sparse is not None:
            layers["sparse"] = asdict(self.sparse)
        return {
            "family": family_key(c), "dense_layers": c.dense_layers, "sparse_layers": c.sparse_layers,
            "placement": c.placement if c.sparse_layers else None, "layer_plan": c.plan,
            "token_mixer": c.token_mixer if c.family in ("smlp", "gmlp") else None,
            "d_model": c.d_model, "d_ffn": c.d_ffn, "seq_len": c.seq_len, "vocab_size": c.vocab_size,
            "heads": c.heads, "num_experts": c.num_experts if c.sparse_layers else 0,
            "experts_per_gpu": self.experts_per_gpu, "world_size": self.world_size, "tokens": self.tokens,
            "flops": self.flops, "macs": self.macs, "params_expert_per_gpu": self.params_expert_per_gpu,
            "params_non_expert": self.params_non_expert, "params_per_gpu": self.params_per_gpu,
            "params_total": self.params_total, "method": self.method, "per_layer": layers,
            "convention": CONVENTION.format(T=self.tokens),
        }


@dataclass(frozen=True)
class CostModel:
    """Per-kind costs of one model (fixed widths): cost(N1, N2) = head + N1 dense + N2 sparse."""

    cfg: LMConfig
    tokens: int
    experts_per_gpu: int
    world_size: int
    head: LayerCost
    dense: LayerCost
    sparse: LayerCost | None
    method: str

    def count(self, dense_layers: int | None = None, sparse_layers: int | None = None) -> Count:
        cfg = self.cfg if dense_layers is None else self.cfg.with_layers(dense_layers, sparse_layers or 0)
        if cfg.sparse_layers and self.sparse is None:
            raise ValueError("this cost model was built for a model without sparse layers")
        sparse = self.sparse * cfg.sparse_layers if cfg.sparse_layers else ZERO
        total = self.head + self.dense * cfg.dense_layers + sparse
        return Count(cfg, self.tokens, self.experts_per_gpu if cfg.sparse_layers else 0,
                     self.world_size if cfg.sparse_layers else 1, total.macs, total.params_expert,
                     total.params_non_expert, self.method, self.head, self.dense,
                     self.sparse if cfg.sparse_layers else None)


def family_key(cfg: LMConfig) -> str:
    if cfg.family == "transformer" and cfg.sparse_layers:
        return cfg.moe_router
    if cfg.family == "gmlp" and cfg.token_mixer != "sgu":
        return cfg.token_mixer + ("" if cfg.token_mixer != "hypermixer" or cfg.hypermixer_tied else "_untied")
    if cfg.family == "gmlp" and cfg.token_routed_experts:
        return "gmlp_token_routed"
    return cfg.family


def _dispatcher(cfg: LMConfig, experts_per_gpu: int):
    return OneGPUDispatcher(cfg.num_experts, experts_per_gpu) if cfg.sparse_layers else None


def _minimal(cfg: LMConfig) -> LMConfig:
    """One layer of each kind: the smallest model that holds every layer shape of `cfg`."""
    return cfg.with_layers(1, 1 if cfg.sparse_layers else 0)


def _params(module: nn.Module) -> LayerCost:
    expert = sum(p.numel() for p in module.parameters() if getattr(p, "expert", False))
    total = sum(p.numel() for p in module.parameters())
    return LayerCost(0, expert, total - expert)


def _build(cfg: LMConfig, experts_per_gpu: int, device: str) -> LanguageModel:
    with torch.device(device), torch.no_grad():
        return LanguageModel(cfg, _dispatcher(cfg, experts_per_gpu)).eval()


def _tokens(cfg: LMConfig, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    low = min(4, cfg.vocab_size - 1)  # real-token ids (fairseq: 0-3 are <s> <pad> </s> <unk>)
    return torch.randint(low, cfg.vocab_size, (1, n), generator=g)


def fvcore_by_module(module: nn.Module, *inputs) -> dict[str, int]:
    """fvcore's multiply-add count of one forward call, by submodule name ('' = the whole)."""
    from fvcore.nn import FlopCountAnalysis

    # fvcore cannot see fused SDPA nor the blocked causal product: count their explicit (paper) forms
    with torch.no_grad(), warnings_off(), explicit_attention(module), explicit_spatial(module):
        analysis = FlopCountAnalysis(module, inputs)
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        analysis.tracer_warnings("none")
        return {name: int(round(v)) for name, v in analysis.by_module().items()}


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _layer_macs_fvcore(cfg: LMConfig, tokens: int, experts_per_gpu: int) -> tuple[int, list[int]]:
    small = _minimal(cfg)
    torch.manual_seed(0)
    # Without routing nothing depends on values: trace on the meta device (same graph and shapes, no
    # compute; causal HyperMixing at paper size is ~100 s and 6 GB on 2 CPU cores). Routing needs values.
    device = "cpu" if small.sparse_layers or small.token_routed_experts else "meta"
    model = _build(small, experts_per_gpu, device)
    counts = fvcore_by_module(model, _tokens(small, tokens).to(device))
    layers = [counts.get(f"layers.{i}", 0) for i in range(len(model.layers))]
    return counts[""] - sum(layers), layers


def cost_model(cfg: LMConfig, tokens: int | None = None, *, experts_per_gpu: int = 1,
               method: str = "fvcore") -> CostModel:
    """Per-kind costs of `cfg` for one sequence of `tokens` tokens (default: cfg.seq_len)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: valid values are {', '.join(METHODS)}")
    tokens = cfg.seq_len if tokens is None else tokens
    if not 1 <= tokens <= cfg.seq_len:
        raise ValueError(f"tokens={tokens} must be in [1, seq_len={cfg.seq_len}]")
    if cfg.sparse_layers:
        _check_experts_per_gpu(cfg.num_experts, experts_per_gpu)
    world = cfg.num_experts // experts_per_gpu if cfg.sparse_layers else 1
    small = _minimal(cfg)
    model = _build(small, experts_per_gpu, "meta")  # parameters only
    kinds = layer_plan(small.dense_layers, small.sparse_layers, small.placement)
    layer_params = [_params(layer) for layer in model.layers]
    head_params = _params(model) + LayerCost(0, -sum(p.params_expert for p in layer_params),
                                              -sum(p.params_non_expert for p in layer_params))
    if method == "analytic":
        head_macs = _head_macs(small, tokens)
        layer_macs = [_layer_macs_analytic(layer, tokens) for layer in model.layers]
    else:
        head_macs, layer_macs = _layer_macs_fvcore(cfg, tokens, experts_per_gpu)
    per_kind = {kind: LayerCost(m, p.params_expert, p.params_non_expert)
                for kind, m, p in zip(kinds, layer_macs, layer_params)}
    return CostModel(cfg, tokens, experts_per_gpu, world, replace(head_params, macs=head_macs),
                     per_kind["dense"], per_kind.get("sparse"), method)


def count(cfg: LMConfig, tokens: int | None = None, *, experts_per_gpu: int = 1, method: str = "fvcore") -> Count:
    """FLOPs and parameters of `cfg` for one sequence (see the module docstring for the convention)."""
    if method != "fvcore-full":
        return cost_model(cfg, tokens, experts_per_gpu=experts_per_gpu, method=method).count()
    cm = cost_model(cfg, tokens, experts_per_gpu=experts_per_gpu, method="analytic")  # for the parameters
    torch.manual_seed(0)
    model = _build(cfg, experts_per_gpu, "cpu")
    counts = fvcore_by_module(model, _tokens(cfg, cm.tokens))
    layer_macs = {}
    for i, kind in enumerate(layer_plan(cfg.dense_layers, cfg.sparse_layers, cfg.placement)):
        layer_macs.setdefault(kind, counts.get(f"layers.{i}", 0))
    head = counts[""] - sum(counts.get(f"layers.{i}", 0) for i in range(len(model.layers)))
    c = cm.count()
    return replace(c, macs=counts[""], method="fvcore-full", head=replace(c.head, macs=head),
                   dense=replace(c.dense, macs=layer_macs.get("dense", 0)),
                   sparse=c.sparse and replace(c.sparse, macs=layer_macs["sparse"]))


# ---------------------------------------------------------------- analytic (fvcore's rules, closed form)


def _ln(rows: int, width: int) -> int:
    return 5 * rows * width  # fvcore: 5 per element for an affine LayerNorm


def _head_macs(cfg: LMConfig, n: int) -> int:
    return _ln(n, cfg.d_model) + n * cfg.d_model * cfg.vocab_size  # final norm + tied output projection


def _tmoe_macs(tmoe: TMoE, rows: int) -> int:
    c = tmoe.cfg
    router = 0 if c.router == "hash" else rows * c.d_model * c.num_experts
    slots = rows * (2 if c.router == "gshard" else 1)
    expert = 2 * c.d_model * c.d_ffn + (5 * c.d_model if c.uses_expert_norm else 0)
    return router + slots * expert


def _smoe_macs(smoe: SMoE, B: int, n: int) -> int:
    c = smoe.cfg
    C = c.gated_dim
    P = min(c.prefix_len, n)
    M = n - P
    router = B * C * P * c.num_experts if c.routing == "partial" and M else 0
    if c.leaky:  # Appendix B: the router reads all n positions
        router = B * C * n * c.num_experts
    return _ln(B * n, C) + router + B * C * M * M


def _sgu_macs(sgu: SpatialGatingUnit, n: int) -> int:
    C = sgu.cfg.gated_dim
    return _ln(n, C) + n * n * C


def _token_mixer_macs(mixer: nn.Module, n: int) -> int:
    """The gMLP block's token mixer: SGU, causal HyperMixing or NiNformer gating (token_mixers.py)."""
    if isinstance(mixer, SpatialGatingUnit):
        return _sgu_macs(mixer, n)
    if isinstance(mixer, HyperMixingUnit):
        c = mixer.cfg
        C, R, Hh = c.gated_dim, c.hidden_dim, c.hyper_hidden
        hyper = n * (C * Hh + Hh * R) * (1 if c.tied else 2)
        return 2 * _ln(n, C) + hyper + 2 * n * R * C  # outer products W1[s] x_s^T, then W2[t] . H_t
    if isinstance(mixer, NiNformerGatingUnit):
        c = mixer.cfg
        C = c.gated_dim
        return 2 * _ln(n, C) + 2 * c.token_expansion * n * n * C + 2 * n * C * c.channel_hidden
    raise TypeError(f"no analytic formula for a token mixer of type {type(mixer).__name__}: use method='fvcore'")


def _attention_macs(D: int, n: int) -> int:
    return 4 * n * D * D + 2 * n * n * D  # q, k, v, out projections; scores and context


def _token_routed_macs(layer: TokenRoutedGMLPBlock, n: int) -> int:
    """One sequence through a token-routed gMLP block (smlp/token_routed.py): the router, and every
    token once through one expert's projections and its T-long spatial sum; exact whatever the routing."""
    c = layer.cfg
    D, Fw, C, T = c.d_model, c.d_ffn, c.d_ffn // 2, c.seq_len
    return n * D * c.num_experts + _ln(n, D) + n * (D * Fw + 5 * C + T * C + C * D)


def _layer_macs_analytic(layer: nn.Module, n: int) -> int:
    if isinstance(layer, TokenRoutedGMLPBlock):
        return _token_routed_macs(layer, n)
    if isinstance(layer, GMLPBlock):
        D, Fw = layer.cfg.d_model, layer.cfg.d_ffn
        return _ln(n, D) + n * D * Fw + _token_mixer_macs(layer.token_mixer, n) + n * layer.proj_out.in_features * D
    if isinstance(layer, SparseBlock):
        D = layer.cfg.d_model
        return _ln(n, D) + _smoe_macs(layer.smoe, 1, n) + _tmoe_macs(layer.tmoe, n)
    if isinstance(layer, TransformerBlock):
        D = layer.d_model
        ffn = layer.ffn
        if isinstance(ffn, TMoE):
            ffn_macs = _tmoe_macs(ffn, n)
        elif isinstance(ffn, DenseFFN):
            ffn_macs = n * (ffn.fc1.in_features * ffn.fc1.out_features + ffn.fc2.in_features * ffn.fc2.out_features)
        else:
            raise TypeError(f"no analytic formula for an FFN of type {type(ffn).__name__}: use method='fvcore'")
        return 2 * _ln(n, D) + _attention_macs(D, n) + ffn_macs
    raise TypeError(f"no analytic formula for layer type {type(layer).__name__}: use method='fvcore'")


def executed_macs(c: Count) -> int:
    """Multiply-adds the model executes for one sequence, where `c` counts the paper's (full T x T).

    Causal products skip their zero triangle: our SGU and sMoE experts run blocked
    (smlp/causal.py, `executed_pairs` per column), and the Transformers' fused causal attention
    (scores and context) computes the causal triangle, n (n + 1) / 2 of the n^2 pairs (the
    kernel's own blocks add a little more, not counted). Other token mixers (HyperMixer,
    NiNformer) run as counted. The benchmark's MFU is reported against both figures."""
    cfg, n = c.cfg, c.tokens

    def spatial(width: int, m: int) -> int:  # pairs skipped by the blocked product, times the columns
        return width * (m * m - executed_pairs(m))

    attention = 2 * cfg.d_model * (n * n - n * (n + 1) // 2)
    saved_dense = saved_sparse = 0
    if cfg.family in ("gmlp", "smlp") and cfg.token_mixer == "sgu":
        saved_dense = spatial(cfg.d_ffn // 2, n)
    elif cfg.family == "transformer":
        saved_dense = attention
    if cfg.sparse_layers and cfg.family == "smlp":
        smoe = cfg.sparse_block.smoe
        saved_sparse = spatial(smoe.gated_dim, n - min(smoe.prefix_len, n))
    elif cfg.sparse_layers:
        saved_sparse = attention
    return c.macs - cfg.dense_layers * saved_dense - cfg.sparse_layers * saved_sparse


# ---------------------------------------------------------------- token-wise operations (Table 3)


def count_module(module: nn.Module, x: torch.Tensor) -> LayerCost:
    """fvcore multiply-adds of module(x) and the module's parameters (expert ones as held by one GPU)."""
    macs = fvcore_by_module(module.eval(), x)[""]
    return replace(_params(module), macs=macs)


def table3_module(kind: str, heads: int, *, seq_len: int, d_model: int, d_ffn: int, num_experts: int):
    """(module, input) of one Table 3 row: the token-wise operation alone, as used in our blocks.

    attention: the Transformer's causal self-attention on the D-wide stream.
    sgu:       the (multi-head) SGU of a gMLP block, on the F-wide channel projection.
    smoe:      the sMoE in the SGU's place (same F-wide input, gated half routed to the experts),
               as held by one GPU: one expert (one T x T spatial weight) and the LayerNorm.
    """
    torch.manual_seed(0)
    if kind == "attention":
        return CausalSelfAttention(d_model, heads), torch.randn(1, seq_len, d_model)
    if kind == "sgu":
        return SpatialGatingUnit(SGUConfig(dim=d_ffn, seq_len=seq_len, heads=heads)), torch.randn(1, seq_len, d_ffn)
    if kind == "smoe":
        cfg = SMoEConfig(dim=d_ffn, seq_len=seq_len, num_experts=num_experts, split=True)
        return SMoE(cfg, OneGPUDispatcher(num_experts, heads)), torch.randn(1, seq_len, d_ffn)
    raise ValueError(f"kind={kind!r} is unknown: valid values are attention, sgu, smoe")


def table3(dims: dict | None = None) -> list[dict]:
    dims = dict(TABLE3_DIMS if dims is None else dims)
    rows = []
    for name, kind, heads in TABLE3_ROWS:
        module, x = table3_module(kind, heads, **dims)
        cost = count_module(module, x)
        rows.append({"module": name, "heads": heads, "params": cost.params_expert + cost.params_non_expert,
                     "flops": 2 * cost.macs, "macs": cost.macs})
    return rows


# ---------------------------------------------------------------- fairseq flags -> LMConfig


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


# ---------------------------------------------------------------- FLOPs matching


@dataclass(frozen=True)
class MatchRow:
    family: str
    layers: int
    count: Count
    target_flops: int
    within_tolerance: bool

    @property
    def rel(self) -> float:
        return self.count.flops / self.target_flops - 1

    def as_dict(self) -> dict:
        c = self.count
        return {"family": FAMILY_NAMES[self.family], "key": self.family, "layers": self.layers,
                "dense_layers": c.cfg.dense_layers, "sparse_layers": c.cfg.sparse_layers, "flops": c.flops,
                "flops_vs_target": self.rel, "within_tolerance": self.within_tolerance,
                "params": c.params_per_gpu, "params_expert_per_gpu": c.params_expert_per_gpu,
                "params_non_expert": c.params_non_expert, "params_total": c.params_total,
                "fairseq_flags": fairseq_flags(c.cfg)}


def _heads_for(d_model: int) -> int:
    return next(h for h in (16, 8, 4, 2, 1) if d_model % h == 0)  # attention FLOPs do not depend on heads


LayerSplit = Callable[[int], tuple[int, int]]  # layers -> (dense, sparse)


def family_config(target: LMConfig, family: str, smlp_sparse: int | None) -> tuple[LMConfig, LayerSplit] | None:
    """(template config, layers -> (dense, sparse)) of one baseline family at the target's widths."""
    common = dict(vocab_size=target.vocab_size, d_model=target.d_model, d_ffn=target.d_ffn, seq_len=target.seq_len,
                  padding_idx=target.padding_idx)
    experts = target.num_experts if target.sparse_layers else 32
    if family == "gmlp":
        return LMConfig(family="gmlp", dense_layers=1, **common), lambda n: (n, 0)
    if family in MIXER_FAMILIES:
        mixer = MIXER_FAMILIES[family]
        same = target.token_mixer == mixer["token_mixer"]  # keep the target's mixer width if it has one
        cfg = LMConfig(family="gmlp", dense_layers=1, **mixer, mixer_dim=target.mixer_dim if same else 0, **common)
        return cfg, lambda n: (n, 0)
    if family == "transformer":
        cfg = LMConfig(family="transformer", dense_layers=1, heads=_heads_for(target.d_model), **common)
        return cfg, lambda n: (n, 0)
    if family == "gmlp_token_routed":  # the target's expert count (Table 7 compares several: give a gmlp target)
        E = target.token_routed_experts or (target.num_experts if target.sparse_layers else 2)
        return LMConfig(family="gmlp", dense_layers=1, token_routed_experts=E, **common), lambda n: (n, 0)
    if family == "smlp":
        if not smlp_sparse:
            return None
        routing = dict(smoe_routing=target.smoe_routing, prefix_fraction=target.prefix_fraction) \
            if target.family == "smlp" else {}
        cfg = LMConfig(family="smlp", dense_layers=1, sparse_layers=smlp_sparse, num_experts=experts, **routing,
                       **common)
        return cfg, lambda n: (n, smlp_sparse)
    heads = target.heads if target.family == "transformer" else _heads_for(target.d_model)
    cfg = LMConfig(family="transformer", dense_layers=1, sparse_layers=1, heads=heads, num_experts=experts,
                   moe_router=family, **common)
    return cfg, lambda n: (n - n // 2, n // 2)


# the families --match lists by default (token-routed gMLP only when asked: it is Table 7's ablation)
MATCH_FAMILIES = tuple(f for f in FAMILY_NAMES if f != "gmlp_token_routed")


def match(target: Count, *, tolerance: float = 0.015, smlp_sparse: int | None = None, method: str = "fvcore",
          experts_per_gpu: int = 1, families: Sequence[str] = MATCH_FAMILIES) -> list[MatchRow]:
    """For each family, the layer count whose FLOPs match the target's (rule: module docstring)."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"--match-tolerance {tolerance} must be in [0, 1)")
    t = target.cfg
    if smlp_sparse is None and t.family == "smlp":
        smlp_sparse = t.sparse_layers
    rows = []
    for family in families:
        built = family_config(t, family, smlp_sparse)
        if built is None:
            continue
        template, split = built
        epg = experts_per_gpu if template.num_experts % experts_per_gpu == 0 else 1
        cm = cost_model(template, target.tokens, experts_per_gpu=epg,
                        method="analytic" if method == "analytic" else "fvcore")
        # FLOPs grow with n: stop past the tolerance band and past the target.
        candidates, n = [], 0
        while not candidates or candidates[-1][1].flops <= target.flops * (1 + tolerance):
            n += 1
            if n > 100_000:
                raise ValueError(f"no {FAMILY_NAMES[family]} model reaches {target.flops:.3g} FLOPs")
            dense, sparse = split(n)
            if family in ("gshard", "switch", "base", "hash") and sparse == 0:
                continue  # a sparse family needs a sparse layer
            candidates.append((n, cm.count(dense, sparse)))
        within = [(n, c) for n, c in candidates if abs(c.flops / target.flops - 1) <= tolerance]
        if within:
            n, c = min(within, key=lambda nc: nc[0])
        else:
            n, c = min(candidates, key=lambda nc: abs(nc[1].flops - target.flops))
        rows.append(MatchRow(family, n, c, target.flops, bool(within)))
    return rows


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


# ---------------------------------------------------------------- output


def _m(n: int) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e5 or n == 0 else f"{n / 1e3:,.1f}K"


def _fl(n: int) -> str:
    for scale, unit, digits in ((1e11, "T", 4), (1e8, "G", 3), (1e5, "M", 3)):
        if n >= scale:
            return f"{n / (scale * 10):.{digits}f}{unit}"
    return f"{n:,}"


def describe(c: Count) -> str:
    cfg = c.cfg
    layers = f"{cfg.dense_layers} dense" + (f" + {cfg.sparse_layers} sparse" if cfg.sparse_layers else "")
    s = (f"{FAMILY_NAMES[family_key(cfg)]}: {layers} layers, D={cfg.d_model}, F={cfg.d_ffn}, T={cfg.seq_len}, "
         f"V={cfg.vocab_size}")
    if cfg.sparse_layers:
        s += f", {cfg.num_experts} experts, {c.experts_per_gpu} per GPU on {c.world_size} GPUs"
    mixer = cfg.dense_mixer if cfg.family in ("smlp", "gmlp") else None
    if mixer is not None:
        sizes = {k: v for k, v in vars(mixer).items() if k not in ("dim", "seq_len", "chunk_size", "causal")}
        s += f", dense token mixer {cfg.token_mixer} ({', '.join(f'{k}={v}' for k, v in sizes.items())})"
    return s


def format_count(name: str, c: Count, markdown: bool = False) -> str:
    if markdown:
        head = "| model | layers | FLOPs | expert params / GPU | non-expert params | params / GPU | params total |"
        sep = "|---|---|---:|---:|---:|---:|---:|"
        layers = f"{c.cfg.dense_layers} + {c.cfg.sparse_layers}" if c.cfg.sparse_layers else str(c.cfg.dense_layers)
        row = (f"| {name} | {layers} | {_fl(c.flops)} | {_m(c.params_expert_per_gpu)} | {_m(c.params_non_expert)} "
               f"| {_m(c.params_per_gpu)} | {_m(c.params_total)} |")
        return "\n".join([head, sep, row, "", f"_{CONVENTION.format(T=c.tokens)}._"])
    lines = [f"{name}  ({describe(c)})",
             f"  FLOPs                     {_fl(c.flops):>12}  ({c.flops:,})",
             f"  expert params per GPU     {_m(c.params_expert_per_gpu):>12}",
             f"  non-expert params         {_m(c.params_non_expert):>12}",
             f"  params per GPU            {_m(c.params_per_gpu):>12}",
             f"  params total (all GPUs)   {_m(c.params_total):>12}",
             "  per layer (FLOPs, params/GPU):",
             f"    embedding + output      {_fl(2 * c.head.macs):>12}  {_m(c.head.params_non_expert)}",
             f"    dense layer  x{c.cfg.dense_layers:<4}     {_fl(2 * c.dense.macs):>12}  "
             f"{_m(c.dense.params_expert + c.dense.params_non_expert)}"]
    if c.sparse is not None:
        lines.append(f"    sparse layer x{c.cfg.sparse_layers:<4}     {_fl(2 * c.sparse.macs):>12}  "
                     f"{_m(c.sparse.params_expert)} expert + {_m(c.sparse.params_non_expert)} non-expert")
    lines += [f"  method: {c.method}", f"  {CONVENTION.format(T=c.tokens)}"]
    return "\n".join(lines)


def format_match(name: str, target: Count, rows: list[MatchRow], tolerance: float, markdown: bool = False) -> str:
    if markdown:
        out = [f"FLOPs matched to {name} ({_fl(target.flops)}), tolerance {tolerance:.1%}:", "",
               "| family | layers (dense + sparse) | FLOPs | vs target | params / GPU | non-expert params |",
               "|---|---|---:|---:|---:|---:|"]
        for r in rows:
            c = r.count
            layers = f"{c.cfg.dense_layers} + {c.cfg.sparse_layers}" if c.cfg.sparse_layers else str(c.cfg.dense_layers)
            mark = "" if r.within_tolerance else " (nearest, none within tolerance)"
            out.append(f"| {FAMILY_NAMES[r.family]} | {layers} | {_fl(c.flops)} | {r.rel:+.2%}{mark} "
                       f"| {_m(c.params_per_gpu)} | {_m(c.params_non_expert)} |")
        out += ["", f"_{CONVENTION.format(T=target.tokens)}._"]
        return "\n".join(out)
    out = [f"FLOPs matched to {name}: {describe(target)}, {_fl(target.flops)}",
           f"rule: within {tolerance:.1%} of the target, fewest layers (else the nearest)",
           f"  {'family':<20}{'layers':>8}  {'dense+sparse':>12}  {'FLOPs':>10}  {'vs target':>9}  "
           f"{'params/GPU':>12}  {'non-expert':>11}"]
    for r in rows:
        c = r.count
        split = f"{c.cfg.dense_layers}+{c.cfg.sparse_layers}"
        mark = "" if r.within_tolerance else "  (nearest; none within tolerance)"
        out.append(f"  {FAMILY_NAMES[r.family]:<20}{r.layers:>8}  {split:>12}  {_fl(c.flops):>10}  {r.rel:>+9.2%}  "
                   f"{_m(c.params_per_gpu):>12}  {_m(c.params_non_expert):>11}{mark}")
    out.append(f"  {CONVENTION.format(T=target.tokens)}")
    return "\n".join(out)


def paper_tables(method: str = "fvcore") -> dict:
    """Our derived figures for the configurations of Tables 3, 5, 8, 9, 10 (no paper figures here)."""
    models = []
    cache: dict = {}
    for pm in PAPER_MODELS:
        spec = parse_model(pm.arch, list(pm.flags))
        key = (spec.cfg.with_layers(1, 1 if spec.cfg.sparse_layers else 0), spec.tokens, spec.experts_per_gpu)
        if key not in cache:
            cache[key] = cost_model(spec.cfg, spec.tokens, experts_per_gpu=max(spec.experts_per_gpu, 1), method=method)
        c = cache[key].count(spec.cfg.dense_layers, spec.cfg.sparse_layers)
        models.append({"table": pm.table, "name": pm.name, "arch": pm.arch, **c.as_dict()})
    return {"table3": table3(), "models": models, "table5": table5_comparison(models)}


def table5_comparison(models: list[dict]) -> list[dict]:
    """Table 5 as printed beside our count of the architecture it prints, with the difference and its cause."""
    ours = {m["arch"]: m for m in models if m["table"] in ("5", "10")}
    rows = []
    for row in TABLE5:
        m = ours[row.arch]
        flops_diff = m["flops"] / (row.flops_T * 1e12) - 1
        size_diff = m["params_total"] / (row.size_B * 1e9) - 1
        rows.append({
            "name": row.name, "arch": row.arch, "dense_layers": m["dense_layers"],
            "sparse_layers": m["sparse_layers"], "paper_flops": row.flops_T * 1e12, "flops": m["flops"],
            "flops_diff": flops_diff, "flops_match": abs(flops_diff) <= MATCH_TOLERANCE,
            "paper_params_total": row.size_B * 1e9, "params_total": m["params_total"], "params_diff": size_diff,
            "params_match": abs(size_diff) <= MATCH_TOLERANCE, "cause": row.cause,
        })
    return rows


def format_paper_tables(tables: dict, markdown: bool = False) -> str:
    t3 = tables["table3"]
    if markdown:
        out = ["| Module | heads | params | FLOPs |", "|---|---:|---:|---:|"]
        out += [f"| {r['module']} | {r['heads']} | {r['params'] / 1e6:.3f}M | {r['flops'] / 1e9:.3f}G |" for r in t3]
        out += ["", "| table | model | layers (dense + sparse) | expert params / GPU | non-expert params | FLOPs |",
                "|---|---|---|---:|---:|---:|"]
        for m in tables["models"]:
            out.append(f"| {m['table']} | {m['name']} | {m['dense_layers']} + {m['sparse_layers']} "
                       f"| {_m(m['params_expert_per_gpu'])} | {_m(m['params_non_expert'])} | {_fl(m['flops'])} |")
        out += ["", "Table 5 as printed against our count of the printed architecture:", "",
                "| model | layers (dense + sparse) | FLOPs: ours (paper) | diff | params total: ours (paper) | diff "
                "| cause of a difference |", "|---|---|---:|---:|---:|---:|---|"]
        for r in tables["table5"]:
            out.append(f"| {r['name']} | {r['dense_layers']} + {r['sparse_layers']} | {_fl(r['flops'])} "
                       f"({r['paper_flops'] / 1e12:.1f}T) | {r['flops_diff']:+.1%} | {r['params_total'] / 1e9:.2f}B "
                       f"({r['paper_params_total'] / 1e9:.2f}B) | {r['params_diff']:+.1%} | {r['cause']} |")
        out += ["", f"_{CONVENTION.format(T=1024)}._"]
        return "\n".join(out)
    out = [f"Table 3 (T={TABLE3_DIMS['seq_len']}, D={TABLE3_DIMS['d_model']}, F={TABLE3_DIMS['d_ffn']}):",
           f"  {'module':<22}{'heads':>6}{'params':>12}{'FLOPs':>12}"]
    out += [f"  {r['module']:<22}{r['heads']:>6}{r['params'] / 1e6:>11.3f}M{r['flops'] / 1e9:>11.3f}G" for r in t3]
    out += ["", "Tables 5, 8-10:",
            f"  {'table':<6}{'model':<30}{'layers':>8}{'expert/GPU':>13}{'non-expert':>13}{'FLOPs':>10}"]
    for m in tables["models"]:
        out.append(f"  {m['table']:<6}{m['name']:<30}{m['dense_layers']:>4}+{m['sparse_layers']:<3}"
                   f"{_m(m['params_expert_per_gpu']):>13}{_m(m['params_non_expert']):>13}{_fl(m['flops']):>10}")
    out += ["", f"Table 5 as printed vs our count of the printed architecture (match: within {MATCH_TOLERANCE:.0%}):",
            f"  {'model':<30}{'layers':>8}{'FLOPs ours':>12}{'paper':>8}{'diff':>8}{'params ours':>13}{'paper':>8}"
            f"{'diff':>8}"]
    for r in tables["table5"]:
        out.append(f"  {r['name']:<30}{r['dense_layers']:>4}+{r['sparse_layers']:<3}{_fl(r['flops']):>12}"
                   f"{r['paper_flops'] / 1e12:>7.1f}T{r['flops_diff']:>+8.1%}{r['params_total'] / 1e9:>12.2f}B"
                   f"{r['paper_params_total'] / 1e9:>7.2f}B{r['params_diff']:>+8.1%}")
        if r["cause"]:
            out.append(f"      {r['cause']}")
    out.append(f"  {CONVENTION.format(T=1024)}")
    return "\n".join(out)


# ---------------------------------------------------------------- step time (eval/steptime.py)


def step_time_for(spec: ModelSpec, cluster, *, name: str | None = None, padding: bool = False,
                  method: str = "fvcore"):
    """The step-time model of a model given as fairseq flags (with --batch-size etc.) on `cluster`."""
    from . import steptime

    if not spec.batch_size:
        raise ValueError("the step-time model needs --batch-size (sequences per GPU per micro-batch), e.g. "
                         "--batch-size 4 --update-freq 4 --distributed-world-size 32 --fp16")
    c = count_spec(spec, method)
    train = steptime.Training(world_size=spec.world_size, ep_size=spec.ep_size if spec.cfg.sparse_layers else 1,
                              batch_size=spec.batch_size, update_freq=spec.update_freq, tokens=spec.tokens,
                              fp16=spec.fp16, optimizer_sharding=spec.zero_sharding, padding=padding)
    acts = steptime.activation_bytes(spec.cfg, spec.tokens, max(spec.experts_per_gpu, 1))
    return steptime.step_time(name or spec.arch, spec.cfg, flops_per_sequence=c.flops,
                              params_non_expert=c.params_non_expert, params_expert_per_gpu=c.params_expert_per_gpu,
                              train=train, cluster=cluster, activations=acts)


def table4(which: str, cluster, method: str = "fvcore") -> list[dict]:
    """Predicted words/s of the paper's 32-GPU Table 4 configurations beside the paper's, ranked."""
    from .steptime import TABLE4

    rows = []
    for part in (("top", "bottom") if which == "both" else (which,)):
        for row in TABLE4[part]:
            spec = parse_model(row.arch, list(row.flags))
            st = step_time_for(spec, cluster, name=row.name, padding=True, method=method)
            rows.append({"part": part, "name": row.name, "arch": row.arch, "flags": " ".join(row.flags),
                         "paper_wps": row.paper_wps, "note": row.note, **st.as_dict()})
    for part in {r["part"] for r in rows}:
        mine = [r for r in rows if r["part"] == part]
        for key, rank_key in (("words_per_second", "rank"), ("paper_wps", "paper_rank")):
            for i, r in enumerate(sorted(mine, key=lambda r: -r[key])):
                r[rank_key] = i + 1
        ref = next(r for r in mine if r["name"].startswith("sMLP"))
        for r in mine:
            r["vs_smlp"] = r["words_per_second"] / ref["words_per_second"]
            r["paper_vs_smlp"] = r["paper_wps"] / ref["paper_wps"]
    return rows


def _gb(n: float) -> str:
    return f"{n / 2 ** 30:.1f}G"


def format_step_time(st) -> str:
    t, c = st.train, st.cluster
    lines = [f"{st.name}: {t.world_size} GPUs ({c.name}), expert-parallel groups of {t.ep_size} ({t.replicas} "
             f"replica(s)), {t.batch_size} x {t.tokens} tokens x {t.update_freq} micro-batches per GPU, "
             f"{'fp16' if t.fp16 else 'fp32'}{', optimizer state sharded' if t.optimizer_sharding else ''}",
             "  all2all per sparse layer per micro-batch (bytes leaving one GPU; x4 per step: fwd + bwd):"]
    for e in st.exchanges:
        lines.append(f"    {e.name:<14} {e.rows:>9,} rows x {e.row_bytes:>6,} B  {e.bytes_sent / 2 ** 20:>9.2f} MiB")
    ar = st.allreduce
    lines.append(f"  all-reduce per update: non-expert {ar['non_expert_bytes'] / 2 ** 20:,.1f} MiB over {ar['non_expert_ranks']} "
                 f"ranks; expert {ar['expert_bytes'] / 2 ** 20:,.1f} MiB over {ar['expert_ranks']} replica(s) "
                 f"x {ar['expert_reductions']}")
    m = st.memory
    lines.append(f"  memory per GPU: weights+grads {_gb(m['weights_and_grads'])}, Adam {_gb(m['adam_moments'])} "
                 f"(unsharded {_gb(m['adam_moments_unsharded'])}), activations {_gb(m['activations'])}: total "
                 f"{_gb(m['total'])} of {_gb(c.gpu_memory)}")
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in st.seconds.items())
    lines.append(f"  step {st.step_seconds:.3f} s ({parts}); {st.words_per_second / 1e3:,.0f}k words/s")
    return "\n".join(lines)


def format_table4(rows: list[dict], markdown: bool = False) -> str:
    out = []
    for part in ("top", "bottom"):
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        title = ("Table 4 (top): small models, 0.8T FLOPs" if part == "top"
                 else "Table 4 (bottom): scaled-up models, 2.0T FLOPs")
        c = mine[0]["cluster"]
        out.append(f"{title}; predicted on 32 x {c['name']} (capacity-padded GShard / Switch, as the paper's "
                   f"implementations):")
        if markdown:
            out += ["", "| model | predicted words/s | vs sMLP | paper words/s | vs sMLP | rank: ours (paper) "
                        "| compute | memory-bound | all2all | all-reduce | memory / GPU |",
                    "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in sorted(mine, key=lambda r: r["rank"]):
            s = r["seconds"]
            ar = s["allreduce_non_expert"] + s["allreduce_expert"]
            if markdown:
                out.append(f"| {r['name']} | {r['words_per_second'] / 1e3:.0f}k | {r['vs_smlp']:.2f} "
                           f"| {r['paper_wps'] / 1e3:.0f}k | {r['paper_vs_smlp']:.2f} | {r['rank']} ({r['paper_rank']}) "
                           f"| {s['compute']:.2f} s | {s['memory_bound']:.2f} s | {s['all2all']:.2f} s | {ar:.3f} s "
                           f"| {_gb(r['memory_bytes']['total'])} |")
            else:
                out.append(f"  {r['rank']}. {r['name']:<30} {r['words_per_second'] / 1e3:>6.0f}k ({r['vs_smlp']:.2f} of "
                           f"sMLP)   paper {r['paper_wps'] / 1e3:>4.0f}k ({r['paper_vs_smlp']:.2f}, rank "
                           f"{r['paper_rank']})   compute {s['compute']:.2f} s, memory-bound {s['memory_bound']:.2f} s, "
                           f"all2all {s['all2all']:.2f} s, all-reduce {ar:.3f} s, {_gb(r['memory_bytes']['total'])}/GPU")
                if r["note"]:
                    out.append(f"       {r['note']}")
        out.append("")
    return "\n".join(out).rstrip()


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="FLOPs and parameters of sMLP / gMLP / (MoE) Transformer models, and FLOP matching.",
        epilog="Other flags are fairseq model flags (e.g. --decoder-layers 30 --tokens-per-sample 512 "
               "--distributed-world-size 16), applied on top of the --arch preset.")
    p.add_argument("--arch", help="a registered architecture, e.g. smlp_lm_paper_small")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help=f"vocabulary size (default {DEFAULT_VOCAB})")
    p.add_argument("--method", choices=METHODS, default="fvcore", help="how FLOPs are counted (default fvcore)")
    p.add_argument("--match", action="store_true", help="FLOP-matched layer counts of every family for --arch")
    p.add_argument("--match-tolerance", type=float, default=0.015,
                   help="relative FLOPs tolerance of a match (default 0.015)")
    p.add_argument("--smlp-sparse-layers", type=int,
                   help="sparse blocks of the sMLP row of --match (default: the target's; "
                        "without it a dense target gets no sMLP row)")
    p.add_argument("--paper-tables", action="store_true", help="our figures for the paper's Tables 3, 5, 8-10")
    st = p.add_argument_group("step-time model (eval/steptime.py)")
    st.add_argument("--step-time", action="store_true",
                    help="all2all / all-reduce bytes, memory per GPU and the time of one update of --arch on "
                         "--cluster; training flags as in fairseq-train (--distributed-world-size, "
                         "--expert-parallel-size, --batch-size, --update-freq, --fp16, --zero-sharding os)")
    st.add_argument("--table4", choices=("top", "bottom", "both"),
                    help="predicted ranking and words/s of the paper's 32-GPU Table 4 configurations beside the paper's")
    st.add_argument("--cluster", default="v100-dgx1", help="cluster preset: v100-dgx1 (the paper's 32 V100s; default), a100-dgx")
    st.add_argument("--capacity-padding", choices=("auto", "on", "off"), default="auto",
                    help="GShard / Switch send E x capacity buffers (their implementations: on) or the routed rows "
                         "only (ours: off); auto = on for --table4, off for --step-time")
    st.add_argument("--gpu-tflops", type=float, help="peak dense TFLOP/s per GPU at the training precision")
    st.add_argument("--matmul-efficiency", type=float, help="fraction of the peak the matmuls reach")
    st.add_argument("--hbm-gbps", type=float, help="HBM bandwidth per GPU, GB/s")
    st.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB")
    st.add_argument("--gpus-per-node", type=int, help="GPUs per node (consecutive ranks share a node)")
    st.add_argument("--nvlink-gbps", type=float, help="all2all bandwidth per GPU inside a node, GB/s")
    st.add_argument("--nvlink-latency-us", type=float, help="latency of a collective inside a node, microseconds")
    st.add_argument("--ib-gbps", type=float, help="InfiniBand bandwidth per node (all NICs), GB/s")
    st.add_argument("--ib-latency-us", type=float, help="latency of a collective across nodes, microseconds")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--markdown", action="store_true", help="print a markdown table")
    return p


def run(argv: Sequence[str] | None = None) -> str:
    parser = build_parser()
    args, flags = parser.parse_known_args(argv)
    if args.table4 or args.step_time:
        return _run_step_time(args, flags)
    if args.paper_tables:
        if args.arch or args.match or flags:
            raise ValueError("--paper-tables takes no --arch, --match or model flags")
        tables = paper_tables(args.method)
        return json.dumps(tables, indent=2) if args.json else format_paper_tables(tables, args.markdown)
    if not args.arch:
        raise ValueError("--arch is required (or --paper-tables); e.g. --arch smlp_lm_paper_small")
    if args.smlp_sparse_layers is not None and args.smlp_sparse_layers < 1:
        raise ValueError(f"--smlp-sparse-layers {args.smlp_sparse_layers} must be >= 1")
    spec = parse_model(args.arch, flags, vocab_size=args.vocab_size)
    target = count_spec(spec, args.method)
    if not args.match:
        if args.json:
            return json.dumps({"arch": args.arch, **target.as_dict()}, indent=2)
        return format_count(args.arch, target, args.markdown)
    rows = match(target, tolerance=args.match_tolerance, smlp_sparse=args.smlp_sparse_layers, method=args.method,
                 experts_per_gpu=max(spec.experts_per_gpu, 1))
    if args.json:
        return json.dumps({"target": {"arch": args.arch, **target.as_dict()}, "tolerance": args.match_tolerance,
                           "matches": [r.as_dict() for r in rows]}, indent=2)
    return format_match(args.arch, target, rows, args.match_tolerance, args.markdown)


def cluster_from_args(args):
    from .steptime import CLUSTERS, with_cluster_overrides

    if args.cluster not in CLUSTERS:
        raise ValueError(f"--cluster {args.cluster!r} is unknown: valid presets are {', '.join(CLUSTERS)}")
    scale = lambda v, k: None if v is None else v * k  # noqa: E731
    return with_cluster_overrides(
        CLUSTERS[args.cluster], peak_flops=scale(args.gpu_tflops, 1e12), matmul_efficiency=args.matmul_efficiency,
        hbm_bandwidth=scale(args.hbm_gbps, 1e9), gpu_memory=scale(args.gpu_memory_gib, 2 ** 30),
        gpus_per_node=args.gpus_per_node, nvlink_bandwidth=scale(args.nvlink_gbps, 1e9),
        nvlink_latency=scale(args.nvlink_latency_us, 1e-6), ib_bandwidth=scale(args.ib_gbps, 1e9),
        ib_latency=scale(args.ib_latency_us, 1e-6))


def _run_step_time(args, flags) -> str:
    cluster = cluster_from_args(args)
    if args.table4:
        if args.arch or args.step_time or args.match or args.paper_tables or flags:
            raise ValueError("--table4 takes no --arch, --step-time, --match, --paper-tables or model flags")
        if args.capacity_padding == "off":
            raise ValueError("--table4 predicts the paper's runs, whose GShard / Switch pad to capacity; "
                             "use --step-time --capacity-padding off for our dispatcher")
        rows = table4(args.table4, cluster, "analytic" if args.method == "analytic" else "fvcore")
        return json.dumps(rows, indent=2) if args.json else format_table4(rows, args.markdown)
    if not args.arch:
        raise ValueError("--step-time needs --arch (and --batch-size); e.g. --arch smlp_lm_paper_small "
                         "--distributed-world-size 32 --batch-size 4 --update-freq 4 --fp16")
    spec = parse_model(args.arch, flags, vocab_size=args.vocab_size)
    st = step_time_for(spec, cluster, padding=args.capacity_padding == "on",
                       method="analytic" if args.method == "analytic" else "fvcore")
    return json.dumps(st.as_dict(), indent=2) if args.json else format_step_time(st)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        print(run(argv))
    except (ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
