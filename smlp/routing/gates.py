"""Capacity-limited softmax gates: Switch Transformer top-1 and GShard top-2.

Shapes: the core's legend (smlp/__init__.py); here S rows (tokens), E experts, K expert slots per
row (1 for Switch, 2 for GShard).

Both gates are pure functions: router logits in, a `RoutingPlan` out (Megatron-Core's `routing()`
apart from `gating()`, the logits: logits.py). They never call a collective and own no
parameters; the layer computes the logits with its own weights.

- `switch_top1`: Fedus, Zoph & Shazeer, "Switch Transformers" (arXiv:2101.03961), sec. 2.1-2.2:
  top-1 of the router softmax (eq. 1), combine weight = that probability (eq. 2), expert
  capacity = ceil(capacity_factor * S / E) (eq. 3) with a floor `min_capacity` (4, as in
  flaxformer's Switch `MoeLayer.min_expert_capacity`), load-balancing loss
  E * sum_e f_e * P_e (eq. 4-6; the caller multiplies by alpha, 1e-2 in the paper).
  Checked against DeepSpeed's `top1gating(use_rts=False)`, see the notes on the function.
- `gshard_top2`: Lepikhin et al., "GShard" (arXiv:2006.16668), sec. 2.2 and Algorithm 1:
  first expert = argmax of the softmax, second expert sampled by Gumbel-max on the logits with
  the first excluded, capacity 2S/E, first-choice slots filled before second-choice slots,
  weights renormalized over the kept slots. Equal to fairscale's `top2gating` (see tests); its
  load-balancing loss is scaled by E^2 as fairseq's MoE branch and DeepSpeed scale it. A capacity
  factor scales the capacity to ceil(factor * 2S/E) (1, the default, is the paper's 2S/E).
- `router_z_loss`: ST-MoE (Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse
  Expert Models", eq. 5): the mean over rows of logsumexp(logits)^2, which keeps the router's
  logits small (fp32 roundoff in the softmax). The layer computes it from the logits when the
  criterion asks (moe.TMoE.z_loss), which adds it with its own weight (off by default, as in the
  sMLP paper): a forward that nobody asks it of builds none of its graph.

Capacity dropping keeps rows in order of position (row 0 first). A dropped slot has expert -1
and weight 0: its row gets nothing from that slot (the layer's residual carries it).

Training vs. eval: capacity couples the rows of a batch (whether row t is kept depends on the
rows before it, and rows of the *next* sequence come after row t in a flattened batch). In eval
mode both gates therefore route every row on its own logits with no capacity limit by default,
which keeps eval causal per position (routes.py). `eval_capacity_factor` (both gates) and
`drop_in_eval` (GShard: the training capacity) restore capacity-limited eval when wanted.

Host synchronization: capacities are computed from shapes on the host and dropping is a cumsum
on the device; the only host read is the check that the logits are usable (no NaN or +inf, and at
least one logit above -inf per row; -inf masks an expert), which raises NonFiniteScoresError
naming the layer. Called on its own a gate reads it at once; inside a layer (`defer_checks=True`)
the verdict stays on the device in the plan's fault record, and the dispatcher reads it with the
split sizes it reads anyway (plan.py), so the gate itself never waits for the device.
"""
from __future__ import annotations

import math
import numbers
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import accumulation_dtype
from .plan import RoutingPlan, deferred_or_raised, nonfinite_fault

__all__ = ["switch_top1", "gshard_top2", "switch_capacity", "gshard_capacity", "router_z_loss", "GSHARD_AUX_LOSSES"]

# GShard's load-balancing loss: "normalized" = E^2 * mean_e(m_e c_e) (fairseq's MoE branch, DeepSpeed,
# lingvo; 1.0 for a balanced router, like Switch's E * sum_e f_e P_e), "fairscale" = mean_e(m_e c_e).
GSHARD_AUX_LOSSES = ("normalized", "fairscale")


# ---------------------------------------------------------------- capacities (host ints)


