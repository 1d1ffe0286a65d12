"""Cached incremental decoding and generation against full recomputation (smlp/decoding_cache.py, smlp/generation.py).

References: the full forward of the same model on the same token histories (logits at every position,
fp32, within the rounding bound of two computation orders: tests/tolerance.py), a per-prompt greedy loop
that recomputes the whole prefix, and exhaustive search over every continuation (beam search with enough
beams is exact). Every architecture and routing is covered; the weights are perturbed so that the
spatial weights, experts and routers all matter (at initialization the spatial weights are near zero and
Base Layers' expert outputs exactly zero, which would hide wrong positions).
"""
from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smlp.decoding_cache import DecodingCache
from smlp.generation import fill_prefix, generate
from smlp.hypermixer import hypermixing, hypermixing_step
from smlp.lm import LanguageModel, LMConfig
from smlp.ninformer import CausalTokenMLP
from tolerance import assert_orders_agree, orders_agree

T = 24
BASE = dict(vocab_size=50, d_model=16, d_ffn=32, seq_len=T)
ARCHS = {
    "smlp-deterministic": dict(family="smlp", dense_layers=2, sparse_layers=2, num_experts=2),
    "smlp-partial": dict(family="smlp", dense_layers=2, sparse_layers=2, num_experts=2, smoe_routing="partial"),
    "gmlp": dict(family="gmlp", dense_layers=2),
    "gmlp-multihead": dict(family="gmlp", dense_layers=2, heads=2),
    "hypermixer-tied": dict(family="gmlp", dense_layers=2, token_mixer="hypermixer"),
    "hypermixer-untied": dict(family="gmlp", dense_layers=2, token_mixer="hypermixer", hypermixer_tied=False),
    "ninformer": dict(family="gmlp", dense_layers=2, token_mixer="ninformer"),
    "transformer": dict(family="transformer", dense_layers=2, heads=4),
    "gshard": dict(family="transformer", dense_layers=2, sparse_layers=2, num_experts=4, moe_router="gshard", heads=4),
    "switch": dict(family="transformer", dense_layers=2, sparse_layers=2, num_experts=4, moe_router="switch", heads=4),
    "base": dict(family="transformer", dense_layers=2, sparse_layers=2, num_experts=4, moe_router="base", heads=4),
    "hash": dict(family="transformer", dense_layers=2, sparse_layers=2, num_experts=4, moe_router="hash", heads=4),
}
FILL = list(range(30, 40))  # routing-prefix fill for partial prediction (P = 5 of T = 24)


def _perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed.weight":
                p.add_(torch.randn(p.shape, generator=g) * 2 / max(1, p.shape[-1]) ** 0.5)
    return model


def build(arch: str, dispatcher=None, **overrides) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(**{**BASE, **ARCHS[arch], **overrides}), dispatcher)
    return _perturb(model).eval()


def logits_rule(model: LanguageModel) -> dict:
    """The rounding bound of cached against full logits (tests/tolerance.py): the longest reduction
    of a block (width, channels or positions), one per block and one for the output projection."""
    c = model.cfg
    return dict(reduction=max(c.d_model, c.d_ffn, c.seq_len), depth=len(model.layers) + 1)


def _tokens(shape, seed, vocab=BASE["vocab_size"]):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def decode(model, tokens_BN, schedule, cache=None):
    """Cached logits of tokens_BN fed in chunks of the given sizes."""
    cache = cache if cache is not None else model.new_cache()
    outs, pos = [], cache.length
    for k in schedule:
        outs.append(model(tokens_BN[:, pos:pos + k], cache=cache))
        pos += k
    return torch.cat(outs, dim=1), cache


# ---------------------------------------------------------------- logits: cached == full forward


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_cached_logits_equal_full_forward(arch):
    """Prefill of k tokens then one at a time, also several positions at once after a prefill; three
    sequences; partial prediction's routing prefix (5) completed inside a multi-position step, by the
    prefill, and by a single step."""
    model = build(arch)
    tokens = _tokens((3, T), seed=1)
    full = model(tokens)
    for schedule in ([3, 1, 2, 1, 5] + [1] * 12, [8] + [1] * 16, [4, 1, 1, 3, 15], [T]):
        got, cache = decode(model, tokens, schedule)
        assert cache.length == T and cache.batch_size == 3
        assert_orders_agree(got, full, f"{arch}, schedule {schedule}", **logits_rule(model))


