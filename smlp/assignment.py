"""Balanced assignment of rows to experts: BASE Layers (Lewis et al. 2021, "BASE Layers:
Simplifying Training of Large, Sparse Models"), as used by the sMLP paper's tMoE (sec. 3.1) and
by training-time sMoE routing (sec. 3.2.2).

Shape legend (as in torchtitan's moe.py):
    S   rows to assign (tokens for tMoE, hidden-dimension vectors for sMoE)
    E   experts
    P   E padded to a power of two (at least 2), the width of the integer key table

The problem is a linear assignment with capacities: maximise sum_s scores[s, expert[s]] subject
to expert e receiving exactly capacity[e] rows. Base Layers solves it with an auction
(Bertsekas 1988, "The auction algorithm: a distributed relaxation method for the assignment
problem"; the variant for objects with several identical slots is Bertsekas & Castanon 1989,
"The auction algorithm for the transportation problem"). This file is the pure-torch auction
used by the routers in `routing.py`; fairseq's C++ `libbase.balanced_assignment` is the speed
and quality reference it is benchmarked against (`benchmarks/balanced_assignment.py`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["balanced_assignment", "expert_capacities"]

# Scores are normalised to "gain units": after removing row and column offsets (which change no
# balanced assignment's ranking), one unit is the median over rows of (best score - mean score),
# i.e. how much a typical row gains by going to its best expert rather than a random one.
# Scores further than _CLIP_GAINS units below a row's best are clipped there: such an expert is
# never wanted by that row, and the clip keeps every key inside int32.
_CLIP_GAINS = 64.0
# Integer key budget: a key is value * P + priority (0 <= priority < E <= P) with
# |value| < 3 * levels and levels = 2**_KEY_BITS / P, so keys (and keys minus prices) stay far
# from the int32 limits.
_KEY_BITS = 27
_NEG_KEY = -(1 << 30)  # key of padding experts and experts with capacity 0: never anyone's best
# The quantisation step is 64 * P / 2**27 gain units: 3e-5 for 64 experts, 5e-4 for 1024,
# 0.03 for 65536. Beyond that the step would approach eps.
_MAX_EXPERTS = 1 << 16
_MIN_WORKING_ROWS = 1024  # below this, step 4's smaller rounds cost as much as full ones


def expert_capacities(num_rows: int, num_experts: int, device=None) -> Tensor:
    """Rows each expert receives: S // E, plus one for the first S % E experts. (E,) int64."""
    if num_rows < 0 or num_experts < 1:
        raise ValueError(
            f"need num_rows >= 0 and num_experts >= 1, got num_rows={num_rows}, num_experts={num_experts}")
    e_E = torch.arange(num_experts, device=device)
    return num_rows // num_experts + (e_E < num_rows % num_experts).long()


