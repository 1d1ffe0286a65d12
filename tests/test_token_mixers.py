"""Causal HyperMixer and NiNformer token mixers (smlp/hypermixer.py, smlp/ninformer.py), single process.

References: plain per-position loops written from the papers' equations (HyperMixer section 2.3 and
Appendix F, MLP-Mixer's token MLP as NiNformer's eq. 8 uses it), the paper's non-causal form at the
last position, torch.autograd.gradcheck for the hand-written backward, and closed-form FLOPs counts
(HyperMixer Appendix D.2).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from smlp.causality import assert_causal, earlier_outputs_unchanged
from smlp.config import GMLPConfig
from smlp.gmlp import GMLPBlock
from smlp.hypermixer import CHUNK_ELEMENTS, HyperMixerConfig, HyperMixingUnit, _chunk_len, _outer, hypermixing
from smlp.lm import LanguageModel, LMConfig
from smlp.ninformer import CausalTokenMLP, NiNformerConfig, NiNformerGatingUnit
from smlp.transformer import sinusoidal_positions
from tolerance import within_bound

torch.set_num_threads(1)


# ---------------------------------------------------------------- plain references


def hypermixing_reference(u, v, w):
    """y_t = w_t . GELU((1/(t+1)) sum_{s<=t} u_s v_s^T), one position at a time."""
    B, n, R = u.shape
    out = []
    for t in range(n):
        state = torch.zeros(B, R, v.shape[-1], dtype=v.dtype)
        for s in range(t + 1):
            state = state + u[:, s, :, None] * v[:, s, None, :]
        out.append((w[:, t, :, None] * F.gelu(state / (t + 1))).sum(dim=1))
    return torch.stack(out, dim=1)


def hypermixing_paper(u, v, w):
    """The paper's encoder form with length normalisation: every output sees all n positions."""
    state = sum(u[:, s, :, None] * v[:, s, None, :] for s in range(u.shape[1])) / u.shape[1]
    return torch.stack([(w[:, t, :, None] * F.gelu(state)).sum(1) for t in range(u.shape[1])], dim=1)


def token_mlp_reference(mlp: CausalTokenMLP, x):
    """Per output position t: hidden units of positions <= t, each reading positions <= its own."""
    B, n, C = x.shape
    r = mlp.expansion
    out = torch.empty_like(x)
    for t in range(n):
        acc = mlp.b2[t].expand(B, C).clone()
        for m in range(r * (t + 1)):
            p = m // r
            pre = mlp.b1[m] + sum(mlp.w1[m, s] * x[:, s] for s in range(p + 1))
            acc = acc + mlp.w2[t, m] * F.gelu(pre)
        out[:, t] = acc
    return out