def _check_capacity_factor(name: str, value) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0 (e.g. 1.0 or 1.25)")
    # The decimal the user wrote, not its binary approximation: 1.1 * 100 / 2 must give 55, not
    # 55.00000000000001 (float64, ceil -> 56), nor a float32 product (DeepSpeed: ceil(1.2 * 25) = 31).
    return Fraction(repr(float(value)))


def _check_min_capacity(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"min_capacity={value!r} is invalid: it must be an integer >= 0 (e.g. 0 or 4)")
    return value


def switch_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int = 4) -> int:
    """Switch expert capacity (Fedus et al. eq. 3): max(ceil(capacity_factor * S / E), min_capacity).

    The product is exact in the decimal the factor was written in (1.2 * 25 / 1 -> 30). It is
    not capped at S: a capacity >= S simply never drops.
    """
    cf = _check_capacity_factor("capacity_factor", capacity_factor)
    min_capacity = _check_min_capacity(min_capacity)
    if num_experts < 1 or num_tokens < 0:
        raise ValueError(f"switch_capacity needs num_tokens >= 0 and num_experts >= 1, got {num_tokens}, {num_experts}")
    return max(math.ceil(cf * num_tokens / num_experts), min_capacity)


def gshard_capacity(num_tokens: int, num_experts: int, capacity_factor: float = 1.0) -> int:
    """GShard expert capacity 2S/E (Lepikhin et al. sec. 2.2), rounded up: ceil(factor * 2S / E).

    fairscale computes 2S // E and only accepts S divisible by E, where both agree. Rounding up
    keeps at least one slot per expert for any S >= 1 (2S // E is 0 when 2S < E). The factor
    (1 by default, the paper's) is exact in the decimal it was written in, as Switch's.
    """
    cf = _check_capacity_factor("capacity_factor", capacity_factor)
    if num_experts < 1 or num_tokens < 0:
        raise ValueError(f"gshard_capacity needs num_tokens >= 0 and num_experts >= 1, got {num_tokens}, {num_experts}")
    return math.ceil(cf * 2 * num_tokens / num_experts)


