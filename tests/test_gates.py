"""Switch top-1 and GShard top-2 gates against the canonical implementations.

GShard == fairscale.nn.moe.top2gate.top2gating (same noise), Switch == DeepSpeed's
sharded_moe.top1gating(use_rts=False) where DeepSpeed's keep rule is defined, plus
reference loops for position-priority dropping, gradients, capacities and bad inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from smlp.routing.gates import gshard_capacity, gshard_top2, switch_capacity, switch_top1


def _logits(S, E, seed, skew=0.0):
    """Random logits; `skew` adds a bias towards expert 0 so capacity overflows."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(S, E, generator=g)
    logits[:, 0] += skew
    return logits


def _gumbel(S, E, seed):
    g = torch.Generator().manual_seed(seed + 10_000)
    u = torch.rand(S, E, generator=g).clamp(1e-6, 1 - 1e-6)
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------- GShard == fairscale


def _fairscale_per_slot(combine_SEC, first_S):
    """fairscale's (S, E, C) combine weights -> per-row (first, second) experts and weights."""
    dispatch_SEC = combine_SEC != 0
    assert int(dispatch_SEC.sum(-1).max()) <= 1, "a row holds two slots of one expert"
    dispatch_SE = dispatch_SEC.any(-1)
    assert int(dispatch_SE.sum(-1).max()) <= 2
    weight_SE = combine_SEC.sum(-1)
    kept1 = dispatch_SE.gather(1, first_S[:, None]).squeeze(1)
    others = dispatch_SE.scatter(1, first_S[:, None], False)
    kept2 = others.any(1)
    second = others.float().argmax(1)
    experts = torch.stack([torch.where(kept1, first_S, -1), torch.where(kept2, second, -1)], 1)
    weights = torch.stack([weight_SE.gather(1, first_S[:, None]).squeeze(1) * kept1,
                           weight_SE.gather(1, second[:, None]).squeeze(1) * kept2], 1)
    return experts, weights


def _fairscale_top2(monkeypatch, logits, noise):
    from fairscale.nn.moe import top2gate

    monkeypatch.setattr(top2gate, "gumbel_rsample", lambda shape, device: noise.clone())
    l_aux, combine_SEC, _ = top2gate.top2gating(logits)
    return l_aux, combine_SEC


GSHARD_CASES = [  # (S, E, skew, seed): skew > 0 overflows expert 0
    (8, 4, 0.0, 0), (16, 4, 4.0, 1), (32, 8, 0.0, 2), (32, 8, 6.0, 3), (12, 3, 3.0, 4), (6, 2, 0.0, 5),
    (64, 4, 2.0, 6), (2, 2, 0.0, 7),
]


@pytest.mark.parametrize("S,E,skew,seed", GSHARD_CASES)
def test_gshard_equals_fairscale_top2gating(monkeypatch, S, E, skew, seed):
    logits, noise = _logits(S, E, seed, skew), _gumbel(S, E, seed)
    l_aux, combine_SEC = _fairscale_top2(monkeypatch, logits, noise)
    plan = gshard_top2(logits, noise_SE=noise, training=True, aux_loss="fairscale")

    first_S = torch.softmax(logits, 1).argmax(1)
    experts, weights = _fairscale_per_slot(combine_SEC, first_S)
    assert torch.equal(plan.experts_SK, experts)
    torch.testing.assert_close(plan.weights_SK, weights, rtol=0, atol=1e-7)
    torch.testing.assert_close(plan.aux_loss, l_aux, rtol=1e-6, atol=0)
    assert plan.counts(E).max() <= combine_SEC.shape[-1] == gshard_capacity(S, E)
    if skew >= 3.0:
        assert (plan.experts_SK == -1).any(), "the case was meant to drop slots"


