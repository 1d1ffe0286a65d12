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
