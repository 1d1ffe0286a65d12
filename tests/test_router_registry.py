"""The router registry (smlp/routing/registry.py): every consumer reads its routers from it.

The layer, the core config, the FLOPs calculator, the step-time model and the benchmark see exactly
the registry's routers, with the facts the registry gives (checked against hand computations); a
router added to the registry (here a test router, registered for the test only) is built, routed,
counted and modelled with no other file touched. The fairseq flag choices are checked in
tests/test_config_table.py (they need fairseq).
"""
import math

import pytest
import torch

from smlp import steptime
from smlp.config import TMoEConfig
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import TMoE
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS, TokenRouter
from smlp.routing.token_routers import Router
from smlp_eval.flops import counting as flop_count
from smlp_eval.flops import matching as flop_match

COMMON = dict(vocab_size=53, d_model=16, d_ffn=32, seq_len=12, dense_layers=2)


def transformer(router: str, **kw) -> LMConfig:
    return LMConfig(family="transformer", heads=2, sparse_layers=2, num_experts=4, moe_router=router,
                    **{**COMMON, **kw})


def test_every_import_time_consumer_lists_the_registry():
    from smlp_bench import presets

    names = tuple(TOKEN_ROUTERS)
    assert names == ("gshard", "switch", "base", "hash")  # the paper's four baselines (sec. 4.1)
    assert presets.MOE_BASELINES == names
    assert set(names) <= set(presets.OUR_FAMILIES) and set(names) <= set(presets.MODEL_ORDER)
    assert set(names) <= set(presets.LONG_MODELS)
    assert set(names) <= set(flop_match.MATCH_FAMILIES)
    for r in TOKEN_ROUTERS.values():
        assert presets.NAMES[r.name] == flop_count.FAMILY_NAMES[r.name] == r.title
    assert presets.NAMES["smlp_det"] == SMOE_ROUTINGS["deterministic"].title
    assert presets.NAMES["smlp_partial"] == SMOE_ROUTINGS["partial"].title


def test_the_registry_facts_match_the_papers_rules():
    """Hand values: GShard top-2 with capacity ceil(2S/E); Switch top-1 with max(ceil(cf S/E), 4); Base
    and HASH drop nothing; the softmax gates have an auxiliary loss; Base Layers and HASH sit where the
    paper puts them, GShard and Switch every other layer."""
    S, E = 100, 8
    g, s, b, h = (TOKEN_ROUTERS[k] for k in ("gshard", "switch", "base", "hash"))
    assert (g.top_k, s.top_k, b.top_k, h.top_k) == (2, 1, 1, 1)
    assert g.capacity(S, E, 1.0) == math.ceil(2 * S / E) == 25
    assert s.capacity(S, E, 1.25) == math.ceil(1.25 * S / E) == 16 and s.capacity(8, E, 1.0) == 4
    assert not b.drops and not h.drops and g.drops and s.drops
    assert [r.name for r in TOKEN_ROUTERS.values() if r.aux_loss] == ["gshard", "switch"]
    assert {r.name: r.placement for r in TOKEN_ROUTERS.values()} == {
        "gshard": "every_other", "switch": "every_other", "base": "paper", "hash": "paper"}
    assert b.router_macs(S, 16, E) == S * 16 * E and h.router_macs(S, 16, E) == 0
    assert s.exchange_rows(S, E, 1.25, padding=True) == E * 16 and s.exchange_rows(S, E, 1.25, padding=False) == S
    assert g.exchange_rows(S, E, 1.0, padding=True) == E * 25 and g.padding_rows(S, E, 1.0) == 0
    assert s.padding_rows(S, E, 1.25) == E * 16 - S


@pytest.mark.parametrize("name", list(TOKEN_ROUTERS))
def test_the_layer_the_config_the_calculator_and_the_step_time_model_read_the_entry(name):
    router = TOKEN_ROUTERS[name]
    cfg = transformer(name)
    assert cfg.placement == router.placement
    # the layer: the router's parameters, its route function, its capacity rule
    lm = LanguageModel(cfg).eval()
    tmoe = next(m for _, m in lm.moe_modules())
    assert tmoe.token_router is router
    tokens = torch.randint(2, COMMON["vocab_size"], (2, COMMON["seq_len"]))
    lm(tokens)
    assert (tmoe.dropped is not None) == router.drops
    assert int(tmoe.load_E.sum()) == router.top_k * tokens.numel()  # eval: every slot kept
    lm.train()(tokens)  # the load-balancing loss is a training-time loss
    assert (lm.aux_loss() is not None) == (router.aux_loss is not None)
    # the calculator: router and expert multiply-adds of one sparse layer, by hand
    count = flop_count.count(cfg, method="analytic")
    fv = flop_count.count(cfg, method="fvcore")
    assert count.macs == fv.macs  # two counts that share nothing but the model
    n, D, F, E = COMMON["seq_len"], COMMON["d_model"], COMMON["d_ffn"], 4
    expert = 2 * D * F + (5 * D if cfg.tmoe.uses_expert_norm else 0)
    assert flop_count._tmoe_macs(tmoe, n) == (n * D * E if router.learned_scores else 0) + router.top_k * n * expert
    # the step-time model: rows of the tMoE exchange, with and without capacity padding
    for padding in (False, True):
        ex = steptime.sparse_exchanges(cfg, sequences=2, tokens=n, ep_size=4, dtype_bytes=2, padding=padding)
        tmoe_ex = next(e for e in ex if e.name == f"tmoe-{name}")
        S = 2 * n
        if padding and router.capacity is not None:
            assert tmoe_ex.rows == E * router.capacity(S, E, cfg.capacity_factor)
        else:
            assert tmoe_ex.rows == router.top_k * S
        assert any(e.name.startswith("base-shuffle") for e in ex) == router.shuffle