def test_gshard_default_noise_is_drawn_like_fairscale():
    from fairscale.nn.moe.top2gate import top2gating

    logits = _logits(24, 4, 11, skew=1.0)
    torch.manual_seed(123)
    l_aux, combine_SEC, _ = top2gating(logits)
    torch.manual_seed(123)
    plan = gshard_top2(logits, training=True, aux_loss="fairscale")
    experts, weights = _fairscale_per_slot(combine_SEC, torch.softmax(logits, 1).argmax(1))
    assert torch.equal(plan.experts_SK, experts)
    torch.testing.assert_close(plan.weights_SK, weights, rtol=0, atol=1e-7)
    torch.testing.assert_close(plan.aux_loss, l_aux)


def _gshard_loop(logits, noise, capacity):
    """Reference: first choices take slots in row order, then second choices in row order."""
    S, E = logits.shape
    p = torch.softmax(logits.double(), 1)
    first = p.argmax(1).tolist()
    scores = (logits + noise).double()
    count = [0] * E
    out_e, out_w = [[-1, -1] for _ in range(S)], [[0.0, 0.0] for _ in range(S)]
    for s in range(S):
        e = first[s]
        if count[e] < capacity:
            out_e[s][0] = e
        count[e] += 1
    for s in range(S):
        row = scores[s].clone()
        row[first[s]] = -math.inf
        e = int(row.argmax())
        if count[e] < capacity:
            out_e[s][1] = e
        count[e] += 1
    for s in range(S):
        g = [float(p[s, e]) if e >= 0 else 0.0 for e in out_e[s]]
        out_w[s] = [x / max(sum(g), torch.finfo(torch.float32).eps) for x in g]
    return torch.tensor(out_e), torch.tensor(out_w)


@pytest.mark.parametrize("S,E,skew", [(10, 4, 3.0), (7, 3, 5.0), (3, 4, 0.0), (1, 8, 0.0), (40, 5, 2.0)])
def test_gshard_priority_matches_reference_loop_for_any_S(S, E, skew):
    logits, noise = _logits(S, E, S + E, skew), _gumbel(S, E, S)
    plan = gshard_top2(logits, noise_SE=noise)
    experts, weights = _gshard_loop(logits, noise, gshard_capacity(S, E))
    assert torch.equal(plan.experts_SK, experts)
    torch.testing.assert_close(plan.weights_SK, weights.float(), rtol=1e-5, atol=1e-6)


def test_gshard_second_slot_only_gets_leftover_capacity():
    # S=4, E=2, capacity 4: expert 1 holds row 3's first choice, then rows 0-2's second choices.
    logits = torch.tensor([[2.0, 0.0]] * 3 + [[0.0, 2.0]])
    plan = gshard_top2(logits, noise_SE=torch.zeros(4, 2))
    assert plan.experts_SK.tolist() == [[0, 1], [0, 1], [0, 1], [1, 0]]
    # S=3, E=3, capacity 2: all rows want expert 0 then expert 1; row 2 loses both.
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 3)
    plan = gshard_top2(logits, noise_SE=torch.zeros(3, 3))
    assert plan.experts_SK.tolist() == [[0, 1], [0, 1], [-1, -1]]
    torch.testing.assert_close(plan.weights_SK[2], torch.zeros(2))
    p = torch.softmax(logits[0], 0)
    torch.testing.assert_close(plan.weights_SK[0], p[:2] / p[:2].sum())


def test_gshard_weights_renormalize_over_kept_slots():
    # S=4, E=4, capacity 2. Expert 0: first choices of rows 0, 1, 2 -> row 2 dropped.
    # Expert 1: row 3's first choice (rank 0), then second choices of rows 0, 1 (ranks 1, 2)
    # -> row 1's second dropped. Row 2's second (expert 3) fits, so it gets weight 1.
    logits = torch.tensor([[4.0, 1.0, 0.0, -1.0]] * 2 + [[4.0, -1.0, 0.0, 1.0], [-1.0, 4.0, 1.0, 0.0]])
    plan = gshard_top2(logits, noise_SE=torch.zeros(4, 4))
    assert plan.experts_SK.tolist() == [[0, 1], [0, -1], [-1, 3], [1, 2]]
    assert plan.weights_SK[1].tolist() == [1.0, 0.0]
    assert plan.weights_SK[2].tolist() == [0.0, 1.0]