def rand(*shape, seed=0, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


# ---------------------------------------------------------------- HyperMixing: fast path == reference


@pytest.mark.parametrize("chunk", [0, 1, 3, 7, 16])
@pytest.mark.parametrize("tied", [True, False])
def test_hypermixing_equals_plain_reference_forward_and_backward(chunk, tied):
    B, n, R, C = 2, 7, 3, 5
    u, v = rand(B, n, R, seed=1), rand(B, n, C, seed=2)
    w = u if tied else rand(B, n, R, seed=3)
    y = hypermixing(u, v, w, chunk_size=chunk)
    ref = hypermixing_reference(u, v, w)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    dy = rand(B, n, C, seed=4, grad=False)
    inputs = (u, v) if tied else (u, v, w)
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(ref, inputs, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_hypermixing_gradcheck(chunk):
    u, v, w = rand(2, 5, 3, seed=1), rand(2, 5, 4, seed=2), rand(2, 5, 3, seed=3)
    assert torch.autograd.gradcheck(lambda a, b, c: hypermixing(a, b, c, chunk_size=chunk), (u, v, w))
    assert torch.autograd.gradcheck(lambda a, b: hypermixing(a, b, a, chunk_size=chunk), (u, v))  # tied


def test_hypermixing_float32_matches_reference_and_no_grad_path():
    u, v, w = (rand(2, 40, 6, seed=s, dtype=torch.float32) for s in (1, 2, 3))
    y = hypermixing(u, v, w, chunk_size=6)
    ref = hypermixing_reference(u.double(), v.double(), w.double())
    assert within_bound(y.double(), ref, reduction=40 * 6, dtype=torch.float32)  # positions x width
    with torch.no_grad():
        assert torch.equal(hypermixing(u, v, w, chunk_size=6), y.detach())
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (u, v, w), dy)
    ud, vd, wd = (t.detach().double().requires_grad_() for t in (u, v, w))
    want = torch.autograd.grad(hypermixing_reference(ud, vd, wd), (ud, vd, wd), dy.double())
    for a, b in zip(got, want):
        assert within_bound(a.double(), b, reduction=40 * 6, depth=2, dtype=torch.float32)


def test_last_position_is_the_papers_length_normalised_form():
    """At t = n-1 the prefix is the whole sequence: the causal form meets the paper's (App. F)."""
    u, v, w = (rand(2, 6, 3, seed=s) for s in (1, 2, 3))
    assert torch.allclose(hypermixing(u, v, w)[:, -1], hypermixing_paper(u, v, w)[:, -1], rtol=1e-12, atol=1e-12)
    assert torch.allclose(hypermixing(u, v, w, causal=False), hypermixing_paper(u, v, w), rtol=1e-12, atol=1e-12)


def test_training_saves_no_per_position_state():
    """Memory independent of n: autograd keeps u, v, w and one (B, R, C) carry, not n x R x C states."""
    B, R, C = 2, 4, 6
    for n in (8, 64):
        u, v, w = rand(B, n, R, seed=1), rand(B, n, C, seed=2), rand(B, n, R, seed=3)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=saved: s.append(t.numel()) or t, lambda t: t):
            hypermixing(u, v, w, chunk_size=3)
        assert sum(saved) == u.numel() + v.numel() + w.numel() + B * R * C, (n, saved)


def test_traced_outer_products_equal_the_eager_ones():
    """fvcore traces a matmul form of the outer products; eager runs a broadcast multiply: same numbers."""
    u, v = rand(3, 5, 4, dtype=torch.float32, grad=False), rand(3, 5, 6, seed=1, dtype=torch.float32, grad=False)
    traced = torch.jit.trace(_outer, (u, v))
    assert "aten::matmul" in str(traced.graph)
    assert torch.equal(traced(u, v), _outer(u, v))


def test_automatic_chunk_bounds_working_memory():
    for B, R, C, n in [(1, 2048, 2048, 1024), (8, 64, 64, 32), (1, 8, 8, 10 ** 6), (4, 4096, 4096, 100)]:
        L = _chunk_len(0, B, R, C, n)
        assert 1 <= L <= n
        assert B * L * R * C <= max(CHUNK_ELEMENTS, B * R * C)
    assert _chunk_len(5, 1, 1, 1, 3) == 3 and _chunk_len(5, 1, 1, 1, 30) == 5


# ---------------------------------------------------------------- HyperMixingUnit


def hyper_unit(tied=True, causal=True, seed=0, chunk=0):
    torch.manual_seed(seed)
    return HyperMixingUnit(HyperMixerConfig(dim=16, hidden_dim=6, hyper_hidden=10, tied=tied, causal=causal,
                                            chunk_size=chunk))


@pytest.mark.parametrize("tied", [True, False])
def test_hypermixing_unit_equals_its_definition(tied):
    unit = hyper_unit(tied, chunk=4)
    z = torch.randn(2, 9, 16)
    z1, z2 = z[..., :8], z[..., 8:]
    v = F.layer_norm(z2, (8,), unit.norm.weight, unit.norm.bias)
    h = v + sinusoidal_positions(9, 8)
    mlp = lambda net, x: net[2](F.gelu(net[0](x)))  # noqa: E731
    u = mlp(unit.hyper_in, h)
    w = u if tied else mlp(unit.hyper_out, h)
    m = hypermixing_reference(u.double(), v.double(), w.double()).float()
    expected = z1 * F.layer_norm(m, (8,), unit.out_norm.weight, unit.out_norm.bias)
    assert within_bound(unit(z), expected, reduction=9 * 8, depth=3)  # positions x width; MLP, mix, LN
    assert torch.equal(unit.out_norm.bias, torch.ones(8))  # gate starts near one, as the SGU's
    params = {n for n, _ in unit.named_parameters()}
    assert any(n.startswith("hyper_out") for n in params) == (not tied)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("tied", [True, False])
