"""Activation checkpointing (--checkpoint-activations, smlp/recompute.py) against the plain run.

Every family recomputes in backward what the plain run keeps, and ends with the plain run's loss and gradients
bit for bit (the same kernels on the same inputs, dropout's masks drawn again alike) in fp32, bf16 and fp16, while
autograd keeps less; a sparse layer runs its experts again but never its router. On 2 gloo ranks the sparse
blocks' recompute repeats no all2all (tests/test_distributed.py, `test_recompute_repeats_no_exchange`). The
memory estimator counts what checkpointing keeps (smlp/steptime.py through eval/flops/activations.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from smlp.lm import LanguageModel, LMConfig

BASE = dict(vocab_size=64, d_model=32, d_ffn=64, seq_len=16, num_experts=4, padding_idx=1, dropout=0.1)
FAMILIES = {
    "smlp-deterministic": dict(family="smlp", dense_layers=2, sparse_layers=1),
    "smlp-partial": dict(family="smlp", dense_layers=1, sparse_layers=1, smoe_routing="partial"),
    "gmlp": dict(family="gmlp", dense_layers=2),
    "hypermixer": dict(family="gmlp", dense_layers=2, token_mixer="hypermixer"),
    "ninformer": dict(family="gmlp", dense_layers=2, token_mixer="ninformer"),
    "token-routed-gmlp": dict(family="gmlp", dense_layers=2, token_routed_experts=2),
    "transformer": dict(family="transformer", dense_layers=2, heads=2),
    **{router: dict(family="transformer", dense_layers=1, sparse_layers=1, moe_router=router, heads=2)
       for router in ("switch", "gshard", "base", "hash")},
}


def _pair(family: dict, dtype: torch.dtype) -> tuple[LanguageModel, LanguageModel]:
    """(plain, checkpointed) models with the same weights, in train mode."""
    torch.manual_seed(0)
    plain = LanguageModel(LMConfig(**BASE, **family)).to(dtype).train()
    recomputing = LanguageModel(LMConfig(**BASE, **family, checkpoint_activations=True)).to(dtype).train()
    recomputing.load_state_dict(plain.state_dict())
    return plain, recomputing


def _step(model: LanguageModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """(loss, gradients, floating-point elements autograd kept) of one training step's forward and backward."""
    kept, seen = [0], set()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and ptr not in params and ptr not in seen:
            seen.add(ptr)
            kept[0] += t.untyped_storage().nbytes() // t.element_size()
        return t

    torch.manual_seed(5)  # dropout's masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        aux = model.aux_loss()
        loss = loss + 0.01 * aux if aux is not None else loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}, kept[0]


