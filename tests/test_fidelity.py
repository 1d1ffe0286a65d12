"""Baseline and paper fidelity, one process: every default that makes the comparison fair is pinned.

- sparse-block placement: the paper's rule (sec. 4.1) by default, fairseq's insertion and
  every-other as named options; fairseq's rule checked against fairseq's own TransformerDecoder;
- GShard's E^2-normalised load-balancing loss through the layer and the model;
- Base Layers: the zero-initialised second projection of fairseq's BaseSublayer;
- GShard's two-slot combine against an explicit loop;
- the criterion: prefix masking, token count, aux-loss scaling, and the warning when another
  criterion would drop what the model needs;
- partial prediction: the prefix follows --seq-len, explained when it differs from the sequences;
- all2all timing synchronises an accelerator before reading the clock.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from smlp.config import TMoEConfig
from smlp.dispatch import LocalDispatcher
from smlp.lm import LanguageModel, LMConfig, layer_plan
from smlp.moe import TMoE
from smlp.transformer import TransformerBlock
from smlp_eval import flops as FL
from tolerance import assert_orders_agree


def sparse_at(plan):
    return [i for i, kind in enumerate(plan) if kind == "sparse"]


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("n1, n2, expected", [
    (12, 12, [1, 3, 5, 7, 9, 11, 12, 14, 16, 18, 20, 22]),        # Base Layers small (Table 8)
    (28, 12, [3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36]),      # sMLP small (Table 8)
    (22, 8, [3, 6, 10, 13, 16, 20, 23, 26]),                       # sMLP large (Table 10)
    (8, 8, [1, 3, 5, 7, 8, 10, 12, 14]),                           # Base / HASH large (Table 5)
    (2, 2, [1, 2]),                                                # the tiny presets
    (0, 3, [0, 1, 2]),
    (5, 0, []),
])
def test_paper_placement_is_the_section_4_1_rule(n1, n2, expected):
    """k-th sparse block at 0-based index floor(k (N1 + N2) / (N2 + 1)); hand-computed lists."""
    plan = layer_plan(n1, n2, "paper")
    assert len(plan) == n1 + n2 and plan.count("sparse") == n2
    assert sparse_at(plan) == expected


def test_fairseq_placement_stacks_sparse_blocks_low_and_every_other_alternates():
    assert sparse_at(layer_plan(12, 12, "fairseq")) == list(range(12))          # 12 sparse, then 12 dense
    assert sparse_at(layer_plan(28, 12, "fairseq"))[-1] == 25                    # last 14 layers dense
    assert layer_plan(3, 2, "every_other") == ["dense", "sparse", "dense", "sparse", "dense"]
    with pytest.raises(ValueError, match="placement='middle' is unknown: valid values are paper, every_other, fairseq"):
        layer_plan(2, 2, "middle")
    with pytest.raises(ValueError, match="sparse_placement='middle' is unknown"):
        LMConfig(family="smlp", vocab_size=10, d_model=8, d_ffn=16, seq_len=8, dense_layers=1, sparse_layers=1,
                 num_experts=2, sparse_placement="middle")


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank gloo group: fairseq's BaseLayer asks torch.distributed for its rank when built (the group fairseq
    caches from it is dropped after the test: conftest's no_stale_fairseq_group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n1, n2", [(4, 2), (12, 12), (6, 5)])
def test_fairseq_placement_equals_fairseq_transformer_decoder(tiny_lm_data, one_rank_group, n1, n2):
    """fairseq's own transformer_lm with --base-layers puts its BaseLayers where our "fairseq" option does."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tiny_lm_data), "--task", "language_modeling", "--arch", "transformer_lm", "--cpu",
        "--decoder-layers", str(n1), "--base-layers", str(n2), "--decoder-embed-dim", "16",
        "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--tokens-per-sample", "16"])
    cfg = convert_namespace_to_omegaconf(args)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    theirs = ["sparse" if type(layer).__name__ == "BaseLayer" else "dense" for layer in model.decoder.layers]
    assert theirs == layer_plan(n1, n2, "fairseq")
    assert theirs != layer_plan(n1, n2, "paper")