def router_z_loss(logits_SE: Tensor) -> Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over rows of logsumexp(logits)^2, in fp32.

    0 rows give a zero that still belongs to the graph."""
    logits_SE = logits_SE.to(accumulation_dtype(logits_SE.dtype))
    if logits_SE.shape[0] == 0:
        return logits_SE.sum() * 0
    return torch.logsumexp(logits_SE, dim=-1).square().mean()


# ---------------------------------------------------------------- shared pieces


def _open_gate(fn: str, logits_SE: Tensor, noise_SE: Tensor | None, layer: str,
               defer_checks: bool) -> tuple[Tensor | None, Tensor, Tensor]:
    """The opening both gates share: check the logits, take their fault record (plan.py), and
    compute in (at least) fp32 (Switch sec. 2.4, "selective precision"; fp64 stays fp64).

    Returns:
        fault:   the fault record to leave in the plan (defer_checks), or None once read
        logits_SE: the logits in the compute dtype, (S, E)
        probs_SE:  their softmax, (S, E)
    """
    if not isinstance(logits_SE, Tensor) or logits_SE.dim() != 2:
        shape = tuple(logits_SE.shape) if isinstance(logits_SE, Tensor) else type(logits_SE).__name__
        raise ValueError(f"{fn} expects router logits of shape (S, E) (rows, experts), got {shape}")
    if not logits_SE.is_floating_point():
        raise ValueError(f"{fn} expects floating-point logits, got dtype {logits_SE.dtype}")
    if logits_SE.shape[1] < 1:
        raise ValueError(f"{fn} needs at least one expert: got logits of shape {tuple(logits_SE.shape)} (E = 0)")
    if noise_SE is not None and (not isinstance(noise_SE, Tensor) or noise_SE.shape != logits_SE.shape):
        shape = tuple(noise_SE.shape) if isinstance(noise_SE, Tensor) else type(noise_SE).__name__
        raise ValueError(f"{fn}: noise_SE must have the logits' shape {tuple(logits_SE.shape)}, got {shape}")
    fault = deferred_or_raised(nonfinite_fault(logits_SE, allow_neg_inf=True), layer, defer_checks)
    logits_SE = logits_SE.to(accumulation_dtype(logits_SE.dtype))
    return fault, logits_SE, torch.softmax(logits_SE, dim=-1)


def _slot_positions(mask_SE: Tensor) -> Tensor:
    """0-based rank of each row among the rows sent to the same expert, in row order: (S, E)."""
    return torch.cumsum(mask_SE, dim=0) - 1


def _empty_plan(logits_SE: Tensor, k: int, fault: Tensor | None) -> RoutingPlan:
    # S = 0 (e.g. a rank with no tokens): a zero loss that still belongs to the graph.
    return RoutingPlan(torch.empty(0, k, dtype=torch.long, device=logits_SE.device),
                       logits_SE.new_zeros(0, k), logits_SE.sum() * 0, fault)


# ---------------------------------------------------------------- Switch


def switch_top1(
    logits_SE: Tensor,
    *,
    capacity_factor: float | None = 1.0,
    min_capacity: int = 4,
    training: bool = True,
    eval_capacity_factor: float | None = None,
    noise_SE: Tensor | None = None,
    layer: str = "switch router",
    defer_checks: bool = False,
) -> RoutingPlan:
    """Switch Transformer top-1 routing (Fedus et al. 2021, sec. 2.1-2.2).

    p = softmax(logits) in fp32; each row goes to e = argmax p with combine weight p_e (not
    renormalized). Expert capacity C = max(ceil(capacity_factor * S / E), min_capacity)
    (`switch_capacity`); rows beyond C for an expert are dropped in order of position (the first
    C rows that chose e are kept): expert -1, weight 0.

    aux_loss = E * sum_e f_e * P_e (eq. 4 without alpha), f_e the fraction of rows whose choice
    is e *before* dropping, P_e the mean router probability of e. It is 1.0 for a perfectly
    balanced router and differentiable through P only.

    capacity_factor:      training capacity factor; None = never drop.
    min_capacity:         floor on the capacity (>= 0).
    training:             False routes with `eval_capacity_factor` instead.
    eval_capacity_factor: eval capacity factor; None (default) = no limit in eval, so each row is
                          routed on its own logits (causal per position).
    noise_SE:             optional additive noise on the logits for the *choice* only (DeepSpeed's
                          noisy_gate_policy='RSample' with Gumbel noise); weights and P_e use the
                          clean probabilities. Used whenever given. The paper's default is no noise.
    layer:                the layer's name, for the error on non-finite logits.
    defer_checks:         leave that check's verdict on the device in the plan's fault record
                          (read by the dispatcher, plan.py) instead of reading it here.

    Reference: DeepSpeed `sharded_moe.top1gating(..., drop_tokens=True, use_rts=False)` gives the
    same choices, weights and l_aux = E * sum(me * ce). It differs in two places (tests pin both):
    it keeps the rows `torch.topk` happens to return among the tied 0/1 mask entries instead of
    the first C by position, and its capacity is ceil() of a float32 product, which is one too
    large when rounding lands just above an integer (S=25, E=1, factor 1.2 gives 31, not 30).
    """
    factor = capacity_factor if training else eval_capacity_factor
    if capacity_factor is not None:
        _check_capacity_factor("capacity_factor", capacity_factor)
    if eval_capacity_factor is not None:
        _check_capacity_factor("eval_capacity_factor", eval_capacity_factor)
    _check_min_capacity(min_capacity)
    fault, logits_SE, probs_SE = _open_gate("switch_top1", logits_SE, noise_SE, layer, defer_checks)
    S, E = logits_SE.shape
    if S == 0:
        return _empty_plan(logits_SE, 1, fault)

    with torch.no_grad():
        choice_scores = probs_SE if noise_SE is None else logits_SE + noise_SE.to(logits_SE.device)
        expert_S = choice_scores.argmax(dim=-1)
        mask_SE = F.one_hot(expert_S, E)
        if factor is None:
            kept_S = torch.ones_like(expert_S, dtype=torch.bool)
        else:
            capacity = switch_capacity(S, E, factor, min_capacity)
            kept_S = _slot_positions(mask_SE).gather(1, expert_S[:, None]).squeeze(1) < capacity

    fraction_E = mask_SE.to(probs_SE.dtype).mean(dim=0)                      # f_e, before dropping
    aux_loss = E * torch.sum(fraction_E * probs_SE.mean(dim=0))     # E * sum f_e P_e
    weight_S = probs_SE.gather(1, expert_S[:, None]).squeeze(1) * kept_S
    experts_S = torch.where(kept_S, expert_S, -1)
    return RoutingPlan(experts_S[:, None], weight_S[:, None], aux_loss, fault)


# ---------------------------------------------------------------- GShard


def _gumbel_like(logits_SE: Tensor) -> Tensor:
    """Gumbel(0, 1) noise of the logits' shape (default dtype, float32) from the global generator.

    Bit for bit what fairscale's `gumbel_rsample` draws, torch.distributions.Gumbel(0, 1).rsample
    (a seeded run picks the same second experts as fairscale), with the same operations written
    out: building the distribution validates its arguments with two host reads on every call, and
    torch.compile cannot trace it. Gumbel is Uniform(tiny, 1 - eps) followed by
    x -> -log(x) -> -log(x) as affine maps 0 + (-1) * x (tests/test_gates.py compares the two)."""
    device, dtype = logits_SE.device, torch.get_default_dtype()  # the distribution's (0-d zeros and ones)
    finfo = torch.finfo(dtype)
    low = torch.full((), finfo.tiny, dtype=dtype, device=device)
    high = torch.full((), 1 - finfo.eps, dtype=dtype, device=device)
    minus_one = -torch.ones((), dtype=dtype, device=device)
    u = low + torch.rand(logits_SE.shape, dtype=dtype, device=device) * (high - low)
    x = 0 + minus_one * u.log()
    return torch.zeros((), dtype=dtype, device=device) + minus_one * x.log()


def gshard_top2(
    logits_SE: Tensor,
    *,
    noise_SE: Tensor | None = None,
    training: bool = True,
    drop_in_eval: bool = False,
    capacity_factor: float = 1.0,
    eval_capacity_factor: float | None = None,
    aux_loss: str = "normalized",
    layer: str = "gshard router",
    defer_checks: bool = False,
) -> RoutingPlan:
    """GShard top-2 gating (Lepikhin et al. 2020, sec. 2.2, Algorithm 1), as fairscale's `top2gating`.

    1. p = softmax(logits) in fp32; first expert e1 = argmax p.
    2. Second expert e2 = argmax(logits + noise) with e1 excluded (Gumbel-max: a sample from the
       softmax over the remaining experts). noise_SE is used whenever given; otherwise training
       draws Gumbel(0, 1) noise as fairscale does and eval uses none (e2 = second-best logit,
       deterministic).
    3. Capacity C = ceil(capacity_factor x 2S / E) (`gshard_capacity`; the paper's 2S/E at the
       default 1; in eval mode eval_capacity_factor, or capacity_factor with drop_in_eval, or no
       limit). Slots are ranked per expert: all first
       choices in row order, then all second choices in row order, so a second choice only gets
       a slot left over by the first choices (dropped first choices still count). Slots with
       rank >= C are dropped (expert -1, weight 0).
    4. Weights: w_k = p_{e_k} / max(p_{e1} + p_{e2}, eps) over the kept slots, so a row whose first
       choice was dropped puts weight 1 on its second.
    5. The load-balancing loss, m_e the mean router probability of expert e and c_e the fraction
       of first choices that went to e before dropping:
       aux_loss="normalized" (default): E^2 * mean_e(m_e * c_e), as fairseq's MoE branch
           (`top2gating`), DeepSpeed (`sharded_moe.top2gating`) and lingvo compute it. It is 1 for
           a perfectly balanced router and equals switch_top1's E * sum_e f_e P_e on the first
           choices, so one weight (0.01) balances GShard and Switch equally hard.
       aux_loss="fairscale": mean_e(m_e * c_e) (fairscale's `top2gating`, Algorithm 1 as
           printed), 1/E^2 when balanced: with the same weight, E^2 times weaker.
    `layer` names the layer in the error raised for non-finite logits; defer_checks=True leaves
    that check's verdict in the plan's fault record for the dispatcher to read (plan.py).

    Differences from fairscale, all outside its domain or degenerate: any S is accepted (fairscale
    asserts S % E == 0; where it runs the capacities agree), eval mode has no capacity limit unless
    drop_in_eval=True (fairscale has no eval mode), and when no second expert exists (E = 1, or every
    other logit -inf) the second slot is dropped instead of sending the row to e1 twice with half
    weight each (the layer output is the same). Weights and loss stay fp32 (fairscale casts them
    back to the logits' dtype).
    """
    _check_capacity_factor("capacity_factor", capacity_factor)
    if eval_capacity_factor is not None:
        _check_capacity_factor("eval_capacity_factor", eval_capacity_factor)
    factor = capacity_factor if training else (
        eval_capacity_factor if eval_capacity_factor is not None else capacity_factor if drop_in_eval else None)
    if aux_loss not in GSHARD_AUX_LOSSES:
        raise ValueError(f"aux_loss={aux_loss!r} is unknown: valid values are {', '.join(GSHARD_AUX_LOSSES)}")
    fault, logits_SE, probs_SE = _open_gate("gshard_top2", logits_SE, noise_SE, layer, defer_checks)
    S, E = logits_SE.shape
    if S == 0:
        return _empty_plan(logits_SE, 2, fault)

    with torch.no_grad():
        first_S = probs_SE.argmax(dim=-1)
        mask1_SE = F.one_hot(first_S, E)
        if noise_SE is None and training:
            noise_SE = _gumbel_like(logits_SE)
        scores_SE = logits_SE if noise_SE is None else logits_SE + noise_SE.to(logits_SE.device)
        second_S = scores_SE.masked_fill(mask1_SE.bool(), float("-inf")).argmax(dim=-1)
        has_second_S = second_S != first_S          # False only when every other score is -inf
        mask2_SE = F.one_hot(second_S, E) * has_second_S[:, None]

        if factor is not None:
            capacity = gshard_capacity(S, E, factor)
            rank1_S = _slot_positions(mask1_SE).gather(1, first_S[:, None]).squeeze(1)
            rank2_SE = _slot_positions(mask2_SE) + mask1_SE.sum(dim=0, keepdim=True)
            rank2_S = rank2_SE.gather(1, second_S[:, None]).squeeze(1)
            kept1_S = rank1_S < capacity
            kept2_S = has_second_S & (rank2_S < capacity)
        else:
            kept1_S = torch.ones_like(has_second_S)
            kept2_S = has_second_S

    loss = torch.mean(probs_SE.mean(dim=0) * mask1_SE.to(probs_SE.dtype).mean(dim=0))
    if aux_loss == "normalized":
        loss = loss * (E * E)

    gate1_S = probs_SE.gather(1, first_S[:, None]).squeeze(1) * kept1_S
    gate2_S = probs_SE.gather(1, second_S[:, None]).squeeze(1) * kept2_S
    denom_S = torch.clamp(gate1_S + gate2_S, min=torch.finfo(probs_SE.dtype).eps)
    weights_SK = torch.stack([gate1_S / denom_S, gate2_S / denom_S], dim=1)
    experts_SK = torch.stack([torch.where(kept1_S, first_S, -1), torch.where(kept2_S, second_S, -1)], dim=1)
    return RoutingPlan(experts_SK, weights_SK, loss, fault)
