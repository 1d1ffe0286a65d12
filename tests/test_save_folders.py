"""What a training run loads, and from where: the newest complete save of any world size, a --restore-file or a
--finetune-from-model of any layout (fairseq_plugins/checkpoint_sources.py), with the user's files left as they
were, and whole saves pruned whatever world wrote them (fairseq_plugins/save_dir.py).

Train once, check many ways: one 2-rank sMLP (2 experts, a save every 2 updates, 7 updates) in a folder whose path
holds `.pt` (`exp.ptb/base`), then from its files, each once: a 2-rank --restore-file of smlp-consolidate's merge of
update 6, a 2-rank and a 1-process --finetune-from-model of the update-4 set (learning rate 0, so the saved experts
are the loaded ones), and a 1-process requeue of a folder whose checkpoint_last is older than a complete numbered
save. The reference is the 2-rank run itself: fairseq reseeds every update, so a run that continues from update 6
with the same weights, batch and learning rate logs update 7's loss exactly (1 process with --update-freq 2: within
float noise).
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_fairseq, run_in_process, train_losses

SMLP = ["--arch", "smlp_lm_tiny", "--num-experts", "2", "--disable-validation"]


def _flags(data, save, *extra) -> list[str]:
    return [str(data), "--user-dir", PLUGINS, *TINY_TRAIN, *SMLP, *extra, "--save-dir", str(save)]


def _digest(folder: Path) -> dict[str, str]:
    """name -> sha256 of every file under `folder` but its save folder lock (what a run must leave as it was)."""
    from smlp.folder_lock import LOCK_NAME

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _lrs(log: str) -> dict[int, float]:
    from smlp_launch.fairseq_log import train_records

    return {int(f["num_updates"]): float(f["lr"]) for f in train_records(log) if {"lr", "num_updates"} <= f.keys()}


@pytest.fixture(scope="module")
def runs(tiny_lm_data, tmp_path_factory):
    from fairseq_plugins.checkpoints import consolidate

    root = tmp_path_factory.mktemp("save_folders")
    base = root / "exp.ptb" / "base"
    out = {"root": root, "base": base}
    res = run_fairseq("fairseq-train", _flags(tiny_lm_data, base, "--save-interval-updates", "2", "--max-update", "7"),
                      world=2)
    out["base_log"] = assert_ok(res)
    out["base_losses"], out["base_lrs"] = train_losses(res[0].stdout), _lrs(res[0].stdout)
    (root / "inputs").mkdir()
    out["merged"] = Path(consolidate(str(base / "checkpoint_1_6.pt"), str(root / "inputs" / "merged.pt")))
    out["base_files"], out["inputs"] = _digest(base), _digest(root / "inputs")
    # a requeue: checkpoint_last is the update-4 save (killed before its copy of update 6), 1_6 is complete
    requeue = root / "exp.ptb" / "requeue"
    shutil.copytree(base, requeue)
    for r in (0, 1):
        shutil.copyfile(base / f"checkpoint_1_4-rank-{r}.pt", requeue / f"checkpoint_last-rank-{r}.pt")
    out["requeue_before"] = _digest(requeue)
    text = assert_ok(run_in_process("fairseq-train", _flags(
        tiny_lm_data, requeue, "--update-freq", "2", "--max-update", "8", "--save-interval-updates", "1",
        "--keep-interval-updates", "3")))
    out["requeue"] = (train_losses(text), text, _digest(requeue))
    restored = root / "exp.ptb" / "restored"
    res = run_fairseq("fairseq-train", _flags(tiny_lm_data, restored, "--restore-file", str(out["merged"]),
                                              "--max-update", "7"), world=2)
    out["restored"] = (train_losses(res[0].stdout), assert_ok(res), _lrs(res[0].stdout), _digest(restored))
    set4 = str(base / "checkpoint_1_4.pt")
    res = run_fairseq("fairseq-train", _flags(tiny_lm_data, root / "ft2", "--finetune-from-model", set4, "--lr", "0",
                                              "--max-update", "1"), world=2)
    out["ft2"] = assert_ok(res)
    out["ft1"] = assert_ok(run_in_process("fairseq-train", _flags(
        tiny_lm_data, root / "ft1", "--finetune-from-model", set4, "--lr", "0", "--max-update", "1")))
    out["base_after"], out["inputs_after"] = _digest(base), _digest(root / "inputs")
    return out


def _model(path: Path) -> dict[str, torch.Tensor]:
    from fairseq_plugins.checkpoints import load_checkpoint

    return load_checkpoint(str(path))["model"]


@pytest.mark.slow
def test_a_requeue_on_other_ranks_resumes_the_newest_complete_save_and_keeps_it(runs):
    """checkpoint_last-rank-* at update 4, a complete checkpoint_1_6-rank-* set at update 6, resumed on one
    process: update 6 is resharded beside the set and training goes on with update 7 (update 4's state would
    train update 5 again), logging the 2-rank run's update-7 loss. The set stays whole and unchanged."""
    losses, text, after = runs["requeue"]
    assert "Resuming from the newest complete save, checkpoint_1_6-rank-*.pt (update 6, written by a 2-rank run), " \
           "resharded for this run's 1 rank(s); the save itself is unchanged." in text, text[-3000:]
    assert "into checkpoint_resharded_6_w1.pt; the source is unchanged" in text, text[-3000:]
    assert sorted(losses) == [7, 8], text[-3000:]
    assert losses[7] == pytest.approx(runs["base_losses"][7], abs=2e-3)
    for r in (0, 1):
        name = f"checkpoint_1_6-rank-{r}.pt"
        assert after[name] == runs["requeue_before"][name]


