"""Save folders a cluster job can trust (docs/faults.md lists each case): what a training run loads, the newest
complete save of any world size, a --restore-file or a --finetune-from-model of any layout
(fairseq_plugins/checkpoint_sources.py), the user's files left as they were, one job per folder, whole saves
pruned whatever world wrote them (fairseq_plugins/save_dir.py).

Train once, check many ways: one 2-rank sMLP (2 experts, a warm-up schedule, a save every 2 updates, 7 updates) in a
folder whose path holds `.pt` (`exp.ptb/base`), then from its files, each once: a 2-rank --restore-file of
smlp-consolidate's merge of update 6, a 2-rank and a 1-process --finetune-from-model of the update-4 set (learning
rate 0, so the saved experts are the loaded ones), and a 1-process requeue of a folder whose checkpoint_last is older
than a complete numbered save. The reference is the 2-rank run itself: fairseq reseeds every update, so a run that
continues from update 6 with the same weights and batch logs update 7's loss exactly (1 process with --update-freq
2: within float noise). The other cases need no training: real files, a killed writer, a lock holder, refusals.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_fairseq, run_in_process, train_losses

SMLP = ["--arch", "smlp_lm_tiny", "--num-experts", "2", "--disable-validation"]
# a warm-up, so that an update count started again at 0 shows in the learning rate
SCHEDULE = ["--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--warmup-init-lr", "1e-4"]


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
    res = run_fairseq("fairseq-train", _flags(tiny_lm_data, base, *SCHEDULE, "--save-interval-updates", "2",
                                              "--max-update", "7"), world=2)
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
        tiny_lm_data, requeue, *SCHEDULE, "--update-freq", "2", "--max-update", "8", "--save-interval-updates", "1",
        "--keep-interval-updates", "3")))
    out["requeue"] = (train_losses(text), text, _digest(requeue))
    restored = root / "exp.ptb" / "restored"
    res = run_fairseq("fairseq-train", _flags(tiny_lm_data, restored, *SCHEDULE, "--restore-file",
                                              str(out["merged"]), "--max-update", "7"), world=2)
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
    assert "removed checkpoint_1_2-rank-1.pt: an older save than --keep-interval-updates 3 keeps" in text, text[-3000:]


@pytest.mark.slow
def test_restoring_a_merged_file_on_two_ranks_continues_its_updates_schedule_and_data(runs):
    """--restore-file merged.pt (smlp-consolidate's merge of update 6, which drops the optimizer state) on 2 ranks:
    resharded under --save-dir (never beside the user's file, which is left as it was), it continues with update 7
    at update 7's learning rate (mid warm-up) and logs the uninterrupted run's update-7 loss (same weights, same
    batch)."""
    losses, text, lrs, files = runs["restored"]
    assert sorted(losses) == [7], text[-3000:]
    assert lrs[7] == runs["base_lrs"][7] != runs["base_lrs"][1], (lrs, runs["base_lrs"])  # mid warm-up
    assert losses[7] == runs["base_losses"][7], (losses, runs["base_losses"])
    assert "checkpoint_resharded_6_w2-rank-0.pt holds no optimizer state (smlp-consolidate leaves it out): the " \
           "update count (6), the learning-rate schedule and the data position continue from it" in text, text[-3000:]
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
        loaded = _model(base / f"checkpoint_1_4-rank-{r}.pt")
        saved = _model(root / "ft2" / f"checkpoint_last-rank-{r}.pt")
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
    from fairseq_plugins.elastic import inspect_saved, plan_resume
    from fairseq_plugins.shard_tags import rank_shards, shard_path
    from smlp.expert_data_parallel import ExpertDataLayout

    last = str(runs["base"] / "checkpoint_last.pt")
    assert shard_path(last, "-rank-1") == str(runs["base"] / "checkpoint_last-rank-1.pt")
    assert sorted(rank_shards(last)) == [0, 1]
    assert plan_resume(last, world_size=2, sharded=True, num_experts=2, replicated=inspect_saved(last).replicated,
                       layout=ExpertDataLayout(world_size=2, ep_size=2, num_experts=2)) is None


# ----------------------------------------------------------------------------- one job per folder, its files


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def _killed_write(path: Path) -> int:
    """The exit status of a fork of this process SIGKILLed inside the one writer while it writes `path`."""
    import signal

    from smlp.files import write_atomic

    def die(f):
        f.write(b"PK part of a file")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()
    if pid == 0:  # the child never returns: it is killed inside the write
        write_atomic(path, die)
        os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.slow
def test_the_stale_sweep_removes_every_writers_killed_temporaries_and_no_user_file(tmp_path):
    """Writes killed partway (SIGKILL inside the one writer) of a rank shard, a resharded set, a merged file and a
    crash file leave temporaries of one form, and the sweep at start removes exactly those: not a user's
    `checkpoint_last-rank-0.pt.backup_1.tmp` (the old pattern took it), nor other names that merely look alike."""
    import signal

    from fairseq_plugins.atomic_files import remove_stale_temp_files

    for name in ("checkpoint_last-rank-1.pt", "checkpoint_resharded_6_w1.pt", "checkpoint_best.pt", "crash.pt"):
        status = _killed_write(tmp_path / name)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 4 and all(n.startswith(".") and ".smlp-tmp-" in n for n in left), left
    users = ["checkpoint_last-rank-0.pt.backup_1.tmp", "checkpoint_last.pt.abcdefgh.tmp", "notes.tmp",
             ".checkpoint_last.pt.smlp-tmp-mine", "dummy", "checkpoint_last-rank-0.pt"]
    for name in users:
        (tmp_path / name).write_text("the user's own file")
    (tmp_path / ".x.smlp-tmp-0123456789abcdef").mkdir()  # a folder of that form is not a writer's file
    before = _snapshot(tmp_path)
    removed = remove_stale_temp_files(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == left
    assert _snapshot(tmp_path) == {n: v for n, v in before.items() if n not in left}


def _holder(folder: Path):
    """A process holding `folder`'s lock as a training job's rank 0 does."""
    import subprocess
    import sys

    code = ("import sys, time; from smlp import folder_lock; folder_lock.hold(sys.argv[1], 'fairseq-train'); "
            "print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_second_job_on_a_save_folder_is_refused_naming_the_holder_before_any_file_is_touched(tmp_path, tiny_lm_data):
    """The first job (its rank 0 holds the folder's lock) is writing a save; a second fairseq-train on the same
    --save-dir refuses in one line naming host, pid and start, and leaves every file as it was (the first job's
    temporary file included); smlp-launch refuses before it starts a worker. SIGKILL of the holder frees it."""
    import socket

    from fairseq_helpers import TRAIN, fairseq_train
    from fairseq_plugins.errors import RefusedInput
    from fairseq_plugins.save_dir import open_save_dir
    from smlp import folder_lock
    from smlp.files import temp_name
    from smlp_launch.local import _check_paths
    from smlp_launch.worker import LaunchError

    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "checkpoint_last.pt").write_bytes(b"the first job's save")
    (save / temp_name("checkpoint_last.pt")).write_bytes(b"the first job's save being written")
    holder = _holder(save)
    try:
        before = _snapshot(save)
        with pytest.raises(RefusedInput) as err:
            fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TRAIN,
                           "--save-dir", str(save)])
        message = str(err.value)
        assert message.startswith(f"--save-dir {save} is in use by another training job (host "
                                   f"{socket.gethostname()}, pid {holder.pid}, started 20"), message
        assert "(fairseq-train)): two jobs in one save folder would overwrite each other's checkpoints" in message
        assert "\n" not in message
        with pytest.raises(LaunchError, match=f"pid {holder.pid}"):
            _check_paths([str(tiny_lm_data), "--save-dir", str(save)])
        assert _snapshot(save) == before
    finally:
        holder.kill()
        holder.wait()
    open_save_dir(str(save))  # the kernel released it: this process holds it now
    folder_lock.release(save)


def test_runs_that_save_nothing_share_a_folder_and_take_no_lock(tmp_path, tiny_lm_data):
    """--no-save runs (benchmarks, tests beside each other in one working folder) take no lock on their save
    folder, so a held lock refuses none of them, and they leave the folder as it was."""
    from fairseq_helpers import TRAIN, fairseq_train
    from smlp import folder_lock
    from smlp_launch.local import _check_paths

    save = tmp_path / "ckpt"
    save.mkdir()
    holder = _holder(save)
    try:
        before = _snapshot(save)
        fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TRAIN, "--no-save",
                       "--save-dir", str(save)])
        _check_paths([str(tiny_lm_data), "--no-save", "--save-dir", str(save)])
        assert _snapshot(save) == before
        from fairseq import checkpoint_utils  # a later save-writing program in this process locks its folder again

        checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
        assert (tmp_path / ".smlp-save-dir.lock").exists()
        folder_lock.release(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_the_start_up_check_leaves_a_users_dummy_file_alone(tmp_path):
    """fairseq's verify_checkpoint_directory opened, emptied and deleted `SAVE_DIR/dummy`; the plugins' check
    probes with a name only the one writer uses."""
    from fairseq import checkpoint_utils

    from smlp import folder_lock

    (tmp_path / "dummy").write_text("a user's notes")
    checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
    folder_lock.release(tmp_path)
    assert (tmp_path / "dummy").read_text() == "a user's notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smlp-save-dir.lock", "dummy"]


@contextlib.contextmanager
def _read_only(folder: Path):
    """`folder` made read-only for this process: chmod for a user, the immutable flag for root (who writes
    through modes); skipped where neither holds."""
    import subprocess

    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = lambda: folder.chmod(0o755)  # noqa: E731
    elif subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    else:
        pytest.skip("cannot make a folder read-only for root here (no chattr +i)")
    try:
        if os.access(folder, os.W_OK) and os.geteuid() != 0:
            pytest.skip("chmod does not make the folder read-only here")
        yield
    finally:
        undo()


@pytest.mark.slow
def test_plain_fairseq_train_refuses_a_read_only_save_folder_in_one_line(tmp_path, tiny_lm_data):
    """Not through smlp-launch: fairseq-train itself prints `fairseq-train: error: --save-dir X cannot be written
    (...)`, one line and no traceback (it was a plain OSError's traceback)."""
    import subprocess

    from fairseq_helpers import BIN, TRAIN

    save = tmp_path / "ckpt"
    save.mkdir()
    with _read_only(save):
        done = subprocess.run([str(BIN / "fairseq-train"), str(tiny_lm_data), "--user-dir", PLUGINS, "--arch",
                               "smlp_lm_tiny", *TRAIN, "--save-dir", str(save)], capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fairseq-train: error: --save-dir {save} cannot be written (") and last.endswith(
        "); training would fail at its first save. Choose a writable folder"), last
    assert list(save.iterdir()) == []


# ----------------------------------------------------------------------------- names, flags, pruning, copies


def test_one_shard_named_for_fine_tuning_is_refused_naming_its_set(tmp_path):
    from fairseq_plugins.checkpoint_sets import CheckpointSetError
    from fairseq_plugins.checkpoint_sources import refuse_one_shard

    for r in (0, 1):
        (tmp_path / f"checkpoint_last-rank-{r}.pt").write_bytes(b"x")
    with pytest.raises(CheckpointSetError) as err:
        refuse_one_shard(str(tmp_path / "checkpoint_last-rank-0.pt"))
    assert str(err.value) == (
        f"--finetune-from-model {tmp_path}/checkpoint_last-rank-0.pt is one rank's shard of the set "
        f"{tmp_path}/checkpoint_last.pt (ranks 0, 1): every rank would load rank 0's experts; pass the set's name, "
        f"--finetune-from-model {tmp_path}/checkpoint_last.pt")
    refuse_one_shard(str(tmp_path / "checkpoint_last.pt"))  # the set's name passes


def test_a_checkpoint_suffix_on_rank_shards_is_refused_in_one_line(tiny_lm_data, tmp_path):
    """fairseq replaces --checkpoint-suffix by -rank-R on an expert-parallel run (the files ignored it): refused
    by the worker's preflight and by plain fairseq-train's distributed_init, one line; one process honours it."""
    from fairseq_helpers import TRAIN
    from smlp_launch.preflight import refusal

    args = [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TRAIN, "--num-experts", "2",
            "--save-dir", str(tmp_path), "--checkpoint-suffix", "_x"]
    assert refusal([*args, "--distributed-world-size", "2"]) == (
        "--checkpoint-suffix _x: an expert-parallel run on 2 ranks names its files by rank (checkpoint_last-rank-R.pt) "
        "and fairseq would drop the suffix; keep runs apart with another --save-dir instead")
    assert refusal(args) is None


def _fake(path: Path, updates: int, run: str = "old", world: int = 2) -> None:
    from fairseq_plugins.shard_tags import SHARD_KEY

    m = re.search(r"-rank-(\d+)", path.name)
    torch.save({"model": {}, "optimizer_history": [{"num_updates": updates}], "extra_state": {},
                SHARD_KEY: {"format": 1, "rank": int(m.group(1)) if m else 0, "world_size": world if m else 1,
                            "sharded": bool(m), "num_updates": updates, "epoch": 1,
                            "set_id": f"{run}:{updates}"}}, path)


def test_pruning_counts_whole_saves_of_every_world_for_each_keep_flag(tmp_path):
    """--keep-last-epochs and --keep-best-checkpoints as --keep-interval-updates: the saves a flag drops lose
    every rank's file, whichever world size wrote them; the ones it keeps, and other names, stay."""
    from types import SimpleNamespace

    from fairseq_plugins.save_dir import prune_saves

    for name, u in (("checkpoint1", 10), ("checkpoint2", 20), ("checkpoint3", 30), ("checkpoint.best_loss_4.1000", 30),
                    ("checkpoint.best_loss_3.9000", 20), ("checkpoint.best_loss_5.0000", 10)):
        for r in (0, 1):
            _fake(tmp_path / f"{name}-rank-{r}.pt", u)
    _fake(tmp_path / "checkpoint4.pt", 40, run="new", world=1)
    _fake(tmp_path / "checkpoint_last.pt", 40, run="new", world=1)
    cfg = SimpleNamespace(keep_interval_updates=-1, keep_last_epochs=2, keep_best_checkpoints=2,
                          best_checkpoint_metric="loss", maximize_best_checkpoint_metric=False)
    removed = sorted(Path(p).name for p in prune_saves(cfg, str(tmp_path)))
    assert removed == [f"{n}-rank-{r}.pt" for n in ("checkpoint.best_loss_5.0000", "checkpoint1", "checkpoint2")
                       for r in (0, 1)], removed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{n}-rank-{r}.pt" for n in ("checkpoint.best_loss_3.9000", "checkpoint.best_loss_4.1000", "checkpoint3")
         for r in (0, 1)] + ["checkpoint4.pt", "checkpoint_last.pt"])


def test_the_sbatch_repair_copies_the_newest_complete_save_of_the_same_layout_through_the_one_writer(tmp_path):
    """checkpoint_last-rank-1.pt cut short. The newest file by time is an incomplete set (rank 1 missing) and
    a newer update comes from a 1-rank run: neither is taken; the newest complete 2-rank save is, whole."""
    from fairseq_plugins.save_dir import repair_checkpoint_last
    from smlp_launch.resume_check import main

    for r in (0, 1):
        _fake(tmp_path / f"checkpoint_1_4-rank-{r}.pt", 4)
        _fake(tmp_path / f"checkpoint_1_6-rank-{r}.pt", 6)
        _fake(tmp_path / f"checkpoint_last-rank-{r}.pt", 8)
    _fake(tmp_path / "checkpoint_1_9-rank-0.pt", 9, run="other", world=1)
    _fake(tmp_path / "checkpoint_1_8-rank-0.pt", 8)  # its rank 1 never written
    (tmp_path / "checkpoint_last-rank-1.pt").write_bytes((tmp_path / "checkpoint_last-rank-1.pt").read_bytes()[:50])
    assert repair_checkpoint_last(str(tmp_path)) == (
        "checkpoint_last-rank-1.pt could not be read: replaced by checkpoint_1_6-rank-*.pt (update 6)")
    for r in (0, 1):
        assert (tmp_path / f"checkpoint_last-rank-{r}.pt").read_bytes() == \
            (tmp_path / f"checkpoint_1_6-rank-{r}.pt").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "smlp-tmp" in p.name]
    assert main([str(tmp_path)]) == 0 and repair_checkpoint_last(str(tmp_path)) is None  # whole now


def test_published_figures_replace_their_files_whole(tmp_path):
    """smlp-bench publish wrote figures and tables over the old files in place (shutil.copy2): a reader holding
    the old file (here a hard link) saw it change under it. They are renamed into place now."""
    from smlp_bench.publish import _copy

    src, dst = tmp_path / "run", tmp_path / "docs"
    src.mkdir()
    dst.mkdir()
    (src / "figure.png").write_bytes(b"new figure")
    (dst / "figure.png").write_bytes(b"old figure")
    os.link(dst / "figure.png", tmp_path / "reader")
    _copy(src, dst, ["figure.png"])
    assert (dst / "figure.png").read_bytes() == b"new figure" and (tmp_path / "reader").read_bytes() == b"old figure"


def test_export_force_through_a_symlinked_folder_writes_into_its_target(tmp_path, monkeypatch):
    """`smlp-export --force --hf hflink` with hflink -> real/hf: the export replaces real/hf (an earlier export)
    and the link stays a link to it; nothing is left beside either (the link was replaced by a real folder and
    `.hflink.old-PID` was left). The model's loading and writing are stood in for: only the folder is in question."""
    pytest.importorskip("safetensors")
    import json

    from smlp_eval import hf_export

    def write_folder(folder, core, encoder, **kwargs):
        (folder / "config.json").write_text(json.dumps({"smlp_export": {"new": True}}))
        return ["config.json"]

    core = type("Core", (), {"cfg": type("Cfg", (), {"family": "smlp", "prediction_start": 0})})
    monkeypatch.setattr(hf_export, "_load", lambda path, data_dir: (None, core, type("E", (), {"dictionary": {}})))
    monkeypatch.setattr(hf_export, "check_representable", lambda core: None)
    monkeypatch.setattr(hf_export, "dictionary_vocab", lambda dictionary: {})
    monkeypatch.setattr(hf_export, "_write_folder", write_folder)
    target = tmp_path / "real" / "hf"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"smlp_export": {"new": False}}))
    (tmp_path / "hflink").symlink_to(target, target_is_directory=True)
    hf_export.export("model.pt", tmp_path / "hflink", force=True, verify=False)
    assert (tmp_path / "hflink").is_symlink() and os.readlink(tmp_path / "hflink") == str(target)
    assert json.loads((target / "config.json").read_text()) == {"smlp_export": {"new": True}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hflink", "real"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["hf"]


def test_fairseqs_own_pruning_on_a_rank_finds_its_old_shard_already_removed(tmp_path):
    """Every rank prunes its own old shards inside fairseq's save_checkpoint (--keep-*) while rank 0's prune_saves
    removes every rank's: rank 1 could see its shard exist, then find it gone (a FileNotFoundError that ended a
    resumed run in the full-disk test once). Inside the save, fairseq's os.remove of a file already gone is no error;
    any other failure to remove still is."""
    from fairseq import checkpoint_utils

    from fairseq_plugins.checkpoint_sets import _PruningOs

    gone = tmp_path / "checkpoint_1_2-rank-1.pt"
    assert os.path.lexists(tmp_path) and not gone.exists()
    _PruningOs().remove(str(gone))  # removed by rank 0 after this rank's lexists
    with pytest.raises(OSError):  # a folder: not a file already gone
        _PruningOs().remove(str(tmp_path))
    assert _PruningOs().path is os.path and checkpoint_utils.os is os  # the real module outside a save
