"""Routing observability, capacity factors and the router z-loss (issue 22), one process.

References: hand computations (the z-loss with Python's math, the logged figures from counts
summed by hand), the gates' own capacity rule, and the criterion's loss without the z-loss term.
The figures over real ranks are compared with one process in tests/test_fairseq.py (2-rank training).
"""
from __future__ import annotations

import math

import pytest
import torch

from smlp.config import TMoEConfig
from smlp.lm import LanguageModel
from smlp.moe import TMoE
from smlp.routing.gates import gshard_capacity, router_z_loss, switch_capacity

torch.set_num_threads(1)


def test_router_z_loss_is_the_mean_squared_logsumexp_of_each_row():
    logits = [[1.0, -2.0, 0.5], [30.0, 29.0, -4.0], [0.0, 0.0, 0.0], [-1e3, 2.0, 1.5]]
    hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / len(logits)
    t = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    z = router_z_loss(t)
    assert float(z) == pytest.approx(hand, rel=1e-12)
    z.backward()  # d/dx of mean(lse^2): 2 lse(x_s) softmax(x_s) / S
    lse = torch.logsumexp(t.detach(), -1, keepdim=True)
    torch.testing.assert_close(t.grad, 2 * lse * torch.softmax(t.detach(), -1) / len(logits))
    # in fp32 from half logits; and the layer's, from its gate's logits
    half = t.detach().to(torch.bfloat16)
    assert router_z_loss(half).dtype == torch.float32
    assert float(router_z_loss(torch.zeros(0, 3))) == 0.0
    layer = TMoE(TMoEConfig(d_model=3, d_ffn=4, num_experts=3, router="switch"))
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(3))
    layer(t.detach().float())  # the logits are the rows themselves
    assert float(layer.z_loss) == pytest.approx(hand, rel=1e-5)


def _tiny_core(router, **kw):
    from tiny_steps import tiny_config

    torch.manual_seed(0)
    return LanguageModel(tiny_config(router, **kw)).train()


def test_the_criterion_adds_the_weighted_z_loss_only_when_asked(monkeypatch):
    import smlp.routing.logits  # the router logits, which the registry's route functions call
    from tiny_steps import criterion, fairseq_model, lm_sample, tokens

    captured = []
    real = smlp.routing.logits.router_logits
    monkeypatch.setattr(smlp.routing.logits, "router_logits", lambda x, w: captured.append(real(x, w)) or captured[-1])
    core = _tiny_core("Switch")
    model, dictionary = fairseq_model(core)
    sample = lm_sample(tokens(), dictionary.pad())
    crit = criterion(dictionary)
    assert crit.router_z_loss_weight == 0.0  # off by default
    torch.manual_seed(1)
    off, size, log_off = crit(model, sample)
    by_hand = sum(router_z_loss(c.detach()) for c in captured)  # one router per sparse layer
    assert len(captured) == 2 and float(log_off["z_loss"]) == pytest.approx(float(by_hand), rel=1e-6)
    crit.router_z_loss_weight = 1e-3
    torch.manual_seed(1)
    on, _, log_on = crit(model, sample)
    assert float(on - off) == pytest.approx(1e-3 * float(by_hand) * size, rel=1e-5)
    core.zero_grad()
    on.backward()  # the z-loss trains the router
    assert all(m.router.gate.weight.grad is not None for _, m in core.moe_modules())
    base = _tiny_core("Base")  # balanced routing has no softmax gate, so no z-loss
    base(tokens())
    assert base.z_loss() is None


def _log_and_read(logging_outputs):
    from fairseq.logging import metrics

    from fairseq_plugins.criterion import SMLPLanguageModelLoss

    with metrics.aggregate(new_root=True) as agg:
        SMLPLanguageModelLoss.reduce_metrics(logging_outputs)
        return {k: float(v) for k, v in agg.get_smoothed_values().items()}


