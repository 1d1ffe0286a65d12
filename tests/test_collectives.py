"""Every torch.distributed collective of the project gets tensors on the backend's device.

NCCL rejects CPU tensors; a CPU-only machine runs gloo, which accepts them. The collectives of the
project (audited: smlp/dispatch.py's all2all and its split/width exchanges, Base Layers' token shuffle
and unshuffle with their backward, the optimizer step's fold of the balanced routers' prices (one all-reduce for
every layer, smlp/routing/prices.py), smlp/expert_data_parallel.py's replica all-reduce of expert gradients,
the zero-shot scorer's batch-count max and score sum, the generation token broadcast, the end-of-run barrier, and
smlp-launch's graceful-stop vote; fairseq_plugins calls none itself) run here on 2 gloo ranks under
`tests/fake_nccl.pretend_nccl()`, which reports an NCCL backend and fails on any CPU tensor that
reaches a collective. A negative control shows the check fails on the mistake it exists for.
"""
from __future__ import annotations

import datetime
import json
from types import SimpleNamespace

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
        # forward: shuffle of the scores (counts, scores), their experts back, dispatch (counts, tokens), combine;
        # backward: the 2 token exchanges reversed (the scores and experts carry no gradient); the prices are
        # folded by the optimizer step: one all-reduce for every balanced layer
        assert r["base_step"] == ["all_to_all_single"] * 8
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