def _registered_archs():
    from smlp_eval.flops import plugin_archs

    return sorted(a for a in plugin_archs() if a.endswith(("_tiny", "_paper_small", "_paper_large")))


def test_every_paper_and_tiny_config_has_the_documented_layer_plan(capsys):
    """smlp-flops --json reports the layer plan; it is the rule of the family and the real model's order."""
    archs = _registered_archs()
    assert len(archs) >= 18
    from smlp_eval.flops.command import as_trained

    for arch in archs:
        flags = ["--distributed-world-size", "2", "--tokens-per-sample", "32"] if "_tiny" in arch else []
        # the flags and vocabulary smlp-flops itself parses below: one fairseq parse per arch (it is remembered)
        parsed, vocab_size = as_trained(arch, flags, None)
        spec = FL.parse_model(arch, parsed, vocab_size=vocab_size)
        cfg = spec.cfg
        expected_rule = "every_other" if cfg.family == "transformer" and cfg.moe_router in ("gshard", "switch") \
            and cfg.sparse_layers else "paper"
        expected = layer_plan(cfg.dense_layers, cfg.sparse_layers, expected_rule)
        with torch.device("meta"):
            model = LanguageModel(cfg, FL.OneGPUDispatcher(cfg.num_experts, spec.experts_per_gpu or 1)
                                  if cfg.sparse_layers else None)
        built = ["sparse" if (isinstance(l, TransformerBlock) and isinstance(l.ffn, TMoE)) or
                 type(l).__name__ == "SparseBlock" else "dense" for l in model.layers]
        assert built == expected, arch
        assert FL.main(["--arch", arch, *flags, "--method", "analytic", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layer_plan"] == expected, arch
        assert out["placement"] == (expected_rule if cfg.sparse_layers else None)
    # the option reaches the model through fairseq's flags
    spec = FL.parse_model("base_layers_lm_paper_small", ["--sparse-placement", "fairseq"])
    assert sparse_at(spec.cfg.plan) == list(range(12))


# ---------------------------------------------------------------- GShard loss scale


def test_gshard_layer_loss_is_normalised_like_switch_by_default():
    """Same router logits: GShard's default loss equals Switch's (both 1 when balanced); fairscale's is 1/E^2 of it."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    losses = {}
    for router, scale in (("switch", "normalized"), ("gshard", "normalized"), ("gshard", "fairscale")):
        torch.manual_seed(1)
        moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, gshard_aux_loss=scale)).train()
        if router == "switch":
            gate_weight = moe.router.gate.weight.detach().clone()
        with torch.no_grad():
            moe.router.gate.weight.copy_(gate_weight)
        moe(x)
        losses[router, scale] = float(moe.aux_loss)
    assert losses["gshard", "normalized"] == pytest.approx(losses["switch", "normalized"], rel=1e-6)
    assert losses["gshard", "fairscale"] == pytest.approx(losses["switch", "normalized"] / 16, rel=1e-6)
    assert 0.9 < losses["switch", "normalized"] < 4.0
    with pytest.raises(ValueError, match="gshard_aux_loss='lingvo' is unknown"):
        TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="gshard", gshard_aux_loss="lingvo")


def test_gshard_two_slot_combine_equals_an_explicit_loop():
    """y_s = sum_k w_sk FFN_{e_sk}(x_s) over the kept slots, E = 4 (training: noise, capacity; eval: neither)."""
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="gshard"))
    with torch.no_grad():
        moe.router.gate.weight.mul_(8.0)  # skewed enough that training drops slots
    x = torch.randn(40, 8)
    e = moe.experts
    for training in (True, False):
        moe.train(training)
        torch.manual_seed(5)
        plan = moe.route(x)
        torch.manual_seed(5)
        y = moe(x)
        expected = torch.zeros_like(x)
        for s in range(x.shape[0]):
            for k in range(2):
                ex = int(plan.experts_SK[s, k])
                if ex >= 0:
                    h = F.gelu(x[s] @ e.w1[ex] + e.b1[ex]) @ e.w2[ex] + e.b2[ex]
                    expected[s] += plan.weights_SK[s, k] * h
        assert (plan.experts_SK >= 0).sum(1).max() == 2 and len(set(plan.experts_SK[:, 0].tolist())) > 1
        if training:
            assert (plan.experts_SK == -1).any(), "the case was meant to drop slots"
        assert_orders_agree(y, expected, reduction=e.w1.shape[-1], depth=2)  # D -> F -> D


# ---------------------------------------------------------------- Base Layers as fairseq runs them


def test_base_layers_expert_second_projection_starts_at_zero():
    """fairseq's BaseSublayer zeroes ff2.weight: at init each expert branch is sigmoid(x.c_e) * b2_e."""
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=3, router="base")).eval()
    assert torch.count_nonzero(moe.experts.w2) == 0 and torch.count_nonzero(moe.experts.b2) > 0
    x = torch.randn(10, 8)
    expert = (x @ moe.router.centroids.t()).argmax(-1)
    alpha = torch.sigmoid((x * moe.router.centroids[expert]).sum(-1, keepdim=True))
    torch.testing.assert_close(moe(x), alpha * moe.experts.b2[expert])
    for router in ("switch", "gshard"):
        assert torch.count_nonzero(TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=3, router=router)).experts.w2) > 0
    off = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=3, router="base", zero_init_output=False))
    assert torch.count_nonzero(off.experts.w2) > 0