def test_routing_figures_come_from_counts_summed_over_ranks():
    """Two ranks (or micro-batches) log their per-expert counts; fairseq sums the logging outputs and the
    figures are those of the summed counts: not the mean of each rank's ratios."""
    rank0 = {"loss": torch.tensor(1.0), "ntokens": 8, "sample_size": 8, "moe_count": 1,
             "moe_load_1_ffn": torch.tensor([6.0, 0.0, 2.0, 0.0]), "moe_drop_1_ffn": torch.tensor(3.0),
             "moe_slots_1_ffn": 11}
    rank1 = {"loss": torch.tensor(1.0), "ntokens": 8, "sample_size": 8, "moe_count": 1,
             "moe_load_1_ffn": torch.tensor([0.0, 6.0, 2.0, 0.0]), "moe_drop_1_ffn": torch.tensor(1.0),
             "moe_slots_1_ffn": 9}
    summed = {k: rank0[k] + rank1[k] for k in rank0}  # what fairseq's all-reduce of the outputs gives
    for outputs in ([summed], [rank0, rank1]):  # several ranks (summed), or micro-batches of one process
        got = _log_and_read(outputs)
        load, mean = [6.0, 6.0, 4.0, 0.0], 4.0
        assert got["load_1_ffn"] == pytest.approx(6.0 / mean, abs=1e-3)  # per rank: 3.0 on both
        assert got["load_min_1_ffn"] == 0.0
        cv = math.sqrt(sum((v - mean) ** 2 for v in load) / 4) / mean
        assert got["load_cv_1_ffn"] == pytest.approx(cv, abs=1e-3)
        assert got["idle_1_ffn"] == 1.0  # expert 3 only; each rank alone has two idle experts
        assert got["drop_1_ffn"] == pytest.approx(4 / 20, abs=1e-4)
    balanced = _log_and_read([{"moe_load_2_tmoe": torch.tensor([5.0, 5.0])}])
    assert (balanced["load_2_tmoe"], balanced["load_min_2_tmoe"], balanced["load_cv_2_tmoe"],
            balanced["idle_2_tmoe"]) == (1.0, 1.0, 0.0, 0.0) and "drop_2_tmoe" not in balanced
    nothing = _log_and_read([{"moe_load_2_tmoe": torch.zeros(2)}])
    assert nothing["load_2_tmoe"] == 0.0 and nothing["idle_2_tmoe"] == 2.0


def test_layers_keep_their_counts_and_drops_for_the_logs():
    from tiny_steps import tokens

    core = _tiny_core("Switch")
    core(tokens())
    for _, m in core.moe_modules():
        S = tokens().numel()
        assert m.slots == S and int(m.load_E.sum() + m.dropped) == S  # every slot kept or dropped
    gshard = _tiny_core("GShard")
    gshard(tokens())
    assert all(m.slots == 2 * tokens().numel() for _, m in gshard.moe_modules())
    for name in ("Base", "HASH", "sMLP-det"):
        c = _tiny_core(name)
        c(tokens())
        assert all(m.dropped is None and m.load_E is not None for _, m in c.moe_modules())


@pytest.mark.parametrize("router", ["switch", "gshard"])
def test_capacity_factors_in_training_and_at_evaluation(router):
    torch.manual_seed(0)
    E, S = 4, 64
    x = torch.randn(S, 8) + 5.0  # with the router below every token's first choice is expert 0

    def layer(**kw):
        torch.manual_seed(0)
        t = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=E, router=router, **kw))
        with torch.no_grad():  # a skewed router: expert 0's logit is the sum of the features
            t.router.gate.weight.zero_()
            t.router.gate.weight[0] = 1.0
        return t

    K = 2 if router == "gshard" else 1
    cap = (lambda cf: gshard_capacity(S, E, cf)) if router == "gshard" else (lambda cf: switch_capacity(S, E, cf))
    for cf in (0.5, 1.0, 2.0):
        t = layer(capacity_factor=cf).train()
        t(x)
        assert int(t.load_E[0]) == min(cap(cf), S)  # the skewed expert fills its capacity
        assert int(t.dropped) == K * S - int(t.load_E.sum())
    ev = layer(capacity_factor=0.5).eval()
    ev(x)
    assert int(ev.dropped) == 0  # no limit at evaluation by default (per-token routing, causal)
    ev = layer(capacity_factor=2.0, eval_capacity_factor=0.5).eval()
    ev(x)
    assert int(ev.load_E[0]) == cap(0.5) and int(ev.dropped) > 0
    assert gshard_capacity(16, 4) == 8 and gshard_capacity(16, 4, 1.5) == 12 and gshard_capacity(10, 4, 1.1) == 6
    with pytest.raises(ValueError, match="eval_capacity_factor=0"):
        TMoEConfig(d_model=8, d_ffn=16, num_experts=E, router=router, eval_capacity_factor=0)


def test_capacity_flags_reach_the_core_config(tiny_lm_data):
    from test_fairseq import build_model

    model, _ = build_model(tiny_lm_data, "switch_lm_tiny", ["--capacity-factor", "1.25", "--eval-capacity-factor", "2"])
    assert (model.core.cfg.capacity_factor, model.core.cfg.eval_capacity_factor) == (1.25, 2.0)
    tmoe = model.core.moe_modules()[0][1]
    assert (tmoe.cfg.capacity_factor, tmoe.cfg.eval_capacity_factor) == (1.25, 2.0)
    model, _ = build_model(tiny_lm_data, "gshard_lm_tiny")
    assert model.core.cfg.eval_capacity_factor is None  # 0, the default: no limit at evaluation


