"""Core configurations: frozen, keyword-only dataclasses validated on construction.

A bad value raises ValueError naming the field, the value and what would be valid, so a
mistake in a fairseq flag surfaces before any weight is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

from .routing.gates import GSHARD_AUX_LOSSES
from .routing.prices import BALANCED_EVAL_ROUTINGS
from .routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS  # router names and per-router defaults: the registry

ACTIVATIONS = ("gelu", "relu")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is unknown: valid values are {', '.join(valid)}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} is invalid: it must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class SGUConfig:
    """Spatial Gating Unit (gMLP section 2.1), optionally multi-head.

    dim:     width of the SGU input. With split=True (gMLP) it is cut into a gate half and a
             value half of dim/2 each; with split=False the normalized input gates itself
             (the sMLP sparse block, which has no channel projection).
    seq_len: T, the size of the causal T x T spatial weight; inputs may be shorter.
    heads:   independent spatial weights over equal chunks of the gated channels.
    """

    dim: int
    seq_len: int
    heads: int = 1
    split: bool = True
    init_eps: float = 1e-3

    def __post_init__(self) -> None:
        _positive("dim", self.dim)
        _positive("seq_len", self.seq_len)
        _positive("heads", self.heads)
        if self.split and self.dim % 2:
            raise ValueError(f"dim={self.dim} must be even: the SGU splits it into two halves")
        if self.gated_dim % self.heads:
            raise ValueError(
                f"heads={self.heads} must divide the gated width {self.gated_dim} "
                f"(dim={self.dim}, split={self.split})"
            )

    @property
    def gated_dim(self) -> int:
        return self.dim // 2 if self.split else self.dim


@dataclass(frozen=True, kw_only=True)
class GMLPConfig:
    """A gMLP block: LayerNorm -> D->F projection -> GELU -> SGU -> F/2->D projection, residual."""

    d_model: int
    d_ffn: int
    seq_len: int
    heads: int = 1
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _positive("d_model", self.d_model)
        _positive("d_ffn", self.d_ffn)
        _probability("dropout", self.dropout)
        SGUConfig(dim=self.d_ffn, seq_len=self.seq_len, heads=self.heads)  # validates the SGU part

    @property
    def sgu(self) -> SGUConfig:
        return SGUConfig(dim=self.d_ffn, seq_len=self.seq_len, heads=self.heads)


@dataclass(frozen=True, kw_only=True)
class TMoEConfig:
    """Token-routed FFN experts (tMoE).

    router: base (balanced assignment, Base Layers), switch (top-1, capacity factor,
            load-balancing loss), gshard (top-2, capacity 2S/E), hash (fixed token-id table).
    capacity_factor: Switch's capacity factor (capacity cf x S/E), GShard's (cf x 2S/E; 1 is
            the paper's 2S/E), in training.
    eval_capacity_factor: the same at evaluation; None (default) routes every token in eval
            mode on its own scores with no capacity limit (causal per position; routing/gates.py).
    expert_norm: each expert normalizes its own input (Base Layers' expert sublayer); the
            default is True for base, False otherwise (the caller normalizes before routing).
    zero_init_output: the experts' second projection starts at zero, so each expert starts as
            the identity branch (as fairseq's `BaseSublayer`); the default is True for base only.
    shuffle: base only: in training, assign on a random rank (fairseq's `--base-shuffle`); only the
            routing scores travel through the shuffle, the tokens go straight to their expert.
    gshard_aux_loss: the scale of GShard's load-balancing loss (GSHARD_AUX_LOSSES).
    eval_routing: base only: how evaluation routes each token, priced (argmax of score - the
            experts' prices averaged over training, smlp/routing/prices.py) or greedy (argmax of
            score, as fairseq's BaseLayer).
    """

    d_model: int
    d_ffn: int
    num_experts: int
    router: str = "base"
    activation: str = "gelu"
    capacity_factor: float = 1.0
    eval_capacity_factor: float | None = None
    vocab_size: int | None = None
    hash_seed: int = 0
    expert_norm: bool | None = None
    zero_init_output: bool | None = None
    shuffle: bool = True
    gshard_aux_loss: str = "normalized"
    eval_routing: str = "priced"

    def __post_init__(self) -> None:
        _positive("d_model", self.d_model)
        _positive("d_ffn", self.d_ffn)
        _positive("num_experts", self.num_experts)
        _choice("router", self.router, tuple(TOKEN_ROUTERS))
        _choice("eval_routing", self.eval_routing, BALANCED_EVAL_ROUTINGS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("gshard_aux_loss", self.gshard_aux_loss, GSHARD_AUX_LOSSES)
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r} is invalid: it must be > 0")
        if self.eval_capacity_factor is not None and not self.eval_capacity_factor > 0:
            raise ValueError(f"eval_capacity_factor={self.eval_capacity_factor!r} is invalid: it must be > 0, or None "
                             f"for no capacity limit at evaluation")
        if not TOKEN_ROUTERS[self.router].learned_scores:  # routes on a table of token ids (hash)
            if self.vocab_size is None:
                raise ValueError(f"router={self.router!r} needs vocab_size: its table maps every token id to an "
                                 f"expert")
            _positive("vocab_size", self.vocab_size)

    @property
    def uses_expert_norm(self) -> bool:
        return TOKEN_ROUTERS[self.router].expert_norm if self.expert_norm is None else self.expert_norm

    @property
    def uses_zero_init_output(self) -> bool:
        return TOKEN_ROUTERS[self.router].zero_init_output if self.zero_init_output is None else self.zero_init_output

    @property
    def uses_shuffle(self) -> bool:
        return TOKEN_ROUTERS[self.router].shuffle and self.shuffle


@dataclass(frozen=True, kw_only=True)
class SMoEConfig:
    """The sparse spatial MoE (sMoE, sMLP section 3.1-3.2).

    dim, split, seq_len: as for SGUConfig; the gated channels are routed to experts.
    routing: deterministic (hidden chunk i -> expert i, 3.2.1) or partial (a router reads the
             first prefix_fraction of positions and assigns hidden dimensions to experts, which
             then mix only the remaining positions, 3.2.2). leaky-full-sequence is Appendix B's
             first design (Figure 7): the router reads all T positions, future ones included, so
             it is NOT causal; only for reproducing Figure 7.
    eval_routing: a balanced routing's evaluation rule, priced or greedy (TMoEConfig).
    """

    dim: int
    seq_len: int
    num_experts: int
    routing: str = "deterministic"
    split: bool = True
    prefix_fraction: float = 0.2
    init_eps: float = 1e-3
    eval_routing: str = "priced"

    def __post_init__(self) -> None:
        _positive("dim", self.dim)
        _positive("seq_len", self.seq_len)
        _positive("num_experts", self.num_experts)
        _choice("routing", self.routing, tuple(SMOE_ROUTINGS))
        _choice("eval_routing", self.eval_routing, BALANCED_EVAL_ROUTINGS)
        if self.split and self.dim % 2:
            raise ValueError(f"dim={self.dim} must be even: the sMoE splits it into gate and value halves")
        if self.routing == "deterministic" and self.gated_dim % self.num_experts:
            raise ValueError(
                f"num_experts={self.num_experts} must divide the gated width {self.gated_dim} "
                f"(dim={self.dim}, split={self.split}): deterministic routing sends equal chunks to experts"
            )
        if self.routing == "partial":
            if not 0.0 < self.prefix_fraction < 1.0:
                raise ValueError(f"prefix_fraction={self.prefix_fraction!r} must be in (0, 1)")
            if not 1 <= self.prefix_len < self.seq_len:
                raise ValueError(
                    f"seq_len={self.seq_len} with prefix_fraction={self.prefix_fraction} gives a routing "
                    f"prefix of {self.prefix_len} positions; it must leave at least one position on each side"
                )

    @property
    def gated_dim(self) -> int:
        return self.dim // 2 if self.split else self.dim

    @property
    def leaky(self) -> bool:
        """True for the router that reads every position (Appendix B): outputs see the future."""
        return not SMOE_ROUTINGS[self.routing].causal

    @property
    def router_len(self) -> int:
        """Positions the router reads: the prefix (partial), all T (leaky), none (deterministic)."""
        return SMOE_ROUTINGS[self.routing].router_len(self.prefix_fraction, self.seq_len)

    @property
    def prefix_len(self) -> int:
        """Positions the partial-prediction router reads (0 for deterministic routing)."""
        return SMOE_ROUTINGS[self.routing].prefix_len(self.prefix_fraction, self.seq_len)

    @property
    def expert_len(self) -> int:
        """Size of each expert's square spatial weight."""
        return self.seq_len - self.prefix_len


def check_smoe_experts(value: int, d_model: int, routing: str) -> None:
    """ValueError for a bad sMoE expert count (0 is the tie to num_experts), naming the valid ones."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"smoe_experts={value!r} is invalid: give a positive number of sMoE experts, or 0 for as "
                         f"many as the tMoE's experts")
    if value and routing == "deterministic" and d_model % value:
        valid = ", ".join(str(n) for n in range(1, d_model + 1) if d_model % n == 0 and n <= 64)
        raise ValueError(f"smoe_experts={value} must divide d_model={d_model}: deterministic routing gives each sMoE "
                         f"expert an equal chunk of the channels (valid counts up to 64: {valid})")


@dataclass(frozen=True, kw_only=True)
class SparseBlockConfig:
    """The sMLP sparse block: sMoE token mixing then tMoE (Base Layers) channel mixing.

    It has no dense channel projection (the paper's per-GPU parameter counts, Tables 8-10):
        x = x + sMoE(LayerNorm(x))     sMoE gates the D channels with themselves (split=False)
        x = x + tMoE(x)                Base Layers: sigmoid(x.c_e) * FFN_e(LN_e(x))

    num_experts:  the tMoE's experts, and the sMoE's unless smoe_experts says otherwise.
    smoe_experts: the sMoE's experts; 0 (default) ties them to num_experts, as the paper's models do
                  (one --num-experts for both). Deterministic routing gives each sMoE expert D / smoe_experts
                  channels (32 in the paper's 1024-wide, 32-expert models), so the two counts are two
                  different choices: more tMoE experts add parameters per token, more sMoE experts split the
                  same channels finer (a multi-head SGU with more heads).
    """

    d_model: int
    d_ffn: int
    seq_len: int
    num_experts: int
    smoe_experts: int = 0
    smoe_routing: str = "deterministic"
    activation: str = "gelu"
    dropout: float = 0.0
    prefix_fraction: float = 0.2
    base_shuffle: bool = True
    eval_routing: str = "priced"  # the balanced routers' evaluation rule (TMoEConfig)

    def __post_init__(self) -> None:
        _probability("dropout", self.dropout)
        check_smoe_experts(self.smoe_experts, self.d_model, self.smoe_routing)
        _ = self.smoe  # validates
        _ = self.tmoe

    @property
    def smoe_num_experts(self) -> int:
        """The sMoE's experts: smoe_experts, or num_experts when it is 0 (the tie)."""
        return self.smoe_experts or self.num_experts

    @property
    def smoe(self) -> SMoEConfig:
        return SMoEConfig(dim=self.d_model, seq_len=self.seq_len, num_experts=self.smoe_num_experts,
                          routing=self.smoe_routing, split=False, prefix_fraction=self.prefix_fraction,
                          eval_routing=self.eval_routing)

    @property
    def tmoe(self) -> TMoEConfig:
        return TMoEConfig(d_model=self.d_model, d_ffn=self.d_ffn, num_experts=self.num_experts,
                          router="base", activation=self.activation, shuffle=self.base_shuffle,
                          eval_routing=self.eval_routing)


@dataclass(frozen=True, kw_only=True)
class TokenRoutedGMLPConfig:
    """gMLP extended to token-level routing (sMLP Appendix A, Figure 6 right, Table 7).

    Every token goes to one of num_experts experts, each a whole gMLP block body whose SGU mixes
    only the earlier tokens routed to the same expert; the router is Switch's top-1 gate without
    a capacity, so it is causal (token_routed.py).
    """

    d_model: int
    d_ffn: int
    seq_len: int
    num_experts: int
    dropout: float = 0.0
    init_eps: float = 1e-3

    def __post_init__(self) -> None:
        _positive("d_model", self.d_model)
        _positive("d_ffn", self.d_ffn)
        _positive("seq_len", self.seq_len)
        _positive("num_experts", self.num_experts)
        _probability("dropout", self.dropout)
        if self.d_ffn % 2:
            raise ValueError(f"d_ffn={self.d_ffn} must be even: the SGU splits it into two halves")

    @property
    def expert(self) -> GMLPConfig:
        return GMLPConfig(d_model=self.d_model, d_ffn=self.d_ffn, seq_len=self.seq_len, heads=1, dropout=self.dropout)
