"""FLOPs and parameters of our models, counted on the real modules (sMLP section 4.1, Tables 3, 5, 8-10).

`smlp-flops` (command.py) prints these counts; FLOP matching is matching.py, a model given as
fairseq flags model_spec.py, the printed tables tables.py.

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
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from smlp.config import SGUConfig, SMoEConfig
from smlp.experts import is_expert
from smlp.flop_forms import counted_forms
from smlp.gmlp import GMLPBlock, SpatialGatingUnit
from smlp.hypermixer import HyperMixingUnit
from smlp.lm import LanguageModel, LMConfig, layer_plan
from smlp.moe import SMoE, SparseBlock, TMoE
from smlp.ninformer import NiNformerGatingUnit
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS
from smlp.spatial import executed_pairs
from smlp.token_routed import TokenRoutedGMLPBlock
from smlp.transformer import CausalSelfAttention, DenseFFN, TransformerBlock

from .one_gpu import OneGPUDispatcher, check_experts_per_gpu
from .paper_figures import TABLE3_DIMS, TABLE3_ROWS

__all__ = ["CONVENTION", "METHODS", "FAMILY_NAMES", "LayerCost", "CostModel", "Count", "cost_model", "count",
           "count_module", "executed_macs", "family_key", "fvcore_by_module", "table3", "table3_module"]

METHODS = ("fvcore", "fvcore-full", "analytic")
CONVENTION = ("FLOPs = 2 x multiply-adds of the forward pass of one sequence of {T} tokens (the paper's "
              "convention; fvcore counts 1 per multiply-add, so fvcore on a batch of 2 sequences gives the same); "
              "eval-mode routing, one expert per routing choice per sparse layer")
# the token routers' keys and names come from the router registry (smlp/routing/registry.py)
FAMILY_NAMES = {"transformer": "Transformer", "gmlp": "gMLP", **{r.name: r.title for r in TOKEN_ROUTERS.values()},
                "smlp": "sMLP",
                "hypermixer": "HyperMixer", "hypermixer_untied": "HyperMixer (untied)", "ninformer": "NiNformer",
                "gmlp_token_routed": "gMLP, token-routed"}
# dense gMLP models whose SGU is replaced (LMConfig.token_mixer): family key -> LMConfig fields


# ---------------------------------------------------------------- costs


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding + final norm + output projection): multiply-adds for one
    sequence, parameters held by one GPU."""

    macs: int
    params_expert: int
    params_non_expert: int

    def __add__(self, other: LayerCost) -> LayerCost:
        return LayerCost(self.macs + other.macs, self.params_expert + other.params_expert,
                         self.params_non_expert + other.params_non_expert)

    def __mul__(self, k: int) -> LayerCost:
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
            "smoe_experts": c.smoe_num_experts,
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
    expert = sum(p.numel() for p in module.parameters() if is_expert(p))
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
    with torch.no_grad(), warnings_off(), counted_forms(module):
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
    """Per-kind costs of `cfg` for one sequence of `tokens` tokens (default: cfg.seq_len).

    Remembered per arguments (the config is frozen, the result too): tracing a model with fvcore takes
    a second, and the FLOP matches, the benchmarks and the step-time model ask for the same ones often."""
    return _cost_model(cfg, tokens, experts_per_gpu, method)


@functools.lru_cache(maxsize=256)
def _cost_model(cfg: LMConfig, tokens: int | None, experts_per_gpu: int, method: str) -> CostModel:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: valid values are {', '.join(METHODS)}")
    tokens = cfg.seq_len if tokens is None else tokens
    if not 1 <= tokens <= cfg.seq_len:
        raise ValueError(f"tokens={tokens} must be in [1, seq_len={cfg.seq_len}]")
    if cfg.sparse_layers:
        check_experts_per_gpu(cfg.num_experts, experts_per_gpu)
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
    router = TOKEN_ROUTERS[c.router]  # scoring cost and slots per token: the registry
    slots = rows * router.top_k
    expert = 2 * c.d_model * c.d_ffn + (5 * c.d_model if c.uses_expert_norm else 0)
    return router.router_macs(rows, c.d_model, c.num_experts) + slots * expert


def _smoe_macs(smoe: SMoE, B: int, n: int) -> int:
    c = smoe.cfg
    C = c.gated_dim
    P = min(c.prefix_len, n)
    M = n - P
    # the positions the router reads (none, the prefix, or all n: Appendix B): the registry
    router = SMOE_ROUTINGS[c.routing].router_macs(B * C, n, P, c.num_experts)
    return _ln(B * n, C) + router + B * C * M * M


def _sgu_macs(sgu: SpatialGatingUnit, n: int) -> int:
    C = sgu.cfg.gated_dim
    return _ln(n, C) + n * n * C


def _token_mixer_macs(mixer: nn.Module, n: int) -> int:
    """The gMLP block's token mixer: SGU, causal HyperMixing or NiNformer gating (smlp/hypermixer.py,
    smlp/ninformer.py)."""
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
    """One sequence through a token-routed gMLP block (smlp/token_routed.py): the router, every token
    once through one expert's projections, and the spatial mixing of all experts at once as one
    masked n x n product (the dense SGU's count); exact whatever the routing."""
    c = layer.cfg
    D, Fw, C = c.d_model, c.d_ffn, c.d_ffn // 2
    return n * D * c.num_experts + _ln(n, D) + n * (D * Fw + 5 * C + n * C + C * D)


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
    (smlp/spatial.py, `executed_pairs` per column), and the Transformers' fused causal attention
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