def test_one_process_shuffle_is_the_identity():
    """With all experts in one process every token is balanced with the same batch either way."""
    d = LocalDispatcher(4)
    x = torch.randn(9, 3)
    y, state = d.shuffle(x)
    assert y is x and d.unshuffle(y, state) is y


# ---------------------------------------------------------------- criterion and config through fairseq


def _build(data, arch, extra=()):
    from test_fairseq import build_model

    return build_model(data, arch, extra)


@pytest.mark.parametrize("arch, extra", [("smlp_lm_tiny", ["--smoe-routing", "partial"]),
                                         ("switch_lm_tiny", []), ("gshard_lm_tiny", [])])
def test_criterion_masks_the_prefix_counts_tokens_and_scales_the_aux_loss(tiny_lm_data, arch, extra):
    """smlp_lm_loss == a hand-written reference: NLL over predicted, non-pad targets + w * aux * sample_size."""
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    model, task = _build(tiny_lm_data, arch, extra)
    crit = task.build_criterion(OmegaConf.create({"_name": "smlp_lm_loss", "aux_loss_weight": 0.25,
                                                  "sentence_avg": False}))
    model.train()
    pad = task.target_dictionary.pad()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, len(task.target_dictionary), (3, 32), generator=g)
    target = torch.randint(4, len(task.target_dictionary), (3, 32), generator=g)
    target[1, 20:] = pad  # a padded tail
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((3,), 32)}, "target": target,
              "ntokens": int((target != pad).sum())}
    torch.manual_seed(7)
    loss, sample_size, log = crit(model, sample)
    torch.manual_seed(7)
    logits, _ = model(tokens)
    aux = model.core.aux_loss()
    start = model.core.cfg.prediction_start
    assert (start > 0) == ("partial" in extra)
    lprobs = torch.log_softmax(logits.float(), -1)
    nll, count = 0.0, 0
    for b in range(3):
        for t in range(start, 32):
            if target[b, t] != pad:
                nll -= float(lprobs[b, t, target[b, t]])
                count += 1
    assert log["ntokens"] == sample_size == count == 3 * (32 - start) - 12  # 12 padded targets after the prefix
    assert float(log["loss"]) == pytest.approx(nll, rel=1e-5)
    if aux is None:
        assert float(loss) == pytest.approx(nll, rel=1e-5) and log["aux_loss"] == 0.0
    else:
        assert float(aux) > 0.5  # normalised losses: about 1 per sparse layer when balanced
        assert float(loss) == pytest.approx(nll + 0.25 * float(aux) * count, rel=1e-5)
        assert log["aux_loss"] == pytest.approx(float(aux), rel=1e-6)


