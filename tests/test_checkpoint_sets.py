"""Rank shards are one checkpoint: atomic writes, tags, and the resume decision (fairseq_plugins/checkpoint_sets.py).

One process, real files: each test writes the files a crash would leave (shards of different
updates or runs, a truncated copy, a missing rank, another world size) and checks what every rank
would decide from them. The end-to-end runs (2 ranks, SIGKILL and SLURM requeue while saving) are in
tests/test_faults.py.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import fairseq_plugins  # noqa: F401  (installs the hooks)
from fairseq_plugins.atomic_files import atomic_copy, atomic_torch_save
from fairseq_plugins.checkpoint_sets import (
    CheckpointSetError,
    _candidates_here,
    decide_resume,
    explain_mismatch,
    shape_mismatch,
)
from fairseq_plugins.checkpoints import consolidate
from fairseq_plugins.errors import RefusedInput
from fairseq_plugins.shard_tags import SHARD_KEY, read_shard
from smlp_fault_plugin import FullDisk


def fake_state(updates: int, *, rank: int = 0, world: int = 2, run: str = "run1", experts: int = 1, sharded=True):
    return {
        "model": {"decoder.core.embed.weight": torch.zeros(10, 4),
                  "decoder.core.layers.1.tmoe.experts.w1": torch.full((experts, 4, 8), float(rank))},
        "optimizer_history": [{"num_updates": updates}],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": updates}},
        "cfg": {"model": {"_name": "smlp_lm", "arch": "smlp_lm_tiny"}},
        SHARD_KEY: {"format": 1, "rank": rank, "world_size": world, "sharded": sharded, "num_updates": updates,
                    "epoch": 1, "set_id": f"{run}:{updates}"},
    }


def write_set(d: Path, stem: str, updates: list[int], run: str = "run1", world: int | None = None) -> None:
    """One file per rank: updates[r] is what rank r's file holds (None: the file is missing)."""
    for rank, u in enumerate(updates):
        if u is not None:
            torch.save(fake_state(u, rank=rank, world=world or len(updates), run=run), d / f"{stem}-rank-{rank}.pt")


def decide(d: Path, world: int = 2, default: bool = True, name: str = "checkpoint_last.pt",
           first_save: int | None = None):
    """What every rank decides, computed as plan_and_check_resume does after its all_gather."""
    requested = [read_shard(str(d / name.replace(".pt", f"-rank-{r}.pt"))) for r in range(world)]
    per_rank = [_candidates_here(str(d), f"-rank-{r}") for r in range(world)]
    candidates = {b: [c[b] for c in per_rank] for b in per_rank[0]
                  if all(b in c for c in per_rank) and not b.endswith("checkpoint_last.pt")}
    others = [i for c in per_rank for b, i in c.items() if not b.endswith("checkpoint_last.pt")]
    return decide_resume(requested, candidates, world=world, sharded=True, default_restore=default,
                         restore_name=name, others=others, first_save=first_save)


def test_a_run_stopped_while_it_wrote_its_first_save_starts_again_from_scratch(tmp_path):
    """Rank 1 was killed while it wrote the first save (update 4); rank 0 had written its shards. No complete save
    exists, and none would be lost by starting over: every rank starts from scratch (this stopped a chaos run for
    good before: the resume refused). Past the first save, a missing rank is still refused: its progress would
    be lost without a word."""
    write_set(tmp_path, "checkpoint_1_4", [4, None])
    write_set(tmp_path, "checkpoint_last", [4, None])
    plan = decide(tmp_path, first_save=4)
    assert plan.from_scratch and plan.restore_file is None
    assert "stopped while its ranks wrote their first save (update 4, --save-interval-updates 4). Starting from " \
           "scratch" in plan.message, plan.message
    with pytest.raises(CheckpointSetError, match="no complete older save"):
        decide(tmp_path)  # saves by epoch: the first save's update is not known
    write_set(tmp_path, "checkpoint_1_8", [8, None])
    write_set(tmp_path, "checkpoint_last", [8, None])
    with pytest.raises(CheckpointSetError, match="no complete older save"):
        decide(tmp_path, first_save=4)


# ----------------------------------------------------------------------------- atomic writes


