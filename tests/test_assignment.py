"""Balanced assignment (Base Layers): exact balance, validity, determinism, quality against the
exact optimum (scipy's linear_sum_assignment on capacity-replicated columns) and against fairseq's
C++ auction, degenerate and non-finite inputs, and the round-budget fallback; the exact two-expert
path against the exact solver; one auction round against a direct computation; the CPU's numpy
rounds against the torch rounds that accelerators run (bitwise).

Quality is measured as the fraction of the optimal gain over a random balanced assignment:
(ours - random) / (optimum - random), 1 = optimal, 0 = chance. For nonnegative scores the plain
ratio ours / optimum is checked as well.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

import smlp.routing.assignment as assignment
from smlp.routing.assignment import balanced_assignment, expert_capacities


def _scores(S, E, kind="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.rand(S, E, generator=g)
    if kind == "randn":
        return torch.randn(S, E, generator=g)
    if kind == "softmax":
        return torch.softmax(torch.randn(S, E, generator=g), dim=1)
    raise ValueError(kind)


def _total(scores_SE, expert_S):
    return float(scores_SE.double()[torch.arange(scores_SE.shape[0]), expert_S].sum())


def _optimum(scores_SE):
    S, E = scores_SE.shape
    cols = np.repeat(np.arange(E), expert_capacities(S, E).tolist())
    big = scores_SE.double().numpy()[:, cols]
    rows, slots = linear_sum_assignment(big, maximize=True)
    return float(big[rows, slots].sum())


def _random_total(scores_SE):
    S, E = scores_SE.shape
    return float((scores_SE.double() * expert_capacities(S, E).double()).sum() / S)


def _optimal_experts(scores_SE):
    """The exact solver's assignment, as an expert per row."""
    S, E = scores_SE.shape
    cols = np.repeat(np.arange(E), expert_capacities(S, E).tolist())
    rows, slots = linear_sum_assignment(scores_SE.double().numpy()[:, cols], maximize=True)
    expert_S = torch.empty(S, dtype=torch.long)
    expert_S[torch.from_numpy(rows)] = torch.from_numpy(cols[slots])
    return expert_S


def _gap_fraction(scores_SE, expert_S):
    rand = _random_total(scores_SE)
    return (_total(scores_SE, expert_S) - rand) / (_optimum(scores_SE) - rand)


def _assert_balanced(expert_S, S, E):
    assert expert_S.shape == (S,)
    assert expert_S.dtype == torch.int64
    if S:
        assert int(expert_S.min()) >= 0 and int(expert_S.max()) < E
    counts = torch.bincount(expert_S, minlength=E)
    assert counts.tolist() == expert_capacities(S, E).tolist()


# ---------------------------------------------------------------- balance and validity


