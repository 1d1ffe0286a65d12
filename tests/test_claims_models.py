"""The models of the paper's other experiments (benchmarks/experiments.py) in one process.

- Appendix B's sMoE router over all T positions (`leaky-full-sequence`) fails the model-level
  causality check, deterministic and partial routing pass it (eval mode, as every model here: in
  training Base Layers' balanced assignment couples the tokens of a batch by design); it is
  accepted only under its name.
- gMLP extended to token-level routing (Table 7) is causal, equals dense gMLP with one expert, and
  equals a per-token loop written from the paper's description.
- Every experiment model that claims causality passes the check; every flag an experiment relies
  on reaches the training command (fairseq_flags round trip), and the FLOPs calculator counts them.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from smlp.causality import assert_causal, earlier_outputs_unchanged, randomized
from smlp.config import SMoEConfig, TokenRoutedGMLPConfig
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import LEAKY_ROUTING_WARNING
from smlp.token_routed import TokenRoutedGMLPBlock
from smlp_bench import experiments as X
from smlp_bench import training
from smlp_eval import flops as Fl
from tolerance import within_bound

TINY = dict(vocab_size=60, d_model=32, d_ffn=64, seq_len=24)


def smlp(routing, **kw):
    return LMConfig(family="smlp", dense_layers=2, sparse_layers=1, num_experts=2, smoe_routing=routing, **TINY, **kw)


def tokens(seed=0, B=3, n=24):
    return torch.randint(4, TINY["vocab_size"], (B, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- Appendix B: the leaky router


def test_leaky_router_fails_the_causality_check_and_the_causal_routings_pass():
    """In eval mode, as every model here is checked: in training the sparse blocks' tMoE (Base Layers)
    assigns tokens with exact balance over the batch, which couples positions by design (docs/training.md)."""
    x = tokens()
    for routing in ("deterministic", "partial", "leaky-full-sequence"):
        torch.manual_seed(0)
        cfg = smlp(routing)
        model = randomized(LanguageModel(cfg), 1).eval()
        start = cfg.prediction_start
        if routing == "leaky-full-sequence":
            assert start == 0  # it predicts every position, having read them all
            changed = [not earlier_outputs_unchanged(model, x, t, first_checked=start) for t in (3, 12, 20)]
            assert all(changed), "the router over all positions must see the future at every position checked"
        else:
            assert_causal(model, x, first_checked=start, positions=[start, 12, 20])


def test_leaky_router_only_by_its_explicit_name_and_with_a_warning(caplog):
    assert LMConfig(family="smlp", dense_layers=1, sparse_layers=1, num_experts=2, **TINY).smoe_routing == \
        "deterministic"
    for alias in ("leaky", "full", "full-sequence", "leaky_full_sequence", "appendix-b", "Leaky-Full-Sequence"):
        with pytest.raises(ValueError, match="valid values are deterministic, partial, leaky-full-sequence"):
            smlp(alias)
        with pytest.raises(ValueError, match="unknown"):
            SMoEConfig(dim=32, seq_len=24, num_experts=2, routing=alias)
    with pytest.raises(ValueError, match="invalid choice"):
        Fl.parse_model("smlp_lm_tiny", ["--smoe-routing", "leaky", "--num-experts", "2"], vocab_size=60)
    with caplog.at_level(logging.WARNING, logger="smlp.moe"):
        LanguageModel(smlp("deterministic"))
        assert not caplog.records
        LanguageModel(smlp("leaky-full-sequence"))
    assert [r.getMessage() for r in caplog.records] == [LEAKY_ROUTING_WARNING]
    assert "SEES THE FUTURE" in LEAKY_ROUTING_WARNING
    spec = Fl.parse_model("smlp_lm_tiny", ["--smoe-routing", "leaky-full-sequence", "--num-experts", "2"],
                           vocab_size=60)
    assert spec.cfg.smoe_routing == "leaky-full-sequence"


def test_leaky_router_reads_every_position_and_is_counted():
    cfg = smlp("leaky-full-sequence")
    smoe = LanguageModel(cfg).layers[1].smoe
    assert tuple(smoe.router.shape) == (24, 2) and smoe.experts.weight.shape[-1] == 24
    full, analytic = Fl.count(cfg, method="fvcore-full"), Fl.count(cfg, method="analytic")
    det = Fl.count(smlp("deterministic"))
    C, T, E = 32, 24, 2
    assert analytic.macs == pytest.approx(full.macs, rel=0.01)
    assert full.macs - det.macs == C * T * E  # the router over all T positions, nothing else


# ---------------------------------------------------------------- Table 7: token-routed gMLP


def token_routed(E, layers=2, **kw):
    return LMConfig(family="gmlp", dense_layers=layers, token_routed_experts=E, **TINY, **kw)


@pytest.mark.parametrize("E", [2, 4])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_token_routed_gmlp_is_causal(E, mode):
    for seed in range(4):
        torch.manual_seed(seed)
        model = randomized(LanguageModel(token_routed(E)), seed).train(mode == "train")
        x = tokens(seed)
        assert_causal(model, x, positions=[0, 5, 11, 17, 22], seed=seed)
        loads = [layer.load_E for layer in model.layers]
        assert all(int(l.sum()) == x.numel() for l in loads)
        assert sum(int((l > 0).sum()) for l in loads) > len(loads), "routing must use more than one expert"


def test_one_expert_token_routed_gmlp_equals_dense_gmlp():
    torch.manual_seed(0)
    dense = randomized(LanguageModel(LMConfig(family="gmlp", dense_layers=2, **TINY)), 3)
    routed = LanguageModel(token_routed(1))
    state = {}
    for name, value in dense.state_dict().items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            name = f"layers.{i}.{rest}" if rest.startswith("norm.") else f"layers.{i}.experts.0.{rest}"
        state[name] = value
    missing = routed.load_state_dict(state, strict=False)
    assert [k for k in missing.missing_keys if not k.endswith("gate.weight")] == [] and not missing.unexpected_keys
    x = tokens(1)
    y_dense, y_routed = dense(x), routed(x)
    rule = dict(reduction=3 * 24, depth=2 * 3)  # weight gradients sum 3 x 24 rows; 3 products per block
    assert within_bound(y_dense, y_routed, **rule)
    y_dense.pow(2).mean().backward()
    y_routed.pow(2).mean().backward()
    gd = dict(dense.named_parameters())
    for name, p in routed.named_parameters():
        if name.endswith("gate.weight"):
            continue  # softmax over one expert is 1 whatever the logits: no gradient reaches it
        ref = name.replace("experts.0.", "")
        assert within_bound(p.grad, gd[ref].grad, **rule), name


def naive_token_routed(block: TokenRoutedGMLPBlock, x_BND: torch.Tensor) -> torch.Tensor:
    """Appendix A written token by token: each token through its expert, whose SGU sums over the
    earlier tokens of the same sequence routed to the same expert, at their original positions."""
    B, n, D = x_BND.shape
    h = block.norm(x_BND)
    probs = torch.softmax(block.gate(h).float(), dim=-1)
    expert = probs.argmax(-1)
    out = x_BND.clone()
    for b in range(B):
        for t in range(n):
            e = int(expert[b, t])
            ex = block.experts[e]
            mine = [s for s in range(t + 1) if int(expert[b, s]) == e]
            z = F.gelu(ex.proj_in(h[b, mine]))
            z1, z2 = z.chunk(2, dim=-1)
            v = ex.sgu.norm(z2)
            w = ex.sgu.proj.weight[0, t, mine]
            gate = w @ v + (1 + ex.sgu.proj.bias_offset[0, t])
            out[b, t] = x_BND[b, t] + probs[b, t, e] * ex.proj_out(z1[-1] * gate)
    return out


@pytest.mark.parametrize("E", [2, 3])
def test_token_routed_gmlp_equals_a_per_token_loop(E):
    torch.manual_seed(E)
    block = randomized(TokenRoutedGMLPBlock(TokenRoutedGMLPConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=E)),
                       E).eval()
    x = torch.randn(2, 17, 16)
    y = block(x)
    assert (block.load_E > 0).sum() >= 2
    assert within_bound(y, naive_token_routed(block, x), reduction=32, depth=3)  # F = 32; 3 products
    block.train()
    block(x)
    assert block.aux_loss is not None and block.aux_loss.item() >= 1.0 - 1e-6  # Switch's loss: 1 when balanced


def test_token_routed_gmlp_config_is_validated():
    with pytest.raises(ValueError, match="the transformer family has none"):
        LMConfig(family="transformer", dense_layers=1, token_routed_experts=2, **TINY)
    with pytest.raises(ValueError, match="single-head SGU experts"):
        token_routed(2, heads=2)
    with pytest.raises(ValueError, match="token_routed_experts=-1"):
        token_routed(-1)


def test_token_routed_gmlp_is_counted_exactly():
    for E in (1, 3):
        cfg = token_routed(E, layers=3)
        for n in (24, 17):
            full = Fl.count(cfg, n, method="fvcore-full")
            assert Fl.count(cfg, n).macs == pytest.approx(full.macs, rel=1e-4)
            assert Fl.count(cfg, n, method="analytic").macs == pytest.approx(full.macs, rel=0.01)
    dense = Fl.count(LMConfig(family="gmlp", dense_layers=3, **TINY))
    one = Fl.count(token_routed(1, layers=3))
    assert one.macs - dense.macs == 3 * 24 * 32 * 1  # only the router (T x D x E per layer)
    assert one.params_non_expert - dense.params_non_expert == 3 * 32  # the router's D x 1 weight per layer


# ---------------------------------------------------------------- the experiments' models and flags


def builds_the_same_model(a: LMConfig, b: LMConfig) -> bool:
    """Equal configs, up to the router of a model without sparse layers (LMConfig's default router is
    base, fairseq's --moe-router default switch; a dense model has no router)."""
    if not a.sparse_layers and not b.sparse_layers:
        b = replace(b, moe_router=a.moe_router)
    return a == b


def tiny_version(cfg: LMConfig) -> LMConfig:
    return replace(cfg, **TINY, dense_layers=min(cfg.dense_layers, 2), sparse_layers=min(cfg.sparse_layers, 1))


@pytest.mark.parametrize("name", list(X.EXPERIMENTS))
def test_experiment_models_are_causal_where_they_claim_and_their_flags_reach_training(name):
    exp = X.get_experiment(name)
    cfgs = exp.configs(vocab_size=4000, nproc=2)
    models, _ = exp.plan_models(vocab_size=4000, nproc=2)
    for m, model in zip(exp.models, models):
        cfg = cfgs[m.key]
        # every field of the config reaches the fairseq-train command and builds the same model
        spec = Fl.parse_model(model.flags[1], model.flags[2:], vocab_size=4000)
        assert builds_the_same_model(spec.cfg, cfg), m.key
        cmd = training.train_command(model, Path("/data"), dict(exp.settings), 2, 1, Path("/tmp/x"))
        assert " ".join(model.flags) in " ".join(cmd)
        # the model-level causality check on a small instance of the same family and options
        small = tiny_version(cfg)
        torch.manual_seed(0)
        lm = randomized(LanguageModel(small), 2).eval()
        x = tokens(3)
        start = small.prediction_start
        if m.causal:
            assert_causal(lm, x, first_checked=start, positions=[start, 12, 21])
        else:
            assert not earlier_outputs_unchanged(lm, x, 12, first_checked=start), m.key
    assert [m.causal for m in exp.models].count(False) == (1 if name == "figure7-routing" else 0)


def test_fairseq_flags_round_trip_every_core_field():
    common = dict(vocab_size=101, d_model=32, d_ffn=64, seq_len=24, dense_layers=3)
    cfgs = [LMConfig(family="gmlp", heads=4, dropout=0.1, activation="relu", **common),
            LMConfig(family="gmlp", token_routed_experts=4, **common),
            LMConfig(family="gmlp", token_mixer="ninformer", mixer_dim=24, **common),
            LMConfig(family="smlp", sparse_layers=2, num_experts=4, smoe_routing="partial", prefix_fraction=0.25,
                     sparse_placement="fairseq", base_shuffle=False, **common),
            LMConfig(family="smlp", sparse_layers=2, num_experts=4, smoe_routing="leaky-full-sequence", **common),
            LMConfig(family="transformer", heads=4, sparse_layers=2, num_experts=4, moe_router="switch",
                     capacity_factor=1.5, sparse_placement="paper", **common),
            LMConfig(family="transformer", heads=4, sparse_layers=2, num_experts=4, moe_router="gshard",
                     gshard_aux_loss="fairscale", **common),
            LMConfig(family="transformer", heads=4, sparse_layers=2, num_experts=4, moe_router="hash", hash_seed=3,
                     **common)]
    for cfg in cfgs:
        flags = Fl.fairseq_flags(cfg).split()
        assert Fl.parse_model(flags[1], flags[2:], vocab_size=101).cfg == cfg, flags


def test_planted_errors_fail_the_token_routed_comparisons():
    """The rounding bound used above catches one expert's projection off by 1e-3 of itself and an SGU
    that also mixes the tokens routed to other experts (Appendix A's rule broken)."""
    torch.manual_seed(2)
    block = randomized(TokenRoutedGMLPBlock(TokenRoutedGMLPConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=2)),
                       2).eval()
    x = torch.randn(2, 17, 16)
    want = naive_token_routed(block, x)
    assert within_bound(block(x), want, reduction=32, depth=3)
    with torch.no_grad():
        block.experts[1].proj_in.weight.mul_(1 + 1e-3)
    assert not within_bound(block(x), want, reduction=32, depth=3)
    with torch.no_grad():
        block.experts[1].proj_in.weight.div_(1 + 1e-3)
    assert int((block.load_E > 0).sum()) == 2  # both experts in use
    # routing ignored: expert 0 for every token, mixing all earlier tokens (a dense gMLP block)
    one = TokenRoutedGMLPBlock(TokenRoutedGMLPConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=1))
    one.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith(("experts.1.", "gate."))},
                        strict=False)
    assert not within_bound(one(x), want, reduction=32, depth=3)


