"""Capacity-limited softmax gates: Switch Transformer top-1 and GShard top-2, and the router z-loss.

Pure functions from router logits (logits.py) to a `RoutingPlan`: no collective, no parameters.

- `switch_top1`: Fedus et al. 2021 (arXiv:2101.03961), sec. 2.1-2.2, eq. 1-6.
- `gshard_top2`: Lepikhin et al. 2020 (arXiv:2006.16668), sec. 2.2 and Algorithm 1.
- `router_z_loss`: Zoph et al. 2022, "ST-MoE", eq. 5.

Capacity drops rows in order of position; a dropped slot has expert -1 and weight 0, and its row
keeps only the residual. Capacity couples the rows of a batch, so in eval mode both gates route each
row on its own logits with no limit by default, which keeps evaluation causal (routes.py). The one
host read is the check that the logits are usable; with `defer_checks` it stays in the plan (a
DeferredCheck), and the dispatcher reads its verdict with the split sizes (plan.py).

Shapes: the core's legend (smlp/__init__.py); K is 1 for Switch, 2 for GShard.
"""
from __future__ import annotations

import math
import numbers
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import accumulation_dtype
from .plan import RoutingPlan, score_check

__all__ = ["switch_top1", "gshard_top2", "switch_capacity", "gshard_capacity", "router_z_loss", "GSHARD_AUX_LOSSES"]

# GShard's load-balancing loss: "normalized" = E^2 * mean_e(m_e c_e) (1.0 for a balanced router, like
# Switch's E * sum_e f_e P_e), "fairscale" = mean_e(m_e c_e).
GSHARD_AUX_LOSSES = ("normalized", "fairscale")


# ---------------------------------------------------------------- capacities (host ints)


def _check_capacity_factor(name: str, value) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0 (e.g. 1.0 or 1.25)")
    # Exact in the decimal the user wrote: ceil(1.1 * 100 / 2) is 55, where float64 gives 56.
    return Fraction(repr(float(value)))


def _check_min_capacity(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"min_capacity={value!r} is invalid: it must be an integer >= 0 (e.g. 0 or 4)")
    return value


def switch_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int = 4) -> int:
    """Switch expert capacity (Fedus et al. eq. 3): max(ceil(capacity_factor * S / E), min_capacity).

    The product is exact in the decimal the factor was written in; a capacity >= S never drops.
    """
    cf = _check_capacity_factor("capacity_factor", capacity_factor)
    min_capacity = _check_min_capacity(min_capacity)
    if num_experts < 1 or num_tokens < 0:
        raise ValueError(f"switch_capacity needs num_tokens >= 0 and num_experts >= 1, got {num_tokens}, {num_experts}")
    return max(math.ceil(cf * num_tokens / num_experts), min_capacity)


def gshard_capacity(num_tokens: int, num_experts: int, capacity_factor: float = 1.0) -> int:
    """GShard expert capacity 2S/E (Lepikhin et al. sec. 2.2), rounded up: ceil(factor * 2S / E).

    Rounded up so that every expert has a slot for any S >= 1; where E divides S it is fairscale's
    2S // E. The factor is exact in the decimal it was written in.
    """
    cf = _check_capacity_factor("capacity_factor", capacity_factor)
    if num_experts < 1 or num_tokens < 0:
        raise ValueError(f"gshard_capacity needs num_tokens >= 0 and num_experts >= 1, got {num_tokens}, {num_experts}")
    return math.ceil(cf * 2 * num_tokens / num_experts)


def router_z_loss(logits_SE: Tensor) -> Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over rows of logsumexp(logits)^2, in fp32.

    It keeps the logits small, against fp32 roundoff in the softmax. 0 rows give a zero in the graph."""
    logits_SE = logits_SE.to(accumulation_dtype(logits_SE.dtype))
    if logits_SE.shape[0] == 0:
        return logits_SE.sum() * 0
    return torch.logsumexp(logits_SE, dim=-1).square().mean()


# ---------------------------------------------------------------- shared pieces


def _open_gate(fn: str, logits_SE: Tensor, noise_SE: Tensor | None, layer: str,
               defer_checks: bool | str) -> tuple[Tensor | None, Tensor, Tensor]:
    """Check the logits (their deferred check, plan.py), and move them to at least fp32 (Switch
    sec. 2.4, "selective precision").

    Returns:
        fault:   the check to leave in the plan (defer_checks), or None once read
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
    fault = score_check(logits_SE, layer, defer_checks, allow_neg_inf=True)
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
    defer_checks: bool | str = False,
) -> RoutingPlan:
    """Switch Transformer top-1 routing (Fedus et al. 2021, sec. 2.1-2.2).

    p = softmax(logits) in fp32; each row goes to e = argmax p with combine weight p_e (not
    renormalized). An expert keeps the first C = `switch_capacity` rows that chose it.

    aux_loss = E * sum_e f_e * P_e (eq. 4 without alpha), f_e the fraction of rows that chose e
    before dropping, P_e the mean router probability of e: 1.0 when balanced, differentiable through P.

    capacity_factor:      training capacity factor; None = never drop.
    min_capacity:         floor on the capacity (>= 0; 4 as flaxformer's min_expert_capacity).
    training:             False routes with `eval_capacity_factor` instead.
    eval_capacity_factor: eval capacity factor; None (default) = no limit in eval, so each row is
                          routed on its own logits (causal per position).
    noise_SE:             optional noise added to the logits for the choice only; weights and P_e
                          use the clean probabilities. The paper uses none.
    layer:                the layer's name, for the error on non-finite logits.
    defer_checks:         leave that check in the plan for the dispatcher (plan.py).
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
    """Gumbel(0, 1) noise of the logits' shape (default dtype) from the global generator.

    Bit for bit fairscale's `gumbel_rsample` (torch.distributions.Gumbel), with its operations written
    out: building the distribution reads the host twice per call and torch.compile cannot trace it."""
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
    defer_checks: bool | str = False,
) -> RoutingPlan:
    """GShard top-2 gating (Lepikhin et al. 2020, sec. 2.2, Algorithm 1), as fairscale's `top2gating`.

    1. p = softmax(logits) in fp32; first expert e1 = argmax p.
    2. Second expert e2 = argmax(logits + noise) with e1 excluded (Gumbel-max: a sample from the
       softmax over the other experts). Without noise_SE, training draws Gumbel(0, 1) noise and eval
       takes the second-best logit.
    3. Capacity C = `gshard_capacity` (eval: eval_capacity_factor, or capacity_factor with
       drop_in_eval, else no limit). Per expert, all first choices take slots in row order before
       any second choice; slots of rank >= C are dropped (expert -1, weight 0).
    4. Weights: w_k = p_{e_k} / max(p_{e1} + p_{e2}, eps) over the kept slots.
    5. Load-balancing loss, m_e the mean probability of e, c_e the fraction of first choices to e:
       "normalized" (default) E^2 * mean_e(m_e * c_e), 1 when balanced like Switch's, so one weight
       balances both gates equally hard; "fairscale" mean_e(m_e * c_e), Algorithm 1 as printed.
    `layer` and `defer_checks` as in `switch_top1`.

    Unlike fairscale: any S is accepted (it asserts S % E == 0), eval has no capacity limit unless
    drop_in_eval, a row with no second expert (E = 1, other logits -inf) drops its second slot, and
    weights and loss stay fp32.
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