def test_capacities_follow_the_balance_rule():
    assert expert_capacities(12, 4).tolist() == [3, 3, 3, 3]
    assert expert_capacities(10, 4).tolist() == [3, 3, 2, 2]
    assert expert_capacities(3, 5).tolist() == [1, 1, 1, 0, 0]
    assert expert_capacities(0, 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("S, E", [
    (64, 8), (1024, 16), (96, 3), (100, 8), (1000, 7), (513, 16), (7, 3), (37, 12),
    (3, 5), (1, 4), (1, 2), (4, 4), (5, 1), (0, 4), (0, 1), (2, 2), (300, 2),
])
def test_exact_counts_for_any_shape(S, E):
    for kind in ("uniform", "randn"):
        expert_S = balanced_assignment(_scores(S, E, kind, seed=S + E))
        _assert_balanced(expert_S, S, E)
        assert expert_S.device == torch.device("cpu")


def test_rows_with_fewer_rows_than_experts_go_to_the_best_distinct_experts():
    # 2 rows, 5 experts: capacities [1, 1, 0, 0, 0]; row 0 prefers expert 1, row 1 prefers 0.
    scores = torch.tensor([[0.0, 1.0, 9.0, 9.0, 9.0], [1.0, 0.0, 9.0, 9.0, 9.0]])
    assert balanced_assignment(scores).tolist() == [1, 0]


def test_deterministic_and_input_untouched():
    scores = _scores(2048, 32, "randn", seed=3)
    before = scores.clone()
    first = balanced_assignment(scores)
    assert torch.equal(scores, before)
    for _ in range(2):
        assert torch.equal(balanced_assignment(scores.clone()), first)


def test_accepts_other_dtypes_and_grad_tensors():
    scores = _scores(256, 8, "randn", seed=4)
    for x in (scores.double(), scores.half(), scores.bfloat16(), (scores * 100).round().long(),
              scores.clone().requires_grad_(True)):
        _assert_balanced(balanced_assignment(x), 256, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda_with_the_same_result():
    scores = _scores(1024, 16, "randn", seed=5)
    expert_S = balanced_assignment(scores.cuda())
    assert expert_S.device.type == "cuda"
    assert torch.equal(expert_S.cpu(), balanced_assignment(scores))  # integer arithmetic after step 0


def test_row_and_column_offsets_do_not_change_the_assignment():
    # A row constant adds to every feasible assignment once, a column constant capacity times:
    # the ranking of assignments is unchanged. Integer scores and S = 512 (a power of two, so
    # column means are exact) keep every float operation exact, so the keys are identical.
    g = torch.Generator().manual_seed(6)
    scores = torch.randint(0, 100, (512, 8), generator=g).float()
    rows = torch.randint(-1000, 1000, (512, 1), generator=g).float()
    cols = torch.randint(-1000, 1000, (1, 8), generator=g).float()
    expected = balanced_assignment(scores)
    assert torch.equal(balanced_assignment(scores + rows), expected)
    assert torch.equal(balanced_assignment(scores + cols), expected)
    assert torch.equal(balanced_assignment(scores + rows + cols), expected)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_one_round_bids_and_capacity_cut_against_a_direct_computation(backend):
    # From the empty assignment every row bids for its best key with margin (best value -
    # second best value); each expert keeps its `capacity` highest margins (ties: earlier row)
    # and, if over-subscribed, raises its price to max(0, lowest kept margin) + eps.
    S, E, sh, eps_q = 500, 12, 4, 7
    P, levels = 1 << sh, (1 << 27) >> sh
    ops = assignment._NumpyOps() if backend == "numpy" else assignment._TorchOps(torch.device("cpu"))
    scores = (_scores(S, E, "uniform", seed=20) * 6).round()  # many tied values: the priorities decide
    key_PS, _, _ = assignment._integer_keys(assignment._finite_scores(scores, ops)[0], sh, levels, ops)
    cap_E = expert_capacities(S, E)
    cap_P = ops.full(P, 0, ops.int64)
    cap_P[:E] = ops.array(cap_E)
    expert_S, price_P, margin_S, rounds, _ = assignment._auction(
        ops, key_PS, cap_P, ops.arange(S, ops.int64), ops.full(S, -1, ops.int64), ops.full(P, 0, ops.int32),
        E, sh, levels, eps_q, 1, assignment.CheckSchedule(1), 0)
    assert rounds == 1
    keys = torch.as_tensor(key_PS).long()
    top = torch.topk(keys, 2, dim=0)
    assert all(len(set(row)) == E for row in keys[:E].t().tolist())  # distinct keys within a row
    best_S = top.indices[0]
    expected_margin_S = (top.values[0] >> sh) - (top.values[1] >> sh)
    assert torch.equal(torch.as_tensor(margin_S).long(), expected_margin_S)
    expected_S = torch.full((S,), -1)
    expected_price_P = torch.zeros(P, dtype=torch.long)
    for e in range(E):
        rows = [s for s in range(S) if best_S[s] == e]
        rows.sort(key=lambda s: (-int(expected_margin_S[s]), s))
        kept = rows[:int(cap_E[e])]
        expected_S[kept] = e
        if len(rows) > cap_E[e]:
            expected_price_P[e] = max(0, int(expected_margin_S[kept[-1]])) + eps_q
    assert torch.equal(torch.as_tensor(expert_S), expected_S)
    assert torch.equal(torch.as_tensor(price_P).long(), expected_price_P)


def _torch_rounds(monkeypatch):
    """Make balanced_assignment run steps 0-4 on torch tensors on the CPU, as on an accelerator."""
    monkeypatch.setattr(assignment, "_array_ops", lambda device: assignment._TorchOps(device))


@pytest.mark.parametrize("S, E, kind, kwargs", [
    (1024, 8, "softmax", {}), (1000, 7, "randn", {"max_rounds": 3}), (37, 12, "uniform", {"check_every": 3}),
    (3, 5, "randn", {}), (513, 16, "coarse", {}), (256, 8, "nonfinite", {}), (4096, 16, "randn", {}),
    (2048, 2, "randn", {}), (7, 2, "coarse", {}), (64, 2, "nonfinite", {}),
])
def test_numpy_rounds_equal_torch_rounds(monkeypatch, S, E, kind, kwargs):
    # The CPU runs the auction on numpy arrays, accelerators on torch tensors: same integer
    # algorithm, so the same experts bit for bit (and the same step 0 keys).
    if kind == "coarse":
        scores = (_scores(S, E, "uniform", seed=S) * 4).round()
    elif kind == "nonfinite":
        scores = _scores(S, E, "randn", seed=S)
        scores[0, 1], scores[3], scores[5, 0] = float("nan"), float("inf"), float("-inf")
    else:
        scores = _scores(S, E, kind, seed=S)
    on_numpy = balanced_assignment(scores, **kwargs)
    if E > 2:
        sh = max(1, (E - 1).bit_length())
        keys = [assignment._integer_keys(assignment._finite_scores(scores, ops)[0], sh, (1 << 27) >> sh, ops)[0]
                for ops in (assignment._NumpyOps(), assignment._TorchOps(torch.device("cpu")))]
        assert torch.equal(torch.from_numpy(keys[0]), keys[1])
    _torch_rounds(monkeypatch)
    on_torch = balanced_assignment(scores, **kwargs)
    _assert_balanced(on_numpy, S, E)
    assert torch.equal(on_numpy, on_torch)


def test_working_set_step_runs_and_stays_close(monkeypatch):
    # Step 4 (the auction continued on the unassigned rows and the 1024 held rows of smallest
    # margin) runs only from S * P >= 65536 keys by default; force it at 2048 x 16.
    sizes = []
    auction = assignment._auction
    monkeypatch.setattr(assignment, "_auction", lambda ops, key_PS, *a: sizes.append(key_PS.shape[1]) or auction(
        ops, key_PS, *a))
    monkeypatch.setattr(assignment, "_MIN_TAIL_KEYS", 0)
    scores = _scores(2048, 16, "randn", seed=19)
    for k in (1, 4):  # the switch point moves with the checks
        sizes.clear()
        expert_S = balanced_assignment(scores, check_every=k)
        assert sizes == [2048, 1024]
        _assert_balanced(expert_S, 2048, 16)
        assert _gap_fraction(scores, expert_S) >= 0.995


# ---------------------------------------------------------------- two experts


@pytest.mark.parametrize("S", [1, 2, 3, 64, 1001])
def test_two_experts_equal_the_exact_solver(S):
    for kind in ("uniform", "softmax", "randn"):
        scores = _scores(S, 2, kind, seed=S)
        expert_S = balanced_assignment(scores)
        _assert_balanced(expert_S, S, 2)
        assert torch.equal(expert_S, _optimal_experts(scores))  # continuous scores: a unique optimum


def test_two_experts_ties_go_to_the_earliest_rows():
    scores = torch.tensor([[1.0, 0], [0, 0], [0, 0], [0, 0], [1, 0], [0, 0]])
    assert balanced_assignment(scores).tolist() == [0, 0, 1, 1, 0, 1]
    assert balanced_assignment(torch.zeros(9, 2)).tolist() == [0] * 5 + [1] * 4
    coarse = (_scores(500, 2, "uniform", seed=3) * 4).round()
    expert_S = balanced_assignment(coarse)
    _assert_balanced(expert_S, 500, 2)
    assert _total(coarse, expert_S) == pytest.approx(_optimum(coarse), abs=1e-9)


def test_two_experts_non_finite_and_overflowing_scores():
    scores = _scores(64, 2, "randn", seed=4)
    scores[0, 0] = float("inf")  # the highest score: expert 0
    scores[1, 0] = float("nan")  # the lowest: expert 1
    scores[2, 1] = float("-inf")  # the lowest: expert 0
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, 64, 2)
    assert expert_S[:3].tolist() == [0, 1, 0]
    for bad in (float("nan"), float("inf")):
        _assert_balanced(balanced_assignment(torch.full((9, 2), bad)), 9, 2)
    # float64 scores whose differences overflow (up to 2 * 1.3e308): redone on rescaled scores
    base = _scores(256, 2, "randn", seed=5).double().clamp(-3, 3)
    assert torch.equal(balanced_assignment(base * 2.0 ** 1022), _optimal_experts(base))


# ---------------------------------------------------------------- quality


@pytest.mark.parametrize("S, E, kind", [
    (512, 8, "uniform"), (1024, 16, "uniform"), (1024, 16, "softmax"), (1024, 16, "randn"),
    (1000, 16, "uniform"), (999, 8, "randn"), (2048, 16, "softmax"), (2100, 16, "randn"),
])
def test_close_to_the_exact_optimum(S, E, kind):
    scores = _scores(S, E, kind, seed=S * E)
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, S, E)
    assert _gap_fraction(scores, expert_S) >= 0.995
    if kind != "randn":
        assert _total(scores, expert_S) >= 0.999 * _optimum(scores)


