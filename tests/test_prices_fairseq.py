"""The balanced routers' evaluation prices through the real fairseq-train (smlp/routing/prices.py,
fairseq_plugins/patches.py `fold_router_prices`): folded once per optimizer step, for every layer in one
all-reduce over the data-parallel group, so that every rank of every layout ends with the same prices; kept
exactly by a resume after a kill between checkpoints, by resharding to one process and by the HF export in
every --dtype.

One sMLP-det model (its tMoE routes with Base Layers' balanced assignment), 2 ranks, --update-freq 2, 8
updates, checkpoints every 4:

    ep2       --expert-parallel-size 2 (one expert per rank), every fold's statistics recorded per rank
    ep1       --expert-parallel-size 1 (every rank holds both experts), recorded the same way
    killed    ep2's command, every rank killed as it starts update 7 (after the checkpoint of update 4),
              then the same command again: it resumes from update 4
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fairseq_helpers import TINY_TRAIN, assert_ok, run_fairseq

pytestmark = pytest.mark.slow

FAULTS = str(Path(__file__).resolve().parent / "smlp_fault_plugin")
UPDATES, DECAY = 8, 0.95


def _flags(data, save, ep):
    return [str(data), "--user-dir", FAULTS, "--arch", "smlp_lm_tiny", *TINY_TRAIN, "--num-experts", "2",
            "--expert-parallel-size", str(ep), "--update-freq", "2", "--max-update", str(UPDATES),
            "--save-interval-updates", "4", "--disable-validation", "--save-dir", str(save)]


def _prices(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["model"]
    return {k: v for k, v in state.items() if ".eval_prices." in k}


def _records(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_lm_data, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("prices")
    out = {}
    for name, ep in (("ep2", 2), ("ep1", 1)):
        record = root / f"record-{name}"
        record.mkdir()
        monkeypatch_module.setenv("SMLP_RECORD_PRICES", str(record))
        assert_ok(run_fairseq("fairseq-train", _flags(tiny_lm_data, root / name, ep), world=2))
        out[name] = (root / name, record)
    monkeypatch_module.delenv("SMLP_RECORD_PRICES")
    monkeypatch_module.setenv("SMLP_FAULT_KILL_AT_UPDATE", "6")
    killed = run_fairseq("fairseq-train", _flags(tiny_lm_data, root / "killed", 2), world=2)
    assert all(r.returncode != 0 for r in killed) and "killed at update 6" in killed[0].stdout
    monkeypatch_module.delenv("SMLP_FAULT_KILL_AT_UPDATE")
    out["resumed"] = assert_ok(run_fairseq("fairseq-train", _flags(tiny_lm_data, root / "killed", 2), world=2))
    out["killed"] = (root / "killed", None)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("layout", ["ep2", "ep1"])
def test_every_rank_ends_with_the_hand_computed_prices_advanced_once_per_update(runs, layout):
    save, record = runs[layout]
    ranks = [_prices(save / f"checkpoint_last-rank-{r}.pt") for r in range(2)]
    assert ranks[0] and ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:  # the same prices on every rank, bitwise
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    logs = [_records(record, r) for r in range(2)]
    assert len(logs[0]) == len(logs[1]) == UPDATES  # one fold per update, not per forward
    names = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in ranks[0]))  # the layers, in module order
    for i, name in enumerate(names):
        price = torch.zeros(ranks[0][f"{name}.price_E"].shape)
        weight = torch.zeros(())
        for step in range(UPDATES):
            layers = [logs[r][step]["layers"][i] for r in range(2)]
            assert [layer["observed"] for layer in layers] == [2, 2]  # --update-freq 2: two assignments a step
            stat = torch.tensor(layers[0]["pending"]) + torch.tensor(layers[1]["pending"])  # the all-reduce
            assert stat[-1] > 0
            s = torch.tensor(1.0 - DECAY)  # the fold, by hand, in fp32
            price = price * (1.0 - s) + s * (stat[:-1] / stat[-1])
            weight = weight * (1.0 - s) + s
        assert torch.equal(ranks[0][f"{name}.price_weight"], weight), name
        assert torch.equal(ranks[0][f"{name}.price_E"], price), name
        assert float(weight) == pytest.approx(1 - DECAY ** UPDATES)  # advanced 8 times, not 16
        assert torch.equal(ranks[0][f"{name}.pending_E1"], torch.zeros_like(ranks[0][f"{name}.pending_E1"]))
        assert price.abs().max() > 0


def test_a_run_killed_between_checkpoints_resumes_to_the_same_prices_and_weights(runs):
    assert "Loaded checkpoint" in runs["resumed"] and "(epoch 1 @ 4 updates)" in runs["resumed"]
    for r in range(2):
        ref = torch.load(runs["ep2"][0] / f"checkpoint_last-rank-{r}.pt", map_location="cpu", weights_only=False)
        got = torch.load(runs["killed"][0] / f"checkpoint_last-rank-{r}.pt", map_location="cpu", weights_only=False)
        assert ref["model"].keys() == got["model"].keys()
        for key, value in ref["model"].items():
            assert torch.equal(got["model"][key], value), (r, key)


def test_resharding_to_one_process_and_the_hf_export_keep_the_prices_exactly(runs, tiny_lm_data, tmp_path):
    from safetensors import safe_open

    from smlp_launch.consolidate import consolidate_main

    save = runs["ep2"][0]
    shard = _prices(save / "checkpoint_last-rank-0.pt")
    assert consolidate_main([str(save / "checkpoint_last.pt")]) == 0
    merged = _prices(save / "checkpoint_last.pt")
    assert merged.keys() == shard.keys() and all(torch.equal(merged[k], v) for k, v in shard.items())
    pytest.importorskip("transformers")
    from smlp_eval import hf_export

    for dtype in ("bfloat16", "float16"):
        result = hf_export.export(str(save / "checkpoint_last.pt"), tmp_path / dtype, dtype=dtype)
        with safe_open(str(result.folder / hf_export.WEIGHTS_FILE), "pt") as f:
            for key, value in shard.items():
                saved = f.get_tensor("model." + key.split("decoder.core.", 1)[1])
                assert saved.dtype == torch.float32 and torch.equal(saved, value), (dtype, key)
            assert any(f.get_tensor(k).dtype == getattr(torch, dtype) for k in f.keys())  # the weights are half
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(result.folder), trust_remote_code=True,
                                                  dtype=getattr(torch, dtype))
        loaded = {k: v for k, v in hf.model.state_dict().items() if ".eval_prices." in k}
        assert len(loaded) == len(shard)
        for key, value in shard.items():
            got = loaded[key.split("decoder.core.", 1)[1]]
            assert got.dtype == torch.float32 and torch.equal(got, value), (dtype, key)


# ---------------------------------------------------------------- in-process trainers: skipped steps, dummy batches

# fairseq's own Trainer on 2 gloo ranks, driven batch by batch (tests/fairseq_helpers.in_process_trainer): the same
# model, three batches b1 b2 b3 per rank (the same on every run), and on b2 an inf forced into one expert's gradient
# on rank 1 for its first backward pass (the whole-model norm makes every rank skip, fairseq_plugins/precision.py).
TRAINER = ["--arch", "smlp_lm_tiny", "--num-experts", "2", "--disable-validation"]
TRAINER_RUNS = {  # name -> (flags, backward passes of b2 that overflow)
    "fp16_skip": (["--fp16"], 1),  # fp16 raises the overflow before the optimizer step: b2 is skipped
    "amp_skip": (["--amp", "--amp-batch-retries", "0"], 1),  # amp steps anyway (the scaler skips): b2 is skipped
    "amp_retry": (["--amp", "--amp-batch-retries", "1"], 1),  # b2 overflows once, fairseq feeds it again
    "amp_clean": (["--amp", "--amp-batch-retries", "1"], 0),  # the same run without the overflow
    "dummy": ([], 0),  # fp32; rank 1 has no b2 (an uneven epoch end): it runs fairseq's dummy batch instead
}


def _model_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()}


def _overflow(trainer, passes: int):
    """The next `passes` backward passes put inf into one expert's gradient."""
    expert = next(p for p in trainer.get_model().parameters() if getattr(p, "expert", False))
    left = [passes]

    def hook(grad):
        if left[0] <= 0:
            return grad
        left[0] -= 1
        return torch.full_like(grad, float("inf"))

    return expert.register_hook(hook)


