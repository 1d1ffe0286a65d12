"""Every torch.distributed collective of the project gets tensors on the backend's device.

NCCL rejects CPU tensors; a CPU-only machine runs gloo, which accepts them. The collectives of the
project (audited: smlp/dispatch.py's all2all and its split/width exchanges, Base Layers' token shuffle
and unshuffle with their backward and the assigned experts' way home with the dispatch's counts, the
optimizer step's fold of the balanced routers' prices (one all-reduce for every layer,
smlp/routing/prices.py), smlp/expert_data_parallel.py's replica all-reduce of expert gradients,
the zero-shot scorer's batch-count max and score sum, the generation token broadcast, the end-of-run barrier, and
smlp-launch's graceful-stop vote; fairseq_plugins calls none itself) run here on 2 gloo ranks under
`tests/fake_nccl.pretend_nccl()`, which reports an NCCL backend and fails on any CPU tensor that
reaches a collective. A negative control shows the check fails on the mistake it exists for.

The same runs count the collectives of a training step of sMLP-det on 2 ranks (issue 47: the shuffle's split
sizes and the deterministic sMoE's counts once per forward, the dispatch's counts home with the assigned experts)
and check that the step computes bit for bit what the per-layer exchanges computed.
"""
from __future__ import annotations

import contextlib
import datetime
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fake_nccl import CpuTensorToNccl, pretend_nccl


class TinyLM(torch.nn.Module):
    """A causal bigram LM whose forward joins a collective, as the experts' all2all does."""

    def __init__(self, vocab: int = 12, start: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)
        self.core = SimpleNamespace(cfg=SimpleNamespace(prediction_start=start))

    def max_positions(self) -> int:
        return 16

    def forward(self, tokens):
        dist.all_reduce(torch.ones(1, device=tokens.device))
        return self.table[tokens], None

    def expected(self, context, continuation, eos=2):
        seq = [eos, *context, *continuation]
        lp = self.table.log_softmax(-1)
        return sum(float(lp[seq[i - 1], seq[i]]) for i in range(1 + len(context), len(seq)))