def test_full_auction_and_smaller_eps_get_closer():
    scores = _scores(1024, 16, "randn", seed=7)
    default = _gap_fraction(scores, balanced_assignment(scores))
    exact = _gap_fraction(scores, balanced_assignment(scores, eps=0.002, tail_fraction=0.0))
    assert exact >= 0.9999
    assert exact >= default - 1e-9


def test_beats_a_greedy_argmax_fill_by_a_wide_margin():
    # Every row prefers expert 0 a lot: capacity forces most rows elsewhere, and which rows
    # keep expert 0 matters. The auction must find the exact structure.
    g = torch.Generator().manual_seed(8)
    scores = torch.rand(512, 8, generator=g)
    scores[:, 0] += 5 * torch.rand(512, generator=g)
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, 512, 8)
    assert _gap_fraction(scores, expert_S) >= 0.995
    # the rows kept on expert 0 are (nearly) those with the largest bonus
    bonus = scores[:, 0] - scores[:, 1:].max(dim=1).values
    top = set(torch.topk(bonus, 64).indices.tolist())
    assert len(top & set((expert_S == 0).nonzero().squeeze(1).tolist())) >= 60


@pytest.mark.parametrize("S, E, kind", [
    (1024, 16, "uniform"), (1024, 16, "softmax"), (1024, 16, "randn"), (4096, 32, "uniform"), (4096, 32, "softmax"),
])
def test_at_least_as_good_as_fairseq_libbase(S, E, kind):
    libbase = pytest.importorskip("fairseq.libbase")
    scores = _scores(S, E, kind, seed=S + E)
    order_S = libbase.balanced_assignment(scores.clone())  # row indices grouped by expert
    assert torch.unique(order_S).numel() == S
    theirs_S = torch.empty(S, dtype=torch.long)
    theirs_S[order_S] = torch.arange(S) // (S // E)
    ours = _total(scores, balanced_assignment(scores))
    theirs = _total(scores, theirs_S)
    gain = ours - _random_total(scores)  # about the optimal gain; no exact solve at 4096 rows
    assert ours >= theirs - 2e-4 * gain, (ours, theirs)