def test_atomic_save_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    atomic_torch_save({"a": torch.ones(3)}, str(path))
    atomic_torch_save({"a": torch.zeros(3)}, str(path))
    assert torch.equal(torch.load(path)["a"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


@pytest.mark.parametrize("where", ["create", "write", "torch-zip-writer", "fsync"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    """ENOSPC when the temporary file is created (no room for it; it was a raw OSError from mkstemp), in the middle
    of torch.save (a full disk), inside torch's own zip writer (which reports it as `unexpected pos N vs M`; the
    error must still say the disk is full), or at fsync (delayed allocation, NFS): the same one line (a refusal,
    no traceback) naming the file and its folder."""
    path = tmp_path / "checkpoint_last-rank-0.pt"
    atomic_torch_save({"update": 7, "w": torch.randn(100)}, str(path))
    before = path.read_bytes()
    real_fdopen = os.fdopen

    def full_disk_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_open = os.open

    def no_room(file, flags, *args, **kwargs):
        if flags & os.O_CREAT and os.path.basename(str(file)).startswith(f".{path.name}.smlp-tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, flags, *args, **kwargs)

    if where == "create":
        monkeypatch.setattr(os, "open", no_room)
    elif where == "write":
        monkeypatch.setattr(torch, "save", full_disk_save)
    elif where == "torch-zip-writer":
        monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode), 300))
    else:
        monkeypatch.setattr(os, "fsync", full_disk_fsync)
    with pytest.raises(OSError) as err:
        atomic_torch_save({"update": 8, "w": torch.randn(1000)}, str(path))
    monkeypatch.undo()
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, RefusedInput)
    assert message.startswith(f"could not write checkpoint {path}: No space left on device (") and "\n" not in message
    assert f"MiB free in {tmp_path}). " in message and "checkpoint_last-rank-0.pt is unchanged" in message, message
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_fairseq_writes_go_through_the_atomic_tagged_writer(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    path = tmp_path / "checkpoint_1_5-rank-1.pt"
    checkpoint_utils.torch_persistent_save(fake_state(5), str(path))
    tag = read_shard(str(path))
    assert (tag.num_updates, tag.epoch, tag.readable) == (5, 1, True)
    state = torch.load(path, weights_only=True)
    assert state[SHARD_KEY]["rank"] == 1 and state[SHARD_KEY]["sharded"] is True
    # an interrupted write (any exception, e.g. KeyboardInterrupt from SIGINT) leaves the old file
    before = path.read_bytes()
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        checkpoint_utils.torch_persistent_save(fake_state(6), str(path))
    assert path.read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_copies_made_while_saving_are_atomic(tmp_path, monkeypatch):
    import shutil

    src, dst = tmp_path / "checkpoint_1_5.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")
    monkeypatch.setattr(shutil, "copyfileobj", lambda s, f, n=0: (f.write(s.read(10)), (_ for _ in ()).throw(
        OSError(errno.EIO, "I/O error")))[1])
    with pytest.raises(OSError):
        atomic_copy(str(src), str(dst))
    assert dst.read_bytes() == b"old" and len(list(tmp_path.iterdir())) == 2
    monkeypatch.undo()
    atomic_copy(str(src), str(dst))
    assert dst.read_bytes() == src.read_bytes()


# ----------------------------------------------------------------------------- the resume decision


def test_a_complete_set_loads_as_fairseq_would(tmp_path):
    write_set(tmp_path, "checkpoint_last", [12, 12])
    assert decide(tmp_path).restore_file is None


def test_a_mixed_set_named_by_restore_file_is_refused_naming_shards_and_updates(tmp_path):
    write_set(tmp_path, "checkpoint_1_12", [12, 11])
    with pytest.raises(CheckpointSetError) as err:
        decide(tmp_path, default=False, name="checkpoint_1_12.pt")
    assert ("checkpoint_1_12.pt is not one consistent save (the shards come from different saves): "
            "checkpoint_1_12-rank-0.pt: update 12; checkpoint_1_12-rank-1.pt: update 11") in str(err.value)


def test_resuming_falls_back_to_the_newest_complete_set(tmp_path):
    """Rank 0 finished saving update 12 (and copied it to checkpoint_last); rank 1 was killed first."""
    write_set(tmp_path, "checkpoint_1_10", [10, 10])
    write_set(tmp_path, "checkpoint_1_11", [11, 11])
    write_set(tmp_path, "checkpoint_1_12", [12, None])
    write_set(tmp_path, "checkpoint_last", [12, 11])
    plan = decide(tmp_path)
    assert plan.restore_file == str(tmp_path / "checkpoint_1_11.pt")
    assert "checkpoint_last-rank-0.pt: update 12; checkpoint_last-rank-1.pt: update 11" in plan.message
    assert "Resuming from the newest complete save, checkpoint_1_11-rank-*.pt (update 11)" in plan.message


def test_a_newer_complete_save_is_resumed_from_not_an_older_consistent_checkpoint_last(tmp_path):
    """Both ranks wrote update 12's numbered save and were stopped before they copied it to checkpoint_last (one chaos
    kill redid 4 updates for it): the newest complete save is loaded, whichever file holds it, and said; with no
    checkpoint_last at all too. An incomplete newer save, or --finetune-from-model (fairseq reads the model to
    finetune when checkpoint_last is missing), keeps checkpoint_last."""
    write_set(tmp_path, "checkpoint_1_4", [4, 4])
    write_set(tmp_path, "checkpoint_last", [8, 8])
    write_set(tmp_path, "checkpoint_1_8", [8, 8])
    write_set(tmp_path, "checkpoint_1_16", [16, None])
    assert decide(tmp_path).restore_file is None  # checkpoint_last is the newest complete save
    write_set(tmp_path, "checkpoint_1_12", [12, 12])
    plan = decide(tmp_path)
    assert plan.restore_file == str(tmp_path / "checkpoint_1_12.pt") and not plan.from_scratch
    assert plan.message == ("checkpoint_last.pt holds update 8, and a newer save is complete (the run was stopped "
                            "after it wrote that save, before it copied it to checkpoint_last.pt). Resuming from the "
                            "newest complete save, checkpoint_1_12-rank-*.pt (update 12).")
    requested = [read_shard(str(tmp_path / f"checkpoint_last-rank-{r}.pt")) for r in range(2)]
    assert decide_resume(requested, {str(tmp_path / "checkpoint_1_12.pt"): requested}, world=2, sharded=True,
                         default_restore=True, restore_name="checkpoint_last.pt", newest=False).restore_file is None
    for r in range(2):
        (tmp_path / f"checkpoint_last-rank-{r}.pt").unlink()
    plan = decide(tmp_path)
    assert plan.restore_file == str(tmp_path / "checkpoint_1_12.pt")
    assert "checkpoint_last.pt does not exist, but a complete save does" in plan.message


def test_the_same_update_from_two_runs_is_not_one_save(tmp_path):
    write_set(tmp_path, "checkpoint_last", [12, None], run="first")
    write_set(tmp_path, "checkpoint_last", [None, 12], run="second")
    write_set(tmp_path, "checkpoint_1_9", [9, 9], run="first")
    plan = decide(tmp_path)
    assert plan.restore_file == str(tmp_path / "checkpoint_1_9.pt"), plan


@pytest.mark.parametrize("damage", ["truncated", "missing", "garbage"])
def test_a_damaged_or_missing_shard_falls_back(tmp_path, damage):
    write_set(tmp_path, "checkpoint_1_3", [3, 3])
    write_set(tmp_path, "checkpoint_last", [4, 4])
    shard = tmp_path / "checkpoint_last-rank-1.pt"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(b"not a checkpoint")
    assert not read_shard(str(shard)).readable
    plan = decide(tmp_path)
    assert plan.restore_file == str(tmp_path / "checkpoint_1_3.pt")
    expected = {"truncated": "unreadable (truncated or corrupt file", "missing": "checkpoint_last-rank-1.pt: missing",
                "garbage": "unreadable ("}[damage]
    assert expected in plan.message, plan.message


def test_no_complete_set_is_an_error_naming_every_shard(tmp_path):
    write_set(tmp_path, "checkpoint_last", [5, 4])
    with pytest.raises(CheckpointSetError, match=r"update 5; checkpoint_last-rank-1\.pt: update 4, and no complete "
                                                 r"older save was found.*--keep-interval-updates"):
        decide(tmp_path)


def test_shards_of_another_world_size_are_refused(tmp_path):
    write_set(tmp_path, "checkpoint_last", [6, 6, 6, 6])  # a 4-rank run; this run has 2
    with pytest.raises(CheckpointSetError) as err:
        decide(tmp_path, world=2)
    assert "written by a 4-rank run and this run has 2 ranks" in str(err.value)
    assert "smlp-consolidate" in str(err.value) and "--finetune-from-model" in str(err.value)


def test_a_restore_file_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(CheckpointSetError, match=r"--restore-file .*nope\.pt: nope-rank-0\.pt: missing.*silently start "
                                                 r"from scratch"):
        decide(tmp_path, default=False, name=str(tmp_path / "nope.pt"))
    assert decide(tmp_path).restore_file is None  # no checkpoint_last at all: a fresh start


def test_a_consolidated_file_as_restore_file_of_a_sharded_run_points_to_finetuning(tmp_path):
    torch.save(fake_state(7, experts=2, sharded=False), tmp_path / "merged.pt")
    requested = [read_shard(str(tmp_path / f"merged-rank-{r}.pt")) for r in range(2)]
    with pytest.raises(CheckpointSetError, match=r"is one file \(a consolidated or one-process checkpoint\).*"
                                                 r"--finetune-from-model"):
        decide_resume(requested, {}, world=2, sharded=True, default_restore=False,
                      restore_name=str(tmp_path / "merged.pt"), single_file_exists=True)


def test_consolidate_refuses_a_mixed_set(tmp_path):
    write_set(tmp_path, "checkpoint_last", [12, 11])
    with pytest.raises(ValueError, match=r"not one save \(the shards come from different saves\): "
                                         r"checkpoint_last-rank-0\.pt: update 12; "
                                         r"checkpoint_last-rank-1\.pt: update 11"):
        consolidate(str(tmp_path / "checkpoint_last.pt"))
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_mismatch_explanations():
    model = {"embed.weight": (100, 8), "layers.1.tmoe.experts.w1": (2, 8, 16), "final.weight": (8,)}
    dictionary = {**model, "embed.weight": (120, 8)}
    experts = {**model, "layers.1.tmoe.experts.w1": (1, 8, 16)}
    arch = {"embed.weight": (100, 8), "layers.1.mlp.w": (8, 8)}
    assert "120-symbol dictionary" in explain_mismatch(dictionary, model)
    assert "1 expert(s) per file and this run 2" in explain_mismatch(experts, model)
    assert "another architecture" in explain_mismatch(arch, model)
    assert shape_mismatch(model, dict(model)) == []


def test_rank_shards_finds_what_the_glob_rules_it_replaced_found(tmp_path, monkeypatch):
    """One finder of a checkpoint's `-rank-R` files (checkpoints, elastic and zeroshot each had one)."""
    import glob
    import re

    from fairseq_plugins.shard_tags import rank_shards

    for name in ("x.pt", "x-rank-0.pt", "x-rank-1.pt", "x-rank-10.pt", "x-rank-1-rank-2.pt", "xy-rank-3.pt",
                 "x-rank-a.pt", "y-rank-0.pt"):
        (tmp_path / name).write_bytes(b"")

    def old(path):  # fairseq_plugins/checkpoints.py before issue 20
        stem = path[:-3]
        found = {}
        for p in glob.glob(glob.escape(stem) + "-rank-*.pt"):
            m = re.fullmatch(re.escape(stem) + r"-rank-(\d+)\.pt", p)
            if m:
                found[int(m.group(1))] = p
        return found

    path = str(tmp_path / "x.pt")
    assert rank_shards(path) == old(path) == {r: str(tmp_path / f"x-rank-{r}.pt") for r in (0, 1, 10)}
    monkeypatch.chdir(tmp_path)
    assert rank_shards("x.pt") == old("x.pt") == {0: "x-rank-0.pt", 1: "x-rank-1.pt", 10: "x-rank-10.pt"}
    assert rank_shards(str(tmp_path / "missing" / "x.pt")) == {}


# ----------------------------------------------------------------------------- runs on other world sizes


def test_a_run_on_fewer_ranks_supersedes_the_shards_it_does_not_write(tmp_path):
    """A 2-rank run saved checkpoint_best at update 10; resumed on 1 rank, its save of update 12 rewrote
    checkpoint_best-rank-0.pt only. rank-1 is the earlier run's and is superseded; a name this run did not
    save (checkpoint_1_10) stays the earlier run's whole set, and a one-file run supersedes every shard."""
    from fairseq_plugins.save_dir import superseded_files

    write_set(tmp_path, "checkpoint_best", [10, 10], run="old")
    write_set(tmp_path, "checkpoint_1_10", [10, 10], run="old")
    torch.save(fake_state(12, rank=0, world=1, run="new"), tmp_path / "checkpoint_best-rank-0.pt")
    stale = superseded_files(str(tmp_path), "new", world=1, sharded=True)
    assert stale == [str(tmp_path / "checkpoint_best-rank-1.pt")]
    assert superseded_files(str(tmp_path), "other", world=1, sharded=True) == []  # only what this run wrote
    with pytest.raises(CheckpointSetError) as err:  # what consolidation said before the superseded file went
        consolidate(str(tmp_path / "checkpoint_best.pt"))
    assert ("not one save (the shards come from runs on 1 and 2 ranks: a run on fewer ranks wrote the first shards "
            "of this name and left the others of an earlier run): checkpoint_best-rank-0.pt: update 12, written by a "
            "1-rank run (run new); checkpoint_best-rank-1.pt: update 10, written by a 2-rank run (run old)") \
        in str(err.value)
    torch.save(fake_state(14, world=1, run="one", sharded=False), tmp_path / "checkpoint_1_10.pt")
    assert superseded_files(str(tmp_path), "one", world=1, sharded=False) == [
        str(tmp_path / f"checkpoint_1_10-rank-{r}.pt") for r in (0, 1)]
    # and a sharded run supersedes the one file an earlier one-process run wrote under a name it saves, never a
    # merged file (smlp-consolidate's output)
    write_set(tmp_path, "checkpoint_1_10", [16, 16], run="two")
    assert superseded_files(str(tmp_path), "two", world=2, sharded=True) == [str(tmp_path / "checkpoint_1_10.pt")]
    torch.save({**fake_state(14, world=1, run="one", sharded=False), "smlp_consolidated_from": 2},
               tmp_path / "checkpoint_1_10.pt")
    assert superseded_files(str(tmp_path), "two", world=2, sharded=True) == []


def test_a_consolidated_file_older_than_its_shards_is_refused_naming_both(tmp_path):
    """smlp-consolidate wrote checkpoint_best.pt at update 10, then training went on and saved update 12's
    shards beside it: every loading path (check_current) refuses, naming both and the fix."""
    from fairseq_plugins.checkpoints import check_current

    write_set(tmp_path, "checkpoint_best", [10, 10], run="run1")
    merged = fake_state(10, run="run1")
    merged["smlp_consolidated_from"] = 2
    torch.save(merged, tmp_path / "checkpoint_best.pt")
    check_current(str(tmp_path / "checkpoint_best.pt"))  # merged from these very shards
    write_set(tmp_path, "checkpoint_best", [12, 12], run="run1")
    with pytest.raises(CheckpointSetError) as err:
        check_current(str(tmp_path / "checkpoint_best.pt"))
    assert (f"{tmp_path / 'checkpoint_best.pt'} and its rank shards hold different saves (checkpoint_best.pt: "
            f"update 10, merged by smlp-consolidate from 2 shards; checkpoint_best-rank-0.pt: update 12, written by a "
            f"2-rank run (run run1); checkpoint_best-rank-1.pt: update 12") in str(err.value)
    assert f"run `smlp-consolidate {tmp_path / 'checkpoint_best.pt'}` again" in str(err.value)


def test_consolidate_never_overwrites_a_training_checkpoint(tmp_path):
    write_set(tmp_path, "checkpoint_best", [10, 10], run="old")
    torch.save(fake_state(12, world=1, run="one", sharded=False), tmp_path / "checkpoint_best.pt")
    before = (tmp_path / "checkpoint_best.pt").read_bytes()
    with pytest.raises(CheckpointSetError, match=r"checkpoint_best\.pt exists and was not written by smlp-consolidate "
                                                 r"\(a training checkpoint, checkpoint_best\.pt: update 12"):
        consolidate(str(tmp_path / "checkpoint_best.pt"))
    assert (tmp_path / "checkpoint_best.pt").read_bytes() == before
