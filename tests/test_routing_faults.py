"""Routing never hangs or silently drops (issue 14).

- Non-finite router scores (NaN, +-inf) raise NonFiniteScoresError naming the layer, for every
  router, in training and at inference; on 2 ranks a fault one rank sees (those scores, or a token
  id outside the HASH table) reaches the other in the count exchange, and both raise the same
  error within seconds instead of one waiting in the all2all until the collective timeout.
- Degenerate but finite scores (all equal, one expert preferred by every token) are still assigned
  with exact balance by Base Layers, at any token count, and the auction ends within its round
  budget on adversarial scores (smlp/routing/assignment.py is tested from outside here).
- A rank with zero tokens, and token counts divisible by neither ranks nor experts, give exactly the
  single-process layer's outputs and gradients on 2 gloo ranks (the reference of test_distributed.py).
"""
from __future__ import annotations

import multiprocessing as std_mp
import os
import queue
import re
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from smlp.config import SparseBlockConfig, TMoEConfig
from smlp.dispatch import AllToAllDispatcher
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import SparseBlock, TMoE
from smlp.resharding import expert_keys, slice_expert_shard
from smlp.routing import NonFiniteScoresError
from smlp.routing.assignment import balanced_assignment, expert_capacities

# ---------------------------------------------------------------- non-finite scores


def _router_weight(module) -> torch.Tensor:
    router = module.router
    if isinstance(router, torch.nn.Parameter):  # the sMoE's router weight
        return router
    return router.centroids if hasattr(router, "centroids") else router.gate.weight  # a tMoE's router module


CASES = [("transformer", "base", "deterministic"), ("transformer", "switch", "deterministic"),
         ("transformer", "gshard", "deterministic"), ("smlp", "base", "partial")]


@pytest.mark.parametrize("family, router, routing", CASES, ids=["base", "switch", "gshard", "smlp-partial"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_router_scores_raise_naming_the_layer(family, router, routing, training, value):
    torch.manual_seed(0)
    cfg = LMConfig(family=family, vocab_size=50, d_model=16, d_ffn=32, seq_len=20, dense_layers=2,
                   sparse_layers=2, heads=2, num_experts=4, moe_router=router, smoe_routing=routing)
    model = LanguageModel(cfg).train(training)
    tokens = torch.randint(2, 50, (2, 20))
    model(tokens)  # finite weights: fine
    routed = [(n, m) for n, m in model.moe_modules() if router != "base" or family == "transformer"
              or hasattr(m, "router")]
    name, module = routed[-1]  # the last routed layer: every earlier layer ran fine
    with torch.no_grad():
        _router_weight(module)[0, 0] = value
    with pytest.raises(NonFiniteScoresError) as err:
        model(tokens)
    message = str(err.value)
    assert message.startswith(f"{name} ({type(module).__name__})"), message
    assert re.search(r"not finite in \d+ of \d+ rows", message) and "learning rate" in message, message


def test_gates_accept_minus_inf_as_a_mask_but_not_a_row_without_any_expert():
    from smlp.routing.gates import gshard_top2, switch_top1

    logits = torch.randn(6, 4)
    logits[:, 3] = float("-inf")  # expert 3 masked for every row: allowed
    assert (switch_top1(logits, training=False).experts_SK != 3).all()
    assert (gshard_top2(logits, training=False).experts_SK != 3).all()
    logits[2] = float("-inf")
    for gate in (switch_top1, gshard_top2):
        with pytest.raises(NonFiniteScoresError, match=r"layer x: .* 1 of 6 rows \(first: row 2"):
            gate(logits, training=True, layer="layer x")


def _fault_cases(rank):
    """(name, layer, inputs of this rank, rank that gets the fault): one forward each."""
    from smlp.config import SparseBlockConfig

    torch.manual_seed(0)
    cases = []
    for router, shuffle, faulty in (("base", False, 0), ("base", True, 1), ("switch", False, 1), ("gshard", False, 0),
                                    ("hash", False, 0)):
        layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=2, router=router, shuffle=shuffle, vocab_size=20),
                     AllToAllDispatcher(2)).train()
        layer.layer_name = "layers.1.moe (TMoE)"
        x, ids = torch.randn(10, 8), torch.randint(0, 20, (10,))
        if rank == faulty:
            if router == "hash":
                ids[2] = 25
            else:
                x[3, 0] = float("nan")
        cases.append((f"{router}{'-shuffle' if shuffle else ''}", layer, (x, ids), faulty))
    block = SparseBlock(SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=2, smoe_routing="partial",
                                          base_shuffle=False), AllToAllDispatcher(2)).train()
    block.smoe.layer_name = "layers.2.smoe (SMoE)"
    x = torch.randn(2, 17, 16)
    if rank == 1:
        x[0, 1] = float("nan")  # inside the routing prefix: the router's logits of sequence 0
    cases.append(("smoe-partial", block, (x,), 1))
    # cached decoding (issue 28): the same fault in the step that completes the routing prefix; before, the
    # faulty rank raised at once while its peer waited in the step's exchanges
    step_block = SparseBlock(SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=2,
                                               smoe_routing="partial"), AllToAllDispatcher(2)).eval()
    step_block.smoe.layer_name = "layers.2.smoe (SMoE)"
    cases.append(("smoe-partial-step", _WholeSequenceStep(step_block), (x,), 1))
    return cases


