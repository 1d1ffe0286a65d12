"""Killed at random, a training loses nothing (issue 45): the suite's small form of `smlp-bench --chaos`.

The uninterrupted baseline is the session's shared 2-rank smlp_lm_tiny run (conftest.py, SHARED_RUN_UPDATES
updates). The same training, saved every 4 updates, is killed 3 times by benchmarks/chaos.py through the real
`smlp-launch` (one worker SIGKILLed, the whole job SIGTERMed as SLURM preempts, one rank SIGKILLed while it writes a
checkpoint file) and resumed each time by the same command. Its final checkpoints must equal the baseline's bit for
bit (fairseq_plugins.checkpoints.save_differences): every tensor of the model, the optimizer state, the update count,
the scheduler and the data position; every logged loss must equal the baseline's; no update is skipped; no
checkpoint file is left torn, and no temporary file of a killed write outlives the resume.
"""
from __future__ import annotations

import random

import pytest
import torch

from fairseq_helpers import SHARED_RUN_UPDATES, smlp_tiny_flags
from smlp_bench import chaos


@pytest.mark.slow
def test_a_training_killed_three_times_ends_bitwise_equal_to_the_uninterrupted_one(
        smlp_tiny_two_ranks, tiny_lm_data, tmp_path):
    save, log = smlp_tiny_two_ranks("deterministic")
    # the baseline's training; saving and validating decide nothing of it (a save validates: not here, for time)
    args = [*smlp_tiny_flags(tiny_lm_data, "deterministic"), "--max-update", str(SHARED_RUN_UPDATES),
            "--save-interval-updates", "4", "--keep-interval-updates", "2", "--no-epoch-checkpoints",
            "--disable-validation"]
    record = chaos.run(tmp_path, args, updates=SHARED_RUN_UPDATES, save_every=4, kills=3, seed=1,
                       baseline=(save, log), timeout=600)
    kills, result = record["kills"], record["result"]
    for e in kills:
        print(f"\n{e['kind']}: planned {e['planned']}, landed {e['landed']}, resumed from {e['resumed_from']}, "
              f"{e['seconds_lost']} s lost")
    assert sorted(e["kind"] for e in kills) == ["sigkill-in-save", "sigkill-worker", "sigterm-job"], kills
    in_save = next(e for e in kills if e["kind"] == "sigkill-in-save")
    assert in_save["landed"]["phase"] == "checkpoint write" and in_save["temp_files_left"], in_save
    assert all(e["launcher_exit"] != 0 and not e["torn_files"] for e in kills), kills
    assert result["loss_mismatches"] == [] and result["update_problems"] == [], result
    assert result["updates_logged"] == SHARED_RUN_UPDATES
    assert result["torn_files"] == [] and result["temp_files_at_end"] == [], result
    assert result["differing"] == {}, result["differing"]  # the routers' prices included (their record is saved)


@pytest.mark.slow
def test_an_amp_training_with_injected_overflows_killed_in_a_save_ends_bitwise_equal(tiny_lm_data, tmp_path):
    """`smlp-bench chaos --amp` in small: --amp (fp16 autocast on CPU, a loss scale, --amp-batch-retries 1) with
    overflows injected (batch 5, the one after the save of update 4, skipped, so that save is written again holding
    its routing record; batch 8, after update 6, fed again; the same after update 8), once uninterrupted, then
    killed inside a checkpoint write and resumed: every tensor, the routers' prices and the loss scale included,
    ends bitwise equal, every loss too."""
    updates, save_every = 12, 4
    plan = chaos.overflow_plan(updates, save_every)
    assert plan == {5: 2, 8: 1, 10: 2, 13: 1}
    args = chaos.train_args(tiny_lm_data, updates, save_every, amp=True)
    record = chaos.run(tmp_path, args, updates=updates, save_every=save_every, kills=["sigkill-in-save"], seed=3,
                       env=chaos.overflow_env(plan), timeout=600)
    result, baseline = record["result"], record["baseline"]
    assert baseline["overflows"] == 6 and baseline["skipped"] == 2, baseline  # 2 + 1 + 2 + 1 passes; 2 skipped
    in_save = record["kills"][0]
    assert in_save["landed"]["phase"] == "checkpoint write" and in_save["launcher_exit"] != 0, in_save
    assert result["loss_mismatches"] == [] and result["update_problems"] == [], result
    assert result["updates_logged"] == updates and result["torn_files"] == [] and result["temp_files_at_end"] == []
    assert result["differing"] == {}, result["differing"]


def _save(path, model: dict, exp_avg: torch.Tensor, iterations: int, history: int = 1) -> None:
    torch.save({"model": model, "criterion": {},
                "last_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
                                         "param_groups": [{"lr": 0.003, "params": [0]}]},
                "optimizer_history": [{"num_updates": 3, "lr_scheduler_state": {"lr": 0.003}}] * history,
                "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": iterations},
                                "metrics": {"wall": float(history)}}}, path)


def test_save_differences_names_every_entry_that_differs_by_a_bit(tmp_path):
    """The comparison the chaos run relies on: equal saves give nothing; a sign bit (-0.0 against 0.0, equal as
    numbers), a moment of the optimizer and the data position are each named; history and meters are not compared."""
    from fairseq_plugins.checkpoints import save_differences

    w = torch.tensor([0.0, 1.0, 2.0])
    _save(tmp_path / "a.pt", {"w": w, "router.price_E": torch.ones(2)}, torch.ones(3), 3)
    _save(tmp_path / "b.pt", {"w": w.clone(), "router.price_E": torch.ones(2)}, torch.ones(3), 3, history=2)
    assert save_differences(tmp_path / "a.pt", tmp_path / "b.pt") == {}
    _save(tmp_path / "c.pt", {"w": torch.tensor([-0.0, 1.0, 2.0]), "router.price_E": torch.tensor([1.0, 1.5])},
          torch.tensor([1.0, 1.0, 1.0 + 2 ** -23]), 4)
    found = save_differences(tmp_path / "a.pt", tmp_path / "c.pt")
    assert sorted(found) == ["extra_state.train_iterator.iterations_in_epoch", "last_optimizer_state.state.0.exp_avg",
                             "model.router.price_E", "model.w"], found
    assert found["model.w"].startswith("1 of 3 values differ"), found
    assert found["model.router.price_E"].startswith("1 of 2 values differ"), found


def test_the_kills_cover_every_kind_and_land_before_the_end():
    rng = random.Random(5)
    assert sorted(chaos.plan_kinds(3, rng)) == ["sigkill-in-save", "sigkill-worker", "sigterm-job"]
    kinds = chaos.plan_kinds(20, rng)
    assert len(kinds) == 20 and set(kinds) == set(chaos.KINDS)
    for _ in range(200):
        resumed = rng.randrange(0, 40)
        moment = chaos.plan_moment("sigkill-in-save", rng, resumed, 48, 4)
        assert moment["save"] % 4 == 0 and resumed < moment["save"] < 48 and moment["file"] in ("numbered", "last")
        moment = chaos.plan_moment("sigterm-job", rng, resumed, 48, 4)
        assert resumed < moment["after_update"] <= min(resumed + 8, 47) and 0 <= moment["step_fraction"] <= 1
    with pytest.raises(chaos.BenchError, match="--kills 0"):
        chaos.check_plan(0, 48, 4)
