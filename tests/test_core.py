"""Single-process tests of the core: mixers, sMoE, tMoE, routing rules, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smlp.causality import assert_causal, earlier_outputs_unchanged
from smlp.config import GMLPConfig, SGUConfig, SMoEConfig, SparseBlockConfig, TMoEConfig
from smlp.dispatch import LocalDispatcher
from smlp.expert_data_parallel import expert_parallel_layout
from smlp.gmlp import GMLPBlock, SpatialGatingUnit
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import SMoE, SparseBlock, TMoE, hash_table
from smlp.routing import base_route, smoe_partial_route
from smlp.routing.assignment import sanitize_scores
from tiny_steps import PlainOpCount
from tolerance import within_bound

torch.set_num_threads(1)


def randomize_spatial_(module, seed=0):
    """Give spatial weights O(1) values so tests are not dominated by the near-zero init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "weight" in name and p.dim() == 3 and p.shape[-1] == p.shape[-2]:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


# ---------------------------------------------------------------- token mixers


@pytest.mark.parametrize("split", [True, False])
def test_sgu_initial_state_is_identity_gate(split):
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=12, split=split))
    # the near-zero init is small but not zero, and bias starts at one (stored as its offset from one)
    assert 0 < sgu.proj.weight.abs().max() <= 1e-3 / 12
    assert torch.equal(sgu.proj.bias_offset, torch.zeros_like(sgu.proj.bias_offset))
    with torch.no_grad():
        sgu.proj.weight.zero_()
    z = torch.randn(2, 9, 16)
    expected = z[..., :8] if split else z
    assert torch.allclose(sgu(z), expected)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_multihead_sgu_matches_explicit_loops(heads):
    torch.manual_seed(0)
    cfg = SGUConfig(dim=16, seq_len=10, heads=heads)
    sgu = SpatialGatingUnit(cfg)
    randomize_spatial_(sgu)
    z = torch.randn(3, 7, 16)
    z1, z2 = z.chunk(2, -1)
    v = F.layer_norm(z2, (8,), sgu.norm.weight, sgu.norm.bias)
    c = 8 // heads
    out = torch.empty_like(z1)
    for b in range(3):
        for h in range(heads):
            for t in range(7):
                acc = (1 + sgu.proj.bias_offset[h, t]).expand(c).clone()
                for s in range(t + 1):
                    acc = acc + sgu.proj.weight[h, t, s] * v[b, s, h * c:(h + 1) * c]
                out[b, t, h * c:(h + 1) * c] = z1[b, t, h * c:(h + 1) * c] * acc
    assert within_bound(sgu(z), out, reduction=7)  # a sum over at most 7 positions


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("heads", [1, 4])
def test_gmlp_block_is_causal(mode, heads):
    torch.manual_seed(0)
    block = GMLPBlock(GMLPConfig(d_model=16, d_ffn=32, seq_len=12, heads=heads, dropout=0.1))
    randomize_spatial_(block)
    block.train(mode == "train")
    assert_causal(block, torch.randn(2, 12, 16))
    assert_causal(block, torch.randn(2, 7, 16))  # shorter than T