@torch.no_grad()
def balanced_assignment(
    scores_SE: Tensor,
    *,
    eps: float = 0.03,
    tail_fraction: float = 1 / 128,
    working_fraction: float = 1 / 16,
    max_rounds: int | None = None,
    check_every: int | None = None,
) -> Tensor:
    """Assign each row to one expert with exact balance, maximising the total affinity.

    Balance rule: expert e receives exactly S // E + (1 if e < S % E else 0) rows, so every expert
    gets the same number of rows when E divides S (the Base Layers setting); S not divisible by
    E, S < E, S = 0 and E = 1 are all valid.

    Algorithm: Bertsekas' auction in Jacobi form (all rows bid at once), with experts as objects
    that hold several identical slots (Bertsekas & Castanon 1989). Vectorised torch only, on the
    input's device.
      0. Normalise: remove row and column offsets (each adds the same amount to every balanced
         assignment) so that each row's best score is 0, measure scores in gain units (1 =
         median over rows of best minus mean score), clip at -64 units and quantise to int32
         keys value * P + priority. One int32 max then yields both the best value and the best
         expert; the priority breaks ties in a per-row rotated order, so indifferent rows spread
         over the experts at once instead of queueing for expert 0. Everything after this step
         is exact integer arithmetic: bitwise deterministic on any device.
      1. Each round every row finds its best and second best expert at the current prices (a
         max/min tournament over the experts). Unassigned rows bid for their best expert,
         assigned rows re-bid for the expert they hold. A bid is the price at which the row would
         be indifferent: price + (its value there - the value of its best alternative).
      2. An over-subscribed expert keeps the highest bids up to its capacity and raises its price
         to max(price, lowest kept bid) + eps, pricing the others out: they bid elsewhere next
         round. An expert loses a row only when it is over-subscribed and refills at once, so the
         number of assigned rows never falls.
      3. Repeat until at most tail_fraction * S rows are unassigned (all rows, when step 4 is
         skipped). That count is read only every `check_every` rounds, never inside a round;
         once every row is assigned, further rounds change nothing.
      4. The last few rows take many cheap-to-resolve but full-cost rounds (an evicted row
         evicts another, one step per round). So continue the same auction, with its prices and
         assignments, on a working set only: the unassigned rows plus the working_fraction * S
         held rows with the smallest margins, the only ones those chains are likely to move;
         the other rows keep their expert. Skipped when the working set would not be small.
    With one eps (no eps-scaling), eps = 0.03 gain units, 4096 x 32 and 8192 x 64 random score
    matrices take about 5-10 full rounds and end within about 0.05% of the optimal gain over a
    random assignment (benchmarks/balanced_assignment.py measures it against scipy's exact
    solver and fairseq's C++ auction).

    Termination is guaranteed whatever the input: a round either raises some price by at least
    eps or assigns at least one more row, and prices stay bounded (no row bids above the clipped
    score range while some expert still has its initial price). Independently of that, after
    `max_rounds` rounds any row still unassigned is put into the remaining free capacity (a
    deterministic fill in row order), so the balance is exact even if the budget runs out.
    Non-finite scores are treated defensively: NaN and -inf count as the lowest finite score,
    +inf as the highest, and a matrix with no finite entry as all zeros.

    In training this couples the rows of a batch: the expert a row gets depends on every other
    row's scores, so the routing is not causal per position by design (the routers use greedy
    top-1 at inference for that reason).

    Args:
        scores_SE: (S, E) affinities, higher is better. Any real dtype, any device.
        eps: auction price step in gain units, in (0, 64]. Rows end within about eps of their
            best choice at the final prices, so the total is within about S * eps gain units of
            the optimum (far closer in practice). Smaller is more exact and takes more rounds.
        tail_fraction: step 4 starts when at most this fraction of rows is unassigned; 0 runs
            the full auction to the end (slower, slightly closer to the optimum).
        working_fraction: held rows in step 4's working set, as a fraction of S (at least
            1024 rows; step 4 is skipped if that is more than half of the rows).
        max_rounds: auction round budget, steps 1-4 together, before the fill; default
            max(64, 4 * E, 4 / eps) (random scores take 5-20 rounds at the default eps).
        check_every: rounds between completion checks (each check is a host sync); default 1 on
            CPU, where a check costs nothing, and 4 on accelerators.

    Returns:
        (S,) int64 expert index per row, on the input's device.
    """
    if scores_SE.dim() != 2:
        raise ValueError(f"balanced_assignment expects scores of shape (S, E), got {tuple(scores_SE.shape)}")
    S, E = scores_SE.shape
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"balanced_assignment supports 1 to {_MAX_EXPERTS} experts, got scores of shape {(S, E)}")
    if not 0 < eps <= _CLIP_GAINS:
        raise ValueError(f"eps={eps} must be in (0, {_CLIP_GAINS:g}] (the auction's price step in gain units)")
    if not 0 <= tail_fraction < 1:
        raise ValueError(f"tail_fraction={tail_fraction} must be in [0, 1)")
    if not 0 < working_fraction <= 1:
        raise ValueError(f"working_fraction={working_fraction} must be in (0, 1]")
    device = scores_SE.device
    if S == 0 or E == 1:
        return torch.zeros(S, dtype=torch.long, device=device)
    if max_rounds is None:
        max_rounds = max(64, 4 * E, int(4 / eps))
    if check_every is None:
        check_every = 1 if device.type == "cpu" else 4
    if max_rounds < 0 or check_every < 1:
        raise ValueError(f"need max_rounds >= 0 and check_every >= 1, got {max_rounds} and {check_every}")

    cap_E = expert_capacities(S, E, device)
    sh = max(1, (E - 1).bit_length())
    levels = (1 << _KEY_BITS) >> sh
    eps_q = max(1, round(eps * levels / _CLIP_GAINS))  # eps in quantisation steps
    key_PS = _integer_keys(scores_SE, sh, levels)
    if S < E:
        key_PS = _disable_empty_experts(key_PS, cap_E)
    # Step 4 pays off only when the working set is a small part of the rows.
    work_rows = max(int(working_fraction * S), _MIN_WORKING_ROWS)
    tail_rows = int(tail_fraction * S) if 2 * work_rows <= S else 0
    expert_S, price_P, margin_S, rounds = _auction(
        key_PS, cap_E, sh, levels, eps_q, max_rounds, check_every, tail_rows)
    if tail_rows and rounds < max_rounds and int((expert_S < 0).sum()):
        # Step 4: continue on a working set: the unassigned rows and the held rows with the
        # smallest margins; the others keep their expert (one sync, for the gather).
        W = min(S, max(work_rows, 4 * tail_rows))
        rank_key_S = torch.where(expert_S < 0, -(1 << 40), margin_S.long())
        work_W = torch.sort(rank_key_S, stable=True).indices[:W]
        frozen_S = torch.ones(S, dtype=torch.bool, device=device).index_fill_(0, work_W, False)
        held_E = torch.zeros_like(cap_E).scatter_add_(0, expert_S.clamp(min=0), (frozen_S & (expert_S >= 0)).long())
        cap_W_E = cap_E - held_E
        key_PW = _disable_empty_experts(key_PS[:, work_W], cap_W_E)
        expert_W, _, _, _ = _auction(key_PW, cap_W_E, sh, levels, eps_q, max_rounds - rounds, check_every, 0,
                                     row_S=work_W, expert_S=expert_S[work_W], price_P=price_P)
        expert_S[work_W] = expert_W
    return _fill_free_capacity(expert_S, cap_E)


