"""Expert-parallel layers on 2 and 4 gloo ranks against their single-process twins.

Every rank builds the single-process reference (all experts local) with the same weights, runs
it on every rank's input, and checks its own share: outputs, input gradients, its experts'
gradients, and the all-reduced gradients of the shared (non-expert) parameters.

Starting ranks costs far more than the cases: every case of a world size runs in one spawn (the
`spawned` fixture, each case in its own process group), and each test checks its case's outcome.
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smlp.config import SGUConfig, SMoEConfig, SparseBlockConfig, TMoEConfig
from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
from smlp.flop_forms import flag_set
from smlp.gmlp import SpatialGatingUnit
from smlp.moe import SMoE, SparseBlock, TMoE
from smlp.resharding import expert_keys, slice_expert_shard
from tolerance import assert_orders_agree, within_bound

pytestmark = pytest.mark.slow
# Two computation orders of the same sums (tests/tolerance.py): the longest reduction here is a weight
# gradient summed over every rank's rows (4 ranks x 3 sequences x 20 positions), one layer and its backward.
RULE = dict(reduction=4 * 3 * 20, depth=2)


def run_workers(fn, world: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, os.path.join(tmp, "rendezvous"), *args), nprocs=world, join=True,
                start_method="forkserver")


def _run_cases(rank: int, world: int, tmp: str, cases: list) -> None:
    """Each case in order, in its own process group; the first failure ends this rank (its peers then fail
    their collectives at once instead of waiting for a partner that moved on)."""
    for i, (case_id, fn, args) in enumerate(cases):
        try:
            fn(rank, world, os.path.join(tmp, f"rendezvous-{i}"), *args)
        except BaseException:
            with open(os.path.join(tmp, f"{rank}-{i}.json"), "w") as f:
                json.dump({"case": case_id, "error": traceback.format_exc()}, f)
            os._exit(1)
        with open(os.path.join(tmp, f"{rank}-{i}.json"), "w") as f:
            json.dump({"case": case_id, "error": None}, f)


def run_cases(world: int, cases: list, timeout: float = 900) -> dict:
    """Run every (case_id, fn, args) on `world` ranks, fn(rank, world, init_file, *args) as run_workers would,
    in as few spawns as failures allow: after a failing case the rest run in a fresh spawn.
    Returns {case_id: None if it passed on every rank, else what went wrong}."""
    outcome, pending = {}, list(cases)
    while pending:
        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.spawn(_run_cases, args=(world, tmp, pending), nprocs=world, join=False, start_method="forkserver")
            crash = None
            try:
                deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
                while not ctx.join(timeout=1):
                    if datetime.datetime.now() > deadline:
                        crash = f"timed out after {timeout:.0f} s"
                        break
            except Exception as exc:  # a rank exited non-zero (its case's traceback is in its file)
                crash = f"{type(exc).__name__}: {exc}"
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
            done = 0
            for i, (case_id, _, _) in enumerate(pending):
                reports = {r: os.path.join(tmp, f"{r}-{i}.json") for r in range(world)}
                errors = {r: json.loads(Path(f).read_text())["error"] for r, f in reports.items() if os.path.exists(f)}
                if len(errors) == world and not any(errors.values()):
                    outcome[case_id] = None
                    done = i + 1
                    continue
                found = [f"rank {r}: {e}" for r, e in errors.items() if e]
                outcome[case_id] = "\n".join(found) or f"did not finish on every rank ({crash})"
                done = i + 1
                break
            pending = pending[done:]
    return outcome


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    # a timeout, so that a peer that failed out of a case cannot leave this rank waiting for 30 minutes
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))


def _finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _randomize_spatial(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in module.named_parameters():
            if p.dim() == 3 and p.shape[-1] == p.shape[-2]:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _inputs(world, shape_fn, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape_fn(r), generator=g) for r in range(world)]


def _check_shared_grads(model, ref, skip=()):
    """Non-expert gradients summed over ranks equal the reference's (DDP would average them)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if getattr(p, "expert", False) or name in skip:
            continue
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        expected = ref_params[name].grad if ref_params[name].grad is not None else torch.zeros_like(p)
        assert within_bound(g, expected, **RULE), f"shared gradient of {name} differs"


def _check_expert_grads(model, ref, rank, world):
    ref_params = dict(ref.named_parameters())
    for name in expert_keys(model):
        full = ref_params[name].grad
        local = full.shape[0] // world
        mine = dict(model.named_parameters())[name].grad
        assert within_bound(mine, full[rank * local:(rank + 1) * local], **RULE), f"expert gradient {name}"