class _WholeSequenceStep:
    """A cached decoding step over the whole sequence, from an empty cache at every call."""

    def __init__(self, block):
        self.block = block

    def __call__(self, x):
        with torch.no_grad():
            return self.block.step(x, {}, 0)


def _faults_on_one_rank(rank, world, init_file, results):
    torch.set_num_threads(1)
    start = time.monotonic()
    report = {}
    try:
        # the project's default collective timeout: a rank left waiting would block 600 s
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        for name, layer, inputs, _ in _fault_cases(rank):
            clean = tuple(t.nan_to_num(0.0).clamp(max=19) if t.is_floating_point() else t.clamp(max=19)
                          for t in inputs)
            layer(*clean)  # one good step on both ranks
            t0 = time.monotonic()
            try:
                layer(*inputs)
                report[name] = ("finished", "", time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                report[name] = (type(exc).__name__, str(exc)[:600], time.monotonic() - t0)
        # the group is still in step after the errors: a clean step with timing asked for
        layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=2, router="base"), AllToAllDispatcher(2)).train()
        layer.dispatcher.timer.enabled = True
        y = layer(torch.randn(10, 8))
        y.sum().backward()
        report["after"] = ("finished", f"{layer.comm_seconds:.6f} {len(layer.comm_time.records)}", 0.0)
        dist.barrier()
        results.put((rank, report, time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001
        results.put((rank, {"setup": (type(exc).__name__, str(exc)[:600], 0.0)}, time.monotonic() - start))
    finally:
        results.close()
        results.join_thread()  # flush the report before leaving
        os._exit(0)  # no destroy_process_group: the peer may be gone


@pytest.mark.slow
def test_nan_on_one_rank_raises_there_and_its_peer_does_not_hang():
    """A fault seen by one rank (NaN or inf router scores, a token id outside the HASH table) reaches
    every rank in the count exchange: both raise the same error, naming the layer and the rank, within
    seconds, and the process group stays usable."""
    ctx = std_mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_faults_on_one_rank, args=(r, 2, os.path.join(tmp, "rdv"), results))
                 for r in range(2)]
        for p in procs:
            p.start()
        reports = {}
        try:
            for _ in range(2):
                rank, report, took = results.get(timeout=120)
                reports[rank] = report
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert set(reports) == {0, 1}, reports
    got = {rank: reports[rank]["base"] for rank in (0, 1)}
    assert got.get(0, ("",))[0] == "NonFiniteScoresError", got
    assert got[0][1].startswith("layers.1.moe (TMoE): router scores are not finite in 1 of"), got
    assert 1 in got and got[1][0] != "finished", got  # the peer's exchange failed instead of completing
    assert got[1][2] < 60, got
    expected = {"base": ("NonFiniteScoresError", 0), "base-shuffle": ("NonFiniteScoresError", None),
                "switch": ("NonFiniteScoresError", 1), "gshard": ("NonFiniteScoresError", 0),
                "hash": ("ValueError", 0), "smoe-partial": ("NonFiniteScoresError", 1),
                "smoe-partial-step": ("NonFiniteScoresError", 1)}
    for case, (kind, seen) in expected.items():
        (kind0, message0, took0), (kind1, message1, took1) = reports[0][case], reports[1][case]
        assert kind0 == kind1 == kind and message0 == message1, (case, reports[0][case], reports[1][case])
        assert took0 < 10 and took1 < 10, (case, took0, took1)  # not the 600 s collective timeout
        layer = "layers.2.smoe (SMoE)" if case.startswith("smoe-partial") else "layers.1.moe (TMoE)"
        assert message0.startswith(f"{layer}: "), message0
        assert "every rank of the expert-parallel group raises this error" in message0, message0
        if seen is not None:  # with the shuffle the NaN row travels to a random rank
            assert f"[seen on rank {seen};" in message0, message0
    assert "hash routing got token ids in [" in reports[0]["hash"][1] and ", 25]" in reports[0]["hash"][1]
    for rank in (0, 1):
        kind, timing, _ = reports[rank]["after"]
        seconds, records = timing.split()
        assert kind == "finished" and float(seconds) > 0 and int(records) == 4  # shuffle, dispatch, combine, unshuffle