def test_hypermixing_unit_is_causal(mode, tied):
    unit = hyper_unit(tied, chunk=3).train(mode == "train")
    assert_causal(unit, torch.randn(2, 11, 16))


def test_papers_hypermixing_fails_the_causality_check():
    """Negative control: the paper's encoder form (every position sees all) leaks the future."""
    unit = hyper_unit(causal=False).eval()
    x = torch.randn(2, 11, 16)
    for t in (0, 5, 9):
        assert not earlier_outputs_unchanged(unit, x, t)


# ---------------------------------------------------------------- NiNformer


@pytest.mark.parametrize("expansion", [1, 2])
@pytest.mark.parametrize("n", [6, 4])
def test_causal_token_mlp_equals_plain_reference(expansion, n):
    torch.manual_seed(0)
    mlp = CausalTokenMLP(seq_len=6, expansion=expansion).double()
    x = torch.randn(2, n, 3, dtype=torch.float64)
    assert torch.allclose(mlp(x), token_mlp_reference(mlp, x), rtol=1e-12, atol=1e-12)


def test_causal_token_mlp_gives_future_weights_no_gradient():
    torch.manual_seed(0)
    mlp = CausalTokenMLP(seq_len=6, expansion=2)
    mlp(torch.randn(2, 6, 3)).pow(2).sum().backward()
    unit_pos = torch.arange(12) // 2
    future1 = torch.arange(6)[None, :] > unit_pos[:, None]  # w1[m, s]: unit m reading a later position s
    future2 = unit_pos[None, :] > torch.arange(6)[:, None]  # w2[t, m]: output t reading a later unit m
    assert torch.all(mlp.w1.grad[future1] == 0) and torch.all(mlp.w1.grad[~future1] != 0)
    assert torch.all(mlp.w2.grad[future2] == 0) and torch.all(mlp.w2.grad[~future2] != 0)


def test_ninformer_unit_equals_its_definition():
    """out = z1 * Mixer(z2), Mixer = x + TokenMLP(LN x), then + ChannelMLP(LN .) (NiNformer eq. 8)."""
    torch.manual_seed(0)
    unit = NiNformerGatingUnit(NiNformerConfig(dim=16, seq_len=10, channel_hidden=12))
    mixer = unit.mixer
    z = torch.randn(2, 7, 16)
    z1, z2 = z[..., :8], z[..., 8:]
    with torch.no_grad():
        g = z2 + token_mlp_reference(mixer.token_mlp, F.layer_norm(z2, (8,), mixer.token_norm.weight,
                                                                     mixer.token_norm.bias))
        g = g + mixer.channel_mlp(F.layer_norm(g, (8,), mixer.channel_norm.weight, mixer.channel_norm.bias))
        assert within_bound(unit(z), z1 * g, reduction=7 * 8, depth=4)  # positions x width; two MLPs


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_ninformer_unit_is_causal(mode):
    torch.manual_seed(0)
    unit = NiNformerGatingUnit(NiNformerConfig(dim=16, seq_len=12, channel_hidden=8, token_expansion=2))
    unit.train(mode == "train")
    assert_causal(unit, torch.randn(2, 12, 16))
    assert_causal(unit, torch.randn(2, 7, 16))  # shorter than T


def test_papers_token_mixing_mlp_fails_the_causality_check():
    """Negative control: MLP-Mixer's unmasked token MLP (NiNformer as published) leaks the future."""
    torch.manual_seed(0)
    unit = NiNformerGatingUnit(NiNformerConfig(dim=16, seq_len=12, channel_hidden=8, causal=False)).eval()
    x = torch.randn(2, 12, 16)
    for t in (0, 5, 10):
        assert not earlier_outputs_unchanged(unit, x, t)


def test_ninformer_gradcheck():
    torch.manual_seed(0)
    unit = NiNformerGatingUnit(NiNformerConfig(dim=6, seq_len=5, channel_hidden=4, token_expansion=2)).double()
    assert torch.autograd.gradcheck(unit, (torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True),))