@pytest.mark.parametrize("arch", ["smlp-deterministic", "smlp-partial", "switch"])
@torch.no_grad()
def test_planted_errors_fail_the_cached_logits_comparison(arch):
    """The bound above still catches a real difference: the cached path run with one expert or block
    weight off by 1e-3 of itself, or reading one position from the future, fails it."""
    model = build(arch)
    tokens = _tokens((3, T), seed=1)
    full = model(tokens)
    got, _ = decode(model, tokens, [8] + [1] * 16)
    assert orders_agree(got, full, **logits_rule(model))[0]
    weight = next(p for p in model.layers[0].parameters() if p.dim() >= 2)
    weight.mul_(1 + 1e-3)
    planted, _ = decode(model, tokens, [8] + [1] * 16)
    weight.div_(1 + 1e-3)
    ok, err, tol = orders_agree(planted, full, **logits_rule(model))
    assert not ok and err > 3 * tol, (err, tol)
    # a leak: the logits at position t computed from a history whose next token is already t + 1's
    shifted = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    leaked = torch.cat([full[:, :10], model(shifted)[:, 10:]], dim=1)
    assert not orders_agree(leaked, full, **logits_rule(model))[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_cached_steps_keep_the_spatial_term_in_half_precision(dtype):
    """The cached steps return the gate minus one, W z + (b - 1), as the forward paths do
    (tests/test_precision.py): at the gMLP init (W z ~ 1e-5, b = 1) a step computing W z + b would round
    the spatial term away in bf16/fp16. Checked for the SGU projection and the sMoE spatial experts:
    the step's term equals the fp32 forward's within 10%, and z1 + z1 * term is the SGU's cached output."""
    from smlp.config import SGUConfig
    from smlp.experts import SpatialExperts
    from smlp.gmlp import SpatialGatingUnit

    torch.manual_seed(0)
    n, start = 256, 250
    sgu = SpatialGatingUnit(SGUConfig(dim=32, seq_len=n))
    z = torch.randn(2, n, 32)
    ref = sgu.proj(sgu.norm(z.chunk(2, -1)[1]))[:, start:]  # fp32 forward: W v + (b - 1)
    half = sgu.to(dtype)
    v = half.norm(z.to(dtype).chunk(2, -1)[1])
    term = half.proj.step(v, start)
    assert ref.abs().max() < 1e-3 and _rel(term, ref) < 0.10, _rel(term, ref)
    state = {}
    half.step(z[:, :start].to(dtype), state, 0)
    out = half.step(z[:, start:].to(dtype), state, start)
    z1 = z[:, start:].to(dtype).chunk(2, -1)[0]
    assert torch.equal(out, z1 + z1 * term)

    experts = SpatialExperts(2, n)
    x = torch.randn(4, n)
    ref = experts(x, [2, 2])[:, start:]
    got = experts.to(dtype).step(x.to(dtype), [[2], [2]], [(start, n)])
    assert ref.abs().max() < 1e-3 and _rel(got, ref) < 0.10, _rel(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["smlp-deterministic", "smlp-partial", "gshard"])
@torch.no_grad()
def test_local_decoding_steps_dispatch_nothing_and_hold_in_half_precision(arch, dtype):
    """Batch-1 steps of a model whose experts are all local take the direct paths (the sMoE's multi-head or
    gathered-row spatial step, the tMoE's token straight to its expert): no dispatch after the routing
    decision. In bf16 / fp16 their logits stay as close to the fp32 full forward as the half model's own full
    forward is (the half format's error of this model, measured, not a fixed figure), within 2 ulps more."""
    model = build(arch)
    tokens = _tokens((1, T), seed=3)
    full = model(tokens).double()
    half = model.to(dtype)
    own = float((half(tokens).double()[:, :8 + 16] - full[:, :8 + 16]).norm() / full[:, :8 + 16].norm())
    first, cache = decode(half, tokens, [8])  # the prompt's 8 rows go through the dispatcher
    dispatches = []
    real = half.dispatcher.dispatch
    half.dispatcher.dispatch = lambda *a, **k: dispatches.append(1) or real(*a, **k)
    rest, _ = decode(half, tokens, [1] * 16, cache)
    assert not dispatches, f"{len(dispatches)} dispatches in the one-token steps of a one-process model"
    got = torch.cat([first, rest], dim=1)
    err = float((got.double() - full[:, :got.shape[1]]).norm() / full[:, :got.shape[1]].norm())
    bound = 1.5 * own + 2 * torch.finfo(dtype).eps
    assert err <= bound, (err, own)
    assert bound < (0.1 if dtype == torch.bfloat16 else 0.02), own  # the half model itself is sound


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_reorder_in_the_middle_equals_full_forward_on_the_reordered_histories(arch):
    """Beam-style reorders: rows repeated and permuted (3 -> 4 rows), then dropped (4 -> 2)."""
    model = build(arch)
    hist1 = _tokens((3, T), seed=2)
    order1, order2 = torch.tensor([2, 0, 0, 1]), torch.tensor([3, 1])
    hist2 = torch.cat([hist1[order1, :10], _tokens((4, T - 10), seed=3)], dim=1)
    hist3 = torch.cat([hist2[order2, :16], _tokens((2, T - 16), seed=4)], dim=1)
    first, cache = decode(model, hist1, [6, 1, 3])
    cache.reorder(order1)
    second, _ = decode(model, hist2, [1, 2, 1, 1, 1], cache)
    cache.reorder(order2)
    third, _ = decode(model, hist3, [1] * 8, cache)
    rule = logits_rule(model)
    assert_orders_agree(first, model(hist1)[:, :10], **rule)
    assert_orders_agree(second, model(hist2)[:, 10:16], **rule)
    assert_orders_agree(third, model(hist3)[:, 16:], **rule)


@torch.no_grad()
def test_token_mlp_with_expansion_and_chunked_hypermixing_steps_equal_their_full_forms():
    """Pieces the LM presets do not reach: NiNformer's token MLP with r = 2 hidden units per position,
    and HyperMixing steps whose prefill is cut into chunks of 2 positions."""
    torch.manual_seed(0)
    mlp = CausalTokenMLP(12, expansion=2)
    x = torch.randn(2, 12, 5)
    state, outs, pos = {}, [], 0
    for k in (4, 1, 3, 1, 1, 2):
        outs.append(mlp.step(x[:, pos:pos + k], state, pos))
        pos += k
    assert_orders_agree(torch.cat(outs, 1), mlp(x), reduction=12 * 2)  # positions x hidden units
    u, v, w = torch.randn(2, 9, 3), torch.randn(2, 9, 4), torch.randn(2, 9, 3)
    y1, carry = hypermixing_step(u[:, :5], v[:, :5], w[:, :5], None, 0, chunk_size=2)
    y2, _ = hypermixing_step(u[:, 5:], v[:, 5:], w[:, 5:], carry, 5, chunk_size=2)
    assert_orders_agree(torch.cat([y1, y2], 1), hypermixing(u, v, w), reduction=9 * 4)  # positions x width


# ---------------------------------------------------------------- limits and bad input


@torch.no_grad()
def test_positions_beyond_seq_len_raise_naming_the_limit():
    model = build("smlp-partial")
    cache = model.new_cache()
    model(_tokens((1, T - 2), seed=5), cache=cache)
    with pytest.raises(ValueError, match=rf"{T - 2} cached \+ 3 new positions = {T + 1} exceeds the model's {T} "
                                         rf"positions .*at most 2 more tokens fit"):
        model(_tokens((1, 3), seed=6), cache=cache)
    assert cache.length == T - 2  # nothing was written: the cache is still usable
    model(_tokens((1, 2), seed=6), cache=cache)
    with pytest.raises(ValueError, match=rf"needs {T + 1} positions but the model has {T} \(seq_len"):
        generate(model, [list(range(10, 20))], T - 8)
    generate(model, [list(range(10, 20))], T - 9)  # exactly fits: the last token is never fed


@torch.no_grad()
def test_cached_decoding_refuses_training_mode_other_batches_and_foreign_caches():
    model = build("switch")
    with pytest.raises(RuntimeError, match="needs eval mode"):
        model.train()(_tokens((1, 2), seed=7), cache=model.new_cache())
    model.eval()
    cache = model.new_cache()
    model(_tokens((2, 3), seed=7), cache=cache)
    with pytest.raises(ValueError, match="the cache holds 2 sequences but 3 were given"):
        model(_tokens((3, 1), seed=7), cache=cache)
    with pytest.raises(ValueError, match="holds rows 0..2 but the cache holds 2 rows"):
        cache.reorder(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="the cache has 3 layers but the model 4"):
        model(_tokens((1, 1), seed=7), cache=DecodingCache(3))


@torch.no_grad()
def test_empty_batch_steps_join_without_reading_or_advancing_positions():
    """A rank whose rows are all done keeps stepping (expert-parallel lockstep) even at the last position."""
    model = build("smlp-partial")
    cache = model.new_cache()
    model(_tokens((2, T), seed=8), cache=cache)
    cache.reorder(torch.tensor([], dtype=torch.long))
    for _ in range(3):
        assert model(_tokens((0, 1), seed=8), cache=cache).shape == (0, 1, BASE["vocab_size"])
    assert cache.length == T and cache.batch_size == 0


# ---------------------------------------------------------------- generation


def reference_greedy(model, prompt, n, eos=None):
    """One prompt, the whole prefix recomputed at every step."""
    seq, out = list(prompt), []
    for _ in range(n):
        token = int(model(torch.tensor([seq]))[0, -1].argmax())
        if token == eos:
            break
        seq.append(token)
        out.append(token)
    return out


PROMPTS = [[2, 5, 7, 9, 11, 3, 4], [2, 8], [2, 4, 4, 6, 8, 10, 12, 14, 3, 9]]


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_greedy_generation_with_and_without_cache_equals_a_per_prompt_loop(arch):
    """Prompts of different lengths in one batch; then an eos that ends rows at different steps."""
    model = build(arch)
    P = model.cfg.prediction_start
    filled = [fill_prefix(FILL, len(p) - 1, P) + p for p in PROMPTS]
    expected = [reference_greedy(model, p, 10) for p in filled]
    assert generate(model, PROMPTS, 10, prefix_fill=FILL) == expected
    assert generate(model, PROMPTS, 10, prefix_fill=FILL, use_cache=False) == expected
    eos = expected[0][3]
    expected_eos = [reference_greedy(model, p, 10, eos=eos) for p in filled]
    assert expected_eos != expected
    assert generate(model, PROMPTS, 10, prefix_fill=FILL, eos=eos) == expected_eos


@pytest.mark.parametrize("arch", ["smlp-partial", "hypermixer-untied", "gshard", "hash"])
@torch.no_grad()
def test_sampling_with_and_without_cache_draws_the_same_tokens(arch):
    model = build(arch)

    def run(**kw):
        return generate(model, PROMPTS, 10, prefix_fill=FILL, sample=True, eos=3,
                        generator=torch.Generator().manual_seed(11), **kw)

    cached = run(temperature=0.7, top_k=5)
    assert cached == run(temperature=0.7, top_k=5, use_cache=False)
    assert run(temperature=1.3) == run(temperature=1.3, use_cache=False)
    assert run(top_k=1) == generate(model, PROMPTS, 10, prefix_fill=FILL, eos=3)  # top-1 sampling is greedy


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_beam_search_with_and_without_cache_agree(arch):
    model = build(arch)
    for eos in (None, 3):
        cached = generate(model, PROMPTS, 8, prefix_fill=FILL, beam_size=3, eos=eos)
        assert cached == generate(model, PROMPTS, 8, prefix_fill=FILL, beam_size=3, eos=eos, use_cache=False)


def most_likely_continuation(model, seq, n, eos):
    """Exhaustive search: the continuation of at most n tokens with the highest log-probability, a
    hypothesis ending at its first eos (not returned) or after n tokens."""
    V = model.cfg.vocab_size
    conts = torch.tensor(list(itertools.product(range(V), repeat=n)))
    batch = torch.cat([torch.tensor(seq).expand(len(conts), -1), conts], dim=1)
    logp_Cn = model(batch).log_softmax(-1)[:, len(seq) - 1:-1].gather(2, conts[:, :, None])[..., 0]
    hyps = {}
    for c, lp in zip(conts.tolist(), logp_Cn):
        j = c.index(eos) + 1 if eos in c else n
        hyps[tuple(c[:j])] = float(lp[:j].sum())
    best = list(max(hyps, key=hyps.get))
    return best[:-1] if best[-1:] == [eos] else best


@pytest.mark.parametrize("arch", ["smlp-partial", "switch"])
@torch.no_grad()
def test_beam_search_with_enough_beams_finds_the_most_likely_continuation(arch):
    """V = 6 and 3 new tokens: 36 beams keep every 2-token prefix, so beam search is exhaustive, with
    and without an eos that ends hypotheses early (the likeliest first token, and another)."""
    model = build(arch, vocab_size=6)
    fill = [5, 4, 3, 2, 0, 5, 4]
    for prompt in ([0, 2, 3, 4, 5, 0, 2], [0, 4]):
        seq = fill_prefix(fill, len(prompt) - 1, model.cfg.prediction_start) + prompt
        first = int(model(torch.tensor([seq]))[0, -1].argmax())
        for eos in (None, first, (first + 1) % 6):
            expected = most_likely_continuation(model, seq, 3, eos)
            assert generate(model, [prompt], 3, beam_size=36, eos=eos, prefix_fill=fill) == [expected]
    prompts = [[0, 2, 3, 4, 5, 0, 2], [0, 4]]
    assert generate(model, prompts, 3, beam_size=1, prefix_fill=fill) == generate(model, prompts, 3, prefix_fill=fill)


def test_partial_prediction_prompts_shorter_than_the_routing_prefix_are_filled_or_refused():
    model = build("smlp-partial")
    assert model.cfg.prediction_start == 5
    assert fill_prefix(FILL, 1, 5) == FILL[-4:]  # position 1 predicts: 4 tokens push it to position 5
    assert fill_prefix(FILL, 5, 5) == [] and fill_prefix([], 7, 5) == []
    with pytest.raises(ValueError, match="needs 5 fill tokens before this sequence but the fill has only 3"):
        fill_prefix([1, 2, 3], 0, 5)
    with pytest.raises(ValueError, match="prompt 1 has 2 tokens but this partial-prediction model predicts only "
                                         "from position 5"):
        generate(model, PROMPTS, 3)


# ---------------------------------------------------------------- expert parallelism (2 gloo ranks)


EP_ARCHS = [("smlp-deterministic", 2), ("smlp-deterministic", 4), ("smlp-partial", 2), ("smlp-partial", 4),
            ("gshard", 4), ("switch", 2), ("base", 4), ("hash", 2),
            ("smlp-deterministic", "replicated"), ("smlp-partial", "replicated")]  # the sMoE replicated, 4 experts


def _ep_worker(rank, world, init_file, failures):
    from datetime import timedelta

    from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
    from smlp.resharding import expert_keys, slice_expert_shard

    torch.set_num_threads(1)
    # an exception on one rank leaves the other waiting in a collective: the timeout ends it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    for arch, experts in EP_ARCHS:
        replicated = experts == "replicated"
        experts = 4 if replicated else experts
        ref = build(arch, num_experts=experts)
        smoe = LocalDispatcher(experts, replicated=True) if replicated else None
        model = LanguageModel(ref.cfg, AllToAllDispatcher(experts), smoe_dispatcher=smoe).eval()
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(model), rank, world))
        real, calls = dist.all_gather, []  # the replicated sMoE's steps gather no spans (no collective)
        if replicated:
            dist.all_gather = lambda *a, calls=calls, real=real, **k: calls.append(1) or real(*a, **k)
        # rank 0: 2 sequences, a prompt of 3 (inside partial prediction's routing prefix), reordered to 3 rows
        # at position 12, decoded to the end; rank 1: 1 sequence, a prompt of 9, done at position 16, then
        # empty steps: both ranks make 1 + 21 calls
        prompt, end = (3, T) if rank == 0 else (9, 16)
        hist = _tokens((2 if rank == 0 else 1, T), seed=20 + rank)
        cache = model.new_cache()
        with torch.no_grad():
            got = [model(hist[:, :prompt], cache=cache)]
            for pos in range(prompt, prompt + T - 3):
                if rank == 0 and pos == 12:
                    order = torch.tensor([1, 0, 1])
                    cache.reorder(order)
                    hist = torch.cat([hist[order, :12], _tokens((3, T - 12), seed=30)], dim=1)
                    got = [g[order] for g in got]
                if pos < end:
                    got.append(model(hist[:, pos:pos + 1], cache=cache))
                else:
                    if cache.batch_size:
                        cache.reorder(torch.tensor([], dtype=torch.long))
                    model(hist[:0, :1], cache=cache)
            expected = ref(hist[:, :end])
        dist.all_gather = real
        if calls:
            failures.append(f"{arch} replicated rank {rank}: the sMoE steps called all_gather {len(calls)} times")
        ok, err, tol = orders_agree(torch.cat(got, dim=1), expected, **logits_rule(ref))
        if not ok:
            failures.append(f"{arch} E={experts} rank {rank}: max |cached - one process| = {err:.3g} > bound {tol:.3g}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_cached_decoding_equals_one_process():
    """2 gloo ranks through AllToAllDispatcher (1 and 2 local experts per rank; the sMoE's experts also
    replicated on both, its steps then without a collective): ranks with different batch sizes, prompt
    lengths, positions, a reorder on one rank and empty steps on the other; every rank's cached logits
    equal the one-process full forward on its own sequences."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        failures = manager.list()
        mp.spawn(_ep_worker, args=(2, os.path.join(tmp, "rendezvous"), failures), nprocs=2, join=True,
                start_method="forkserver")
        assert not list(failures), "\n".join(failures)


@pytest.mark.parametrize("overrides", [dict(family="gmlp", dense_layers=2, token_routed_experts=2),
                                       dict(family="smlp", dense_layers=1, sparse_layers=1, num_experts=2,
                                            smoe_routing="leaky-full-sequence")])
@torch.no_grad()
def test_models_without_a_cached_path_refuse_cached_decoding_and_still_generate_without_it(overrides):
    """The token-routed gMLP experiment and the leaky (non-causal) sMoE router have no cached step:
    asking for one names the model and the way out; generation recomputes, asked for the cache or not."""
    model = build("gmlp", **overrides)
    with pytest.raises(NotImplementedError, match="use_cache=False"):
        model(_tokens((1, 3), seed=0), cache=model.new_cache())
    out = generate(model, [[3, 4, 5]], 4, use_cache=False)
    assert out == [reference_greedy(model, [3, 4, 5], 4)]
    assert generate(model, [[3, 4, 5]], 4) == out  # the default use_cache=True recomputes (smlp-generate)


@torch.no_grad()
def test_an_evaluation_capacity_refuses_cached_decoding_and_generates_by_recomputing():
    """With --eval-capacity-factor the full forward keeps a token by the capacity of its B x N rows and the
    tokens before it in the flattened batch (later positions of earlier sequences included); a decoding
    step would count its own B x k rows (issue 28: before, the cached logits silently differed from the
    full forward's). The step is refused with the reason, and generation recomputes the prefix."""
    model = build("switch", eval_capacity_factor=0.5)
    x = _tokens((3, T), seed=1)
    model(x)
    assert sum(int(m.dropped) for _, m in model.moe_modules()) > 0  # the capacity drops tokens here
    assert not model.supports_cached_decoding
    with pytest.raises(NotImplementedError, match=r"eval_capacity_factor=0\.5, --eval-capacity-factor\).*"
                                                  r"use_cache=False"):
        model(x[:, :5], cache=model.new_cache())
    out = generate(model, [[3, 4, 5]], 4)  # use_cache=True: recomputes, as for the models without a step
    assert out == [reference_greedy(model, [3, 4, 5], 4)]
    assert build("switch").supports_cached_decoding  # no capacity at evaluation: every token on its own