def _trainer_run(name: str, data: str, tmp: str, rank: int, port: int) -> dict:
    from fairseq_helpers import PLUGINS, in_process_trainer
    from smlp.routing import prices

    flags, passes = TRAINER_RUNS[name]

    def args(save):
        return [data, "--user-dir", PLUGINS, *TINY_TRAIN, *TRAINER, "--save-dir", os.path.join(tmp, save), *flags]

    trainer, epoch_itr, batches = in_process_trainer(args(name), world=2, rank=rank, port=port)
    folds, real = [], prices.fold_prices

    def fold_prices(model, group=None, applied=None):  # each rank's record as the fold finds it
        folds.append([m.pending_E1.clone() for m in prices.price_modules(model)])
        return real(model, group) if applied is None else real(model, group, applied)

    prices.fold_prices = fold_prices
    try:
        b1, b2, b3 = (next(batches) for _ in range(3))
        out = {"states": [_model_state(trainer)], "updates": [], "folds": folds}
        for i, samples in enumerate((b1, b2, b3)):
            handle = _overflow(trainer, passes) if i == 1 and rank == 1 and passes else None
            if i == 1 and name == "dummy" and rank == 1:
                samples = [None]  # no batch left: fairseq runs its dummy batch with the loss zeroed
            trainer.train_step(samples)
            if handle is not None:
                handle.remove()
            out["states"].append(_model_state(trainer))
            out["updates"].append(trainer.get_num_updates())
            out.setdefault("retries_left", []).append(getattr(trainer, "_amp_retries", None))
            if i == 1 and name == "fp16_skip":  # saved after the skipped step, as fairseq saves at an interval
                out["saved"] = os.path.join(tmp, f"skipped-rank-{rank}.pt")
                trainer.consolidate_optimizer()  # as checkpoint_utils.save_checkpoint does first
                trainer.save_checkpoint(out["saved"], {"train_iterator": epoch_itr.state_dict(), "val_loss": None})
        if name == "fp16_skip":  # resumed from that save in a new trainer: b3 again
            again, _, _ = in_process_trainer(args("again"), world=2, rank=rank, port=port)
            again.load_checkpoint(out["saved"])
            out["saved"] = torch.load(out["saved"], map_location="cpu", weights_only=False)["model"]
            out["loaded"] = _model_state(again)
            again.train_step(b3)
            out["resumed"] = _model_state(again)
    finally:
        prices.fold_prices = real
    return out