def _run_pair(model, ref, xs, gs, rank, world, seed_base=1000, extra=None):
    """Forward/backward the distributed model on this rank's input and the reference on all inputs."""
    x = xs[rank].clone().requires_grad_(True)
    torch.manual_seed(seed_base + rank)
    y = model(x, *([extra[rank]] if extra else []))
    y.backward(gs[rank])
    ref_out = []
    for r in range(world):
        xr = xs[r].clone().requires_grad_(True)
        torch.manual_seed(seed_base + r)
        yr = ref(xr, *([extra[r]] if extra else []))
        yr.backward(gs[r])
        ref_out.append((yr.detach(), xr.grad))
    assert within_bound(y, ref_out[rank][0], **RULE), "forward differs from the single-process layer"
    assert within_bound(x.grad, ref_out[rank][1], **RULE), "input gradient differs"
    return y


# ---------------------------------------------------------------- sMoE deterministic == multi-head SGU


def _smoe_worker(rank, world, init_file, split, lengths):
    _init(rank, world, init_file)
    try:
        torch.manual_seed(0)
        ref = SpatialGatingUnit(SGUConfig(dim=16, seq_len=12, heads=world, split=split))
        _randomize_spatial(ref)
        model = SMoE(SMoEConfig(dim=16, seq_len=12, num_experts=world, split=split), AllToAllDispatcher(world))
        with torch.no_grad():
            model.norm.load_state_dict(ref.norm.state_dict())
            model.experts.weight.copy_(ref.proj.weight[rank:rank + 1])
            model.experts.bias_offset.copy_(ref.proj.bias_offset[rank:rank + 1])
        xs = _inputs(world, lambda r: (2 + r % 2, lengths[r], 16))
        gs = _inputs(world, lambda r: (2 + r % 2, lengths[r], 16 // 2 if split else 16), seed=200)
        _run_pair(model, ref, xs, gs, rank, world)
        assert within_bound(model.experts.weight.grad, ref.proj.weight.grad[rank:rank + 1], **RULE)
        assert within_bound(model.experts.bias_offset.grad, ref.proj.bias_offset.grad[rank:rank + 1], **RULE)
        _check_shared_grads(model, _sgu_as_smoe_names(ref))
    finally:
        _finish()


def _sgu_as_smoe_names(ref):
    """Expose the SGU's LayerNorm under the sMoE's parameter names for the shared-gradient check."""
    holder = torch.nn.Module()
    holder.norm = ref.norm
    return holder


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("split", [True, False])
def test_smoe_deterministic_matches_multihead_sgu(world, split, spawned, request):
    spawned.check(request.node.name)


def test_smoe_ranks_with_different_sequence_lengths(spawned, request):
    spawned.check(request.node.name)


# ---------------------------------------------------------------- tMoE


def check_tmoe_against_one_process(rank, world, router, E, tokens, chunks=1):
    """The expert-parallel tMoE (E experts over `world` ranks, tokens[r] rows on rank r; its exchanges
    overlapped in `chunks` chunks) equals its single-process twin with the same weights: outputs and
    every gradient. Returns the parallel layer."""
    cfg = TMoEConfig(d_model=8, d_ffn=16, num_experts=E, router=router, vocab_size=40, capacity_factor=1.5,
                     shuffle=False, zero_init_output=False)
    torch.manual_seed(0)
    ref = TMoE(cfg).train()
    model = TMoE(cfg, AllToAllDispatcher(E, chunks=chunks)).train()
    model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
    xs = _inputs(world, lambda r: (tokens[r], 8))
    gs = _inputs(world, lambda r: (tokens[r], 8), seed=200)
    g = torch.Generator().manual_seed(300)
    ids = [torch.randint(0, 40, (tokens[r],), generator=g) for r in range(world)]
    _run_pair(model, ref, xs, gs, rank, world, extra=ids)
    _check_expert_grads(model, ref, rank, world)
    _check_shared_grads(model, ref)
    return model


def _tmoe_worker(rank, world, init_file, router, experts_per_rank, tokens, chunks=1):
    _init(rank, world, init_file)
    try:
        E = world * experts_per_rank
        model = check_tmoe_against_one_process(rank, world, router, E, tokens, chunks)
        if router == "base":
            counts = model.load_E.tolist()
            assert sum(counts) == tokens[rank]
            assert max(counts) - min(counts) == (0 if tokens[rank] % E == 0 else 1), counts
            _check_eval_prices(model, rank, world, tokens)
    finally:
        _finish()


def _check_eval_prices(model, rank, world, tokens):
    """After one training step every rank holds the same evaluation prices: the mean of the ranks'
    balanced-assignment prices, weighted by their rows (each rank assigned its own rows: no shuffle)."""
    from smlp.routing.assignment import balanced_assignment
    from smlp.routing.logits import router_logits

    xs = _inputs(world, lambda r: (tokens[r], 8))
    prices = [balanced_assignment(router_logits(xs[r], model.router.centroids.detach().t()), with_prices=True)[1]
              for r in range(world)]
    expected = sum(p * n for p, n in zip(prices, tokens)) / sum(tokens)
    from smlp.routing.prices import fold_prices

    fold_prices(model)  # what the optimizer step does (over the default group: every rank holds the router)
    got = model.router.eval_prices.prices()
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    assert all(torch.equal(every[0], p) for p in every), every


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("experts_per_rank", [1, 2])
def test_base_tmoe_matches_single_process(world, experts_per_rank, spawned, request):
    spawned.check(request.node.name)


@pytest.mark.parametrize("router", ["switch", "gshard", "hash"])
def test_other_token_routers_match_single_process(router, spawned, request):
    spawned.check(request.node.name)


def test_token_counts_not_divisible_by_experts_do_not_hang(spawned, request):
    # 4 experts on 2 ranks; 7 and 13 tokens, one rank even fewer tokens than experts later (two cases)
    spawned.check(request.node.name)


# ---------------------------------------------------------------- the sparse block


def _block_worker(rank, world, init_file, routing, lengths=None, training=True, chunks=1, batch=2, smoe_experts=0):
    _init(rank, world, init_file)
    try:
        cfg = SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=2 * world, smoe_routing=routing,
                                base_shuffle=False, smoe_experts=smoe_experts)
        lengths = lengths or [20] * world
        torch.manual_seed(0)
        ref = SparseBlock(cfg).train(training)
        _randomize_spatial(ref)
        _randomize_expert_output(ref)
        model = SparseBlock(cfg, AllToAllDispatcher(2 * world, chunks=chunks)).train(training)
        if smoe_experts:  # the sMoE's own count: its own all2all dispatcher over the same group
            assert model.smoe.dispatcher.num_experts == smoe_experts != model.tmoe.dispatcher.num_experts
            assert model.smoe.experts.weight.shape[0] == smoe_experts // world
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        xs = _inputs(world, lambda r: (batch, lengths[r], 16))
        gs = _inputs(world, lambda r: (batch, lengths[r], 16), seed=200)
        _run_pair(model, ref, xs, gs, rank, world)
        _check_expert_grads(model, ref, rank, world)
        _check_shared_grads(model, ref)
    finally:
        _finish()


def _replicated_smoe_worker(rank, world, init_file, routing, smoe_experts=0):
    """The sMoE's replicated layout: every rank holds all N spatial experts (LocalDispatcher(N, replicated=True),
    not marked expert, so the data-parallel all-reduce averages their gradients) and the tMoE stays expert-
    parallel. Equal to the single-process block and to the all-expert-parallel block; the sMoE calls no
    collective. N: the tMoE's E, or the sMoE's own count (--smoe-experts)."""
    _init(rank, world, init_file)
    try:
        E = 2 * world
        N = smoe_experts or E
        cfg = SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=E, smoe_routing=routing,
                                base_shuffle=False, smoe_experts=smoe_experts)
        torch.manual_seed(0)
        ref = SparseBlock(cfg).train()
        _randomize_spatial(ref)
        _randomize_expert_output(ref)
        model = SparseBlock(cfg, AllToAllDispatcher(E), LocalDispatcher(N, replicated=True)).train()
        spread = SparseBlock(cfg, AllToAllDispatcher(E)).train()  # both layers expert-parallel
        assert not any(getattr(p, "expert", False) for p in model.smoe.parameters())
        assert expert_keys(model) == [k for k in expert_keys(ref) if k.startswith("tmoe.")]
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(model), rank, world))
        spread.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        xs = _inputs(world, lambda r: (2, 20, 16))
        gs = _inputs(world, lambda r: (2, 20, 16), seed=200)
        calls, real = [], dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            model.smoe(model.norm(xs[rank]))
        finally:
            dist.all_to_all_single = real
        assert not calls, f"the replicated sMoE exchanged {len(calls)} times"
        y = _run_pair(model, ref, xs, gs, rank, world)
        _check_expert_grads(model, ref, rank, world)
        _check_shared_grads(model, ref)  # the sMoE's spatial weights among them, summed over the ranks
        x = xs[rank].clone().requires_grad_(True)
        y_spread = spread(x)
        assert within_bound(y, y_spread.detach(), **RULE), "replicated and expert-parallel sMoE differ"
        y_spread.backward(gs[rank])
        for name in ("smoe.experts.weight", "smoe.experts.bias_offset"):
            mine = dict(model.named_parameters())[name].grad.clone()
            dist.all_reduce(mine)  # the data-parallel sum; the expert-parallel rank holds its experts' sum
            theirs = dict(spread.named_parameters())[name].grad
            local = N // world
            assert within_bound(mine[rank * local:(rank + 1) * local], theirs, **RULE), name
    finally:
        _finish()