# ---------------------------------------------------------------- degenerate inputs


def test_constant_and_tied_scores_are_balanced():
    _assert_balanced(balanced_assignment(torch.zeros(64, 8)), 64, 8)
    _assert_balanced(balanced_assignment(torch.full((100, 7), 3.5)), 100, 7)
    # two experts tie for every row: both must be filled with the rows that want them
    scores = torch.zeros(64, 4)
    scores[:, :2] = 1.0
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, 64, 4)
    # bf16-like coarse scores: many exact ties
    coarse = (_scores(512, 16, "uniform", seed=12) * 8).round()
    expert_S = balanced_assignment(coarse)
    _assert_balanced(expert_S, 512, 16)
    assert _gap_fraction(coarse, expert_S) >= 0.995


def test_indifferent_rows_spread_over_the_experts_in_one_round():
    # Ties are broken in a per-row rotated order: row s prefers expert s mod E, so constant or
    # identical rows are balanced by the first round instead of queueing expert by expert.
    for S, E in ((96, 12), (128, 16), (100, 7)):
        assert balanced_assignment(torch.zeros(S, E), max_rounds=1).tolist() == (torch.arange(S) % E).tolist()
    same = torch.rand(12).expand(96, 12)  # identical rows: column offsets only
    assert balanced_assignment(same, max_rounds=1).tolist() == (torch.arange(96) % 12).tolist()