@pytest.mark.parametrize("router", ["Switch", "sMLP-partial"])
def test_the_criterion_scores_every_model_on_the_suffix_partial_prediction_predicts(router):
    """--valid-suffix-from N: in validation, suffix_loss is the loss over target positions >= N only (by
    hand from the model's log-probabilities); a partial-prediction model's suffix from its own prefix is
    its loss; nothing is logged in training."""
    from tiny_steps import criterion, fairseq_model, lm_sample, tokens

    core = _tiny_core(router)
    model, dictionary = fairseq_model(core)
    model.eval()
    sample = lm_sample(tokens(), dictionary.pad())
    crit = criterion(dictionary)
    start = core.cfg.prediction_start
    N = max(start, 5)
    crit.valid_suffix_from = N
    with torch.no_grad():
        _, _, log = crit(model, sample)
        lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
    want = -lprobs[:, N:].gather(-1, sample["target"][:, N:, None]).sum()
    assert float(log["suffix_loss"]) == pytest.approx(float(want), rel=1e-5)
    assert log["suffix_ntokens"] == sample["target"][:, N:].numel()
    figures = _log_and_read([log])
    assert figures["suffix_ppl"] == pytest.approx(2 ** (float(want) / log["suffix_ntokens"] / math.log(2)), rel=1e-2)
    if start:
        crit.valid_suffix_from = start
        with torch.no_grad():
            _, _, log = crit(model, sample)
        assert float(log["suffix_loss"]) == pytest.approx(float(log["loss"]), rel=1e-6)
    model.train()
    assert "suffix_loss" not in crit(model, sample)[2]


@pytest.mark.parametrize("router", ["sMLP-det", "sMLP-partial", "Base", "Switch", "gMLP"])
def test_the_criterion_scores_balanced_routers_with_their_training_assignment_too(router):
    """--valid-trained-routing: in validation, trained_routing_loss is the loss of the same targets with every
    balanced router (Base Layers, sMLP's tMoE, sMLP-partial's sMoE) assigning as in training; a model without
    one logs its own loss there; nothing is logged in training (issue 29)."""
    from tiny_steps import criterion, fairseq_model, lm_sample, tokens

    core = _tiny_core(router)
    model, dictionary = fairseq_model(core)
    model.eval()
    sample = lm_sample(tokens(), dictionary.pad())
    crit = criterion(dictionary)
    crit.valid_trained_routing = True
    with torch.no_grad():
        _, _, log = crit(model, sample)
        with core.assigning_as_in_training():
            lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
    assert not any(m.assign_as_in_training for _, m in core.moe_modules() if hasattr(m, "assign_as_in_training"))
    start = core.cfg.prediction_start
    want = -lprobs[:, start:].gather(-1, sample["target"][:, start:, None]).sum()
    assert core.has_balanced_routers == (router in ("sMLP-det", "sMLP-partial", "Base"))
    if core.has_balanced_routers:
        assert float(log["trained_routing_loss"]) == pytest.approx(float(want), rel=1e-5)
        assert float(log["trained_routing_loss"]) != pytest.approx(float(log["loss"]), rel=1e-6)  # routed otherwise
    else:
        assert float(log["trained_routing_loss"]) == float(log["loss"])
    assert log["trained_routing_ntokens"] == log["ntokens"]
    figures = _log_and_read([log])
    assert figures["trained_routing_ppl"] == pytest.approx(
        2 ** (float(log["trained_routing_loss"]) / log["ntokens"] / math.log(2)), rel=1e-2)
    model.train()
    assert "trained_routing_loss" not in crit(model, sample)[2]


@pytest.mark.parametrize("router", ["Base", "sMLP-partial"])
def test_evaluation_with_the_training_assignment_balances_every_expert_exactly(router):
    """Greedy evaluation leaves the experts' loads uneven; within `assigning_as_in_training()` a balanced router
    gives every expert exactly the same number of rows, as in training, and the flag is restored after."""
    core = _tiny_core(router).eval()
    x = torch.randint(4, 64, (4, 20), generator=torch.Generator().manual_seed(3))
    layer = next(m for _, m in core.moe_modules()
                 if type(m).__name__ == ("TMoE" if router == "Base" else "SMoE"))
    with torch.no_grad():
        core(x)
        greedy = layer.load_E.tolist()
        with core.assigning_as_in_training():
            core(x)
            balanced = layer.load_E.tolist()
    assert len(set(balanced)) == 1 and sum(balanced) == sum(greedy)
    assert len(set(greedy)) > 1, greedy  # greedy routing of this batch is uneven (otherwise the test says nothing)
    assert layer.assign_as_in_training is False