def test_gshard_eval_is_deterministic_undropped_and_rowwise():
    logits = _logits(32, 4, 3, skew=5.0)
    a = gshard_top2(logits, training=False)
    b = gshard_top2(logits, training=False)
    assert torch.equal(a.experts_SK, b.experts_SK) and torch.equal(a.weights_SK, b.weights_SK)
    assert (a.experts_SK >= 0).all()
    assert torch.equal(a.experts_SK, logits.topk(2, dim=1).indices)
    # each row depends only on its own logits
    part = gshard_top2(logits[5:9], training=False)
    assert torch.equal(part.experts_SK, a.experts_SK[5:9])
    # drop_in_eval restores the training capacity (with no noise)
    d = gshard_top2(logits, training=False, drop_in_eval=True)
    assert (d.experts_SK == -1).any() and d.counts(4).max() <= gshard_capacity(32, 4)
    assert torch.equal(d.experts_SK, gshard_top2(logits, training=True, noise_SE=torch.zeros(32, 4)).experts_SK)


def test_gshard_aux_loss_conventions():
    logits = _logits(16, 4, 0)
    plain = gshard_top2(logits, noise_SE=torch.zeros(16, 4), aux_loss="fairscale")
    scaled = gshard_top2(logits, noise_SE=torch.zeros(16, 4))  # the default: E^2-normalized
    torch.testing.assert_close(scaled.aux_loss, plain.aux_loss * 16)
    # the normalized GShard loss is the Switch loss of the first choices
    torch.testing.assert_close(scaled.aux_loss, switch_top1(logits).aux_loss)
    # a perfectly balanced router (uniform probabilities, first choices spread evenly) gives 1
    balanced = torch.zeros(16, 4)
    balanced[torch.arange(16), torch.arange(16) % 4] = 1e-3
    torch.testing.assert_close(gshard_top2(balanced, noise_SE=torch.zeros(16, 4)).aux_loss,
                               torch.tensor(1.0), rtol=1e-3, atol=0)
    with pytest.raises(ValueError, match="aux_loss='lingvo' is unknown: valid values are normalized, fairscale"):
        gshard_top2(logits, aux_loss="lingvo")


@pytest.mark.parametrize("S,E,seed", [(16, 4, 0), (32, 8, 1), (12, 3, 2)])
def test_gshard_default_aux_loss_equals_deepspeed_top2gating(S, E, seed):
    """DeepSpeed's top2gating scales mean(m_e c_e) by E^2, as our default does (fairseq's MoE branch too)."""
    from deepspeed.moe import sharded_moe

    logits = _logits(S, E, seed)
    l_aux, *_ = sharded_moe.top2gating(logits.clone(), capacity_factor=1.0, min_capacity=0,
                                       top2_2nd_expert_sampling=False)
    torch.testing.assert_close(gshard_top2(logits, training=True).aux_loss, l_aux, rtol=1e-6, atol=0)


def test_gshard_one_expert_keeps_one_slot_with_weight_one():
    plan = gshard_top2(torch.randn(5, 1))
    assert plan.experts_SK.tolist() == [[0, -1]] * 5
    assert plan.weights_SK.tolist() == [[1.0, 0.0]] * 5
    torch.testing.assert_close(plan.aux_loss, torch.tensor(1.0))


# ---------------------------------------------------------------- Switch == DeepSpeed


@pytest.fixture(scope="module")
def ds():
    from deepspeed.moe import sharded_moe

    return sharded_moe


def _ds_per_row(combine_SEC):
    dispatch_SE = (combine_SEC != 0).any(-1)
    assert int(dispatch_SE.sum(-1).max()) <= 1
    kept = dispatch_SE.any(-1)
    expert = torch.where(kept, dispatch_SE.float().argmax(-1), -1)
    return expert, combine_SEC.sum((1, 2))


SWITCH_NO_DROP = [(16, 4, 0), (33, 5, 1), (1, 3, 2), (64, 8, 3), (10, 1, 4)]