def _randomize_expert_output(module, seed=1):
    """Base Layers' zero-initialised second projection would leave the first projection without gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("experts.w2"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_sparse_block_matches_single_process(routing, spawned, request):
    spawned.check(request.node.name)


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_replicated_smoe_with_expert_parallel_tmoe_matches_single_process(routing, spawned, request):
    """--smoe-parallel replicated: outputs and gradients equal the single-process block and the block with
    both layers expert-parallel; the sMoE runs no collective."""
    spawned.check(request.node.name)


@pytest.mark.parametrize("case", ["deterministic-expert-2", "deterministic-expert-8", "partial-expert-2",
                                  "deterministic-replicated-8", "partial-replicated-2"])
def test_smoe_experts_apart_from_the_tmoes_match_single_process(case, spawned, request):
    """--smoe-experts N apart from the tMoE's E = 4 on 2 ranks: the sMoE spread over the group (its own all2all
    dispatcher, N / 2 experts a rank) or replicated (all N on every rank), outputs and every gradient equal to
    the single-process block with the same weights."""
    spawned.check(request.node.name)


@pytest.mark.parametrize("case", ["smlp-deterministic", "smlp-partial-uneven", "smlp-one-sequence", "base-2-local",
                                  "gshard"])
def test_overlapped_exchanges_match_single_process(case, spawned, request):
    """Rows in 2 chunks, each chunk's all2all overlapped with the other's experts (async collectives): the
    sparse block (both sMoE routings; a rank with one sequence, so one of its chunks is empty) and tMoEs
    (2 local experts per rank, GShard's two slots per token) equal their single-process twins."""
    spawned.check(request.node.name)


@pytest.mark.parametrize("lengths", [[20, 9], [20, 3]], ids=["different-lengths", "one-rank-within-prefix"])
def test_partial_routing_with_uneven_sequences_matches_single_process(lengths, spawned, request):
    """Partial prediction (prefix 4 of T=20) where ranks hold sequences of different lengths, and where one
    rank's sequences are no longer than the routing prefix (it predicts nothing but joins every exchange)."""
    spawned.check(request.node.name)


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_sparse_block_eval_outputs_equal_one_process(routing, spawned, request):
    """Inference routing is per row (argmax), so 2 ranks give what one process gives on each rank's input."""
    spawned.check(request.node.name)


# ---------------------------------------------------------------- activation checkpointing


def _recompute_worker(rank, world, init_file, kind, dtype_name):
    """A sparse block with its activations recomputed in backward (smlp/recompute.py) against the same block
    without: the same outputs and gradients bit for bit, and not one all2all more, forward or backward."""
    from smlp.transformer import TransformerBlock

    _init(rank, world, init_file)
    try:
        dtype = getattr(torch, dtype_name)
        E = 2 * world

        def build(recompute):
            torch.manual_seed(0)
            if kind == "base":
                block = TransformerBlock(16, 24, 2, dropout=0.1, moe=TMoEConfig(d_model=16, d_ffn=24, num_experts=E),
                                         dispatcher=AllToAllDispatcher(E))
            else:  # "partial", "deterministic", "deterministic-overlapped" (2 chunks, exchanges beside experts)
                cfg = SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=E,
                                        smoe_routing=kind.split("-")[0], dropout=0.1)
                block = SparseBlock(cfg, AllToAllDispatcher(E, chunks=2 if kind.endswith("overlapped") else 1))
            _randomize_expert_output(block)
            for m in block.modules():
                if hasattr(m, "recompute"):
                    m.recompute = recompute
            return block.to(dtype).train()

        x = _inputs(world, lambda r: (3, 20, 16))[rank].to(dtype)
        g = _inputs(world, lambda r: (3, 20, 16), seed=200)[rank].to(dtype)
        results = []
        for block in (build(False), build(True)):
            calls, real = {"forward": 0, "backward": 0, "experts": 0}, dist.all_to_all_single
            phase = ["forward"]
            experts = next(m for n, m in block.named_modules() if n.endswith(("tmoe.experts", "ffn.experts")))

            def count_experts(*a, calls=calls, forward=experts.forward, **k):
                calls["experts"] += 1
                return forward(*a, **k)

            experts.forward = count_experts

            def counted(*a, calls=calls, phase=phase, real=real, **k):
                calls[phase[0]] += 1
                return real(*a, **k)

            dist.all_to_all_single = counted
            try:
                torch.manual_seed(10 + rank)  # dropout, Base Layers' shuffle
                xi = x.clone().requires_grad_(True)
                y = block(xi)
                phase[0] = "backward"
                y.backward(g)
            finally:
                dist.all_to_all_single = real
            grads = {n: p.grad for n, p in block.named_parameters()}
            results.append((y.detach(), xi.grad, grads, calls))
        (y0, gx0, g0, c0), (y1, gx1, g1, c1) = results
        assert c1["experts"] == 2 * c0["experts"] > 0, (c0, c1)  # the experts ran again in backward
        c0.pop("experts"), c1.pop("experts")
        assert c0 == c1 and c0["forward"] > 0 and c0["backward"] > 0, (c0, c1)
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
        assert all(g0[n] is not None for n in g0), [n for n in g0 if g0[n] is None]
        assert not [n for n in g0 if not torch.equal(g0[n], g1[n])]
    finally:
        _finish()