def _trainer_worker(rank: int, tmp: str, data: str, port: int) -> None:
    import torch.distributed as dist

    from fairseq_helpers import result_path

    torch.set_num_threads(1)
    results = {name: _trainer_run(name, data, tmp, rank, port) for name in TRAINER_RUNS}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, result_path(tmp, rank))


@pytest.fixture(scope="module")
def trainers(tiny_lm_data):
    from fairseq_helpers import free_port, spawn_and_collect

    return spawn_and_collect(_trainer_worker, 2, str(tiny_lm_data), free_port())


def _split(state: dict) -> tuple[dict, dict]:
    """(the routers' price buffers, everything else: weights and other buffers) of a model state."""
    return ({k: v for k, v in state.items() if ".eval_prices." in k},
            {k: v for k, v in state.items() if ".eval_prices." not in k})


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _hand_weight(folds: int) -> torch.Tensor:
    weight, s = torch.zeros(()), torch.tensor(1.0 - DECAY)
    for _ in range(folds):
        weight = weight * (1.0 - s) + s
    return weight


@pytest.mark.parametrize("name", ["fp16_skip", "amp_skip"])
def test_a_skipped_step_leaves_prices_and_weights_as_a_run_without_that_batch(trainers, name):
    """Right after the overflow step every weight, average price and price weight is bitwise what it was before
    b2, as a run that never saw b2 has them (issue 52: under --amp fairseq calls the optimizer step on an overflow
    too and the prices advanced). b2's assignments stay recorded; the next applied step folds them with b3's:
    the price weight has advanced twice in three steps, the prices by the hand-computed fold of both records."""
    for rank, run in enumerate(r[name] for r in trainers):
        s1, s2, s3 = run["states"][1:]
        assert run["updates"] == [1, 1, 2], (rank, run["updates"])
        (p1, w1), (p2, w2) = _split(s1), _split(s2)
        assert _equal(w1, w2) == [], (rank, _equal(w1, w2))  # no weight moved
        for key in p1:
            if key.endswith(("price_E", "price_weight")):
                assert torch.equal(p1[key], p2[key]), (rank, key, p1[key], p2[key])
            else:  # the skipped batch's record waits for the next step
                assert p2[key][-1] > 0 and torch.equal(p1[key], torch.zeros_like(p1[key])), (rank, key)
        for key, value in _split(s3)[0].items():
            if key.endswith("price_weight"):
                assert torch.equal(value, _hand_weight(2)), (rank, key, value, _hand_weight(2))
    layers = sorted({k.rsplit(".", 1)[0] for k in _split(trainers[0][name]["states"][3])[0]})
    for i, layer in enumerate(layers):
        stat = trainers[0][name]["folds"][-1][i] + trainers[1][name]["folds"][-1][i]  # the all-reduce, by hand
        first = trainers[0][name]["folds"][0][i] + trainers[1][name]["folds"][0][i]
        assert stat[-1] == 2 * first[-1], (layer, stat[-1], first[-1])  # b2's rows and b3's
        s = torch.tensor(1.0 - DECAY)
        price = trainers[0][name]["states"][2][f"{layer}.price_E"] * (1.0 - s) + s * (stat[:-1] / stat[-1])
        for rank in range(2):
            assert torch.equal(trainers[rank][name]["states"][3][f"{layer}.price_E"], price), (rank, layer)