class GreedyRouter(Router):
    """A test router: greedy top-1 on a learned gate, sigmoid weight, no capacity (Base Layers' eval rule)."""

    def __init__(self, cfg, dispatcher):
        super().__init__(cfg, dispatcher)
        self.gate = torch.nn.Linear(cfg.d_model, cfg.num_experts, bias=False)

    def gating(self, x_SD):
        from smlp.routing.logits import router_logits

        return router_logits(x_SD, self.gate.weight.t())

    def routing(self, logits_SE, token_ids_S, *, layer, defer_checks):
        from smlp.routing import base_route

        return base_route(logits_SE, layer=layer, defer_checks=defer_checks)


GREEDY = TokenRouter("greedy", "Greedy (test)", top_k=1, aux_loss=None, capacity=None, placement="fairseq",
                     learned_scores=True, router_class=GreedyRouter)


def test_a_router_added_to_the_registry_works_everywhere(monkeypatch):
    """One entry (and its router class) is all a new router needs: the configs accept it, the model
    builds and routes with it, the calculator counts it and the step-time model prices its exchange."""
    monkeypatch.setitem(TOKEN_ROUTERS, "greedy", GREEDY)
    cfg = transformer("greedy", dense_layers=3)
    # fairseq --base-layers insertion: layers.insert((i + 1) * 3 // 3, sparse) for i = 0, 1
    assert cfg.placement == "fairseq" and cfg.plan == ["dense", "sparse", "sparse", "dense", "dense"]
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=16, d_ffn=32, num_experts=4, router="greedy"))
    x_SD = torch.randn(20, 16)
    plan = layer.route(x_SD)
    scores_SE = x_SD @ layer.router.gate.weight.t()
    torch.testing.assert_close(plan.experts_SK[:, 0], scores_SE.argmax(-1))  # by hand
    torch.testing.assert_close(plan.weights_SK[:, 0], torch.sigmoid(scores_SE.max(-1).values))
    layer(x_SD)
    assert torch.equal(layer.load_E, torch.bincount(scores_SE.argmax(-1), minlength=4)) and layer.dropped is None
    lm = LanguageModel(cfg)
    assert lm(torch.randint(2, 53, (2, 12))).shape == (2, 12, 53)
    assert flop_count.count(cfg, method="analytic").macs == flop_count.count(cfg, method="fvcore").macs
    ex = steptime.sparse_exchanges(cfg, sequences=2, tokens=12, ep_size=4, dtype_bytes=2, padding=True)
    assert [(e.name, e.rows) for e in ex] == [("tmoe-greedy", 24)]
    with pytest.raises(ValueError, match="greedy"):  # the valid names come from the registry
        LMConfig(family="transformer", heads=2, sparse_layers=2, num_experts=4, moe_router="nope", **COMMON)


@pytest.mark.parametrize("name", list(SMOE_ROUTINGS))
def test_smoe_routings_read_the_entry(name):
    """The sMoE layer, the calculator and the step-time model take the routing's positions from the entry."""
    routing = SMOE_ROUTINGS[name]
    cfg = LMConfig(family="smlp", sparse_layers=1, num_experts=4, smoe_routing=name, prefix_fraction=0.25,
                   **{**COMMON, "dense_layers": 1})
    smoe = cfg.sparse_block.smoe
    T = COMMON["seq_len"]
    assert smoe.prefix_len == (3 if routing.router_reads == "prefix" else 0)
    assert smoe.router_len == {"none": 0, "prefix": 3, "all": T}[routing.router_reads]
    lm = LanguageModel(cfg)
    layer = next(m for _, m in lm.moe_modules() if m.__class__.__name__ == "SMoE")
    assert layer.routing is routing
    assert (getattr(layer, "router", None) is not None) == (routing.router_reads != "none")
    count = flop_count.count(cfg, method="analytic")
    assert count.macs == flop_count.count(cfg, method="fvcore").macs
    ex = steptime.sparse_exchanges(cfg, sequences=2, tokens=T, ep_size=4, dtype_bytes=2)
    assert ex[0].name == "smoe" and ex[0].row_bytes == (T - smoe.prefix_len) * 2
