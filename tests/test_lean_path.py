"""The tMoE's lean path (issue 53): the same training step, bit for bit, with fewer operators.

- The rows' moves (to the experts' order and back, on both sides of the all2all) are one permutation function
  (row_moves.permute_rows / unpermute_rows) whose backward gathers with the inverse permutation, each inverse made
  once; the regroup by local expert is one stable sort. Kept here as plain reference functions, the former forms:
  indexing (whose backward is a zero fill and an accumulating scatter), the inverse made at each way back, the
  regroup by block arithmetic, and the shuffle's split sizes exchanged by the first layer that shuffles.
- Unit checks: a permutation and its inverse round-trip, their backward equals indexing's, and the regroup is the
  former block transpose for any counts (zeros included).
- A training step (loss, logits, every gradient) of sMLP-det, Base Layers, Switch, GShard and HASH on 1 process and
  on 2 gloo ranks (two local experts per rank, so the regroup runs; uneven batches; Switch and GShard drop slots;
  Base Layers also with its exchanges in 2 overlapped chunks) equals the step with the former forms bit for bit
  (torch.equal), with fewer operators forward and backward.
- On 2 ranks the shuffle's split sizes are the forward's first exchange, begun without waiting (async_op), and a
  step makes as many exchanges as before.
- The balanced assignment's auction has a profiler range of its own, inside the routing range.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from smlp import dispatch
from smlp.config import TMoEConfig
from smlp.dispatch import AllToAllDispatcher
from smlp.lm import LanguageModel
from smlp.moe import TMoE
from smlp.profiling import RANGES, breakdown, routing_and_all2all
from smlp.row_moves import RowPermutation, permute_rows, unpermute_rows
from tiny_steps import PlainOpCount, tiny_config

TMOE_FAMILIES = ("sMLP-det", "Base", "Switch", "GShard", "HASH")

# ---------------------------------------------------------------- the former forms, as references


def _former_permute(x, perm):
    return x if perm is None else x[perm.order_S]


def _former_unpermute(y, perm):
    if perm is None:
        return y
    inverse = torch.empty_like(perm.order_S)
    inverse[perm.order_S] = torch.arange(perm.order_S.numel(), device=perm.order_S.device)
    return y[inverse]


def _former_block_transpose(counts_WL, num_rows):
    W, L = counts_WL.shape
    flat = counts_WL.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    counts_LW = counts_WL.t().reshape(-1)
    out_starts = torch.cumsum(counts_LW, 0) - counts_LW
    block_R = torch.repeat_interleave(torch.arange(L * W, device=flat.device), counts_LW, output_size=num_rows)
    offset_R = torch.arange(num_rows, device=flat.device) - out_starts[block_R]
    l_R, w_R = block_R // W, block_R % W
    return starts[w_R * L + l_R] + offset_R


def _former_regroup(self, recv_dev_WL, num_rows, device):
    if self.num_local_experts == 1:
        return None
    return RowPermutation(_former_block_transpose(recv_dev_WL.to(device), num_rows))


@contextlib.contextmanager
def former_path():
    """Within the block the dispatchers move rows as before issue 53."""
    with mock.patch.object(dispatch, "permute_rows", _former_permute), \
            mock.patch.object(dispatch, "unpermute_rows", _former_unpermute), \
            mock.patch.object(AllToAllDispatcher, "_regroup", _former_regroup), \
            mock.patch.object(LanguageModel, "_prepare_exchanges", lambda self, rows: None):
        yield


# ---------------------------------------------------------------- the permutations


def test_a_permutation_round_trips_and_its_backward_is_indexing_s():
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(11, generator=g)
    x = torch.randn(11, 3, generator=g)
    grad = torch.randn(11, 3, generator=g)
    for move, former in ((permute_rows, _former_permute), (unpermute_rows, _former_unpermute)):
        perm = RowPermutation(order)
        outs = []
        for fn in (move, former):
            xi = x.clone().requires_grad_()
            y = fn(xi, perm)
            y.backward(grad)
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    perm = RowPermutation(order)
    assert torch.equal(unpermute_rows(permute_rows(x, perm), perm), x)
    assert torch.equal(perm.inverse_S[order], torch.arange(11))
    assert perm.inverse_S is perm.inverse_S  # made once
    assert permute_rows(x, None) is x and unpermute_rows(x, None) is x


@pytest.mark.parametrize("W, L", [(2, 2), (2, 4), (3, 2), (4, 3)])
def test_the_regroup_is_the_former_block_transpose(W, L):
    g = torch.Generator().manual_seed(W * 10 + L)
    stub = SimpleNamespace(world_size=W, num_local_experts=L, _labels={})
    for _ in range(5):
        counts_WL = torch.randint(0, 4, (W, L), generator=g)
        counts_WL[0, 0] = 0  # empty blocks
        R = int(counts_WL.sum())
        got = AllToAllDispatcher._regroup(stub, counts_WL, R, torch.device("cpu")).order_S
        assert torch.equal(got, _former_block_transpose(counts_WL, R))
    assert AllToAllDispatcher._regroup(SimpleNamespace(world_size=W, num_local_experts=1, _labels={}),
                                       counts_WL[:, :1], 3, torch.device("cpu")) is None


# ---------------------------------------------------------------- a training step, new against former


def _config(name: str):
    cfg = tiny_config(name)
    return dataclasses.replace(cfg, capacity_factor=0.5) if name in ("Switch", "GShard") else cfg  # slots dropped


def _step(name: str, tokens: torch.Tensor, seed: int, former: bool, dispatcher=None, events=None) -> dict:
    """One training step (forward, loss with the auxiliary loss, backward) of the family's tiny model; what it
    computed and its operators. `events`, if given, hears "tmoe" as each tMoE's forward begins."""
    torch.manual_seed(0)
    model = LanguageModel(_config(name), dispatcher).train()
    with torch.no_grad():  # Base Layers' zero-initialised expert output would hide the experts' inputs' gradients
        for m in model.modules():
            if isinstance(m, TMoE):
                m.experts.w2.normal_(std=0.1)
                if events is not None:
                    m.register_forward_pre_hook(lambda module, args: events.append("tmoe"))
    with former_path() if former else contextlib.nullcontext():
        torch.manual_seed(seed)  # the shuffle's permutation, GShard's noise: alike in both runs
        with PlainOpCount() as forward:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        aux = model.aux_loss()
        if aux is not None:
            loss = loss + 0.01 * aux
        with PlainOpCount() as backward:
            loss.backward()
    dropped = sum(int(m.dropped) for m in model.modules() if isinstance(m, TMoE) and m.dropped is not None)
    return {"loss": loss.detach(), "logits": logits.detach(), "dropped": dropped, "ops": (forward.n, backward.n),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _compare(new: dict, old: dict) -> dict:
    return {"loss": torch.equal(new["loss"], old["loss"]), "logits": torch.equal(new["logits"], old["logits"]),
            "grads": new["grads"].keys() == old["grads"].keys()
            and all(torch.equal(g, old["grads"][n]) for n, g in new["grads"].items()),
            "ops": [list(new["ops"]), list(old["ops"])], "dropped": new["dropped"]}


def _check(name: str, got: dict) -> None:
    assert (got["loss"], got["logits"], got["grads"]) == (True, True, True), (name, got)
    (fwd, bwd), (fwd_before, bwd_before) = got["ops"]
    assert fwd < fwd_before and bwd < bwd_before, (name, got["ops"])
    if name in ("Switch", "GShard"):
        assert got["dropped"] > 0, name


@pytest.mark.parametrize("name", TMOE_FAMILIES)
def test_a_training_step_on_one_process_is_the_former_bit_for_bit(name):
    tokens = torch.randint(4, 64, (4, 21), generator=torch.Generator().manual_seed(1))
    _step(name, tokens, 7, True)  # what is made once per process (the auction's tie priorities) made before counting
    _check(name, _compare(_step(name, tokens, 7, False), _step(name, tokens, 7, True)))


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    report: dict = {}
    try:
        tokens = torch.randint(4, 64, (2 + rank, 17), generator=torch.Generator().manual_seed(rank))  # uneven
        exchange = dist.all_to_all_single
        for name in TMOE_FAMILIES:
            _step(name, tokens, 100 + rank, True, AllToAllDispatcher(4))  # made once per process, before counting
            runs, events = {}, {}
            for former in (False, True):
                seen = events[former] = []

                def logged(*args, seen=seen, **kwargs):
                    seen.append("begun" if kwargs.get("async_op", False) else "exchange")
                    return exchange(*args, **kwargs)

                with mock.patch.object(dist, "all_to_all_single", logged):
                    runs[former] = _step(name, tokens, 100 + rank, former, AllToAllDispatcher(4), seen)
            report[name] = {**_compare(runs[False], runs[True]), "events": events[False],
                            "events_before": events[True]}
        # the exchanges overlapped with the experts (--all2all-chunks 2: dispatch.ExchangedChunks)
        runs = {former: _step("Base", tokens, 100 + rank, former, AllToAllDispatcher(4, chunks=2))
                for former in (False, True)}
        report["Base, 2 chunks"] = _compare(runs[False], runs[True])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(report, f)


@pytest.mark.slow
def test_a_training_step_on_2_ranks_is_the_former_bit_for_bit(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=2,
                                start_method="forkserver")
    for rank in range(2):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        for name in TMOE_FAMILIES:
            got = report[name]
            _check(name, got)
            # the exchanges of the step (forward and backward): as many as before; the shuffle's split sizes (Base
            # Layers' tMoE: sMLP-det, Base) begun without waiting before the first tMoE, where they were exchanged
            # by the first tMoE before, and only they
            new, before = got["events"], got["events_before"]
            assert new.count("tmoe") == before.count("tmoe") == 2, got
            exchanges = [e for e in new if e != "tmoe"]
            assert len(exchanges) == len([e for e in before if e != "tmoe"]), got
            if name in ("sMLP-det", "Base"):
                assert new[0] == "begun" and new.count("begun") == 1, got
                assert before.index("tmoe") < before.index("begun") and before.count("begun") == 1, got
            else:
                assert "begun" not in new + before, got
        _check("Base, 2 chunks", report["Base, 2 chunks"])


def test_the_auction_has_a_profiler_range_of_its_own_inside_routing():
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="base")).train()
    x = torch.randn(64, 8)
    layer(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x)
    events = prof.events()
    auctions = [e for e in events if e.name == RANGES["auction"]]
    assert len(auctions) == 1
    parents, p = [], auctions[0].cpu_parent
    while p is not None:
        parents.append(p.name)
        p = p.cpu_parent
    assert RANGES["routing"] in parents
    total = sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1e6
    parts = breakdown(events, total)
    assert parts["auction"] > 0 and parts["routing"] > 0
    assert routing_and_all2all(parts) == parts["routing"] + parts["auction"] + parts["all2all"]
    assert routing_and_all2all({"routing": 1.0, "all2all": 2.0}) == 3.0  # a record made before the auction's range