@pytest.mark.parametrize("arch, extra, warned", [
    ("switch_lm_tiny", [], True), ("gshard_lm_tiny", [], True),
    ("smlp_lm_tiny", ["--smoe-routing", "partial"], True),
    ("hash_layers_lm_tiny", [], False), ("smlp_lm_tiny", [], False),
])
def test_a_criterion_that_ignores_the_routing_loss_is_warned_about(tiny_lm_data, caplog, arch, extra, warned):
    with caplog.at_level(logging.WARNING, logger="fairseq_plugins.models"):
        _build(tiny_lm_data, arch, [*extra, "--criterion", "cross_entropy"])
    text = caplog.text
    assert ("--criterion cross_entropy ignores what this model needs" in text) == warned, text
    if warned:
        assert "Train with --criterion smlp_lm_loss" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fairseq_plugins.models"):
        _build(tiny_lm_data, arch, extra)  # TINY_TRAIN's smlp_lm_loss
    assert "ignores what this model needs" not in caplog.text


def test_partial_prefix_follows_seq_len_and_says_so_when_sequences_are_shorter(tiny_lm_data, caplog):
    """P = round(0.2 * --seq-len) positions (a P x E router); shorter training sequences are warned about."""
    with caplog.at_level(logging.WARNING, logger="fairseq_plugins.config"):
        model, _ = _build(tiny_lm_data, "smlp_lm_tiny", ["--smoe-routing", "partial"])
    assert model.core.cfg.prediction_start == round(0.2 * 32) and "partial prediction routes" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="fairseq_plugins.config"):
        model, _ = _build(tiny_lm_data, "smlp_lm_tiny", ["--smoe-routing", "partial", "--seq-len", "64"])
    P = model.core.cfg.prediction_start
    assert P == round(0.2 * 64) == 13
    assert model.core.layers[1].smoe.router.shape == (P, model.core.cfg.num_experts)
    assert "routes on the first 13 positions" in caplog.text and "41% of the 32-token training sequences" in caplog.text
    assert "use --seq-len 32 or --prefix-fraction 0.1" in caplog.text
    with pytest.raises(ValueError, match="no position would be predicted; use --seq-len 32"):
        _build(tiny_lm_data, "smlp_lm_tiny", ["--smoe-routing", "partial", "--seq-len", "256", "--prefix-fraction",
                                              "0.5"])


def test_new_flags_reach_the_core_config(tiny_lm_data):
    model, _ = _build(tiny_lm_data, "gshard_lm_tiny", ["--gshard-aux-loss", "fairscale", "--sparse-placement",
                                                       "fairseq"])
    cfg = model.core.cfg
    assert cfg.gshard_aux_loss == "fairscale" and cfg.placement == "fairseq" and cfg.tmoe.gshard_aux_loss == "fairscale"
    model, _ = _build(tiny_lm_data, "base_layers_lm_tiny", ["--base-shuffle", "0"])
    assert model.core.cfg.tmoe.uses_shuffle is False
    model, _ = _build(tiny_lm_data, "base_layers_lm_tiny")
    assert model.core.cfg.tmoe.uses_shuffle is True and model.core.cfg.placement == "paper"
    with pytest.raises(ValueError, match="--base-shuffle 2 is invalid"):
        _build(tiny_lm_data, "base_layers_lm_tiny", ["--base-shuffle", "2"])