def _integer_keys(scores_SE: Tensor, sh: int, levels: int) -> Tensor:
    """Step 0: (P, S) int32 keys value * P + priority, value in [-levels, 0] quantised gain units.

    Padding experts (E <= e < P) get _NEG_KEY. Works in the (E, S) layout throughout, so every
    pass is contiguous.
    """
    S, E = scores_SE.shape
    P = 1 << sh
    x_ES = scores_SE.detach().t()
    x_ES = (x_ES.double() if x_ES.dtype == torch.float64 else x_ES.float()).contiguous()
    hi, lo = torch.stack([x_ES.amax(), x_ES.amin()]).tolist()  # one sync; NaN propagates through both
    if not (math.isfinite(hi) and math.isfinite(lo)):
        x_ES = _sanitize(x_ES)
        hi, lo = torch.stack([x_ES.amax(), x_ES.amin()]).tolist()
    mag = max(abs(hi), abs(lo))
    if mag > 1e30 or 0 < mag < 1e-30:  # rescale so the row shift cannot overflow (1e38 - -1e38)
        x_ES = x_ES / mag
    # Row and column offsets add the same amount to every balanced assignment (each row is used
    # once, each expert exactly capacity times), so both are removed: rows first (best = 0), then
    # scores far below a row's best are clipped so an outlier row cannot move a column mean,
    # then columns (mean accumulated in float64, so identical rows cancel exactly), rows again.
    y_ES = x_ES - x_ES.amax(dim=0, keepdim=True)
    y_ES.clamp_(min=-_CLIP_GAINS * _gain_unit(y_ES))
    y_ES -= y_ES.mean(dim=1, keepdim=True, dtype=torch.float64).to(y_ES.dtype)
    y_ES -= y_ES.amax(dim=0, keepdim=True)
    # One gain unit becomes levels / _CLIP_GAINS steps (the scale is capped so that a tiny gain
    # cannot make 0 * inf); anything below -levels is clipped there.
    scale = ((levels / _CLIP_GAINS) / _gain_unit(y_ES)).clamp_(max=torch.finfo(y_ES.dtype).max)
    y_ES.mul_(scale).floor_().clamp_(min=-levels)
    key_PS = torch.empty((P, S), dtype=torch.int32, device=y_ES.device)
    key_PS[:E] = y_ES
    # Tie priority of expert e for row s: (s - 1 - e) mod E, so that rows that are indifferent
    # start out spread evenly over the experts instead of all bidding for expert 0.
    e_E = torch.arange(E, device=y_ES.device, dtype=torch.int32)
    rotation_S = _rotation(torch.arange(S, device=y_ES.device, dtype=torch.int32), E)
    priority_ES = _wrap(rotation_S - e_E[:, None], E)
    torch.add(priority_ES, key_PS[:E], alpha=P, out=key_PS[:E])
    key_PS[E:] = _NEG_KEY
    return key_PS