@pytest.mark.slow
def test_pruning_removes_every_ranks_shards_of_old_saves_whatever_world_wrote_them(runs):
    """--keep-interval-updates 3 on the one-process requeue keeps updates 8, 7 (its own) and 6 (the 2-rank set it
    resumed from), and removes both ranks' shards of updates 4 and 2, which fairseq's per-rank pruning never sees
    (its rank 0 looks for -rank-0 files only in a sharded run, for one file here). checkpoint_last-rank-* (the
    2-rank run's) is superseded by this run's checkpoint_last.pt, and the resharded copy is gone once update 7 was
    saved."""
    _, text, after = runs["requeue"]
    assert sorted(after) == ["checkpoint_1_6-rank-0.pt", "checkpoint_1_6-rank-1.pt", "checkpoint_1_7.pt",
                             "checkpoint_1_8.pt", "checkpoint_last.pt"], sorted(after)
    assert "removed checkpoint_1_2-rank-1.pt: an older save that --keep-* flags drop" in text, text[-3000:]


@pytest.mark.slow
def test_restoring_a_merged_file_on_two_ranks_continues_its_updates_schedule_and_data(runs):
    """--restore-file merged.pt (smlp-consolidate's merge of update 6, which drops the optimizer state) on 2 ranks:
    resharded under --save-dir (never beside the user's file, which is left as it was), it continues with update 7
    at update 7's learning rate and logs the uninterrupted run's update-7 loss (same weights, same batch)."""
    losses, text, lrs, files = runs["restored"]
    assert sorted(losses) == [7], text[-3000:]
    assert losses[7] == runs["base_losses"][7] and lrs[7] == runs["base_lrs"][7], (losses, lrs, runs["base_lrs"])
    assert "checkpoint_resharded_6_w2-rank-0.pt holds no optimizer state (smlp-consolidate leaves it out): the update " \
           "count (6), the learning-rate schedule and the data position continue from it" in text, text[-3000:]
    assert runs["inputs_after"] == runs["inputs"]  # merged.pt unchanged, no merged-rank-R.pt beside it
    assert sorted(files) == ["checkpoint_last-rank-0.pt", "checkpoint_last-rank-1.pt"], sorted(files)


@pytest.mark.slow
def test_fine_tuning_from_a_set_gives_each_rank_its_own_experts(runs):
    """--finetune-from-model NAME.pt of a 2-rank set (no NAME.pt file): on 2 ranks each rank loads its own shard,
    on one process the set is resharded under --save-dir; at learning rate 0 the saved model is the loaded one:
    rank r's experts are the set's rank r experts, the one file holds both ranks' experts."""
    from fairseq_plugins.checkpoints import merge_rank_models

    base, root = runs["base"], runs["root"]
    for r in (0, 1):
        loaded, saved = _model(base / f"checkpoint_1_4-rank-{r}.pt"), _model(root / "ft2" / f"checkpoint_last-rank-{r}.pt")
        experts = [k for k in loaded if ".experts." in k]
        assert experts and all(torch.equal(saved[k], loaded[k]) for k in experts), r
    from fairseq_plugins.checkpoints import load_checkpoint

    merged = merge_rank_models([load_checkpoint(str(base / f"checkpoint_1_4-rank-{r}.pt")) for r in (0, 1)])
    one = _model(root / "ft1" / "checkpoint_last.pt")
    assert all(torch.equal(one[k], v) for k, v in merged.items() if ".experts." in k)
    assert "loading pretrained model from" in runs["ft1"] and "finetune_resharded_4_w1.pt" in runs["ft1"]
    assert sorted(p.name for p in (root / "ft1").iterdir() if p.suffix == ".pt") == ["checkpoint_last.pt"]
    assert runs["base_after"] == runs["base_files"]  # nothing of the source folder moved or changed


@pytest.mark.slow
def test_a_folder_named_like_a_checkpoint_resumes_on_its_own_ranks(runs):
    """`exp.ptb/base`: fairseq's whole-path `.pt` replace named rank 0's file `exp-rank-0.ptb/...`, so the same
    command run again tried to reshard into a folder that does not exist. Shard names come from the file name."""
    from fairseq_plugins.checkpoint_sets import rank_shards, shard_path
    from fairseq_plugins.elastic import inspect_saved, plan_resume
    from smlp.expert_data_parallel import ExpertDataLayout

    last = str(runs["base"] / "checkpoint_last.pt")
    assert shard_path(last, "-rank-1") == str(runs["base"] / "checkpoint_last-rank-1.pt")
    assert sorted(rank_shards(last)) == [0, 1]
    assert plan_resume(last, world_size=2, sharded=True, num_experts=2, replicated=inspect_saved(last).replicated,
                       layout=ExpertDataLayout(world_size=2, ep_size=2, num_experts=2)) is None