def test_sequence_longer_than_token_mlp_is_refused():
    unit = NiNformerGatingUnit(NiNformerConfig(dim=8, seq_len=6, channel_hidden=4))
    with pytest.raises(ValueError, match=r"length 7 exceeds the spatial weight's size 6"):
        unit(torch.randn(1, 7, 8))


# ---------------------------------------------------------------- language models


def lm_config(mixer, family="gmlp", **kw):
    extra = dict(sparse_layers=1, num_experts=2) if family == "smlp" else {}
    return LMConfig(family=family, vocab_size=40, d_model=16, d_ffn=32, seq_len=12, dense_layers=2,
                    token_mixer=mixer, **extra, **kw)


@pytest.mark.parametrize("family", ["gmlp", "smlp"])
@pytest.mark.parametrize("mixer, kw", [("hypermixer", {}), ("hypermixer", {"hypermixer_tied": False}),
                                        ("ninformer", {})], ids=["hyper", "hyper-untied", "ninformer"])
def test_language_models_with_the_new_mixers_are_causal(family, mixer, kw):
    torch.manual_seed(0)
    model = LanguageModel(lm_config(mixer, family, **kw)).eval()
    dense = [layer for layer in model.layers if isinstance(layer, GMLPBlock)]
    expected = HyperMixingUnit if mixer == "hypermixer" else NiNformerGatingUnit
    assert dense and all(isinstance(layer.token_mixer, expected) for layer in dense)
    with torch.no_grad():
        assert_causal(model, torch.randint(4, 40, (2, 12)), positions=[0, 5, 10])


def test_sgu_block_keeps_its_checkpoint_keys():
    keys = set(GMLPBlock(GMLPConfig(d_model=8, d_ffn=16, seq_len=6)).state_dict())
    assert {"sgu.proj.weight", "sgu.proj.bias_offset", "sgu.norm.weight"} <= keys
    assert not any(k.startswith("mixer.") for k in keys)