def _rotation(row_S: Tensor, E: int) -> Tensor:
    """(row - 1) mod E: the expert of priority 0 for each row, see _integer_keys."""
    return torch.remainder(row_S - 1, E)


def _wrap(d: Tensor, E: int) -> Tensor:
    """d mod E for d in (-E, E), without an integer division over a large tensor."""
    return d + ((d >> (8 * d.element_size() - 1)) & E)


def _gain_unit(y_ES: Tensor) -> Tensor:
    """Median over rows of (best - mean score) for rows shifted to best 0: a few outlier rows
    cannot flatten all the others. The mean if most rows are constant, 1 if all are."""
    row_gain_S = -y_ES.mean(dim=0)
    gain = row_gain_S.median()
    gain = torch.where(gain > 0, gain, row_gain_S.mean())
    return torch.where(gain > 0, gain, torch.ones_like(gain))


def _disable_empty_experts(key_PS: Tensor, cap_E: Tensor) -> Tensor:
    """Experts with no capacity get the padding key, so no row ever bids for them."""
    P, E = key_PS.shape[0], cap_E.shape[0]
    off_P = torch.zeros(P, dtype=torch.bool, device=key_PS.device)
    off_P[:E] = cap_E == 0
    return torch.where(off_P[:, None], _NEG_KEY, key_PS)


def _sanitize(x: Tensor) -> Tensor:
    """NaN and -inf -> lowest finite score, +inf -> highest; no finite entry -> all zeros."""
    finite = torch.isfinite(x)
    lo = torch.where(finite, x, torch.inf).amin()
    hi = torch.where(finite, x, -torch.inf).amax()
    any_finite = finite.any()
    lo = torch.where(any_finite, lo, 0.0)
    hi = torch.where(any_finite, hi, 0.0)
    return torch.where(finite, x, torch.where(torch.isposinf(x), hi, lo))


def _top2(key_PS: Tensor) -> tuple[Tensor, Tensor]:
    """Largest and second largest key of every column, by a max/min tournament (P a power of 2)."""
    n = key_PS.shape[0] // 2
    first = torch.maximum(key_PS[:n], key_PS[n:])
    second = torch.minimum(key_PS[:n], key_PS[n:])
    while first.shape[0] > 1:
        n = first.shape[0] // 2
        a1, b1, a2, b2 = first[:n], first[n:], second[:n], second[n:]
        second = torch.maximum(torch.minimum(a1, b1), torch.maximum(a2, b2))
        first = torch.maximum(a1, b1)
    return first[0], second[0]