@pytest.mark.parametrize("scale", [1e30, 1e37, 1e-30, 1e-38, 1e-42])
def test_huge_and_tiny_magnitudes(scale):
    base = _scores(512, 8, "randn", seed=13)
    scaled = base * scale  # 1e-42 is subnormal in float32
    expert_S = balanced_assignment(scaled)
    _assert_balanced(expert_S, 512, 8)
    assert _gap_fraction(base, expert_S) >= (0.99 if scale < 1e-40 else 0.995)


def test_float64_beyond_float32_range():
    base = _scores(256, 8, "randn", seed=14).double()
    for scale in (1e300, 1e-300):
        expert_S = balanced_assignment(base * scale)
        _assert_balanced(expert_S, 256, 8)
        assert _gap_fraction(base, expert_S) >= 0.995


def test_one_outlier_row_does_not_spoil_the_rest():
    scores = _scores(512, 8, "uniform", seed=15)
    scores[0] = torch.tensor([1e9, -1e9, 0, 0, 0, 0, 0, 0])
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, 512, 8)
    assert int(expert_S[0]) == 0
    assert _gap_fraction(scores[1:], expert_S[1:]) >= 0.99


def test_non_finite_scores_neither_hang_nor_crash():
    scores = _scores(256, 8, "randn", seed=16)
    scores[0, 1] = float("nan")
    scores[3] = float("inf")
    scores[5, 2] = float("-inf")
    scores[7, :4] = float("nan")
    expert_S = balanced_assignment(scores)
    _assert_balanced(expert_S, 256, 8)
    for bad in (float("nan"), float("inf"), float("-inf")):
        _assert_balanced(balanced_assignment(torch.full((64, 8), bad)), 64, 8)
    _assert_balanced(balanced_assignment(torch.full((10, 4), float("nan"))), 10, 4)


def test_non_finite_scores_mean_lowest_and_highest():
    scores = torch.zeros(8, 2)
    scores[:, 0] = torch.linspace(0.1, 0.8, 8)  # rows 4..7 prefer expert 0 most
    scores[0, 0] = float("inf")  # +inf: row 0 wants expert 0 above all
    scores[7, 0] = float("nan")  # NaN: the lowest score, row 7 goes to expert 1
    expert_S = balanced_assignment(scores)
    assert expert_S.tolist() == [0, 1, 1, 1, 0, 0, 0, 1]


