"""Generation through fairseq and our programs (fairseq_plugins/models.py CoreLMDecoder,
fairseq_plugins/generation_patches.py, smlp_eval.generate, LMScorer.greedy_continuation).

References: fairseq's own non-incremental path of SequenceGenerator (the same generator with the
decoder's cache turned off, `EnsembleModel.has_incremental = False`), the core's full forward,
`smlp.generation.generate` (an independent decoding loop), the old recompute path of the lm-eval
adapter's greedy decoding, and one process holding every expert. The command-line programs
(fairseq-interactive, fairseq-generate, the hub's sample, smlp-generate on 2 ranks) are tested by
tests/test_generation_docs.py, which runs every command of docs/generation.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_fairseq import IDS, TINY_ARCHS, build_model
from tolerance import assert_orders_agree

T = 32  # TINY_TRAIN's --tokens-per-sample: the models' seq_len


def _perturb(model, seed: int = 0):
    """Make spatial weights, experts and routers matter (at init the spatial weights are ~0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("embed.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 2 / max(1, p.shape[-1]) ** 0.5)
    return model.eval()


def _logits_rule(model) -> dict:
    """Cached against full scores: the rounding bound of two computation orders (tests/tolerance.py), the
    longest reduction of a block and one per block plus the output projection (test_generation.py's rule)."""
    core = getattr(model, "decoder", model).core
    c = core.cfg
    return dict(reduction=max(c.d_model, c.d_ffn, c.seq_len), depth=len(core.layers) + 1)


def _model(data, arch, extra):
    torch.manual_seed(0)
    model, task = build_model(data, arch, extra)
    return _perturb(model), task


def _sample(task, prompts):
    """A fairseq-interactive batch: each prompt as a line (its </s> appended, then stripped, </s> prepended)."""
    eos = task.source_dictionary.eos()
    tokens = [torch.tensor([*p, eos]) for p in prompts]
    ds = task.build_dataset_for_inference(tokens, [len(t) for t in tokens])  # TokenBlockDataset: numpy 2 patch
    return ds.collater([ds[i] for i in range(len(prompts))])


def _generator(task, model, **kwargs):
    args = argparse.Namespace(**{"beam": 1, "max_len_b": 16, **kwargs})
    return task.build_generator([model], args)


def _prompts(vocab: int, lengths=(2, 5, 9)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def _run(task, model, gen, prompts, incremental: bool):
    gen.model.has_incremental = incremental  # fairseq's switch between the two paths
    widths = []
    hook = model.decoder.core.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        hypos = task.inference_step(gen, [model], _sample(task, prompts))
    finally:
        hook.remove()
    return hypos, widths


# ---------------------------------------------------------------- SequenceGenerator: cached == uncached


@pytest.mark.parametrize("arch, extra", TINY_ARCHS, ids=IDS)
def test_sequence_generator_with_the_cache_equals_it_without(tiny_lm_data, arch, extra):
    """Greedy and beam search (4 beams, every hypothesis) through fairseq's SequenceGenerator give
    the same tokens with the incremental decoder as with fairseq's recompute path, and the cached
    path feeds the core one position per call (three prompt lengths; partial prediction's fill
    groups included)."""
    model, task = _model(tiny_lm_data, arch, extra)
    prompts = _prompts(len(task.target_dictionary))
    for beam in (1, 4):
        gen = _generator(task, model, beam=beam)
        cached, widths_cached = _run(task, model, gen, prompts, True)
        full, widths_full = _run(task, model, gen, prompts, False)
        P = model.decoder.core.cfg.prediction_start  # a fill of f tokens is read with the first position
        fills = sorted(P - len(p) + 1 for p in prompts if len(p) < P)
        if model.decoder.core.supports_cached_decoding:
            assert sorted(w for w in widths_cached if w > 1) == fills and max(widths_full) > 1
        else:  # token-routed experiment: the incremental path falls back to recomputing every prefix
            assert widths_cached == widths_full and max(widths_full) > 1
        for row_c, row_f in zip(cached, full):
            assert len(row_c) == len(row_f) == beam
            for h_c, h_f in zip(row_c, row_f):
                assert h_c["tokens"].tolist() == h_f["tokens"].tolist(), (arch, beam)
                assert_orders_agree(h_c["positional_scores"], h_f["positional_scores"], **_logits_rule(model))


@pytest.mark.parametrize("arch, extra", [TINY_ARCHS[0], TINY_ARCHS[1], TINY_ARCHS[5]], ids=["smlp-det", "smlp-partial",
                                                                                             "switch"])
def test_fairseq_greedy_equals_smlp_generation_and_fills_the_routing_prefix(tiny_lm_data, arch, extra, caplog):
    """fairseq's greedy output (the prompt, then new tokens) equals smlp.generation.generate on the core,
    an independent loop. For partial prediction (P = 6 of 32) prompts of 2 and 5 tokens are left-filled
    with the end of the valid split, read independently here (smlp-zeroshot's reader), and the fill is
    logged, never printed: the hypotheses start with the prompt."""
    from fairseq_plugins.prefix_fill import routing_prefix_fill
    from smlp.generation import generate

    model, task = _model(tiny_lm_data, arch, extra)
    core, eos = model.decoder.core, task.target_dictionary.eos()
    P = core.cfg.prediction_start
    assert (P > 0) == ("partial" in extra)
    fill = routing_prefix_fill(task.target_dictionary, tiny_lm_data, P)[0] if P else None
    prompts = _prompts(len(task.target_dictionary))
    gen = _generator(task, model, max_len_b=16)
    with caplog.at_level(logging.INFO, logger="fairseq_plugins.generation_patches"):
        hypos, _ = _run(task, model, gen, prompts, True)
    for prompt, row in zip(prompts, hypos):
        got = row[0]["tokens"].tolist()
        assert got[-1] == eos and got[:len(prompt)] == prompt
        expected = generate(core, [[eos, *prompt]], 16 - len(prompt), eos=eos, prefix_fill=fill)[0]
        assert got[len(prompt):-1] == expected
        assert len(row[0]["positional_scores"]) == len(got)
    logged = "routing prefix (6 positions) are left-filled" in caplog.text
    assert logged == bool(P)


def test_generation_limits_name_the_models_positions(tiny_lm_data, caplog):
    """A prompt that leaves no room in T = 32 positions, or that --max-len-b (which counts the prompt)
    would cut, stops with an error naming the limit; asking for more than T positions warns with T and
    stops there (fairseq's cap), never feeding the core more than T positions."""
    model, task = _model(tiny_lm_data, "smlp_lm_tiny", [])
    vocab = len(task.target_dictionary)
    with pytest.raises(ValueError, match=r"prompt 0 has 31 tokens.*32 positions \(--seq-len"):
        task.inference_step(_generator(task, model, max_len_b=40), [model], _sample(task, _prompts(vocab, (31,))))
    with pytest.raises(ValueError, match=r"prompt 0 has 9 tokens but generation is limited to 9 tokens.*--max-len-b"):
        task.inference_step(_generator(task, model, max_len_b=9), [model], _sample(task, _prompts(vocab, (9,))))
    widths = []
    hook = model.decoder.core.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    with caplog.at_level(logging.WARNING, logger="fairseq_plugins.generation_patches"):
        hypos = task.inference_step(_generator(task, model, max_len_b=200), [model], _sample(task, _prompts(vocab)))
    hook.remove()
    assert "asked for up to 200 tokens" in caplog.text and "at most 32 positions (--seq-len" in caplog.text
    assert max(len(h[0]["tokens"]) for h in hypos) <= T and sum(widths) <= T  # T - 1 tokens + the closing </s>


def test_incremental_decoder_steps_and_reorders_like_the_full_forward(tiny_lm_data):
    """The decoder's own interface: incremental_state across calls of 1 and 3 new positions and a
    beam-style reorder give the full forward's logits on the reordered histories (1e-5)."""
    model, task = _model(tiny_lm_data, "smlp_lm_tiny", [])
    dec = model.decoder
    tokens = torch.randint(4, len(task.target_dictionary), (3, 12), generator=torch.Generator().manual_seed(5))
    state: dict = {}
    with torch.no_grad():
        a = dec(tokens[:, :4], incremental_state=state)[0]
        order = torch.tensor([2, 0, 0])
        dec.reorder_incremental_state_scripting(state, order)
        hist = tokens[order]
        b = dec(hist[:, :7], incremental_state=state)[0]  # positions 4..6
        c = dec(hist[:, :8], incremental_state=state)[0]
        full = dec(hist[:, :8])[0]
        assert b.shape[1] == 3 and c.shape[1] == 1
        assert_orders_agree(torch.cat([a[order], b, c], dim=1), full, **_logits_rule(dec))
        with pytest.raises(ValueError, match="8 are decoded already"):
            dec(hist[:, :8], incremental_state=state)


def test_patches_are_installed_once():
    from fairseq import checkpoint_utils
    from fairseq.data import token_block_dataset
    from fairseq.tasks.language_modeling import LanguageModelingTask

    import fairseq_plugins  # noqa: F401
    from fairseq_plugins import generation_patches

    assert generation_patches.install() == []  # applied when the plugins were imported
    assert token_block_dataset.np.compat.long is __import__("numpy").int64
    assert getattr(checkpoint_utils.load_model_ensemble_and_task, "_smlp_patch", False)
    assert getattr(LanguageModelingTask.inference_step, "_smlp_patch", False)


def test_a_rank_shard_set_with_a_rank_missing_is_refused_by_name(tmp_path):
    """fairseq's loader given X.pt when only X-rank-1.pt exists: our error naming the missing rank, not
    fairseq's "Model file not found" nor a model with half its experts."""
    from fairseq import checkpoint_utils

    import fairseq_plugins  # noqa: F401

    (tmp_path / "checkpoint_last-rank-1.pt").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"shards of rank\(s\) \[0\] are missing"):
        checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "checkpoint_last.pt")])
    with pytest.raises(IOError, match="Model file not found"):  # no shards at all: fairseq's own error
        checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "nothing.pt")])