def test_tile_slots_sort_rows_by_expert_into_whole_tiles():
    from smlp.token_routed import tile_slots

    g = torch.Generator().manual_seed(0)
    for E, S, R in ((3, 50, 4), (4, 7, 16), (1, 33, 8)):
        expert_S = torch.randint(0, E, (S,), generator=g)
        slot_S, tiles_E = tile_slots(expert_S, E, R)
        counts = torch.bincount(expert_S, minlength=E).tolist()
        assert tiles_E == [-(-c // R) for c in counts]
        assert len(set(slot_S.tolist())) == S  # one row per slot
        first = 0
        for e in range(E):
            mine = slot_S[expert_S == e]
            # expert e's rows fill the start of its own tiles, in their original order
            assert mine.tolist() == list(range(first * R, first * R + counts[e]))
            first += tiles_E[e]


def test_token_routed_experts_without_tokens_still_get_a_gradient():
    """DDP (fairseq's default --ddp-backend pytorch_ddp) fails on a parameter without a gradient: an expert
    that received no token gets zeros, the others their real gradient."""
    torch.manual_seed(0)
    block = TokenRoutedGMLPBlock(TokenRoutedGMLPConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=3))
    with torch.no_grad():
        block.norm.bias.fill_(1.0)  # every normalized token sums to D: logits D, 0, -D
        block.gate.weight.zero_()
        block.gate.weight[0] = 1.0
        block.gate.weight[2] = -1.0
    block(torch.randn(2, 9, 16)).square().sum().backward()
    assert int(block.load_E[2]) == 0
    for name, p in block.named_parameters():
        assert p.grad is not None, name
    assert all(float(p.grad.abs().sum()) == 0 for p in block.experts[2].parameters())
    assert float(block.experts[0].proj_in.weight.grad.abs().sum()) > 0