def _auction(key_PS: Tensor, cap_E: Tensor, sh: int, levels: int, eps_q: int, max_rounds: int,
             check_every: int, stop_at: int, row_S: Tensor | None = None, expert_S: Tensor | None = None,
             price_P: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, int]:
    """Steps 1-3 on keys (P, S), from an empty assignment at price 0 unless a state is given.

    row_S are the rows' indices in the full problem (they set the tie priorities of step 0).
    Stops at a check that finds at most `stop_at` rows unassigned, or after max_rounds rounds.
    Returns the (S,) int64 expert per row (-1: unassigned), the prices, the margins of the last
    round (bid - price, in quantisation steps) and the number of rounds run.
    """
    P, S = key_PS.shape
    E = cap_E.shape[0]
    device = key_PS.device
    cap_P = torch.zeros(P, dtype=torch.long, device=device)
    cap_P[:E] = cap_E
    # Sort key of a candidate: (expert, descending margin) packed in one int32; the margin lives
    # in [-levels, levels] and is stored as levels - margin.
    margin_bits = (2 * levels).bit_length()
    low_mask = (1 << margin_bits) - 1
    if price_P is None:
        price_P = torch.zeros(P, dtype=torch.int32, device=device)  # in quantisation steps
    if expert_S is None:
        expert_S = torch.full((S,), -1, dtype=torch.long, device=device)
    margin_S = torch.zeros(S, dtype=torch.int32, device=device)
    if row_S is None:
        row_S = torch.arange(S, device=device)
    rotation_S = _rotation(row_S, E)  # best expert = (rotation - priority) mod E
    e_P = torch.arange(P, device=device)
    pos_S = torch.arange(S, device=device)
    net_PS = torch.empty_like(key_PS)
    rounds = 0
    while rounds < max_rounds:
        if rounds and rounds % check_every == 0 and int((expert_S < 0).sum()) <= stop_at:
            break
        rounds += 1
        torch.sub(key_PS, (price_P << sh)[:, None], out=net_PS)
        best_S, second_S = _top2(net_PS)
        best_expert_S = _wrap(rotation_S - (best_S & (P - 1)), E)
        target_S = torch.where(expert_S >= 0, expert_S, best_expert_S)
        own_S = net_PS.gather(0, target_S[None])[0] >> sh
        alternative_S = torch.where(target_S == best_expert_S, second_S, best_S) >> sh
        # A row bids price[target] + margin: the price at which it would be indifferent.
        margin_S = (own_S - alternative_S).clamp_(-levels, levels)
        sort_key_S = (target_S.to(torch.int32) << margin_bits) + (levels - margin_S)
        sorted_S, order_S = torch.sort(sort_key_S, stable=True)  # stable: ties keep the earlier row
        sorted_expert_S = (sorted_S >> margin_bits).long()
        start_P = torch.searchsorted(sorted_expert_S, e_P)
        count_P = torch.searchsorted(sorted_expert_S, e_P, right=True) - start_P
        kept_sorted_S = (pos_S - start_P[sorted_expert_S]) < cap_P[sorted_expert_S]
        expert_S = torch.empty_like(expert_S).scatter_(0, order_S, torch.where(kept_sorted_S, sorted_expert_S, -1))
        # Over-subscribed experts: new price = max(old price, lowest kept bid) + eps.
        last_kept_P = sorted_S[(start_P + cap_P - 1).clamp_(0, S - 1)]
        raise_P = (levels - (last_kept_P & low_mask)).clamp_(min=0) + eps_q
        price_P = torch.where(count_P > cap_P, price_P + raise_P, price_P).to(torch.int32)
    return expert_S, price_P, margin_S, rounds


def _fill_free_capacity(expert_S: Tensor, cap_E: Tensor) -> Tensor:
    """Put rows still unassigned (-1) into the free capacity, in row order, without a host sync."""
    S = expert_S.shape[0]
    E = cap_E.shape[0]
    device = expert_S.device
    assigned_S = expert_S >= 0
    count_E = torch.zeros(E, dtype=torch.long, device=device).scatter_add_(
        0, expert_S.clamp(min=0), assigned_S.long())
    # Slot j of the layout [expert 0's slots, expert 1's slots, ...] is free if it lies past the
    # rows its expert already holds. Free slots and unassigned rows are equally many.
    slot_expert_S = torch.repeat_interleave(torch.arange(E, device=device), cap_E, output_size=S)
    first_slot_E = torch.cumsum(cap_E, 0) - cap_E
    free_S = (torch.arange(S, device=device) - first_slot_E[slot_expert_S]) >= count_E[slot_expert_S]
    free_rank_S = torch.cumsum(free_S.long(), 0) - 1
    expert_of_free_rank = torch.zeros(S + 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(free_S, free_rank_S, S), slot_expert_S)
    unassigned_rank_S = torch.cumsum((~assigned_S).long(), 0) - 1
    return torch.where(assigned_S, expert_S, expert_of_free_rank[unassigned_rank_S.clamp(min=0)])