# ---------------------------------------------------------------- degenerate scores, bounded auction


@pytest.mark.parametrize("tokens", [64, 61, 3, 1], ids=["divisible", "not-divisible", "fewer-than-experts", "one"])
@pytest.mark.parametrize("kind", ["all-equal", "one-expert-dominates", "huge", "ties-in-two-groups"])
def test_base_layers_balance_degenerate_scores_exactly(tokens, kind):
    E, D = 4, 8
    layer = TMoE(TMoEConfig(d_model=D, d_ffn=16, num_experts=E, router="base")).train()
    x = torch.randn(tokens, D)
    with torch.no_grad():
        if kind == "all-equal":
            layer.router.centroids.zero_()
        elif kind == "one-expert-dominates":
            layer.router.centroids.zero_()
            layer.router.centroids[2] = 1e4
            x = x.abs() + 1.0  # every token prefers expert 2 by far
        elif kind == "huge":
            layer.router.centroids.mul_(1e30)
        else:
            layer.router.centroids.zero_()
            layer.router.centroids[:2] = 1.0
    layer(x)
    assert layer.load_E.tolist() == expert_capacities(tokens, E).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["price-war", "near-ties", "one-hot-columns"])
def test_auction_ends_within_its_round_budget_on_adversarial_scores(kind):
    """Scores that make auctions slow (everyone wants the same expert by tiny margins) still end,
    exactly balanced, and a round budget of 1 is honoured (the remaining rows fill free capacity)."""
    g = torch.Generator().manual_seed(0)
    S, E = 8192, 64
    if kind == "price-war":
        scores = torch.linspace(0, 1e-6, E).expand(S, E) + 1e-9 * torch.randn(S, E, generator=g)
    elif kind == "near-ties":
        scores = torch.ones(S, E) + 1e-7 * torch.randint(0, 2, (S, E), generator=g)
    else:
        scores = torch.zeros(S, E)
        scores[:, 0] = 1e6
    cap = expert_capacities(S, E).tolist()
    t0 = time.perf_counter()
    expert = balanced_assignment(scores)
    full = time.perf_counter() - t0
    assert torch.bincount(expert, minlength=E).tolist() == cap
    t0 = time.perf_counter()
    expert1 = balanced_assignment(scores, max_rounds=1)
    one_round = time.perf_counter() - t0
    assert torch.bincount(expert1, minlength=E).tolist() == cap
    assert one_round < max(2.0, full), (one_round, full)


# ---------------------------------------------------------------- zero tokens on a rank (2 gloo ranks)


def _zero_token_cases(rank, world, init_file):
    """Every case in one process group (spawning ranks costs far more than the cases)."""
    from test_distributed import (
        _check_expert_grads,
        _check_shared_grads,
        _finish,
        _init,
        _inputs,
        _randomize_spatial,
        _run_pair,
        _shuffle_worker,
        check_tmoe_against_one_process,
    )

    _init(rank, world, init_file)
    try:
        tokens = [0, 13]  # rank 0 holds no token; 13 is divisible by neither 2 ranks nor 4 experts
        for router in ("base", "switch", "gshard", "hash"):
            model = check_tmoe_against_one_process(rank, world, router, 4, tokens)
            if router in ("base", "hash"):  # no capacity: every token is routed
                assert sum(model.load_E.tolist()) == tokens[rank]
        for routing in ("deterministic", "partial"):
            cfg = SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=4, smoe_routing=routing,
                                    base_shuffle=False)
            torch.manual_seed(0)
            ref = SparseBlock(cfg).train()
            _randomize_spatial(ref)
            model = SparseBlock(cfg, AllToAllDispatcher(4)).train()
            model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
            batches = [0, 3]  # rank 0 holds no sequence at all
            xs = _inputs(world, lambda r, b=batches: (b[r], 17, 16))  # called here, in this iteration
            gs = _inputs(world, lambda r, b=batches: (b[r], 17, 16), seed=200)
            _run_pair(model, ref, xs, gs, rank, world)
            _check_expert_grads(model, ref, rank, world)
            _check_shared_grads(model, ref)
        dist.barrier()
    finally:
        _finish()
    _shuffle_worker(rank, world, init_file + "-shuffle", [0, 9])  # Base Layers' token shuffle, own group


@pytest.mark.slow
def test_a_rank_with_zero_tokens_matches_the_single_process_layer():
    """Every token router, the token shuffle and both sMoE routings, with rank 0 empty."""
    from test_distributed import run_workers

    run_workers(_zero_token_cases, 2)