# half precision: one model of each recomputed form (a whole dense block, attention before a router, a tMoE's
# experts, the token-routed gMLP's experts)
HALF = ("smlp-deterministic", "token-routed-gmlp", "transformer", "switch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_recomputed_steps_give_the_plain_gradients_and_keep_less(dtype):
    tokens = torch.randint(4, BASE["vocab_size"], (3, BASE["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    for name in FAMILIES if dtype == torch.float32 else HALF:
        family = FAMILIES[name]
        plain, recomputing = _pair(family, dtype)
        loss, grads, kept = _step(plain, tokens)
        loss_r, grads_r, kept_r = _step(recomputing, tokens)
        assert torch.isfinite(loss) and torch.equal(loss, loss_r), (name, loss, loss_r)
        assert grads.keys() == grads_r.keys() and len(grads) == len(list(plain.parameters())), name
        differ = [k for k in grads if not torch.equal(grads[k], grads_r[k])]
        assert not differ, (name, differ)
        assert kept_r < 0.75 * kept, (name, kept_r, kept)  # a bound a checkpointing that does nothing breaks


def test_a_sparse_layer_runs_its_experts_again_but_never_its_router():
    """Per training step: the FFN experts of every tMoE run twice (forward, and again in backward), each router
    and the sMoE once; without checkpointing everything runs once."""
    tokens = torch.randint(4, BASE["vocab_size"], (3, BASE["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    for name in ("smlp-deterministic", "smlp-partial", "base", "switch"):
        for model in _pair(FAMILIES[name], torch.float32):
            calls: dict[str, int] = {}
            watched = {n: m for n, m in model.named_modules() if n.endswith(("tmoe.experts", "ffn.experts",
                                                                             ".router", ".smoe"))}
            for n, m in watched.items():  # counted in forward itself (the recompute runs no module hook)
                def counted(*args, n=n, forward=m.forward, calls=calls, **kwargs):
                    calls[n] = calls.get(n, 0) + 1
                    return forward(*args, **kwargs)

                m.forward = counted
            _step(model, tokens)
            twice = 2 if model.cfg.checkpoint_activations else 1
            assert calls == {n: (twice if n.endswith("experts") else 1) for n in watched}, (name, calls)


def test_evaluation_and_generation_do_not_recompute():
    """No autograd (evaluation, generation): the plain forward, the same logits as without the flag."""
    plain, recomputing = _pair(FAMILIES["smlp-deterministic"], torch.float32)
    tokens = torch.randint(4, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain.eval()(tokens), recomputing.eval()(tokens))


def test_the_memory_estimator_counts_what_checkpointing_keeps():
    """eval/flops/activations.py (the step-time model's memory per GPU) measures the model as it trains: with
    --checkpoint-activations a dense gMLP block keeps its input alone, n x D values, and a sparse block less
    than without; memory_per_gpu's activations shrink accordingly."""
    from smlp.steptime import Training, memory_per_gpu
    from smlp_eval.flops.activations import activation_bytes

    cfg = LMConfig(vocab_size=64, d_model=32, d_ffn=128, seq_len=16, padding_idx=1, family="smlp", dense_layers=3,
                   sparse_layers=1, num_experts=4)
    plain = activation_bytes(cfg, 16, exact=True)
    kept = activation_bytes(replace(cfg, checkpoint_activations=True), 16, exact=True)
    assert kept["dense"] == (16 * 32, 0) < plain["dense"]
    assert kept["sparse"][0] < 0.6 * plain["sparse"][0] and kept["head"] == plain["head"]
    train = Training(world_size=4, ep_size=4, batch_size=2, update_freq=1, tokens=16)
    mem = {k: memory_per_gpu(c, params_non_expert=1, params_expert_per_gpu=1, train=train, activations=a)
           for k, (c, a) in {"plain": (cfg, plain), "kept": (cfg, kept)}.items()}
    per_sequence = sum(layers * (kept[kind][0] * train.dtype_bytes + kept[kind][1])
                       for kind, layers in (("head", 1), ("dense", 3), ("sparse", 1)))
    assert mem["kept"]["activations"] == train.batch_size * per_sequence
    assert mem["kept"]["activations"] < 0.5 * mem["plain"]["activations"]


def test_the_step_time_model_adds_the_recomputed_forward():
    """smlp-flops --step-time with --checkpoint-activations: every block's forward runs again in backward (its
    FLOPs are the model's less the head's), the recomputed activations cost what the plain ones do in memory
    traffic plus the kept inputs written and read again, and nothing else changes; the default sMoE layout's
    choice is unaffected."""
    import smlp.steptime as S
    from smlp_eval import flops as FL
    from smlp_eval.flops.activations import activation_bytes

    flags = ["--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--tokens-per-sample", "16",
             "--num-experts", "4", "--distributed-world-size", "4", "--batch-size", "3", "--update-freq", "2"]
    cluster = S.CLUSTERS["v100-dgx1"]
    plain_spec = FL.parse_model("smlp_lm", flags, vocab_size=64)
    spec = FL.parse_model("smlp_lm", [*flags, "--checkpoint-activations"], vocab_size=64)
    assert spec.cfg.checkpoint_activations and not plain_spec.cfg.checkpoint_activations
    plain, kept = (FL.steptime.step_time_for(s, cluster, method="analytic", smoe_layout="expert")
                   for s in (plain_spec, spec))
    c = FL.count_spec(spec, "analytic")
    rate = cluster.peak_flops * cluster.matmul_efficiency
    assert kept.seconds["recompute"] == pytest.approx(2 * 3 * (c.flops - 2 * c.head.macs) / rate, rel=1e-12)
    assert 0 < c.head.macs and 2 * c.head.macs < c.flops
    assert kept.memory["activations"] < 0.5 * plain.memory["activations"]
    kept_per_sequence = activation_bytes(spec.cfg, 16, 1)  # (fp32 floats, other bytes) per block kind
    assert kept_per_sequence["dense"] == (16 * 32, 0)  # a dense block keeps its input alone
    inputs = 2 * 3 * sum(layers * (kept_per_sequence[k][0] * 4 + kept_per_sequence[k][1])  # U x B x blocks
                         for k, layers in (("dense", spec.cfg.dense_layers), ("sparse", spec.cfg.sparse_layers)))
    assert kept.seconds["memory_bound"] == pytest.approx(
        plain.seconds["memory_bound"] + 2 * inputs / cluster.hbm_bandwidth, rel=1e-12)
    assert {k: v for k, v in kept.seconds.items() if k not in ("recompute", "memory_bound")} == \
        {k: v for k, v in plain.seconds.items() if k != "memory_bound"}
    assert kept.step_seconds > plain.step_seconds
    with pytest.raises(ValueError, match="checkpoint_activations needs recompute"):
        S.step_time("x", spec.cfg, flops_per_sequence=c.flops, params_non_expert=1, params_expert_per_gpu=1,
                    train=S.Training(world_size=4, ep_size=4, batch_size=3, tokens=16), cluster=cluster,
                    activations={})
    train = S.Training(world_size=4, ep_size=4, batch_size=3, tokens=16)
    assert S.layout_seconds(spec.cfg, train, cluster) == S.layout_seconds(plain_spec.cfg, train, cluster)


def test_recomputing_adds_no_host_sync(monkeypatch):
    """On the path a GPU takes (smlp_bench.micro.host_syncs), a training step with --checkpoint-activations reads
    from the device exactly what the plain step reads in its forward, and the recomputed stages read nothing in
    backward (they run outside any TorchFunctionMode, so each is counted on its own here)."""
    from dataclasses import replace as with_fields

    import smlp.recompute
    from smlp_bench.micro.host_syncs import HostSyncCounter, accelerator_paths
    from tiny_steps import FAMILIES as STEP_FAMILIES
    from tiny_steps import tiny_config, tokens

    in_backward, recomputes, recomputed = [False], HostSyncCounter(), [0]
    real = smlp.recompute.checkpoint

    def counted_checkpoint(fn, *args, **kwargs):
        def run(*a):
            if not in_backward[0]:
                return fn(*a)
            recomputed[0] += 1
            with recomputes:
                return fn(*a)
        return real(run, *args, **kwargs)

    monkeypatch.setattr(smlp.recompute, "checkpoint", counted_checkpoint)
    for name in STEP_FAMILIES:
        forward_syncs = []
        for on in (False, True):
            torch.manual_seed(0)
            model = LanguageModel(with_fields(tiny_config(name), checkpoint_activations=on)).train()
            x = tokens()
            in_backward[0] = False
            with accelerator_paths():
                with HostSyncCounter() as forward:
                    loss = model(x).float().logsumexp(-1).mean()
                in_backward[0] = True
                before, runs = recomputes.count, recomputed[0]
                loss.backward()
            forward_syncs.append(dict(forward.by_site))
            assert recomputes.count == before, (name, dict(recomputes.by_site))
            assert (recomputed[0] > runs) == on, name  # the stages ran again, counted
        assert forward_syncs[0] == forward_syncs[1], name
    assert recomputes.count == 0


def test_the_pages_table_is_the_committed_records():
    """docs/training.md's activation-memory table is what `smlp-bench activations --publish` writes from the
    committed record (never typed by hand), and the record's estimate is the allocator's figure to 0.1 MiB."""
    import json
    from pathlib import Path

    from smlp_bench.micro.activation_memory import PAGE_END, PAGE_START, markdown

    root = Path(__file__).resolve().parents[1]
    record = json.loads((root / "docs/benchmark/checkpoint_activations/paper_small.json").read_text())
    page = (root / "docs/training.md").read_text()
    assert page.split(PAGE_START, 1)[1].split(PAGE_END, 1)[0].strip() == markdown(record).strip()
    for arch in record["archs"]:
        for side in ("plain", "checkpointed"):
            measured = arch[side]["forward_held_bytes"]
            assert abs(arch[side]["estimated"]["activations_per_sequence_fp32"] - measured) < 0.1 * 2 ** 20, side
        assert arch["held_ratio"] < 0.5