@pytest.mark.parametrize("S,E,seed", SWITCH_NO_DROP)
def test_switch_equals_deepspeed_top1gating_without_drops(ds, S, E, seed):
    logits = _logits(S, E, seed)
    cf = float(E)  # capacity >= S: nothing is dropped, DeepSpeed's keep rule plays no role
    l_aux, combine_SEC, _, exp_counts = ds.top1gating(
        logits, cf, 0, noisy_gate_policy=None, drop_tokens=True, use_rts=False, ep_group=None)
    plan = switch_top1(logits, capacity_factor=cf, min_capacity=0)
    expert, weight = _ds_per_row(combine_SEC)
    assert (expert >= 0).all()
    assert torch.equal(plan.experts_SK[:, 0], expert)
    torch.testing.assert_close(plan.weights_SK[:, 0], weight, rtol=0, atol=0)
    torch.testing.assert_close(plan.aux_loss, l_aux, rtol=1e-6, atol=0)
    assert torch.equal(plan.counts(E), exp_counts)
    assert combine_SEC.shape[-1] == switch_capacity(S, E, cf, 0)


@pytest.mark.parametrize("S,E,cf,min_cap", [(64, 4, 0.5, 0), (40, 4, 1.0, 0), (30, 3, 1.25, 0), (12, 4, 0.25, 4)])
def test_switch_matches_deepspeed_when_dropping_up_to_which_rows(ds, S, E, cf, min_cap):
    """With drops DeepSpeed keeps whichever rows torch.topk returns among tied mask entries.

    Same capacity, same choices and weights, same number kept per expert, same l_aux; only
    the identity of the kept rows differs (ours: the first C rows by position).
    """
    logits = _logits(S, E, S, skew=3.0)
    l_aux, combine_SEC, _, _ = ds.top1gating(
        logits, cf, min_cap, noisy_gate_policy=None, drop_tokens=True, use_rts=False, ep_group=None)
    plan = switch_top1(logits, capacity_factor=cf, min_capacity=min_cap)
    capacity = switch_capacity(S, E, cf, min_cap)
    assert combine_SEC.shape[-1] == capacity
    expert, weight = _ds_per_row(combine_SEC)
    assert (plan.experts_SK == -1).any(), "the case was meant to drop rows"
    assert torch.equal(plan.counts(E), torch.bincount(expert[expert >= 0], minlength=E))
    both = (expert >= 0) & (plan.experts_SK[:, 0] >= 0)
    assert torch.equal(plan.experts_SK[both, 0], expert[both])
    torch.testing.assert_close(plan.weights_SK[both, 0], weight[both], rtol=0, atol=0)
    torch.testing.assert_close(plan.aux_loss, l_aux, rtol=1e-6, atol=0)


def test_switch_noise_matches_deepspeed_rsample(ds, monkeypatch):
    S, E = 20, 4
    logits, noise = _logits(S, E, 9), _gumbel(S, E, 9)
    monkeypatch.setattr(ds, "gumbel_rsample", lambda shape, device: noise.clone())
    l_aux, combine_SEC, _, _ = ds.top1gating(
        logits, 4.0, 0, noisy_gate_policy="RSample", drop_tokens=True, use_rts=False, ep_group=None)
    plan = switch_top1(logits, capacity_factor=4.0, min_capacity=0, noise_SE=noise)
    expert, weight = _ds_per_row(combine_SEC)
    assert not torch.equal(expert, logits.argmax(1)), "the noise was meant to change some choices"
    assert torch.equal(plan.experts_SK[:, 0], expert)
    torch.testing.assert_close(plan.weights_SK[:, 0], weight, rtol=0, atol=0)
    torch.testing.assert_close(plan.aux_loss, l_aux, rtol=1e-6, atol=0)


def _switch_loop(logits, capacity):
    p = torch.softmax(logits.double(), 1)
    count = [0] * logits.shape[1]
    experts, weights = [], []
    for s in range(logits.shape[0]):
        e = int(p[s].argmax())
        keep = count[e] < capacity
        count[e] += 1
        experts.append(e if keep else -1)
        weights.append(float(p[s, e]) if keep else 0.0)
    return torch.tensor(experts), torch.tensor(weights)