# ---------------------------------------------------------------- budget, checks, errors


@pytest.mark.parametrize("max_rounds", [0, 1, 2, 3])
def test_round_budget_still_gives_exact_balance(max_rounds):
    for S, E in ((1024, 16), (1000, 7), (3, 5)):
        expert_S = balanced_assignment(_scores(S, E, "randn", seed=17), max_rounds=max_rounds)
        _assert_balanced(expert_S, S, E)


def test_rounds_after_completion_change_nothing(monkeypatch):
    # An accelerator checks for completion only every few rounds; the extra rounds must be no-ops
    # (with step 4, where the switch point moves with the checks, see
    # test_working_set_step_runs_and_stays_close).
    scores = _scores(1024, 16, "softmax", seed=18)
    every_round = balanced_assignment(scores, tail_fraction=0.0, check_every=1)
    for k in (3, 4, 7):
        assert torch.equal(balanced_assignment(scores, tail_fraction=0.0, check_every=k), every_round)
    _torch_rounds(monkeypatch)
    for k in (1, 4):
        assert torch.equal(balanced_assignment(scores, tail_fraction=0.0, check_every=k), every_round)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"shape \(S, E\)"):
        balanced_assignment(torch.zeros(8))
    with pytest.raises(ValueError, match="experts"):
        balanced_assignment(torch.zeros(8, 0))
    with pytest.raises(ValueError, match="eps=0"):
        balanced_assignment(torch.zeros(8, 2), eps=0)
    with pytest.raises(ValueError, match="tail_fraction"):
        balanced_assignment(torch.zeros(8, 2), tail_fraction=1.0)
    with pytest.raises(ValueError, match="check_every"):
        balanced_assignment(torch.zeros(8, 2), check_every=0)


# ---------------------------------------------------------------- a layer's own completion checks (issue 47)


def _frozen_auction(ops, key_ZS, cap_Z, row_S, expert_S, price_Z, E: int, sh: int, levels: int, eps_q: int,
                    max_rounds: int, checks, stop_at: int):
    """assignment._auction as it was before issue 47 (commit 8246884), kept as the reference."""
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
    rounds = 0
    unassigned = None
    while rounds < max_rounds:
        if checks.due(rounds):
            # Rows not kept by the last round (each row bid for exactly one expert): none if
            # no expert was over-subscribed.
            if stop_at == 0:
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
    return expert_S, price_sh_Z >> shift, margin_S, rounds, unassigned


def _reference(scores, monkeypatch, *, numpy_path: bool, **kwargs):
    """(experts, prices) of the auction before issue 47: the CPU's numpy path checking every round, or the torch
    path an accelerator runs, checking at ACCELERATOR_CHECKS."""
    with monkeypatch.context() as m:
        m.setattr(assignment, "_auction", _frozen_auction)
        if not numpy_path:
            m.setattr(assignment, "_array_ops", lambda device: assignment._TorchOps(device))
            m.setattr(assignment, "_check_schedule", lambda device: assignment.ACCELERATOR_CHECKS)
        return balanced_assignment(scores, with_prices=True, **kwargs)


def _with_checks(scores, checks, monkeypatch, *, numpy_path: bool, **kwargs):
    with monkeypatch.context() as m:
        if not numpy_path:
            m.setattr(assignment, "_array_ops", lambda device: assignment._TorchOps(device))
            m.setattr(assignment, "_check_schedule", lambda device: assignment.ACCELERATOR_CHECKS)
        return balanced_assignment(scores, with_prices=True, check_every=checks, **kwargs)