@pytest.mark.parametrize("mixer", ["hypermixer", "ninformer"])
def test_mixer_learns_a_task_that_needs_token_mixing(mixer):
    """Sequences a b a b ...: the next token is the previous one, which a model without token mixing
    cannot see (its best loss is log V, a and b being independent and uniform)."""
    torch.manual_seed(0)
    V, n = 12, 12
    model = LanguageModel(LMConfig(family="gmlp", vocab_size=V + 4, d_model=32, d_ffn=64, seq_len=n,
                                   dense_layers=1, token_mixer=mixer, padding_idx=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def batch(size=32):
        ab = torch.randint(4, V + 4, (size, 2))
        return ab.repeat(1, n // 2)

    for _ in range(150):
        x = batch()
        loss = F.cross_entropy(model(x)[:, 2:-1].reshape(-1, V + 4), x[:, 3:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        x = batch(256)
        loss = F.cross_entropy(model(x)[:, 2:-1].reshape(-1, V + 4), x[:, 3:].reshape(-1)).item()
    assert loss < 0.25 * math.log(V), loss


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("make, message", [
    (lambda: HyperMixerConfig(dim=15, hidden_dim=4, hyper_hidden=4), "dim=15 must be even"),
    (lambda: HyperMixerConfig(dim=16, hidden_dim=0, hyper_hidden=4), "hidden_dim=0 is invalid"),
    (lambda: HyperMixerConfig(dim=16, hidden_dim=4, hyper_hidden=4, chunk_size=-1), "chunk_size=-1 is invalid"),
    (lambda: HyperMixerConfig(dim=16, hidden_dim=4, hyper_hidden=4, tied=1), "tied=1 is invalid"),
    (lambda: NiNformerConfig(dim=16, seq_len=0, channel_hidden=4), "seq_len=0 is invalid"),
    (lambda: NiNformerConfig(dim=16, seq_len=8, channel_hidden=4, token_expansion=0), "token_expansion=0"),
    (lambda: lm_config("attention"), "token_mixer='attention' is unknown: valid values are sgu, hypermixer"),
    (lambda: lm_config("hypermixer", heads=2), "needs heads=1"),
    (lambda: lm_config("ninformer", mixer_dim=-3), "mixer_dim=-3 is invalid"),
    (lambda: LMConfig(family="transformer", vocab_size=40, d_model=16, d_ffn=32, seq_len=12, dense_layers=2,
                      token_mixer="hypermixer"), "the transformer family has none"),
])
def test_bad_configuration_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_wrong_input_width_is_refused():
    with pytest.raises(ValueError, match=r"HyperMixingUnit expects \(batch, length, 16\)"):
        hyper_unit()(torch.randn(1, 4, 12))
    with pytest.raises(ValueError, match=r"u and w of shape \(B, N, R\)"):
        hypermixing(torch.randn(1, 4, 3), torch.randn(1, 4, 5), torch.randn(1, 4, 2))


# ---------------------------------------------------------------- FLOPs against closed forms


def gmlp_block_macs(n, D, Fw, mixer_macs):
    return 5 * n * D + n * D * Fw + mixer_macs + n * (Fw // 2) * D  # LN, proj_in, mixer, proj_out


@pytest.mark.parametrize("tied", [True, False])
def test_hypermixer_flops_closed_form(tied):
    """HyperMixer Appendix D.2 counted in multiply-adds: hypernetwork N (d d_h + d_h d') per network,
    mixing 2 N d' d (the paper's 4 N d' d operations), plus the two LayerNorms (5 per element)."""
    from smlp_eval import flops as F_

    n, D, Fw, R = 24, 32, 64, 20
    C = Fw // 2
    cfg = LMConfig(family="gmlp", vocab_size=101, d_model=D, d_ffn=Fw, seq_len=n, dense_layers=3,
                   token_mixer="hypermixer", mixer_dim=R, hypermixer_tied=tied)
    mixer = 2 * 5 * n * C + (1 if tied else 2) * n * (C * C + C * R) + 2 * n * R * C
    for method in ("fvcore", "analytic"):
        c = F_.count(cfg, method=method)
        assert c.dense.macs == gmlp_block_macs(n, D, Fw, mixer), method
        assert c.macs == 3 * c.dense.macs + 5 * n * D + n * D * 101


def test_ninformer_flops_closed_form():
    """Token MLP 2 r n^2 C (full products, as the SGU's n^2 C), channel MLP 2 n C E, two LayerNorms."""
    from smlp_eval import flops as F_

    n, D, Fw, E = 24, 32, 64, 48
    C = Fw // 2
    cfg = LMConfig(family="gmlp", vocab_size=101, d_model=D, d_ffn=Fw, seq_len=n, dense_layers=3,
                   token_mixer="ninformer", mixer_dim=E)
    mixer = 2 * 5 * n * C + 2 * n * n * C + 2 * n * C * E
    for method in ("fvcore", "analytic"):
        assert F_.count(cfg, method=method).dense.macs == gmlp_block_macs(n, D, Fw, mixer), method


def test_paper_small_presets_are_the_flop_matches_of_the_small_smlp():
    """hypermixer(_untied)_lm_paper_small and ninformer_lm_paper_small hold the layer counts that
    `smlp-flops --arch smlp_lm_paper_small --match` picks."""
    from smlp_eval import flops as F_

    target = F_.count_spec(F_.parse_model("smlp_lm_paper_small"), "analytic")
    rows = {r.family: r for r in F_.match(target, method="analytic",
                                          families=("hypermixer", "hypermixer_untied", "ninformer"))}
    for family, arch in [("hypermixer", "hypermixer_lm_paper_small"),
                         ("hypermixer_untied", "hypermixer_untied_lm_paper_small"),
                         ("ninformer", "ninformer_lm_paper_small")]:
        spec = F_.parse_model(arch)
        cfg = spec.cfg
        assert (cfg.d_model, cfg.d_ffn, cfg.seq_len, cfg.sparse_layers) == (1024, 4096, 1024, 0)
        assert F_.family_key(cfg) == family
        assert cfg.dense_layers == rows[family].layers, (arch, rows[family].layers)
        assert abs(rows[family].rel) <= 0.025  # per-layer steps are ~4-7% of the total here
        matched = rows[family].count.cfg
        assert (matched.token_mixer, matched.mixer_dim, matched.hypermixer_tied) == \
            (cfg.token_mixer, cfg.mixer_dim, cfg.hypermixer_tied)
        assert f"--token-mixer {cfg.token_mixer}" in F_.fairseq_flags(cfg)