def test_an_amp_overflow_fed_again_advances_the_prices_once(trainers):
    """--amp-batch-retries 1: b2 overflows, fairseq feeds it again and applies it. The prices end bitwise as the
    run without the overflow has them (the overflowed pass's record of b2 is the retry's: its mean is the same),
    advanced once per update (issue 52: once more, for the overflowed pass); the weights as that run's, to the
    rounding of a halved loss scale."""
    for rank in range(2):
        retry, clean = trainers[rank]["amp_retry"], trainers[rank]["amp_clean"]
        assert retry["updates"] == clean["updates"] == [1, 2, 3]
        # the retry count is per batch (fairseq kept 1 after a retry that worked: the next overflow was skipped at
        # once, and a resumed run, starting at 0, fed it again where the uninterrupted run skipped it)
        assert retry["retries_left"] == [0, 0, 0], retry["retries_left"]
        (p, w), (pc, wc) = _split(retry["states"][3]), _split(clean["states"][3])
        assert _equal(p, pc) == [], (rank, _equal(p, pc))
        assert all(torch.equal(v, _hand_weight(3)) for k, v in p.items() if k.endswith("price_weight")), p
        for key in w:  # measured: within 5e-6 (fp16 gradients that underflow at one scale and not the other);
            # one update moves a weight by up to the learning rate, 3e-3
            torch.testing.assert_close(w[key], wc[key], rtol=1e-5, atol=2e-5, msg=key)


def test_the_record_of_a_skipped_step_is_saved_and_resumed(trainers):
    """--fp16, saved right after the skipped step (fairseq saves again at the same update): the checkpoint holds
    b2's record, a new trainer loads every tensor as it was, and ends b3 with the routers' prices bitwise as the
    uninterrupted run (b2's record folded with b3's); its weights to half precision (fairseq's fp16 checkpoint
    keeps the fp16 weights, not their fp32 master copies)."""
    for rank in range(2):
        run = trainers[rank]["fp16_skip"]
        assert _equal(run["loaded"], run["states"][2]) == [], rank
        pending = {k: v for k, v in run["saved"].items() if k.endswith("pending_E1")}
        assert pending and all(v[-1] > 0 and torch.equal(v, run["states"][2][k]) for k, v in pending.items())
        (p, w), (pu, wu) = _split(run["resumed"]), _split(run["states"][3])
        assert _equal(p, pu) == [], (rank, _equal(p, pu))
        assert all(torch.equal(v, _hand_weight(2)) for k, v in p.items() if k.endswith("price_weight")), p
        for key in w:
            torch.testing.assert_close(w[key].float(), wu[key].float(), rtol=4e-3, atol=1e-4, msg=key)


def test_a_dummy_batch_does_not_count(trainers):
    """Rank 1 runs fairseq's dummy batch for b2 (in train mode, loss zeroed): it records nothing, and the step's
    record is dropped on every rank (Base Layers' shuffle mixed the dummy's rows into rank 0's assignment), so the
    prices stay bitwise as before b2 while rank 0's update is applied; b3 folds its own record only."""
    for rank in range(2):
        run = trainers[rank]["dummy"]
        assert run["updates"] == [1, 2, 3]
        (p1, w1), (p2, w2) = _split(run["states"][1]), _split(run["states"][2])
        assert _equal(p1, p2) == [], (rank, _equal(p1, p2))
        assert _equal(w1, w2), rank  # the update of rank 0's batch was applied
        assert all(torch.equal(v, _hand_weight(2)) for k, v in _split(run["states"][3])[0].items()
                   if k.endswith("price_weight"))
    dummy_record = trainers[1]["dummy"]["folds"][1]
    assert all(not bool(t.any()) for t in dummy_record), dummy_record