# ---------------------------------------------------------------- lm-eval adapter: greedy_continuation


class _LM(torch.nn.Module):
    """What LMScorer reads from a fairseq model: max_positions(), .core, forward -> logits."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def max_positions(self):
        return self.core.cfg.seq_len

    def forward(self, tokens):
        return self.core(tokens)


@pytest.mark.parametrize("arch, extra", [TINY_ARCHS[0], TINY_ARCHS[1], TINY_ARCHS[3]],
                         ids=["smlp-det", "smlp-partial", "transformer"])
def test_greedy_continuation_with_the_cache_equals_the_recompute_path(tiny_lm_data, arch, extra):
    """LMScorer.greedy_continuation (lm-eval's generate_until): the cached path returns the old
    recompute path's tokens, also when the text outgrows T = 32 (it then slides the window as before),
    in far fewer positions; a partial-prediction context shorter than the routing prefix keeps its fill,
    as smlp.generation.generate does."""
    from smlp.generation import generate
    from smlp_eval.scoring import LMScorer

    model, task = _model(tiny_lm_data, arch, extra)
    core, eos = model.decoder.core, task.target_dictionary.eos()
    scorer = LMScorer(_LM(core), eos=eos, pad=task.target_dictionary.pad(), progress=False)
    positions = []
    hook = core.register_forward_pre_hook(lambda m, args: positions.append(args[0].shape[1]))
    scorer.eos = task.target_dictionary.pad()  # a stop token never chosen (its output row is zero): full length
    context = _prompts(len(task.target_dictionary), (20,))[0]
    cached = scorer.greedy_continuation(context, 25, use_cache=True)
    n_cached, positions[:] = sum(positions), []
    old = scorer.greedy_continuation(context, 25, use_cache=False)
    assert cached == old and len(cached) == 25
    # cached: the row of 21 once, then one position per token until 32 are cached (11 tokens), then the
    # last 32 tokens recomputed for each of the 13 others (the window slides), as the old path does
    assert n_cached == 21 + 11 + 13 * 32 and sum(positions) == sum(range(21, 33)) + 13 * 32
    hook.remove()
    scorer.eos = eos
    if core.cfg.prediction_start:
        short = context[:2]
        got = scorer.greedy_continuation(short, 10, use_cache=True)
        expected = generate(core, [[eos, *short]], 10, eos=eos, prefix_fill=scorer.prefix_fill)[0]
        assert got == expected


# ---------------------------------------------------------------- expert-parallel lockstep (2 gloo ranks)

EP_ARCHS = [("smlp-deterministic", dict(family="smlp", dense_layers=1, sparse_layers=2, num_experts=2)),
            ("smlp-partial", dict(family="smlp", dense_layers=1, sparse_layers=2, num_experts=2,
                                  smoe_routing="partial")),
            ("switch", dict(family="transformer", dense_layers=2, sparse_layers=2, num_experts=4, moe_router="switch",
                            heads=4))]


def _ep_worker(rank, world, init_file, failures):
    from datetime import timedelta

    from smlp.dispatch import AllToAllDispatcher
    from smlp.generation import generate
    from smlp.lm import LanguageModel, LMConfig
    from smlp.resharding import expert_keys, slice_expert_shard
    from smlp_eval.generate import generate_lockstep
    from smlp_eval.scoring import LMScorer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    for name, arch in EP_ARCHS:
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=50, d_model=16, d_ffn=32, seq_len=24, **arch)
        ref = _perturb(LanguageModel(cfg))
        model = LanguageModel(cfg, AllToAllDispatcher(cfg.num_experts)).eval()
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        fill = list(range(30, 40))
        g = torch.Generator().manual_seed(7)
        # 5 prompts of 1..11 tokens: rank 0 gets 3 (two batches of <= 2), rank 1 gets 2 (one batch)
        prompts = [[2, *torch.randint(4, 50, (n,), generator=g).tolist()] for n in (4, 1, 11, 6, 2)]
        free = [generate(ref, [p], 8, prefix_fill=fill)[0] for p in prompts]
        eos = free[0][2]  # prompt 0 ends after 3 tokens, the others when (if) they meet this token
        for mode in ({"beam": 1}, {"beam": 2}, {"sample": True, "temperature": 0.9, "top_k": 10}):
            expected = []
            for i, p in enumerate(prompts):
                kw = dict(beam_size=mode.get("beam", 1), sample=mode.get("sample", False),
                          temperature=mode.get("temperature", 1.0), top_k=mode.get("top_k", 0))
                if kw["sample"]:
                    kw["generator"] = torch.Generator().manual_seed(5 + i)
                expected.append(generate(ref, [p], 8, eos=eos, prefix_fill=fill, **kw)[0])
            got, steps = generate_lockstep(model, prompts, max_new_tokens=8, eos=eos, batch_size=2, seed=5,
                                           prefix_fill=fill, **mode)
            if got != expected:
                failures.append(f"{name} {mode} rank {rank}: {got} != one process {expected}")
            if mode.get("beam") == 1 and len({len(e) for e in expected}) < 2:
                failures.append(f"{name} {mode}: every prompt finished at the same step (test too weak)")
        # lm-eval's greedy decoding: the same calls on every rank, rank 0's tokens broadcast; a text that
        # outgrows T = 24 (the window slides); a partial-prediction context shorter than its prefix (filled once)
        scorer = LMScorer(_LM(model), eos=1, pad=1, progress=False, prefix_fill=fill)
        one = LMScorer(_LM(ref), eos=1, pad=1, progress=False, prefix_fill=fill)
        long_ctx, short_ctx = prompts[2][1:], prompts[1][1:]
        a = scorer.greedy_continuation(long_ctx, 20, use_cache=True)
        b = one.greedy_continuation(long_ctx, 20, use_cache=False)
        if a != b or len(a) != 20:
            failures.append(f"{name} greedy_continuation rank {rank}: {a} != one process, recomputed {b}")
        a = scorer.greedy_continuation(short_ctx, 10, use_cache=True)
        b = generate(ref, [[1, *short_ctx]], 10, eos=1, prefix_fill=fill)[0]
        if a != b:
            failures.append(f"{name} greedy_continuation (short context) rank {rank}: {a} != generate {b}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_generation_lockstep_equals_one_process():
    """smlp_eval.generate.generate_lockstep on 2 gloo ranks (AllToAllDispatcher, experts split): prompts of
    different lengths dealt to the ranks, different numbers of batches per rank, rows ending at different
    steps; greedy, beam search and sampling equal one process holding every expert, prompt by prompt,
    and nothing hangs (a 120 s collective timeout would fail the test). LMScorer.greedy_continuation with
    the cache on the expert-parallel model equals the recompute path on one process."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        failures = manager.list()
        mp.spawn(_ep_worker, args=(2, os.path.join(tmp, "rendezvous"), failures), nprocs=2, join=True,
                start_method="forkserver")
        assert not list(failures), "\n".join(failures)