@pytest.mark.parametrize("S,E,cf,min_cap", [(32, 4, 1.0, 0), (17, 3, 0.7, 2), (50, 8, 1.25, 4), (5, 2, 0.1, 1)])
def test_switch_drops_in_order_of_position(S, E, cf, min_cap):
    logits = _logits(S, E, 2 * S, skew=2.5)
    plan = switch_top1(logits, capacity_factor=cf, min_capacity=min_cap)
    experts, weights = _switch_loop(logits, switch_capacity(S, E, cf, min_cap))
    assert (experts == -1).any()
    assert torch.equal(plan.experts_SK[:, 0], experts)
    torch.testing.assert_close(plan.weights_SK[:, 0], weights.float())


def test_switch_keeps_first_rows_by_position():
    logits = torch.tensor([[1.0, 0.0]] * 10)
    plan = switch_top1(logits, capacity_factor=1.0, min_capacity=0)  # capacity 5
    assert plan.experts_SK[:, 0].tolist() == [0] * 5 + [-1] * 5
    assert (plan.weights_SK[5:] == 0).all() and (plan.weights_SK[:5] > 0.7).all()
    assert switch_top1(logits, capacity_factor=1.0, min_capacity=7).counts(2).tolist() == [7, 0]


def test_switch_eval_has_no_capacity_unless_asked():
    logits = _logits(40, 4, 1, skew=5.0)
    assert (switch_top1(logits, training=False).experts_SK >= 0).all()
    assert (switch_top1(logits, capacity_factor=None).experts_SK >= 0).all()
    ev = switch_top1(logits, training=False, eval_capacity_factor=1.0, min_capacity=0)
    assert torch.equal(ev.experts_SK, switch_top1(logits, capacity_factor=1.0, min_capacity=0).experts_SK)
    assert (ev.experts_SK == -1).any()