def _common_width(dispatcher, width: int) -> int:
    """The largest row width in the dispatcher's group: an all-reduce (MAX) on the backend's device, as
    AllToAllDispatcher.common_width did before the dispatch exchanged the widths with the counts."""
    from smlp.process_group import collective_device

    t = torch.tensor([width], dtype=torch.long, device=collective_device(dispatcher.ep_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dispatcher.ep_group)
    return int(t.item())


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    report: dict = {}
    try:
        from smlp.config import TMoEConfig
        from smlp.dispatch import AllToAllDispatcher
        from smlp.expert_data_parallel import average_expert_gradients
        from smlp.experts import FFNExperts
        from smlp.moe import TMoE
        from smlp_eval.scoring import LMScorer
        from smlp_eval.zeroshot import barrier
        from smlp_launch.worker import _StopFlag

        with pretend_nccl() as (mode, calls):
            # negative control: the mistake the check exists for
            try:
                dist.all_reduce(torch.ones(1))
                report["negative_control"] = "not caught"
            except CpuTensorToNccl as exc:
                report["negative_control"] = str(exc)
            w = torch.ones(2).to("cuda").requires_grad_()  # and in the backward pass
            w.register_hook(lambda grad: dist.all_reduce(torch.zeros(1)))
            try:
                (w * 2).sum().backward()
                report["backward_negative_control"] = "not caught"
            except CpuTensorToNccl as exc:
                report["backward_negative_control"] = str(exc)
            try:
                _StopFlag().agreed(SimpleNamespace(device=torch.device("cpu")))  # a CPU trainer under NCCL
                report["cpu_trainer"] = "not caught"
            except CpuTensorToNccl:
                report["cpu_trainer"] = "caught"

            # the zero-shot scorer: batch-count max, every forward's collective, the score sum
            model = TinyLM(start=3).to("cuda")
            assert model.table.device.type == "cuda"
            reqs = [([4, 5, 6][:k], [7, 8, 9, 10][:m]) for k in range(4) for m in range(1, 5)]
            scorer = LMScorer(model, eos=2, pad=1, batch_size=2, progress=False)
            assert scorer.device.type == "cuda"
            n0 = len(calls)
            scores = scorer.score(reqs)
            report["scorer"] = {"max": [c for c, _ in calls[n0:]].count("all_reduce"),
                                "ok": all(abs(s.logprob - model.expected(c, x)) < 1e-9
                                          for s, (c, x) in zip(scores, reqs))}

            # generation (lm-eval's generate_until): the token broadcast
            n0 = len(calls)
            scorer.greedy_continuation([4, 5], 3)
            report["broadcasts"] = [c for c, _ in calls[n0:]].count("broadcast")

            # the expert-parallel dispatcher: split sizes, row width, rows there and back
            disp = AllToAllDispatcher(num_experts=4)
            x_SD = torch.randn(10, 3, generator=torch.Generator().manual_seed(rank)).to("cuda")
            expert_S = torch.tensor([(3 * i + rank) % 4 for i in range(10)]).to("cuda")
            n0 = len(calls)
            width = _common_width(disp, 5 + rank)
            x_RD, counts_L, state = disp.dispatch(x_SD, expert_S)
            y_SD = disp.combine(x_RD * 2, state)
            report["dispatch"] = {"width": width, "collectives": len(calls) - n0,
                                  "round_trip": bool(torch.equal(y_SD.cpu(), 2 * x_SD.cpu()))}
            # cached decoding's sMoE step: every rank's span of wanted positions
            n0 = len(calls)
            report["spans"] = {"spans": disp.gather_spans(rank, 5 + rank), "collectives": len(calls) - n0}

            # Base Layers' token shuffle and unshuffle, forward and backward (the reverse exchanges)
            x_SD = torch.randn(9 + rank, 3, generator=torch.Generator().manual_seed(rank)).to("cuda")
            x_SD.requires_grad_()
            n0 = len(calls)
            y_SD, shuffle = disp.shuffle(x_SD)
            z_SD = disp.unshuffle(y_SD * 2, shuffle)
            z_SD.backward(torch.full_like(z_SD, 3.0))
            report["shuffle"] = {"collectives": [c for c, _ in calls[n0:]], "sizes": [y_SD.shape[0], 9 + rank],
                                 "round_trip": bool(torch.equal(z_SD.detach().cpu(), 2 * x_SD.detach().cpu())),
                                 "grad": bool(torch.equal(x_SD.grad.cpu(), torch.full((9 + rank, 3), 6.0)))}

            # a Base Layers tMoE training step: the scores shuffled, assigned, their experts back; the tokens
            # dispatched from home, experts, combined home; backward
            torch.manual_seed(0)
            layer = TMoE(TMoEConfig(d_model=6, d_ffn=8, num_experts=4, router="base"), disp).to("cuda").train()
            n0 = len(calls)
            layer(torch.randn(11 + rank, 6).to("cuda").requires_grad_()).square().sum().backward()
            report["base_step"] = [c for c, _ in calls[n0:]]
            # the optimizer step's fold of the prices: one all-reduce for every balanced layer of the model
            from smlp.routing.prices import fold_prices, price_modules

            second = TMoE(TMoEConfig(d_model=6, d_ffn=8, num_experts=4, router="base"), disp).to("cuda").train()
            second(torch.randn(7 + rank, 6).to("cuda"))
            both = torch.nn.ModuleList([layer, second])
            n0 = len(calls)
            fold_prices(both)
            report["price_fold"] = {"collectives": [c for c, _ in calls[n0:]], "layers": len(price_modules(both))}

            # the replica all-reduce of expert gradients (expert-data parallelism): 2 replicas of one expert
            torch.manual_seed(0)
            experts = FFNExperts(1, 4, 8).to("cuda")
            average_expert_gradients(experts, world_size=2, replica_group=None, replicas=2)
            inputs = [torch.randn(5 + r, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
            n0 = len(calls)
            experts(inputs[rank].to("cuda"), [5 + rank]).square().sum().backward()
            report["replica_collectives"] = [c for c, _ in calls[n0:]]
            report["replica_grads"] = [p.grad.cpu().tolist() for p in experts.parameters()]
            report["synchronized"] = len(mode.synchronized)

            # smlp-launch's graceful-stop vote on the trainer's device, and the end-of-run barrier
            report["stop_vote"] = _StopFlag().agreed(SimpleNamespace(device=torch.device("cuda", 0)))
            barrier()
            report["checked"] = sum(n for _, n in calls)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(report, f)


# ---------------------------------------------------------------- sMLP-det's training step (issue 47)

SMLP_DET = dict(family="smlp", vocab_size=64, d_model=16, d_ffn=32, seq_len=16, dense_layers=9, sparse_layers=3,
                num_experts=4, heads=2, padding_idx=1)  # the fair configuration's 9 + 3 blocks, tiny widths


@contextlib.contextmanager
def per_layer_exchanges():
    """The exchanges of a step as they were before issue 47: every layer exchanges its split sizes (the shuffle's,
    the deterministic sMoE's counts), and each dispatch exchanges its counts after the experts came home alone."""
    from smlp.dispatch import AllToAllDispatcher
    from smlp.lm import LanguageModel

    def experts_alone(self, expert_R, state, scores_RE):
        return self.unshuffle(expert_R, state), None

    with mock.patch.object(LanguageModel, "one_forward", lambda self: contextlib.nullcontext()), \
            mock.patch.object(AllToAllDispatcher, "unshuffle_assignment", experts_alone):
        yield


def _training_step(model, tokens, calls) -> dict:
    """One training step as fairseq runs it (forward, loss, backward, the optimizer step's price fold, legacy_ddp's
    all-reduce of the shared gradients): its collectives by phase, and what it computed."""
    import torch.nn.functional as F

    from smlp.experts import is_expert
    from smlp.routing.prices import fold_prices

    n0 = len(calls)
    logits = model(tokens[:, :-1])
    n1 = len(calls)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    n2 = len(calls)
    grads = {n: p.grad.cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.load_E.cpu() for _, m in model.moe_modules()]
    fold_prices(model)
    prices = [m.price_E.cpu().clone() for m in model.modules() if hasattr(m, "pending_E1")]
    shared = [p.grad for p in model.parameters() if not is_expert(p) and p.grad is not None]
    dist.all_reduce(torch.cat([g.reshape(-1) for g in shared]))
    names = [c for c, _ in calls[n0:]]
    return {"collectives": {"forward": names[:n1 - n0], "backward": names[n1 - n0:n2 - n0], "step": names[n2 - n0:]},
            "logits": logits.detach().cpu(), "grads": grads, "loads": loads, "prices": prices}


def _smlp_det_worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    report: dict = {}
    try:
        from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
        from smlp.lm import LanguageModel, LMConfig
        from smlp_bench.micro.host_syncs import count_host_syncs

        cfg = LMConfig(**SMLP_DET)
        tokens = torch.randint(4, 64, (2 + rank, 17), generator=torch.Generator().manual_seed(rank))  # uneven ranks

        def build(layout):
            torch.manual_seed(0)
            smoe = LocalDispatcher(4, replicated=True) if layout == "replicated" else None
            return LanguageModel(cfg, AllToAllDispatcher(4), smoe_dispatcher=smoe).train()

        for layout in ("expert", "replicated"):
            runs = {}
            for path in ("once", "per_layer"):
                model = build(layout)
                with pretend_nccl() as (mode, calls), \
                        (per_layer_exchanges() if path == "per_layer" else contextlib.nullcontext()):
                    model.to("cuda")
                    x = tokens.to("cuda")
                    torch.manual_seed(100 + rank)  # the shuffle's permutations, alike in both runs
                    runs[path] = _training_step(model, x, calls)
                    runs[path]["synchronized"] = len(mode.synchronized)
            once, before = runs["once"], runs["per_layer"]
            report[layout] = {
                "collectives": {path: {k: len(v) for k, v in r["collectives"].items()} for path, r in runs.items()},
                "kinds": {path: sorted(set(sum(r["collectives"].values(), []))) for path, r in runs.items()},
                "synchronized": once["synchronized"],
                "bitwise": {"logits": torch.equal(once["logits"], before["logits"]),
                            "grads": once["grads"].keys() == before["grads"].keys()
                            and all(torch.equal(g, before["grads"][n]) for n, g in once["grads"].items()),
                            "loads": all(torch.equal(a, b) for a, b in zip(once["loads"], before["loads"])),
                            "prices": all(torch.equal(a, b) for a, b in zip(once["prices"], before["prices"]))}}
            # host reads of a training forward on the accelerator's path, per MoE module: the second of two
            # forwards of the same batch and shuffle (each layer's auction checks first where its last completed)
            model = build(layout)
            for _ in range(2):
                per_module = {}
                with count_host_syncs() as counter:
                    hooks = []
                    for name, module in model.moe_modules():
                        hooks.append(module.register_forward_pre_hook(
                            lambda m, a: setattr(m, "_before", counter.count)))
                        hooks.append(module.register_forward_hook(
                            lambda m, a, o, name=name, into=per_module: into.__setitem__(name,
                                                                                          counter.count - m._before)))
                    torch.manual_seed(100 + rank)
                    model(tokens[:, :-1])
                    for hook in hooks:
                        hook.remove()
            report[layout]["host_reads"] = {"forward": counter.count, "per_module": per_module,
                                            "sites": {k: v for k, v in counter.by_site.items()}}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(report, f)


@pytest.mark.slow
def test_an_smlp_det_training_step_on_2_ranks_makes_fewer_collectives_with_the_same_results(tmp_path):
    """sMLP-det (9 dense + 3 sparse blocks, the Base Layers tMoE with its shuffle) on 2 ranks of unequal batches,
    its sMoE experts spread over the ranks or replicated: the collectives of one training step, and the same step
    with every layer exchanging its own split sizes and every dispatch its own counts, as before issue 47.

    Per sparse block before: the shuffle's split sizes, the scores, the experts back, the dispatch's counts, the
    tokens out and back (+ the sMoE's counts, rows out and back when spread); now the split sizes once per forward
    (the sMoE's counts too), the dispatch's counts with the experts. The outputs, every gradient, the loads and the
    prices are bitwise the same (only the exchanges changed), and no CPU tensor reaches a collective under NCCL.
    A training forward reads the host (counted on the accelerator's path) once per forward for the shuffle's split
    sizes, and per balanced layer once for its auction's completion (AuctionChecks: checked first where the
    layer's last auction completed) and once for its dispatch's counts; a spread sMoE once per forward."""
    torch.multiprocessing.spawn(_smlp_det_worker, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=2,
                                start_method="forkserver")
    for rank in range(2):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        # forward, backward, step (the price fold and the shared gradients' all-reduce); once -> per layer:
        #   replicated: forward 1 + 3 x 4 (was 3 x 6), backward 3 x 2, step 2: 21 (was 26)
        #   expert:     forward 2 + 3 x 6 (was 3 x 9), backward 3 x 4, step 2: 34 (was 41)
        assert r["replicated"]["collectives"] == {"once": {"forward": 13, "backward": 6, "step": 2},
                                                  "per_layer": {"forward": 18, "backward": 6, "step": 2}}, r
        assert r["expert"]["collectives"] == {"once": {"forward": 20, "backward": 12, "step": 2},
                                              "per_layer": {"forward": 27, "backward": 12, "step": 2}}, r
        for layout in ("expert", "replicated"):
            got = r[layout]
            assert got["kinds"]["once"] == ["all_reduce", "all_to_all_single"], got["kinds"]
            assert got["bitwise"] == {"logits": True, "grads": True, "loads": True, "prices": True}, (layout, got)
            assert got["synchronized"] == 0
            reads = got["host_reads"]
            tmoe = [n for n in reads["per_module"] if n.endswith(".tmoe")]
            smoe = [n for n in reads["per_module"] if n.endswith(".smoe")]
            assert len(tmoe) == len(smoe) == 3, reads
            # the first tMoE: the shuffle's split sizes, its auction's check, the dispatch's counts; the others
            # 2; a spread sMoE reads its counts in the first block only, a replicated one never
            assert [reads["per_module"][n] for n in tmoe] == [3, 2, 2], reads
            assert [reads["per_module"][n] for n in smoe] == ([1, 0, 0] if layout == "expert" else [0, 0, 0]), reads
            assert reads["forward"] == (8 if layout == "expert" else 7), reads


@pytest.mark.slow
def test_no_cpu_tensor_reaches_a_collective_when_the_backend_is_nccl(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=2,
            start_method="forkserver")
    for rank in range(2):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "got a CPU tensor" in r["negative_control"] and r["cpu_trainer"] == "caught"
        assert "got a CPU tensor" in r["backward_negative_control"]
        assert r["scorer"]["ok"] and r["scorer"]["max"] >= 3  # batch-count max + forwards + score sum
        assert r["broadcasts"] == 3
        assert r["dispatch"] == {"width": 6, "collectives": 4, "round_trip": True}
        assert r["spans"] == {"spans": [[0, 5], [1, 6]], "collectives": 1}
        # shuffle: counts + rows; unshuffle: rows; backward: both row exchanges reversed
        assert r["shuffle"]["collectives"] == ["all_to_all_single"] * 5
        assert r["shuffle"]["round_trip"] and r["shuffle"]["grad"] and r["shuffle"]["sizes"][0] in (9, 10)
        # forward: shuffle of the scores (split sizes, scores), their experts back with the dispatch's counts,
        # tokens out, combine; backward: the 2 token exchanges reversed (the scores and experts carry no
        # gradient); the prices are folded by the optimizer step: one all-reduce for every balanced layer
        assert r["base_step"] == ["all_to_all_single"] * 7
        assert r["price_fold"] == {"collectives": ["all_reduce"], "layers": 2}
        assert r["replica_collectives"] == ["all_reduce"] * 4  # w1, b1, w2, b2
        assert r["synchronized"] == 0  # nothing waited for the device
        assert r["stop_vote"] is False
        assert r["checked"] > 10
    # the replica all-reduce gives every rank the mean over both ranks of their own gradients
    from smlp.experts import FFNExperts

    grads = []
    for source in range(2):
        torch.manual_seed(0)
        experts = FFNExperts(1, 4, 8)
        x = torch.randn(5 + source, 4, generator=torch.Generator().manual_seed(10 + source))
        experts(x, [5 + source]).square().sum().backward()
        grads.append([p.grad for p in experts.parameters()])
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())["replica_grads"]
        for g, g0, g1 in zip(got, *grads):
            torch.testing.assert_close(torch.tensor(g), (g0 + g1) / 2)


def test_collective_device_follows_the_backend(monkeypatch):
    from smlp_eval.scoring import collective_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in (("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
                            ("cpu:gloo,cuda:nccl", torch.device("cpu")), ("mpi", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device() == device, backend


def test_every_caller_follows_one_collective_device_rule(monkeypatch):
    """The dispatchers, expert-data parallelism and evaluation ask one function (smlp/process_group.py),
    and the dispatcher's device follows its group's backend as that function says."""
    from smlp import expert_data_parallel as parallel
    from smlp import process_group
    from smlp.dispatch import AllToAllDispatcher
    from smlp_eval import scoring

    assert parallel.collective_device is process_group.collective_device is scoring.collective_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    dispatcher = AllToAllDispatcher.__new__(AllToAllDispatcher)
    dispatcher.ep_group = None
    for backend, device in (("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
                            ("cpu:gloo,cuda:nccl", torch.device("cpu")), ("xccl", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert dispatcher._device == device == process_group.collective_device(), backend
