"""Balanced assignment of rows to experts: the auction of BASE Layers (Lewis et al. 2021), as the sMLP
paper's tMoE (sec. 3.1) and training-time sMoE routing (sec. 3.2.2) use it.

A linear assignment with capacities: maximise sum_s scores[s, expert[s]] subject to expert e
receiving exactly capacity[e] rows. It is solved by Bertsekas' auction (1988) for objects with
several identical slots (Bertsekas & Castanon 1989), as vectorised integer array code: torch tensors
on the input's device, numpy arrays on the CPU, bitwise the same result (auction_arrays.py).

Shapes: the core's legend (smlp/__init__.py); here S rows to assign, Z the key table's rows (E padded
to a power of two, at least 2), s rows of step 4's working set.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import record_function

from ..profiling import RANGES
from .auction_arrays import _NumpyOps, _TorchOps, sanitize_scores

__all__ = ["ACCELERATOR_CHECKS", "AuctionChecks", "CheckSchedule", "balanced_assignment", "expert_capacities",
           "sanitize_scores"]

# Scores are measured in gain units (step 0). Scores further than _CLIP_GAINS units below a row's best
# are clipped there: that row never wants such an expert, and the clip keeps every key inside int32.
_CLIP_GAINS = 64.0
# Integer key budget: a key is value * Z + priority (0 <= priority < E <= Z) with
# |value| < 3 * levels and levels = 2**_KEY_BITS / Z, so keys (and keys minus prices) stay far
# from the int32 limits.
_KEY_BITS = 27
_NEG_KEY = -(1 << 30)  # key of padding experts and experts with capacity 0: never anyone's best
# The quantisation step is 64 * Z / 2**27 gain units: 3e-5 for 64 experts, 5e-4 for 1024,
# 0.03 for 65536. Beyond that the step would approach eps.
_MAX_EXPERTS = 1 << 16
_MIN_WORKING_ROWS = 1024  # below this, step 4's smaller rounds cost as much as full ones
_MIN_TAIL_KEYS = 1 << 16  # below this many keys (S * Z) a full round costs less than step 4's set-up


@dataclass(frozen=True)
class CheckSchedule:
    """After which rounds the auction reads on the host whether it is done: every `every` rounds, or with
    `doubling` at rounds every, 2 every, 4 every, ... only. Rounds after completion change nothing, so a
    later check gives the same assignment (with step 4, whose start moves with the checks, a close one)."""

    every: int
    doubling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"check_every={self.every!r} is invalid: it must be a positive number of rounds")

    def due(self, rounds: int) -> bool:
        if rounds < 1 or rounds % self.every:
            return False
        k = rounds // self.every
        return not self.doubling or k & (k - 1) == 0


# Completion checks on an accelerator, where each is a host sync that stalls the stream: the routers'
# auctions end within 16 rounds at their sizes (docs/gpu.md), so one check is the rule, and a slow
# auction costs a read per doubling of its rounds, never one per few rounds.
ACCELERATOR_CHECKS = CheckSchedule(16, doubling=True)


class AuctionChecks:
    """One balanced layer's completion checks on an accelerator, sized from its own auctions.

    A check is a host read that stalls the stream, and a round past completion is wasted work: checking
    first at round 16 wastes 4-12 rounds at the routers' sizes (docs/gpu.md) and reads twice when an
    auction needs 17. These checks come first at the most rounds the layer's last `window` auctions took
    to complete (16 before any), then at its doublings. The read at a check is the number of rounds that
    left an expert over-subscribed, which says at which round the auction completed: one read, as a
    completion flag would be. Rounds after completion change nothing, so the assignment and the prices do
    not depend on the checks; `balanced_assignment` uses these only where its step 4, whose start moves
    with the checks, does not run, and where a check costs a read (not on the CPU's numpy path)."""

    def __init__(self, window: int = 8):
        self.recent: collections.deque[int] = collections.deque(maxlen=window)
        self.first = ACCELERATOR_CHECKS.every

    def due(self, rounds: int) -> bool:
        if rounds < 1 or rounds % self.first:
            return False
        k = rounds // self.first
        return k & (k - 1) == 0

    def completed(self, rounds: int) -> None:
        """An auction completed in `rounds` rounds (its last round over-subscribed no expert)."""
        self.recent.append(rounds)
        self.first = max(self.recent)


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
    check_every: int | CheckSchedule | None = None,
    with_prices: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Assign each row to one expert with exact balance, maximising the total affinity.

    Expert e receives exactly S // E + (1 if e < S % E else 0) rows (`expert_capacities`); any S >= 0
    and E >= 1 are valid. E = 2 is solved exactly by one threshold selection (`_two_experts`); other
    E by an auction in Jacobi form (all rows bid at once):
      0. Normalise: remove row and column offsets (each adds the same amount to every balanced
         assignment) so that each row's best score is 0, measure in gain units (1 = median over rows
         of best minus mean score), clip at -64 units and quantise to int32 keys value * Z + priority,
         so one max yields both the best value and the best expert. The priority breaks ties in a
         per-row rotated order, so indifferent rows spread over the experts at once. Everything after
         this step is exact integer arithmetic, bitwise the same on any device and backend.
      1. Every row finds its best expert at the current prices. Unassigned rows bid for it, assigned
         rows re-bid for the expert they hold; a bid is the price at which the row would be
         indifferent: price + (its value there - its best value elsewhere).
      2. An over-subscribed expert keeps the highest bids up to its capacity and raises its price to
         max(price, lowest kept bid) + eps. The number of assigned rows never falls.
      3. Repeat until at most tail_fraction * S rows are unassigned, read only at the rounds
         `check_every` names (never inside a round).
      4. The last rows take many full-cost rounds of one eviction each, so the same auction goes on
         over a working set only: the unassigned rows and the working_fraction * S held rows with the
         smallest margins. Skipped where the working set would not be small or the problem is small.

    Each round raises some price by eps or assigns one more row, and prices stay bounded, so the
    auction ends; after `max_rounds` the rows still unassigned fill the free capacity in row order, so
    the balance is exact regardless. NaN and -inf count as the lowest finite score, +inf as the highest.

    Args:
        scores_SE: (S, E) affinities, higher is better. Any real dtype, any device.
        eps: auction price step in gain units, in (0, 64]. The total ends within about S * eps gain
            units of the optimum; smaller is more exact and takes more rounds.
        tail_fraction: step 4 starts when at most this fraction of rows is unassigned; 0 runs the
            full auction to the end.
        working_fraction: held rows in step 4's working set, as a fraction of S (at least 1024).
        max_rounds: round budget of steps 1-4 before the fill; default max(64, 4 * E, 4 / eps).
        check_every: rounds between completion checks (each a host sync on an accelerator), a
            CheckSchedule, or a layer's AuctionChecks; default every round on the CPU, where a check costs
            nothing, and ACCELERATOR_CHECKS elsewhere (rounds 16, 32, 64, ...: usually one read per call).
            AuctionChecks apply where a check costs a read and step 4 does not run (the assignment is
            then the same whatever the checks); elsewhere the default applies.
        with_prices: also return the final expert prices.

    Returns:
        (S,) int64 expert index per row, on the input's device; with with_prices also price_E, (E,)
        float32 prices in score units, centred on zero. They are the assignment's dual:
        argmax_e(scores - price_E) reproduces it except for rows within about eps of a tie.
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
        expert_S = torch.zeros(S, dtype=torch.long, device=device)
        return (expert_S, torch.zeros(E, device=device)) if with_prices else expert_S
    if max_rounds is None:
        max_rounds = max(64, 4 * E, int(4 / eps))
    if max_rounds < 0:
        raise ValueError(f"need max_rounds >= 0, got {max_rounds}")
    if check_every is None or isinstance(check_every, AuctionChecks):
        checks = _check_schedule(device)
    else:
        checks = check_every if isinstance(check_every, CheckSchedule) else CheckSchedule(check_every)

    with record_function(RANGES["auction"]):  # its own range: numpy's time on the CPU shows apart from routing's
        ops = _array_ops(device)
        if E == 2:
            expert_S, price_E = _two_experts(scores_SE, S - S // 2, ops)
            return (expert_S, price_E) if with_prices else expert_S
        sh = max(1, (E - 1).bit_length())
        levels = (1 << _KEY_BITS) >> sh
        eps_q = max(1, round(eps * levels / _CLIP_GAINS))  # eps in quantisation steps
        x_ES, unit = _finite_scores(scores_SE, ops)
        key_ZS, offset_E, steps_per_unit = _integer_keys(x_ES, sh, levels, ops)
        # Step 4 pays off only when the working set is a small part of the rows and a full round
        # costs much more than setting it up.
        work_rows = max(int(working_fraction * S), _MIN_WORKING_ROWS)
        tail_rows = int(tail_fraction * S) if 2 * work_rows <= S and S << sh >= _MIN_TAIL_KEYS else 0
        if isinstance(check_every, AuctionChecks) and tail_rows == 0 and checks != CheckSchedule(1):
            checks = check_every  # a read per check: the layer's own checks (the same assignment)
        expert_S, price_Z, unassigned = _solve(ops, key_ZS, E, sh, levels, eps_q, max_rounds, checks, tail_rows,
                                               work_rows)
        # unassigned is None if the round budget ran out first
        if unassigned != 0:
            expert_S = _fill_free_capacity(expert_S, expert_capacities(S, E, device))
        if not with_prices:
            return expert_S
        # A row's key is about steps_per_unit * (score - its row's offsets - offset_E) and the auction
        # compares key - price: in score units an expert costs offset_E + price / steps_per_unit.
        return expert_S, _centred(ops.tensor(ops.price_in_units(price_Z[:E], offset_E, steps_per_unit, unit)), device)


def _centred(price_E: Tensor, device: torch.device) -> Tensor:
    """(E,) float32 prices on `device`, minus their mean (a common shift changes no argmax)."""
    price_E = price_E.to(device=device, dtype=torch.float32)
    return price_E - price_E.mean()


def _check_schedule(device: torch.device) -> CheckSchedule:
    """The default completion checks: every round on the CPU (numpy arrays, a check costs nothing),
    ACCELERATOR_CHECKS elsewhere (each check is a host sync)."""
    return CheckSchedule(1) if device.type == "cpu" else ACCELERATOR_CHECKS


def _finite_scores(scores_SE: Tensor, ops):
    """(E, S) float32 (float64 for float64 input) copy of the scores as an array of the `ops`
    backend, contiguous, every entry finite (see sanitize_scores) and of a magnitude whose row shifts
    cannot overflow; and the scale it was divided by (1 unless the magnitude was extreme)."""
    x_SE = scores_SE.detach()
    if x_SE.dtype not in (torch.float32, torch.float64):
        x_SE = x_SE.float()
    return ops.finite_rescaled(ops.transposed_copy(ops.array(x_SE)))


def _two_experts(scores_SE: Tensor, cap0: int, ops) -> tuple[Tensor, Tensor]:
    """E = 2, solved exactly: expert 0 takes the cap0 rows with the largest score[s, 0] - score[s, 1],
    the earliest among ties at the threshold. Returns the experts and the prices (threshold / 2,
    -threshold / 2). The differences are float64, exact for float32 scores; non-finite or overflowing
    ones are redone on the sanitised scores (_finite_scores).
    """
    x_SE = scores_SE.detach()
    if x_SE.dtype not in (torch.float32, torch.float64):
        x_SE = x_SE.float()
    x_SE = ops.array(x_SE)
    d_S = ops.difference64(x_SE[:, 0], x_SE[:, 1])

    def redone():
        x_ES, _ = _finite_scores(scores_SE, ops)
        return ops.difference64(x_ES[0], x_ES[1])

    d_S = ops.where_all_finite(d_S, redone)
    threshold = ops.kth_largest(d_S, cap0)
    expert1_S = d_S < threshold
    # rows tied at the threshold beyond capacity go to expert 1, the latest first; with no
    # surplus the comparison below is False everywhere (no branch: on the torch path the
    # surplus stays on the device)
    surplus = d_S.shape[0] - ops.count(expert1_S) - cap0
    tied_S = d_S == threshold
    expert1_S |= tied_S & (ops.cumsum(tied_S) > ops.count(tied_S) - surplus)
    half = torch.as_tensor(threshold, device=scores_SE.device).float().reshape(1) / 2
    return ops.tensor(ops.as_int64(expert1_S)), torch.nan_to_num(torch.cat([half, -half]))


def _integer_keys(x_ES, sh: int, levels: int, ops):
    """Step 0: (Z, S) int32 keys value * Z + priority, value in [-levels, 0] quantised gain units.

    x_ES are the finite scores from _finite_scores, as an array of the `ops` backend. Padding
    experts (E <= e < Z) get _NEG_KEY. Works in the (E, S) layout throughout, so every pass is
    contiguous. Also returns the column offsets removed, (E, 1), and the quantisation steps per
    score unit: value[e, s] = floor(steps * (x[e, s] - offset[e] - a row offset)).
    """
    E, S = x_ES.shape
    Z = 1 << sh
    # Row and column offsets add the same amount to every balanced assignment (each row is used
    # once, each expert exactly capacity times), so both are removed: rows first (best = 0), then
    # scores far below a row's best are clipped so an outlier row cannot move a column mean,
    # then columns (mean accumulated in float64, so identical rows cancel exactly), rows again.
    y_ES = x_ES - ops.amax(x_ES, 0, keepdims=True)
    ops.clip(y_ES, -_CLIP_GAINS * _gain_unit(y_ES, ops), None)
    offset_E1 = ops.cast(ops.mean(y_ES, 1, keepdims=True, dtype=ops.float64), y_ES)
    y_ES -= offset_E1
    y_ES -= ops.amax(y_ES, 0, keepdims=True)
    # One gain unit becomes levels / _CLIP_GAINS steps (the scale is capped so that a tiny gain
    # cannot make 0 * inf); anything below -levels is clipped there.
    steps = ops.at_most((levels / _CLIP_GAINS) / _gain_unit(y_ES, ops), ops.float_max(y_ES))
    y_ES *= steps
    ops.clip(ops.floor_(y_ES), -levels, None)
    key_ZS = ops.empty((Z, S), ops.int32)
    key_ES = key_ZS[:E]
    key_ES[...] = y_ES
    key_ES *= Z
    key_ES += ops.array(_priorities(E, S, ops.device))
    key_ZS[E:] = _NEG_KEY
    return key_ZS, offset_E1, steps


@functools.lru_cache(maxsize=8)
def _priorities(E: int, S: int, device: torch.device) -> Tensor:
    """(E, S) int32 tie priority of expert e for row s: (s - 1 - e) mod E, so that indifferent rows
    start out spread evenly over the experts. Cached (the routers call with the same shape every
    step), so never modified in place."""
    e_E = torch.arange(E, device=device, dtype=torch.int32)
    rotation_S = torch.remainder(torch.arange(S, device=device, dtype=torch.int32) - 1, E)
    return _wrap(rotation_S - e_E[:, None], E)


def _wrap(d, E: int):
    """d mod E for d in (-E, E), without an integer division over a large array (torch or numpy)."""
    return d + ((d >> (8 * d.itemsize - 1)) & E)


def _gain_unit(y_ES, ops):
    """Median over rows of (best - mean score) for rows shifted to best 0, so that a few outlier rows
    cannot flatten the others; the mean if most rows are constant, 1 if all are. Row sums are float64,
    so every backend rounds alike. A float on numpy, a 0-d float64 tensor on torch (no host sync).
    """
    E = y_ES.shape[0]
    sum_S = ops.sum(y_ES, 0, dtype=ops.float64)
    return ops.first_positive(-ops.upper_median(sum_S) / E, lambda: -ops.mean(sum_S, 0) / E)


def _array_ops(device: torch.device):
    """numpy on the CPU, torch on accelerators (see _NumpyOps)."""
    return _NumpyOps() if device.type == "cpu" else _TorchOps(device)


def _solve(ops, key_ZS, E: int, sh: int, levels: int, eps_q: int, max_rounds: int, checks: CheckSchedule,
           tail_rows: int, work_rows: int) -> tuple[Tensor, object, int | None]:
    """Steps 1-4 on the keys (an array of the `ops` backend). Returns the (S,) int64 expert per
    row as a tensor on the keys' device (-1: unassigned), the final prices (Z,) in value steps (an
    array of the backend) and the number of unassigned rows if the last completion check saw it
    (None if the round budget ran out first)."""
    Z, S = key_ZS.shape
    cap_Z = ops.full(Z, 0, ops.int64)  # see expert_capacities; 0 for padding experts
    cap_Z[:E] = S // E
    cap_Z[:S % E] += 1
    neg_key = ops.const(_NEG_KEY, ops.int32)
    if S < E:  # experts with capacity 0: no row may bid for them
        key_ZS = ops.where((cap_Z == 0)[:, None], neg_key, key_ZS)
    row_S = ops.arange(S, ops.int64)
    expert_S = ops.full(S, -1, ops.int64)
    price_Z = ops.full(Z, 0, ops.int32)
    expert_S, price_Z, margin_S, rounds, unassigned = _auction(
        ops, key_ZS, cap_Z, row_S, expert_S, price_Z, E, sh, levels, eps_q, max_rounds, checks, tail_rows)
    if unassigned:
        # Step 4: continue on a working set: the unassigned rows and the held rows with the
        # smallest margins; the others keep their expert and their slots.
        s = min(S, max(work_rows, 4 * tail_rows))
        # (smallest margin first, unassigned rows before all, ties by row) as unique int64 keys
        pos_bits = max(1, (S - 1).bit_length())
        rank_S = ops.where(expert_S < 0, ops.const(-levels - 1, ops.int32), margin_S)
        work_s = ops.sort((ops.as_int64(rank_S) << ops.const(pos_bits, ops.int64)) | row_S)[:s]
        work_s = work_s & ops.const((1 << pos_bits) - 1, ops.int64)
        expert_s = ops.take(expert_S, work_s)
        # Free slots of each expert for the working set (bin 0 counts the unassigned rows).
        cap_work_Z = cap_Z - ops.bincount(expert_S + 1, Z + 1)[1:] + ops.bincount(expert_s + 1, Z + 1)[1:]
        key_Zs = ops.where((cap_work_Z == 0)[:, None], neg_key, ops.take_columns(key_ZS, work_s))
        expert_s, price_Z, _, _, unassigned = _auction(
            ops, key_Zs, cap_work_Z, work_s, expert_s, price_Z, E, sh, levels, eps_q, max_rounds - rounds,
            checks, 0)
        ops.put(expert_S, work_s, expert_s)
    return ops.tensor(expert_S), price_Z, unassigned


def _auction(ops, key_ZS, cap_Z, row_S, expert_S, price_Z, E: int, sh: int, levels: int, eps_q: int,
             max_rounds: int, checks: CheckSchedule | AuctionChecks, stop_at: int):
    """Steps 1-3 on keys (Z, S) from the given state, in arrays of the `ops` backend.

    row_S are the rows' indices in the full problem (they set the tie priorities); cap_Z the
    capacities (0 for padding experts). Stops at a check that finds at most `stop_at` rows
    unassigned, or after max_rounds. Returns the expert per row (-1: unassigned), the prices, the
    last round's margins (bid - price, in quantisation steps), the rounds run and the rows left
    unassigned (None if the budget ran out first).
    """
    Z, S = key_ZS.shape
    i32, i64 = ops.int32, ops.int64
    # Best expert of a row = (rotation - priority) mod E with rotation = (row - 1) mod E (see
    # _priorities), looked up in a table at rotation * Z + priority.
    rotation_S = ((row_S - 1) % E) * Z
    expert_of_EZ = ((ops.arange(E, i64)[:, None] - ops.arange(Z, i64)) % E).reshape(-1)
    # Sort key of a bid for expert e with margin m: band_Z[e] - m. The bands [e << margin_bits,
    # (e + 1) << margin_bits) hold the margins in [-levels, levels] in descending order, so one
    # sort groups the bids by expert, highest first, and a search for the band edges finds the
    # groups.
    # The sort runs on the unique int64 keys (sort key << pos_bits) | position, so a plain sort,
    # faster than a stable one, orders them as a stable sort of the sort keys would.
    margin_bits = (2 * levels).bit_length()
    pos_bits = max(1, (S - 1).bit_length())
    edge_Z1 = ops.arange(Z + 1, i32) << ops.const(margin_bits, i32)
    band_Z = edge_Z1[:Z] + ops.const(levels, i32)
    band_eps_Z = band_Z + ops.const(eps_q, i32)
    edge_Z1 = ops.as_int64(edge_Z1) << ops.const(pos_bits, i64)
    shift, low_t = ops.const(sh, i32), ops.const(Z - 1, i32)
    zero_t, one_t, none_t = ops.const(0, i64), ops.const(1, i64), ops.const(-1, i64)
    pos_shift, pos_mask = ops.const(pos_bits, i64), ops.const((1 << pos_bits) - 1, i64)
    price_sh_Z = price_Z << shift  # the price in key units
    margin_S = ops.full(S, 0, i32)
    pos_S = ops.arange(S, i64)
    rank_S = ops.full(S, 0, i64)
    net_ZS = key_ZS * 1
    net_flat = net_ZS.reshape(-1)  # a view
    S_t, min_key = ops.const(S, i64), -(1 << 31)  # min_key a Python int: index_fill_ takes it as is
    bound_Z1 = limit_Z = over_Z = None  # of the last round, read by the completion check
    # AuctionChecks: the rounds that over-subscribed an expert, counted on the device (read at a check)
    counted = isinstance(checks, AuctionChecks) and stop_at == 0
    active = ops.const(0, i64)
    rounds = 0
    unassigned = None
    while rounds < max_rounds:
        if checks.due(rounds):
            # Rows not kept by the last round (each row bid for exactly one expert): none if
            # no expert was over-subscribed.
            if counted:  # an over-subscribed expert in every round so far: not done; else done at active + 1
                active_rounds = int(active)
                unassigned = None if active_rounds == rounds else 0
                if unassigned == 0:
                    checks.completed(active_rounds + 1)
            elif stop_at == 0:
                unassigned = None if bool(over_Z.any()) else 0
            else:
                unassigned = int(ops.clip(bound_Z1[1:] - limit_Z, 0, None).sum())
                unassigned = unassigned if unassigned <= stop_at else None
            if unassigned is not None:
                break
        rounds += 1
        ops.sub_out(key_ZS, price_sh_Z[:, None], net_ZS)
        best_expert_S = ops.take(expert_of_EZ, rotation_S + (ops.amax0(net_ZS) & low_t))
        target_S = ops.where(expert_S >= zero_t, expert_S, best_expert_S)
        # A row bids price[target] + margin: the price at which it would be indifferent, with
        # margin = net value at the target - the best net value elsewhere.
        at_S = target_S * S_t + pos_S  # flat index of (target, row) in net_ZS
        own_S = ops.take(net_flat, at_S)
        ops.put(net_flat, at_S, min_key)
        margin_S = ops.clip((own_S >> shift) - (ops.amax0(net_ZS) >> shift), -levels, levels)
        # ties keep the earlier row
        sorted_S = ops.sort((ops.as_int64(ops.take(band_Z, target_S) - margin_S) << pos_shift) | pos_S)
        bound_Z1 = ops.searchsorted(sorted_S, edge_Z1)  # expert e's bids are sorted_S[bound[e]:bound[e + 1]]
        limit_Z = bound_Z1[:-1] + cap_Z  # and it keeps those before its limit
        ops.put(rank_S, sorted_S & pos_mask, pos_S)
        expert_S = ops.where(rank_S < ops.take(limit_Z, target_S), target_S, none_t)
        # Over-subscribed experts: new price = max(old price, lowest kept bid) + eps, i.e. the
        # price plus max(0, margin of the lowest kept bid) + eps.
        last_kept_Z = ops.as_int32(ops.take_clipped(sorted_S, limit_Z - one_t) >> pos_shift)
        over_Z = bound_Z1[1:] > limit_Z
        price_sh_Z = ops.where(over_Z, price_sh_Z + ((band_eps_Z - ops.minimum(last_kept_Z, band_Z)) << shift),
                               price_sh_Z)
        if counted:
            active = active + over_Z.any()
    return expert_S, price_sh_Z >> shift, margin_S, rounds, unassigned


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