@pytest.mark.parametrize("kind", ["deterministic", "partial", "base", "deterministic-overlapped"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recompute_repeats_no_exchange(kind, dtype, spawned, request):
    """--checkpoint-activations on 2 ranks: the sMLP sparse block (both sMoE routings, and with its exchanges
    in 2 chunks beside its experts) and a Base Layers Transformer block recompute their experts and attention in
    backward without one all2all more, and give the plain block's outputs and gradients bit for bit, in fp32 and
    bf16."""
    spawned.check(request.node.name)


# ---------------------------------------------------------------- Base Layers' token shuffle


def _shuffle_worker(rank, world, init_file, tokens):
    """Shuffle on: each rank's rows are balanced together with the rows the shuffle sends it.

    Only the routing scores travel through the shuffle; the tokens go from home to their expert and
    back. The reference is what fairseq computes: it rebuilds every rank's permutation (the same seeded
    global-RNG draw as fairseq's torch.randperm), runs the single-process layer on each receiving rank's
    group of rows and scatters the results back: outputs, input gradients and every parameter gradient agree.
    """
    _init(rank, world, init_file)
    try:
        E = 2 * world
        cfg = TMoEConfig(d_model=8, d_ffn=16, num_experts=E, router="base")
        assert cfg.uses_shuffle
        torch.manual_seed(0)
        ref = TMoE(cfg).train()
        _randomize_expert_output(ref)
        model = TMoE(cfg, AllToAllDispatcher(E)).train()
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        xs = _inputs(world, lambda r: (tokens[r], 8))
        gs = _inputs(world, lambda r: (tokens[r], 8), seed=200)
        x = xs[rank].clone().requires_grad_(True)
        torch.manual_seed(1000 + rank)
        y = model(x)
        y.backward(gs[rank])

        from smlp.dispatch import shuffle_splits
        xs_ref = [xr.clone().requires_grad_(True) for xr in xs]
        pieces = {}  # (source rank, destination rank) -> row indices of the source's input
        for r in range(world):
            torch.manual_seed(1000 + r)
            order = torch.randperm(tokens[r])
            for w, rows in enumerate(torch.split(order, shuffle_splits(tokens[r], world))):
                pieces[r, w] = rows
        ys_ref = [torch.zeros_like(xr) for xr in xs]
        for w in range(world):
            group = torch.cat([xs_ref[r][pieces[r, w]] for r in range(world)])
            out = ref.eval().train()(group)  # train mode, one process: no shuffle, balanced over this group
            start = 0
            for r in range(world):
                n = len(pieces[r, w])
                ys_ref[r] = ys_ref[r].index_add(0, pieces[r, w], out[start:start + n])
                start += n
        sum((yr * gr).sum() for yr, gr in zip(ys_ref, gs)).backward()
        assert within_bound(y, ys_ref[rank], **RULE), "forward differs from the regrouped single-process layer"
        assert within_bound(x.grad, xs_ref[rank].grad, **RULE), "input gradient differs"
        _check_expert_grads(model, ref, rank, world)
        _check_shared_grads(model, ref)
        # the tokens are routed from home (only their scores were shuffled): this rank's load counts its own
        # tokens, and summed over the ranks every expert got exactly what balanced assignment gives each
        # shuffled group (every expert S_w // E of a group of S_w rows, one more for the first S_w % E)
        load = model.load_E.clone()
        assert int(load.sum()) == tokens[rank]
        dist.all_reduce(load)
        received = [sum(len(pieces[r, w]) for r in range(world)) for w in range(world)]
        assert load.tolist() == [sum(n // E + (e < n % E) for n in received) for e in range(E)]
    finally:
        _finish()


@pytest.mark.parametrize("tokens", [[16, 16], [7, 13]], ids=["even", "uneven"])
def test_base_shuffle_equals_single_process_on_the_shuffled_groups(tokens, spawned, request):
    spawned.check(request.node.name)


# ---------------------------------------------------------------- fairseq's own BaseLayer


class _SameAssignment:
    """fairseq's libbase interface over our auction: tokens ordered by expert, equal counts."""

    @staticmethod
    def balanced_assignment(scores):
        from smlp.routing.assignment import balanced_assignment

        return torch.argsort(balanced_assignment(scores), stable=True)


def _fairseq_base_worker(rank, world, init_file, shuffle, assignment):
    """Our Base Layers tMoE == fairseq.modules.base_layer.BaseLayer with the same weights (2 gloo ranks).

    fairseq's layer returns x + alpha * FFN(LN x) (its residual is inside); ours returns the branch.
    assignment: "ours" runs fairseq's layer with our auction (any scores); "libbase" keeps fairseq's
    C++ auction and uses scores whose balanced optimum is unique, so both auctions must find it.
    """
    _init(rank, world, init_file)
    try:
        from argparse import Namespace

        from fairseq.distributed import utils as fairseq_dist
        from fairseq.modules.base_layer import BaseLayer

        D, Fw, S = 8, 16, 16
        torch.manual_seed(0)
        theirs = BaseLayer(Namespace(decoder_embed_dim=D, decoder_ffn_embed_dim=Fw, base_sublayers=1,
                                     base_shuffle=shuffle, activation_fn="gelu"))
        if assignment == "ours":
            theirs.cpp = _SameAssignment()
        cfg = TMoEConfig(d_model=D, d_ffn=Fw, num_experts=world, router="base", shuffle=bool(shuffle))
        ours = TMoE(cfg, AllToAllDispatcher(world)).train()
        assert torch.count_nonzero(ours.experts.w2) == 0
        assert torch.count_nonzero(theirs.expert_network[0].ff2.weight) == 0
        # the same weights everywhere (the centroids are shared, each rank's expert is its own)
        g = torch.Generator().manual_seed(7)
        centroids = torch.linalg.qr(torch.randn(D, world, generator=g))[0].t() * 3.0
        experts = [dict(w1=torch.randn(Fw, D, generator=g) * 0.3, b1=torch.randn(Fw, generator=g) * 0.1,
                        w2=torch.randn(D, Fw, generator=g) * 0.3, b2=torch.randn(D, generator=g) * 0.1,
                        nw=1 + 0.1 * torch.randn(D, generator=g), nb=0.1 * torch.randn(D, generator=g))
                   for _ in range(world)]
        mine = experts[rank]
        sub = theirs.expert_network[0]
        with torch.no_grad():
            theirs.expert_centroids.copy_(centroids)
            ours.router.centroids.copy_(centroids)
            sub.ff1.weight.copy_(mine["w1"]), sub.ff1.bias.copy_(mine["b1"])
            sub.ff2.weight.copy_(mine["w2"]), sub.ff2.bias.copy_(mine["b2"])
            sub.norm.weight.copy_(mine["nw"]), sub.norm.bias.copy_(mine["nb"])
            ours.experts.w1.copy_(mine["w1"].t()[None]), ours.experts.b1.copy_(mine["b1"][None])
            ours.experts.w2.copy_(mine["w2"].t()[None]), ours.experts.b2.copy_(mine["b2"][None])
            ours.experts.norm_weight.copy_(mine["nw"][None]), ours.experts.norm_bias.copy_(mine["nb"][None])
        gx = torch.Generator().manual_seed(100 + rank)
        if assignment == "libbase":
            # half the tokens close to each centroid: the balanced optimum is unique and far from ties
            want = torch.arange(S) % world
            x = centroids[want] / 3.0 * 2.0 + 0.05 * torch.randn(S, D, generator=gx)
        else:
            x = torch.randn(S, D, generator=gx)
        grad = torch.randn(S, D, generator=gx)
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        torch.manual_seed(55 + rank)  # the same shuffle permutation for both layers
        y_theirs, _, _ = theirs(x1)
        torch.manual_seed(55 + rank)
        y_ours = x2 + ours(x2)
        y_theirs.backward(grad)
        y_ours.backward(grad)
        assert_orders_agree(y_ours, y_theirs, **RULE)
        assert_orders_agree(x2.grad, x1.grad, **RULE)
        pairs = [(ours.experts.w1.grad[0], sub.ff1.weight.grad.t()), (ours.experts.b1.grad[0], sub.ff1.bias.grad),
                 (ours.experts.w2.grad[0], sub.ff2.weight.grad.t()), (ours.experts.b2.grad[0], sub.ff2.bias.grad),
                 (ours.experts.norm_weight.grad[0], sub.norm.weight.grad),
                 (ours.experts.norm_bias.grad[0], sub.norm.bias.grad)]
        for a, b in pairs:
            assert_orders_agree(a, b, **RULE)
        # centroids are shared parameters: their gradients agree once summed over the ranks
        c_ours, c_theirs = ours.router.centroids.grad.clone(), theirs.expert_centroids.grad.clone()
        dist.all_reduce(c_ours), dist.all_reduce(c_theirs)
        assert_orders_agree(c_ours, c_theirs, **RULE)
        # at evaluation fairseq's layer routes greedily: so does ours with --balanced-eval-routing greedy
        x_eval = torch.randn(S, D, generator=gx)
        theirs.eval(), ours.eval()
        with torch.no_grad():
            y_theirs, _, _ = theirs(x_eval)
            with flag_set(ours, "route_greedily"):
                y_ours = x_eval + ours(x_eval)
        assert_orders_agree(y_ours, y_theirs, **RULE)
        if hasattr(fairseq_dist.get_global_group, "_global_group"):
            del fairseq_dist.get_global_group._global_group
    finally:
        _finish()


@pytest.mark.parametrize("shuffle, assignment", [(0, "ours"), (1, "ours"), (0, "libbase")],
                         ids=["no-shuffle", "same-shuffle", "libbase-unique-optimum"])
def test_base_layer_equals_fairseq_base_layer(shuffle, assignment, spawned, request):
    spawned.check(request.node.name)


# ---------------------------------------------------------------- every case of a world size in one spawn


def _case_table() -> dict[str, list[tuple[int, object, tuple]]]:
    """test name (as pytest names it) -> its cases: [(world, worker, worker args)]."""
    t = {}
    for world in (2, 4):
        for split in (True, False):
            t[f"test_smoe_deterministic_matches_multihead_sgu[{split}-{world}]"] = [
                (world, _smoe_worker, (split, [12] * world))]
        for experts_per_rank in (1, 2):
            E = world * experts_per_rank
            t[f"test_base_tmoe_matches_single_process[{experts_per_rank}-{world}]"] = [
                (world, _tmoe_worker, ("base", experts_per_rank, [4 * E] * world))]
    t["test_smoe_ranks_with_different_sequence_lengths"] = [(2, _smoe_worker, (True, [12, 7]))]
    for router in ("switch", "gshard", "hash"):
        t[f"test_other_token_routers_match_single_process[{router}]"] = [(2, _tmoe_worker, (router, 2, [16, 24]))]
    t["test_token_counts_not_divisible_by_experts_do_not_hang"] = [(2, _tmoe_worker, ("base", 2, [7, 13])),
                                                                   (2, _tmoe_worker, ("base", 2, [3, 9]))]
    for routing in ("deterministic", "partial"):
        t[f"test_sparse_block_matches_single_process[{routing}]"] = [(2, _block_worker, (routing,))]
        t[f"test_sparse_block_eval_outputs_equal_one_process[{routing}]"] = [
            (2, _block_worker, (routing, [20, 11], False))]
    for routing in ("deterministic", "partial"):
        t[f"test_replicated_smoe_with_expert_parallel_tmoe_matches_single_process[{routing}]"] = [
            (2, _replicated_smoe_worker, (routing,))]
    for routing, layout, N in (("deterministic", "expert", 2), ("deterministic", "expert", 8),
                               ("partial", "expert", 2), ("deterministic", "replicated", 8),
                               ("partial", "replicated", 2)):
        fn, args = ((_block_worker, (routing, None, True, 1, 2, N)) if layout == "expert" else
                    (_replicated_smoe_worker, (routing, N)))
        t[f"test_smoe_experts_apart_from_the_tmoes_match_single_process[{routing}-{layout}-{N}]"] = [(2, fn, args)]
    overlapped = {"smlp-deterministic": (_block_worker, ("deterministic", None, True, 2, 3)),
                  "smlp-partial-uneven": (_block_worker, ("partial", [20, 9], True, 2, 3)),
                  "smlp-one-sequence": (_block_worker, ("deterministic", None, True, 2, 1)),
                  "base-2-local": (_tmoe_worker, ("base", 2, [16, 12], 2)),
                  "gshard": (_tmoe_worker, ("gshard", 2, [16, 24], 2))}
    for name, (fn, args) in overlapped.items():
        t[f"test_overlapped_exchanges_match_single_process[{name}]"] = [(2, fn, args)]
    for name, lengths in (("different-lengths", [20, 9]), ("one-rank-within-prefix", [20, 3])):
        t[f"test_partial_routing_with_uneven_sequences_matches_single_process[{name}]"] = [
            (2, _block_worker, ("partial", lengths))]
    for kind in ("deterministic", "partial", "base", "deterministic-overlapped"):
        for dtype in ("float32", "bfloat16"):
            t[f"test_recompute_repeats_no_exchange[{dtype}-{kind}]"] = [(2, _recompute_worker, (kind, dtype))]
    for name, tokens in (("even", [16, 16]), ("uneven", [7, 13])):
        t[f"test_base_shuffle_equals_single_process_on_the_shuffled_groups[{name}]"] = [
            (2, _shuffle_worker, (tokens,))]
    for name, shuffle, assignment in (("no-shuffle", 0, "ours"), ("same-shuffle", 1, "ours"),
                                      ("libbase-unique-optimum", 0, "libbase")):
        t[f"test_base_layer_equals_fairseq_base_layer[{name}]"] = [(2, _fairseq_base_worker, (shuffle, assignment))]
    return t


class Spawned:
    """Runs the cases of the selected tests, one spawn per world size (on first use), and reports each."""

    def __init__(self, selected: list[str]):
        table = _case_table()
        missing = [name for name in selected if name not in table]
        assert not missing, f"tests without a case in _case_table: {missing}"
        self.cases = {name: table[name] for name in selected}
        self.outcome: dict[str, str | None] = {}

    def check(self, name: str) -> None:
        worlds = {world for world, _, _ in self.cases[name]}
        for world in sorted(worlds - {w for w, _ in self.outcome}):
            cases = [(f"{test}#{k}", fn, args) for test, cs in self.cases.items()
                     for k, (w, fn, args) in enumerate(cs) if w == world]
            self.outcome.update({(world, cid): err for cid, err in run_cases(world, cases).items()})
        mine = {cid: err for (w, cid), err in self.outcome.items() if cid.split("#")[0] == name}
        assert len(mine) == len(self.cases[name]), (name, sorted(mine))  # every case of the test ran
        errors = [f"{cid}: {err}" for cid, err in mine.items() if err]
        if errors:
            pytest.fail("\n".join(errors), pytrace=False)


@pytest.fixture(scope="module")
def spawned(request) -> Spawned:
    here = request.node.path
    return Spawned([item.name for item in request.session.items
                    if item.path == here and "spawned" in getattr(item, "fixturenames", ())])


def test_planted_error_fails_the_rule_of_this_file():
    """RULE catches a real difference at this file's sizes: the sMoE twin (one process, LocalDispatcher)
    against the multi-head SGU with one head's spatial weights off by 1e-3 of themselves."""
    torch.manual_seed(0)
    ref = SpatialGatingUnit(SGUConfig(dim=16, seq_len=12, heads=2, split=True))
    _randomize_spatial(ref)
    model = SMoE(SMoEConfig(dim=16, seq_len=12, num_experts=2, split=True))
    with torch.no_grad():
        model.norm.load_state_dict(ref.norm.state_dict())
        model.experts.weight.copy_(ref.proj.weight)
        model.experts.bias_offset.copy_(ref.proj.bias_offset)
    x = torch.randn(3, 12, 16)
    assert within_bound(model(x), ref(x), **RULE)
    with torch.no_grad():
        ref.proj.weight[1].mul_(1 + 1e-3)
    assert not within_bound(model(x), ref(x), **RULE)