def test_switch_capacity_formula():
    # exact decimal product, then ceil; DeepSpeed's float32 product gives 31 for the first case
    assert switch_capacity(25, 1, 1.2, 0) == 30
    assert switch_capacity(100, 2, 1.1, 0) == 55         # float64: 1.1 * 100 / 2 = 55.00000000000001
    assert switch_capacity(10, 3, 1.0, 0) == 4
    assert switch_capacity(10, 3, 1.0, 6) == 6
    for S in range(0, 60):
        for E in (1, 2, 3, 7):
            for num, den in ((1, 2), (1, 1), (5, 4), (6, 5), (3, 10), (2, 1)):
                assert switch_capacity(S, E, num / den, 0) == -(-S * num // (den * E)), (S, E, num, den)
    assert gshard_capacity(16, 4) == 8 and gshard_capacity(3, 4) == 2 and gshard_capacity(1, 8) == 1


def test_switch_capacity_agrees_with_deepspeed_where_float32_is_exact(ds):
    for S in (1, 7, 16, 33, 100):
        for E in (1, 2, 3, 8):
            for cf in (0.25, 0.5, 1.0, 1.25, 2.0):
                got = int(ds._capacity(torch.empty(S, E), torch.tensor(cf), torch.tensor(4)))
                assert switch_capacity(S, E, cf, 4) == got, (S, E, cf)


# ---------------------------------------------------------------- both: gradients, limits, errors


GATES = {
    "switch": lambda x, **kw: switch_top1(x, capacity_factor=1.0, min_capacity=0, **kw),
    "gshard": lambda x, **kw: gshard_top2(x, noise_SE=torch.zeros_like(x), **kw),
}


@pytest.mark.parametrize("gate", GATES)
def test_gradients_reach_logits_through_weights_and_aux_loss(gate):
    logits = _logits(12, 4, 5, skew=4.0).double().requires_grad_(True)
    plan = GATES[gate](logits)
    assert plan.weights_SK.requires_grad and plan.aux_loss.requires_grad
    # random coefficients: GShard's kept weights sum to 1 per row, so their plain sum has no gradient
    coef = torch.randn(plan.weights_SK.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (g_w,) = torch.autograd.grad((plan.weights_SK * coef).sum(), logits, retain_graph=True)
    (g_a,) = torch.autograd.grad(plan.aux_loss, logits)
    assert g_w.abs().sum() > 0 and g_a.abs().sum() > 0
    # fully dropped rows get no gradient through the weights
    dropped = (plan.experts_SK < 0).all(1)
    full = (plan.experts_SK >= 0).all(1)
    assert dropped.any() and (g_w[dropped] == 0).all() and (g_w[full] != 0).any(1).all()

    # the piecewise-smooth maps are exactly differentiable away from ties (experts fixed)
    f = lambda x: (GATES[gate](x).weights_SK * coef).sum() + 3.0 * GATES[gate](x).aux_loss  # noqa: E731
    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("gate", GATES)
def test_kept_counts_never_exceed_capacity(gate):
    g = torch.Generator().manual_seed(0)
    for _trial in range(40):
        S = int(torch.randint(1, 80, (), generator=g))
        E = int(torch.randint(1, 9, (), generator=g))
        logits = 3 * torch.randn(S, E, generator=g)
        logits[:, 0] += float(torch.rand((), generator=g)) * 4
        if gate == "switch":
            cf = float(torch.rand((), generator=g)) * 2 + 0.1
            plan, cap = switch_top1(logits, capacity_factor=cf, min_capacity=1), switch_capacity(S, E, cf, 1)
        else:
            plan, cap = gshard_top2(logits), gshard_capacity(S, E)
        counts = plan.counts(E)
        assert counts.max() <= cap, (S, E, counts, cap)
        # a first choice is only dropped when its expert is full
        first = torch.softmax(logits, 1).argmax(1)
        dropped_first = plan.experts_SK[:, 0] < 0
        if dropped_first.any():
            assert (counts[first[dropped_first]] == cap).all()
        assert (plan.weights_SK[plan.experts_SK < 0] == 0).all()
        if gate == "gshard":
            kept = plan.experts_SK >= 0
            assert torch.allclose(plan.weights_SK.sum(1)[kept.any(1)], torch.ones(int(kept.any(1).sum())))


@pytest.mark.parametrize("gate", GATES)
def test_empty_batch_and_half_precision(gate):
    empty = GATES[gate](torch.zeros(0, 4, requires_grad=True))
    assert empty.experts_SK.shape[0] == 0 and float(empty.aux_loss) == 0.0
    empty.aux_loss.backward()
    bf = GATES[gate](_logits(16, 4, 0).bfloat16())
    assert bf.weights_SK.dtype == torch.float32 and bf.aux_loss.dtype == torch.float32


@pytest.mark.parametrize("fn", [switch_top1, gshard_top2])
def test_bad_logit_shapes_are_rejected(fn):
    with pytest.raises(ValueError, match=r"shape \(S, E\).*got \(8,\)"):
        fn(torch.randn(8))
    with pytest.raises(ValueError, match=r"got \(2, 4, 3\)"):
        fn(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="E = 0"):
        fn(torch.randn(4, 0))
    with pytest.raises(ValueError, match="floating-point.*int64"):
        fn(torch.ones(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"noise_SE.*\(4, 2\).*\(4, 3\)"):
        fn(torch.randn(4, 2), noise_SE=torch.randn(4, 3))


@pytest.mark.parametrize("kw,match", [
    ({"capacity_factor": 0.0}, r"capacity_factor=0\.0 is invalid.*> 0"),
    ({"capacity_factor": -1.5}, r"capacity_factor=-1\.5 is invalid"),
    ({"capacity_factor": float("nan")}, "capacity_factor=nan is invalid"),
    ({"capacity_factor": float("inf")}, "capacity_factor=inf is invalid"),
    ({"eval_capacity_factor": 0}, "eval_capacity_factor=0 is invalid"),
    ({"min_capacity": -1}, r"min_capacity=-1 is invalid.*>= 0"),
    ({"min_capacity": 2.5}, r"min_capacity=2\.5 is invalid"),
])
def test_bad_switch_settings_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        switch_top1(torch.randn(4, 2), **kw)