HALF_ATTENTION_SCRIPT = """
import torch
from smlp.transformer import CausalSelfAttention
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    attn = CausalSelfAttention(64, 2).to(dtype)
    x = torch.randn(2, 300, 64, dtype=dtype, requires_grad=True)
    attn(x).float().square().sum().backward()
    state = {}
    attn.eval()
    attn.step(x[:, :290].detach(), state, 0)
    attn.step(x[:, 290:].detach(), state, 290)
print(torch.backends.cpu.get_cpu_capability(), "ok")
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_half_precision_attention_runs_under_every_cpu_kernel_set(capability):
    """torch 2.13's fused CPU attention in bf16 fails from ~256 positions on ("pack_vnni2 is only
    supported when avx512 is supported") when the hardware has AVX-512 but the kernels were selected
    lower (ATEN_CPU_CAPABILITY): training, validation and cached decoding must run there too."""
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", HALF_ATTENTION_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_attention_without_the_fused_kernel_equals_it(monkeypatch):
    """Where the fused kernel cannot run (half precision on CPU kernels below AVX-512), the explicit
    form runs instead: the same outputs and gradients up to the rounding of two orders, in training
    and in cached decoding; elsewhere (fp32, or AVX-512 kernels) the fused kernel still runs."""
    from smlp import transformer as T

    torch.manual_seed(0)
    attn = T.CausalSelfAttention(32, 4).eval()
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16, requires_grad=True)
    attn = attn.to(torch.bfloat16)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(T, "_cpu_kernels_have_avx512", lambda fused=fused: fused)
        assert T.fused_attention_runs(x) is fused
        assert T.fused_attention_runs(x.float())  # fp32 always takes the fused kernel
        y = attn(x)
        (g,) = torch.autograd.grad(y.float().square().sum(), x)
        state = {}
        with torch.no_grad():
            steps = torch.cat([attn.step(x[:, :30], state, 0), attn.step(x[:, 30:31], state, 30),
                               attn.step(x[:, 31:], state, 31)], dim=1)
        results[fused] = (y, g, steps)
    # CPU half-precision matmuls accumulate in fp32 and round once to bf16: the two forms differ by the
    # roundings of the scores, the softmax, the context and the output projection (4 in sequence, in
    # forward and backward alike), not by a bf16 sum over the 40 positions
    rule = dict(reduction=1, depth=4, dtype=torch.bfloat16)
    for a, b in zip(results[True], results[False]):
        assert_orders_agree(b.float(), a.float(), **rule)
    # a planted leak: the explicit form without its causal mask (every position sees the future)
    with torch.no_grad():
        q, k, v = attn.qkv(x).view(2, 40, 3, 4, 8).permute(2, 0, 3, 1, 4)
        leaky = attn.out(attn._explicit(q, k, v, torch.zeros((), dtype=torch.bool)).transpose(1, 2).reshape(2, 40, 32))
    with pytest.raises(AssertionError, match="exceeds the rounding bound"):
        assert_orders_agree(leaky.float(), results[True][0].float(), **rule)


def test_fused_attention_equals_the_explicit_form_the_flops_calculator_counts():
    """Training uses fused SDPA (as fairseq); the FLOP counter sees the same maths as matmuls."""
    from smlp.flop_forms import explicit_attention
    from smlp.transformer import CausalSelfAttention

    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4).eval()
    x = torch.randn(3, 17, 32, requires_grad=True)
    fused = attn(x)
    (g_fused,) = torch.autograd.grad(fused.square().sum(), x)
    with explicit_attention(attn):
        assert attn.explicit
        explicit = attn(x)
        (g_explicit,) = torch.autograd.grad(explicit.square().sum(), x)
    assert not attn.explicit
    # the projections (D = 32), the scores and the context (17 positions), in forward and backward
    assert_orders_agree(fused, explicit, reduction=32, depth=3)
    assert_orders_agree(g_fused, g_explicit, reduction=32, depth=6)
    # both are causal: a change after position 8 leaves positions <= 8 unchanged
    x2 = x.detach().clone()
    x2[:, 9:] += 1.0
    for form in (False, True):
        attn.explicit = form
        torch.testing.assert_close(attn(x2)[:, :9], attn(x.detach())[:, :9], rtol=0, atol=1e-6)