def _random_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(1, 2048, (1,), generator=g))
    E = [3, 4, 5, 7, 8, 12, 16, 32][int(torch.randint(0, 8, (1,), generator=g))]
    kind = ["uniform", "randn", "softmax", "coarse", "narrow", "nonfinite"][seed % 6]
    scores = torch.randn(S, E, generator=g)
    if kind == "uniform":
        scores = torch.rand(S, E, generator=g)
    elif kind == "softmax":
        scores = torch.softmax(3 * scores, -1)
    elif kind == "coarse":  # many exact ties
        scores = (torch.rand(S, E, generator=g) * 3).round()
    elif kind == "narrow":  # a router at init: every row nearly indifferent
        scores = 1e-3 * scores + torch.randn(E, generator=g)
    elif kind == "nonfinite":
        scores[0, 0], scores[S // 2, E - 1] = float("nan"), float("inf")
    return scores, S, E


@pytest.mark.parametrize("block", range(3))
def test_a_layers_own_checks_give_the_assignment_and_prices_of_the_former_auction(monkeypatch, block):
    """AuctionChecks (the first check at the most rounds a layer's recent auctions took, issue 47) change when the
    host reads, never what the auction computes: on 60 random problems (sizes, expert counts, ties, non-finite and
    nearly indifferent scores), whatever the layer's history, the experts and prices equal, bit for bit, those of
    the auction loop as it was (frozen above) on the accelerator's path and on the CPU's."""
    for seed in range(20 * block, 20 * (block + 1)):
        scores, S, E = _random_problem(seed)
        before_torch = _reference(scores, monkeypatch, numpy_path=False)
        before_numpy = _reference(scores, monkeypatch, numpy_path=True)
        for history in ([], [1], [3, 40], [int(seed % 17) + 1]):
            checks = assignment.AuctionChecks()
            for rounds in history:
                checks.completed(rounds)
            for numpy_path, before in ((False, before_torch), (True, before_numpy)):
                expert_S, price_E = _with_checks(scores, checks, monkeypatch, numpy_path=numpy_path)
                assert torch.equal(expert_S, before[0]) and torch.equal(price_E, before[1]), (seed, S, E, history)
        _assert_balanced(before_torch[0], S, E)


def test_a_layers_own_checks_stay_out_of_step_4(monkeypatch):
    """Where step 4 runs, its start moves with the checks: the layer's checks are not used there, and the result
    is the former accelerator path's (and the CPU's where its every-round checks start step 4 alike)."""
    scores = _scores(4096, 16, "randn", seed=23)  # 65536 keys: step 4 runs
    checks = assignment.AuctionChecks()
    checks.completed(3)
    before = _reference(scores, monkeypatch, numpy_path=False)
    after = _with_checks(scores, checks, monkeypatch, numpy_path=False)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert list(checks.recent) == [3]  # nothing observed: the default checks ran


def test_a_layers_own_checks_read_once_for_an_auction_like_its_last(monkeypatch):
    """The read at a check says when the auction completed; the next auction of the layer checks first there:
    one host read (counted as an accelerator syncs) where checking at round 16 read twice or wasted rounds."""
    from smlp_bench.micro.host_syncs import count_host_syncs

    rounds = []
    real = assignment._auction
    monkeypatch.setattr(assignment, "_auction", lambda *a: (lambda out: rounds.append(out[3]) or out)(real(*a)))
    for S, E, kind, seed in ((80, 4, "randn", 0), (1024, 8, "softmax", 1), (2000, 32, "randn", 2),
                             (300, 5, "uniform", 3)):
        scores = _scores(S, E, kind, seed=seed)
        rounds.clear()
        balanced_assignment(scores, check_every=1)  # the CPU's every-round checks: the completion round
        completion = rounds[0]
        checks = assignment.AuctionChecks()
        with count_host_syncs() as c:
            balanced_assignment(scores, check_every=checks)
        first_reads = c.count
        assert first_reads == ((completion - 1) // 16).bit_length() + 1, (S, E, completion, first_reads)  # 16, 32..
        assert list(checks.recent) == [completion] and checks.first == completion
        with count_host_syncs() as c:
            balanced_assignment(scores, check_every=checks)
        assert c.count == 1 and rounds[-1] == completion, (S, E, completion)  # no round wasted either