def test_causality_check_can_fail():
    """Negative control: an unmasked spatial weight leaks the future and the check sees it."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    leaky = lambda x: torch.einsum("ts,bsd->btd", w, x)  # noqa: E731
    assert not earlier_outputs_unchanged(leaky, torch.randn(2, 8, 4), 3)


def test_sequence_longer_than_spatial_weight_is_refused():
    block = GMLPBlock(GMLPConfig(d_model=8, d_ffn=16, seq_len=6))
    with pytest.raises(ValueError, match=r"length 7 exceeds the spatial weight's size 6"):
        block(torch.randn(1, 7, 8))


# ---------------------------------------------------------------- sMoE


def copy_smoe_into_sgu(smoe: SMoE, sgu: SpatialGatingUnit) -> None:
    with torch.no_grad():
        sgu.norm.load_state_dict(smoe.norm.state_dict())
        sgu.proj.weight.copy_(smoe.experts.weight)
        sgu.proj.bias_offset.copy_(smoe.experts.bias_offset)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("experts", [1, 2, 4])
def test_smoe_deterministic_equals_multihead_sgu(split, experts):
    """Sec. 3.2.1: hidden chunk i -> expert i is a multi-head SGU with one head per expert."""
    torch.manual_seed(0)
    smoe = SMoE(SMoEConfig(dim=16, seq_len=10, num_experts=experts, split=split))
    randomize_spatial_(smoe)
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=10, heads=experts, split=split))
    copy_smoe_into_sgu(smoe, sgu)
    z = torch.randn(3, 10, 16, requires_grad=True)
    z_ref = z.detach().clone().requires_grad_(True)
    y, y_ref = smoe(z), sgu(z_ref)
    rule = dict(reduction=3 * 10, depth=2)  # weight gradients sum 3 sequences x 10 positions; LN, then mixing
    assert within_bound(y, y_ref, **rule)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert within_bound(z.grad, z_ref.grad, **rule)
    assert within_bound(smoe.experts.weight.grad, sgu.proj.weight.grad, **rule)
    assert within_bound(smoe.norm.weight.grad, sgu.norm.weight.grad, **rule)


def _rows_path(smoe: SMoE, z: torch.Tensor) -> torch.Tensor:
    """The sMoE's forward through its rows, as an exchange needs them: LayerNorm(z2) copied into (channel, sequence)
    rows, the experts on them, the results permuted back into the gate (what one process ran before issue 47)."""
    z1, z2 = z.chunk(2, dim=-1) if smoe.cfg.split else (z, z)
    rows = smoe.route(smoe.norm(z2), 0, training=smoe.training, dtype=z.dtype, defer_checks=True)
    x_RM, counts_L, dstate = smoe.dispatch(rows)
    return smoe.combine(smoe.run_experts(x_RM, counts_L), dstate, rows, z1, z.shape[1])


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("experts", [1, 4])
def test_local_deterministic_smoe_mixes_one_sequence_in_place_as_the_multihead_sgu(split, experts):
    """Every expert here (one process, or the replicated layout) and one sequence: expert i mixes channel chunk i
    where it lies (issue 47), which is exactly the multi-head SGU with one head per expert (bit for bit, forward
    and every gradient), and equals the rows' path within the summation-order bound, with fewer operators."""
    torch.manual_seed(0)
    smoe = SMoE(SMoEConfig(dim=16, seq_len=10, num_experts=experts, split=split))
    randomize_spatial_(smoe)
    with torch.no_grad():
        smoe.experts.bias_offset.normal_()
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=10, heads=experts, split=split))
    copy_smoe_into_sgu(smoe, sgu)
    z = torch.randn(1, 9, 16)
    g = torch.randn(1, 9, 8 if split else 16)
    results, ops = {}, {}
    for name, fn, module in (("in place", smoe, smoe), ("sgu", sgu, sgu),
                             ("rows", lambda x: _rows_path(smoe, x), smoe)):
        module.zero_grad()
        x = z.clone().requires_grad_(True)
        with PlainOpCount() as forward:
            y = fn(x)
        with PlainOpCount() as backward:
            y.backward(g)
        grads = [p.grad.clone() for p in module.parameters()]
        results[name], ops[name] = [y.detach(), x.grad, *grads], (forward.n, backward.n)
    for a, b in zip(results["in place"], results["sgu"]):
        assert torch.equal(a, b)
    rule = dict(reduction=9, depth=2)
    for a, b in zip(results["in place"], results["rows"]):
        assert within_bound(a, b, **rule)
    assert ops["in place"][0] < ops["rows"][0] and ops["in place"][1] < ops["rows"][1], ops
    assert_causal(smoe, torch.randn(1, 10, 16), first_checked=0, positions=[0, 4, 8])
    C = 16 // (2 if split else 1)
    assert smoe.load_E.tolist() == [C // experts] * experts
    smoe(torch.randn(3, 7, 16))  # the rows' path; the constant counts are made once per share, not every forward
    smoe(torch.randn(3, 9, 16))
    assert list(smoe._constant_counts) == [(C // experts, z.device), (3 * C // experts, z.device)]


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_smoe_is_causal(routing, mode):
    torch.manual_seed(0)
    cfg = SMoEConfig(dim=16, seq_len=20, num_experts=4, routing=routing, split=True)
    smoe = SMoE(cfg)
    randomize_spatial_(smoe)
    smoe.train(mode == "train")
    P = cfg.prefix_len
    x = torch.randn(3, 20, 16)
    # partial prediction: only positions after the routing prefix are predicted
    assert_causal(smoe, x, first_checked=P, positions=[P, 11, 18])


class LeakyRouterSMoE(SMoE):
    """Appendix B: a router that reads every position of the hidden vector, future ones included."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.full_router = torch.nn.Parameter(torch.randn(cfg.seq_len, cfg.num_experts))

    def forward(self, z):
        B, n, _ = z.shape
        v = self.norm(z.chunk(2, -1)[1])
        rows = v.transpose(1, 2).reshape(-1, n)
        plan = smoe_partial_route(rows @ self.full_router[:n])
        gate = (plan.weights_SK[:, 0, None] * rows).reshape(B, -1, n).transpose(1, 2)
        return z.chunk(2, -1)[0] * gate


def test_appendix_b_router_fails_causality():
    torch.manual_seed(0)
    leaky = LeakyRouterSMoE(SMoEConfig(dim=16, seq_len=20, num_experts=4, routing="partial")).eval()
    assert not earlier_outputs_unchanged(leaky, torch.randn(3, 20, 16), 10, first_checked=4)


def test_smoe_partial_balances_hidden_dimensions_in_training():
    torch.manual_seed(0)
    smoe = SMoE(SMoEConfig(dim=32, seq_len=20, num_experts=4, routing="partial"))
    smoe.train()
    smoe(torch.randn(3, 20, 32))
    assert smoe.load_E.tolist() == [3 * 16 // 4] * 4


def test_smoe_partial_router_gets_gradients():
    torch.manual_seed(0)
    smoe = SMoE(SMoEConfig(dim=16, seq_len=20, num_experts=4, routing="partial"))
    smoe(torch.randn(2, 20, 16)).pow(2).sum().backward()
    assert smoe.router.grad is not None and smoe.router.grad.abs().sum() > 0


def test_smoe_partial_sequence_within_prefix_passes_gate_through():
    """A last short batch (n <= P) has no predicted position: gate 1, no rows sent, no crash."""
    smoe = SMoE(SMoEConfig(dim=16, seq_len=20, num_experts=4, routing="partial"))
    z = torch.randn(2, 4, 16)
    assert torch.equal(smoe(z), z[..., :8])
    assert smoe.load_E.tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------- tMoE


def dense_ffn(x, w1, b1, w2, b2):
    return F.gelu(x @ w1 + b1) @ w2 + b2


@pytest.mark.parametrize("router", ["switch", "gshard", "hash", "base"])
def test_one_expert_moe_equals_dense_layer(router):
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=1, router=router, vocab_size=50,
                          capacity_factor=2.0))
    e = moe.experts
    with torch.no_grad():  # Base Layers' zero-initialised second projection would hide w2 from the check
        e.w2.normal_(0, 0.3)
    x = torch.randn(12, 8)
    ids = torch.randint(0, 50, (12,))
    y = moe(x, ids)
    h = F.layer_norm(x, (8,), e.norm_weight[0], e.norm_bias[0]) if router == "base" else x
    expected = dense_ffn(h, e.w1[0], e.b1[0], e.w2[0], e.b2[0])
    if router == "base":
        expected = torch.sigmoid(x @ moe.router.centroids[0])[:, None] * expected
    assert within_bound(y, expected, reduction=16, depth=3)  # LN, D -> F, F -> D (F = 16)


@pytest.mark.parametrize("tokens", [64, 61, 3])
def test_base_layer_counts_are_exactly_balanced_in_training(tokens):
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="base")).train()
    moe(torch.randn(tokens, 8))
    counts = moe.load_E.tolist()
    assert sum(counts) == tokens
    assert max(counts) - min(counts) <= (0 if tokens % 4 == 0 else 1)


def test_base_layer_output_mixes_expert_and_input_like_base_layers():
    """x + TMoE(x) == sigmoid(x.c_e) * (x + FFN_e(LN_e x)) + (1 - sigmoid) * x."""
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=3, router="base")).eval()
    x = torch.randn(10, 8)
    e = moe.experts
    with torch.no_grad():
        e.w2.normal_(0, 0.3)
    expert = (x @ moe.router.centroids.t()).argmax(-1)
    alpha = torch.sigmoid((x * moe.router.centroids[expert]).sum(-1, keepdim=True))
    sub = torch.stack([x[i] + dense_ffn(F.layer_norm(x[i], (8,), e.norm_weight[k], e.norm_bias[k]),
                                        e.w1[k], e.b1[k], e.w2[k], e.b2[k]) for i, k in enumerate(expert.tolist())])
    assert within_bound(x + moe(x), alpha * sub + (1 - alpha) * x, reduction=16, depth=4)  # + the score


@pytest.mark.parametrize("router", ["base", "switch", "gshard", "hash"])
def test_token_routers_are_causal_in_eval_mode(router):
    torch.manual_seed(0)
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, vocab_size=30)).eval()
    emb = torch.nn.Embedding(30, 8)

    def lm_layer(ids_BN):
        x = emb(ids_BN)
        return moe(x.reshape(-1, 8), ids_BN.reshape(-1)).view_as(x)

    assert_causal(lm_layer, torch.randint(0, 30, (3, 16)))


def test_hash_table_is_fixed_balanced_and_saved():
    t = hash_table(103, 4, seed=7)
    assert torch.equal(t, hash_table(103, 4, seed=7))
    assert sorted(torch.bincount(t).tolist()) == [25, 26, 26, 26]
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="hash", vocab_size=103, hash_seed=7))
    assert torch.equal(moe.state_dict()["router.hash_table"], t)


def test_hash_router_rejects_ids_outside_table():
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="hash", vocab_size=10))
    with pytest.raises(ValueError, match="hash table covers ids 0..9"):
        moe(torch.randn(3, 8), torch.tensor([1, 2, 12]))


def test_sparse_block_runs_and_is_causal():
    torch.manual_seed(0)
    for routing in ("deterministic", "partial"):
        block = SparseBlock(SparseBlockConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=4,
                                              smoe_routing=routing)).eval()
        randomize_spatial_(block)
        P = block.smoe.cfg.prefix_len
        assert_causal(block, torch.randn(2, 20, 16), first_checked=P, positions=[P, 12, 18])


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
@pytest.mark.parametrize("smoe_experts", [1, 2, 8])
def test_sparse_block_with_its_own_smoe_experts_is_causal_and_is_its_parts(routing, smoe_experts):
    """--smoe-experts N apart from the tMoE's 4: the sMoE holds N spatial experts, the tMoE 4, the block is causal,
    and it equals its two layers built on their own (an sMoE of N experts, a tMoE of 4) with the same weights."""
    torch.manual_seed(0)
    cfg = SparseBlockConfig(d_model=16, d_ffn=32, seq_len=20, num_experts=4, smoe_experts=smoe_experts,
                            smoe_routing=routing)
    block = SparseBlock(cfg).eval()
    randomize_spatial_(block)
    assert block.smoe.experts.weight.shape[0] == smoe_experts and block.tmoe.experts.w1.shape[0] == 4
    assert block.smoe.dispatcher.num_experts == smoe_experts and block.tmoe.dispatcher.num_experts == 4
    P = block.smoe.cfg.prefix_len
    assert_causal(block, torch.randn(2, 20, 16), first_checked=P, positions=[P, 12, 18])
    smoe = SMoE(SMoEConfig(dim=16, seq_len=20, num_experts=smoe_experts, routing=routing, split=False)).eval()
    tmoe = TMoE(cfg.tmoe).eval()
    smoe.load_state_dict({k[5:]: v for k, v in block.state_dict().items() if k.startswith("smoe.")})
    tmoe.load_state_dict({k[5:]: v for k, v in block.state_dict().items() if k.startswith("tmoe.")})
    x = torch.randn(2, 20, 16)
    h = x + smoe(block.norm(x))
    assert torch.equal(block(x), h + tmoe(h.reshape(-1, 16)).view_as(h))


def test_the_tied_smoe_experts_build_the_model_of_before():
    """--smoe-experts 0 (the default) and --smoe-experts E build the same model as before the flag: one
    dispatcher shared by both layers, the same parameters, the same outputs."""
    kw = dict(family="smlp", vocab_size=40, d_model=16, d_ffn=32, seq_len=12, dense_layers=1, sparse_layers=1,
              num_experts=4)
    outs = []
    for smoe_experts in (0, 4):
        torch.manual_seed(0)
        lm = LanguageModel(LMConfig(**kw, smoe_experts=smoe_experts)).eval()
        assert lm.smoe_dispatcher is None and lm.layers[1].smoe.dispatcher is lm.layers[1].tmoe.dispatcher
        outs.append(lm(torch.arange(24).view(2, 12) % 40))
    assert torch.equal(*outs)


# ---------------------------------------------------------------- routing and errors


def test_non_finite_scores_are_refused_by_the_routers():
    """The auction itself tolerates NaN/inf (tests/test_assignment.py); a router refuses them, naming the layer."""
    from smlp.routing import NonFiniteScoresError

    scores = torch.randn(32, 4)
    scores[0, 1] = float("nan")
    scores[3] = float("inf")
    scores[5, 2] = float("-inf")
    with pytest.raises(NonFiniteScoresError,
                       match=r"layers\.7 \(test\): .* 3 of 32 rows \(first: row 0; 1 NaN, 4 \+inf, 1 -inf"):
        base_route(scores, layer="layers.7 (test)")
    assert torch.isfinite(sanitize_scores(scores)).all()
    with pytest.raises(NonFiniteScoresError, match="sMoE router"):
        smoe_partial_route(torch.full((8, 4), float("nan")))


@pytest.mark.parametrize("make, message", [
    (lambda: SMoEConfig(dim=18, seq_len=8, num_experts=4, split=False), "must divide the gated width 18"),
    (lambda: SGUConfig(dim=12, seq_len=8, heads=4), "heads=4 must divide the gated width 6"),
    (lambda: TMoEConfig(d_model=8, d_ffn=8, num_experts=2, router="top3"), "router='top3' is unknown"),
    (lambda: SMoEConfig(dim=8, seq_len=8, num_experts=2, routing="learned"), "routing='learned' is unknown"),
    (lambda: TMoEConfig(d_model=8, d_ffn=8, num_experts=0), "num_experts=0 is invalid"),
    (lambda: TMoEConfig(d_model=8, d_ffn=8, num_experts=2, router="hash"), "needs vocab_size"),
    (lambda: SparseBlockConfig(d_model=10, d_ffn=8, seq_len=8, num_experts=4), "must divide the gated width 10"),
    (lambda: SparseBlockConfig(d_model=16, d_ffn=8, seq_len=8, num_experts=4, smoe_experts=3),
     r"smoe_experts=3 must divide d_model=16: .* \(valid counts up to 64: 1, 2, 4, 8, 16\)"),
    (lambda: SparseBlockConfig(d_model=16, d_ffn=8, seq_len=8, num_experts=4, smoe_experts=-2),
     "smoe_experts=-2 is invalid: give a positive number of sMoE experts, or 0 for as many as the tMoE's experts"),
    (lambda: LMConfig(family="transformer", vocab_size=9, d_model=16, d_ffn=8, seq_len=8, dense_layers=1,
                      sparse_layers=1, num_experts=2, heads=2, smoe_experts=2), "the transformer family has none"),
    (lambda: expert_parallel_layout(6, 4), "num_experts=6 cannot be spread evenly over 4 ranks"),
    (lambda: expert_parallel_layout(2, 4), "an expert-parallel group holds at most one rank per expert"),
    (lambda: TMoE(TMoEConfig(d_model=8, d_ffn=8, num_experts=4), LocalDispatcher(2)), "built for 2 experts"),
])
def test_bad_configuration_is_refused_with_a_clear_message(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_wrong_input_width_is_refused():
    moe = TMoE(TMoEConfig(d_model=8, d_ffn=8, num_experts=2))
    with pytest.raises(ValueError, match=r"expects rows of shape \(S, 8\)"):
        moe(torch.randn(4, 6))
    smoe = SMoE(SMoEConfig(dim=8, seq_len=8, num_experts=2))
    with pytest.raises(ValueError, match=r"SMoE expects \(batch, length, 8\)"):
        smoe(torch.randn(1, 4, 6))


def test_expert_parameters_are_marked_and_others_are_not():
    block = SparseBlock(SparseBlockConfig(d_model=8, d_ffn=16, seq_len=10, num_experts=2))
    marked = {n for n, p in block.named_parameters() if getattr(p, "expert", False)}
    assert marked == {"smoe.experts.weight", "smoe.experts.bias_offset", "tmoe.experts.w1", "tmoe.experts.b1",
                      "tmoe.experts.w2", "tmoe.experts.b2", "tmoe.experts.norm_weight", "tmoe.experts.norm_bias"}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_init_does_not_depend_on_the_world_size(world):
    """Seeded layers built as the ranks of a W-rank group hold exactly the slices of the single-process
    layer, and every parameter built after them is the same too (the RNG advanced equally)."""
    class RankDispatcher(LocalDispatcher):  # the layout of rank r of W, without a process group
        def __init__(self, num_experts, rank, world):
            super().__init__(num_experts)
            self.num_local_experts = num_experts // world
            self.first_expert = rank * self.num_local_experts

    E = 4
    cfg = SparseBlockConfig(d_model=16, d_ffn=32, seq_len=8, num_experts=E)

    def build(dispatcher):
        torch.manual_seed(7)
        block = SparseBlock(cfg, dispatcher)
        after = torch.nn.Linear(4, 4)  # built after the experts: needs the same RNG state
        return block, after

    full, full_after = build(LocalDispatcher(E))
    for rank in range(world):
        part, part_after = build(RankDispatcher(E, rank, world))
        L = E // world
        for (name, p_full), (_, p_part) in zip(full.named_parameters(), part.named_parameters()):
            if getattr(p_full, "expert", False):
                assert torch.equal(p_full[rank * L:(rank + 1) * L], p_part), name
            else:
                assert torch.equal(p_full, p_part), name
        assert torch.equal(full_after.weight, part_after.weight)
    # experts differ from one another (one generator each)
    w = full.tmoe.experts.w1
    assert not torch.equal(w[0], w[1])


def test_layers_build_under_a_default_device_context():
    """Building on the meta device (the FLOPs calculator) or any default device must not fail."""
    cfg = SparseBlockConfig(d_model=16, d_ffn=32, seq_len=8, num_experts=4)
    with torch.device("meta"):
        block = SparseBlock(cfg)
    assert block.tmoe.experts.w1.is_meta and block.smoe.experts.weight.is_meta


def test_planted_errors_fail_the_twin_comparisons():
    """The rounding bounds used above still catch a real difference (tests/tolerance.py): one spatial
    weight of one expert, or one FFN expert weight, off by 1e-3 of itself."""
    torch.manual_seed(0)
    smoe = SMoE(SMoEConfig(dim=16, seq_len=10, num_experts=2, split=True))
    randomize_spatial_(smoe)
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=10, heads=2, split=True))
    copy_smoe_into_sgu(smoe, sgu)
    z = torch.randn(3, 10, 16)
    rule = dict(reduction=3 * 10, depth=2)
    assert within_bound(smoe(z), sgu(z), **rule)
    with torch.no_grad():
        sgu.proj.weight[1, 7, 3] *= 1 + 1e-3
    assert not within_bound(smoe(z), sgu(z), **rule)

    moe = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=1, router="switch"))
    x = torch.randn(12, 8)
    e = moe.experts
    with torch.no_grad():
        e.w2.normal_(0, 0.3)
    gate = moe.router.gate.weight
    expected = torch.softmax(x @ gate.t(), -1)[:, :1] * dense_ffn(x, e.w1[0], e.b1[0], e.w2[0], e.b2[0])
    assert within_bound(moe(x), expected, reduction=16, depth=3)
    with torch.no_grad():
        e.w1[0, 2, 5] *= 1 + 1e-3
    assert not within_bound(moe(x), expected, reduction=16, depth=3)
