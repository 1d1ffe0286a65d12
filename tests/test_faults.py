"""Faults with real processes: a worker killed mid-step, mid-all2all or mid-save, a hung worker, and
SLURM's time limit and requeue during a save (issue 14).

Every run is `smlp_lm_tiny` on 2 gloo ranks (1 thread each) through the real launchers. "Ends
cleanly" means: the launcher (or the SLURM job) ends non-zero within 60 s, names the rank, and no
process of the run is left (found through /proc by the run's unique tmp path). "Consistent resume"
means: the per-update training losses of every interrupted-and-resumed run equal those of one
uninterrupted run (the `baseline` fixture), update for update, so no update was lost or applied
twice, even when the resumed run had to fall back from a mixed set of shards to an older save.

Faults are injected on cue by tests/smlp_fault_plugin (a --user-dir wrapping our plugins).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fairseq_helpers import PLUGINS, SHARED_RUN_UPDATES, TINY_TRAIN, train_losses
from smlp_launch.fairseq_log import loaded_updates
from test_launch import (
    SBATCH,
    SMLP_LAUNCH,
    assert_no_processes,
    processes_mentioning,
    read,
    slurm,  # noqa: F401  (a pytest fixture: test parameters name it)
    wait_for,
    wait_job_end,
    wait_log,
)

pytestmark = pytest.mark.slow

FAULT_PLUGIN = str(Path(__file__).parent / "smlp_fault_plugin")
MAX_UPDATE = 8
BASELINE_UPDATES = 40  # the SLURM test's runs reach about 30 updates
TRAIN = ["--arch", "smlp_lm_tiny", *TINY_TRAIN, "--save-interval-updates", "1", "--keep-interval-updates", "3",
         "--no-epoch-checkpoints", "--disable-validation"]


@pytest.fixture(scope="module")
def baseline(smlp_tiny_two_ranks) -> dict[int, float]:
    """Per-update losses of one uninterrupted 2-rank run: the session's shared smlp_lm_tiny run (conftest.py),
    the model and training flags of TRAIN (it also validates, which changes no training loss)."""
    _, log = smlp_tiny_two_ranks("deterministic")
    losses = train_losses(log)
    assert sorted(losses) == list(range(1, SHARED_RUN_UPDATES + 1)), losses
    assert SHARED_RUN_UPDATES >= BASELINE_UPDATES
    return losses


def worker_pid(marker: str, rank: int) -> int:
    """pid of the training worker of `rank` whose command line mentions `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (marker in " ".join(argv) and "--worker" in argv and "bash" not in argv[0]
                and argv[argv.index("--distributed-rank") + 1:][:1] == [str(rank)]
                if "--distributed-rank" in argv else False):
            found.append(int(d.name))
    assert len(found) == 1, (found, processes_mentioning(marker))
    return found[0]


def launch(tmp_path: Path, data, *fairseq, env=None, max_update=MAX_UPDATE, name="run", launcher=()):
    out = tmp_path / f"{name}.out"
    cmd = [SMLP_LAUNCH, "--nproc", "2", "--cpu", "--threads", "1", "--grace", "5", *launcher, "--",
           str(data), *TRAIN, "--max-update", str(max_update), "--save-dir", str(tmp_path / "ckpt"), *fairseq]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, out


def finish(proc, out: Path, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, read(out), time.monotonic() - t0


def rank_log(tmp_path: Path, rank: int) -> str:
    return read(tmp_path / "ckpt" / "launch-logs" / f"rank{rank}.log")


def assert_same_losses(text: str, baseline: dict[int, float]) -> dict[int, float]:
    got = train_losses(text)
    assert got, text[-3000:]
    assert {u: baseline[u] for u in got} == got, (got, baseline)
    return got


# ----------------------------------------------------------------------------- smlp-launch


def kill_rank_1_and_check_every_worker_ends(proc, out, tmp_path) -> str:
    """SIGKILL rank 1: the launcher must fail within 60 s, name the killed rank and how rank 0 ended,
    and leave no process behind. Returns the launcher's output."""
    os.kill(worker_pid(str(tmp_path), 1), signal.SIGKILL)
    rc, text, took = finish(proc, out, 60)
    assert rc == 128 + signal.SIGKILL and took < 60, (rc, took, text[-3000:])
    assert "FAILED: rank 1 was killed by SIGKILL" in text
    assert re.search(r"then: rank 0 (was killed by SIGTERM|exited with code [1-9])", text), text[-2000:]
    assert_no_processes(str(tmp_path), within=10)
    return text


def test_sigkill_while_saving_ends_all_workers_and_the_resume_is_consistent(tiny_lm_data, tmp_path, baseline):
    """Rank 1 is SIGKILLed while it saves update 5: every rank has written checkpoint_1_5 and its copy to
    checkpoint_last, and rank 0 has renamed its copy, rank 1 not yet (a rank names no file of a save before every
    rank has written its own, so only a kill between the renames leaves a mixed set).

    The launcher stops rank 0 and exits non-zero within 60 s with no process left. The save directory
    then holds checkpoint_last-rank-0.pt at update 5 and -rank-1.pt at 4: the next run names both
    and resumes from the newest complete set (checkpoint_1_5), going on with the baseline's losses.
    """
    from fairseq_plugins.shard_tags import read_shard

    proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", FAULT_PLUGIN,
                       env={"SMLP_FAULT_SLOW_SAVE": "rank=1,nth=5,sleep=120,rename=1"})
    wait_for(lambda: proc.poll() is not None or "rank 1 slow save of update 5" in rank_log(tmp_path, 1), 240,
             "rank 1 to be about to rename its copy of update 5")
    last = tmp_path / "ckpt" / "checkpoint_last-rank-0.pt"
    wait_for(lambda: proc.poll() is not None or read_shard(str(last)).num_updates == 5, 30, "rank 0's rename")
    assert proc.poll() is None, read(out)[-3000:]
    text = kill_rank_1_and_check_every_worker_ends(proc, out, tmp_path)
    assert_same_losses(text, baseline)

    proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", PLUGINS, name="resume")
    rc, text, _ = finish(proc, out, 300)
    assert rc == 0, text[-3000:]
    assert ("checkpoint_last.pt is not one consistent save (the shards come from different saves): "
            "checkpoint_last-rank-0.pt: update 5; checkpoint_last-rank-1.pt: update 4. Resuming from the newest "
            "complete save, checkpoint_1_5-rank-*.pt (update 5)") in text, text[-3000:]
    assert sorted(assert_same_losses(text, baseline)) == list(range(6, MAX_UPDATE + 1))
    assert re.search(r"peak RSS per rank: rank 0 \d+\.\d MiB, rank 1 \d+\.\d MiB", text), text[-500:]
    assert_no_processes(str(tmp_path), within=10)


def test_a_full_disk_on_one_rank_ends_every_rank_in_one_line_and_names_no_part_of_the_save(tiny_lm_data, tmp_path,
                                                                                            baseline):
    """Rank 1's disk is full when it creates its temporary file for update 3 (rank 0 writes its file whole): every
    rank ends with the one line a full disk gives while writing, naming rank 1's file and its folder, no
    traceback, and status 1 (no rank ends through the C library's exit(), where a static destructor aborted it once);
    no file of update 3 is named on any rank (rank 0's waited for rank 1's and was removed), update 2's
    checkpoints stay whole, no partial file is left, and the same command (the disk freed) resumes from update 2
    with the baseline's losses and status 0, its finished ranks too ending before the C library's exit()."""
    proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", FAULT_PLUGIN,
                       env={"SMLP_FAULT_ENOSPC": "nth=3,rank=1,create=1", "SMLP_FAULT_ABORT_AT_EXIT": "1"})
    rc, text, _ = finish(proc, out, 240)
    ckpt = tmp_path / "ckpt"
    assert rc == 1 and "disk full while creating checkpoint_1_3-rank-1" in text + rank_log(tmp_path, 1), text[-3000:]
    line = (rf"fairseq-train: error: could not write checkpoint {ckpt}/checkpoint_1_3-rank-1\.pt: No space left on "
            rf"device \([\d.]+ MiB free in {ckpt}\)\. The previous checkpoint_1_3-rank-1\.pt is unchanged")
    for r, log in ((0, text), (1, rank_log(tmp_path, 1))):  # the same line on every rank (rank 0's: the launcher's)
        assert re.search(rf"^(\[rank{r}\]: |smlp-launch: rank {r}: )?{line}", log, re.M), (r, log[-3000:])
        assert "Traceback" not in log, (r, log[-3000:])
    assert sorted(p.name for p in ckpt.glob("checkpoint*")) == [
        f"checkpoint_{n}-rank-{r}.pt" for n in ("1_1", "1_2", "last") for r in (0, 1)]
    from fairseq_plugins.shard_tags import read_shard

    assert [read_shard(str(ckpt / f"checkpoint_last-rank-{r}.pt")).num_updates for r in (0, 1)] == [2, 2]
    proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", FAULT_PLUGIN, name="resume",
                       env={"SMLP_FAULT_ABORT_AT_EXIT": "1"})
    rc, text, _ = finish(proc, out, 300)
    assert rc == 0 and loaded_updates(text) == [2], text[-3000:]
    assert sorted(assert_same_losses(text, baseline)) == list(range(3, MAX_UPDATE + 1))


def test_sigkill_inside_the_all2all_ends_all_workers(tiny_lm_data, tmp_path):
    """Rank 1 is SIGKILLed while it waits inside the all2all for rank 0, which then enters it."""
    proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", FAULT_PLUGIN, max_update=100000,
                       env={"SMLP_FAULT_A2A": "victim=1,call=60,sleep=5"})
    wait_for(lambda: proc.poll() is not None or "rank 1 inside all2all call 60" in rank_log(tmp_path, 1), 240,
             "rank 1 to enter the all2all")
    time.sleep(1.0)  # rank 0 sleeps 5 s before entering: rank 1 is blocked inside
    assert proc.poll() is None, read(out)[-3000:]
    kill_rank_1_and_check_every_worker_ends(proc, out, tmp_path)


@pytest.mark.parametrize("where", ["fairseq-all-reduce", "anywhere"])
def test_a_hung_worker_ends_the_run_after_the_collective_timeout(tiny_lm_data, tmp_path, where):
    """SIGSTOP (a hung peer: its sockets stay open) makes rank 0 wait in a collective; with
    --timeout 15 it fails there by itself and the launcher then ends the stopped rank.

    fairseq-all-reduce: rank 1 stops itself before fairseq's 6th all-reduce (update 2 or 3), so rank 0
    waits inside fairseq's own process group (`get_global_group`, made by `new_group`). That group
    used to get torch's 30-minute default instead of --timeout: the run outlived the test whenever
    the stop landed there. anywhere: SIGSTOP from outside after 2 updates, wherever rank 1 is."""
    if where == "fairseq-all-reduce":
        proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", FAULT_PLUGIN, max_update=100000,
                           launcher=["--timeout", "15"], env={"SMLP_FAULT_STOP_ALL_REDUCE": "victim=1,call=6"})
        wait_for(lambda: proc.poll() is not None or "stops before fairseq all-reduce" in rank_log(tmp_path, 1),
                 240, "rank 1's stop")
    else:
        proc, out = launch(tmp_path, tiny_lm_data, "--user-dir", PLUGINS, max_update=100000,
                           launcher=["--timeout", "15"])
        wait_for(lambda: proc.poll() is not None or len(train_losses(read(out))) >= 2, 240, "2 updates")
    victim = worker_pid(str(tmp_path), 1)
    if where == "anywhere":
        os.kill(victim, signal.SIGSTOP)
    try:
        rc, text, took = finish(proc, out, 90)
    finally:
        if processes_mentioning(str(tmp_path)):
            os.kill(victim, signal.SIGKILL)
    print(f"hung worker ({where}): the run ended {took:.1f} s after the stop")
    assert rc == 1 and 10 <= took < 60, (rc, took, text[-3000:])
    assert "FAILED: rank 0 exited with code 1" in text and "then: rank 1 was killed by SIGKILL" in text, text[-3000:]
    assert re.search(r"RuntimeError: .*Timed out waiting 15000ms", text), text[-3000:]
    assert_no_processes(str(tmp_path), within=10)


# ----------------------------------------------------------------------------- SLURM


def test_slurm_time_limit_requeue_during_save_and_sigkill(slurm, tiny_lm_data, tmp_path, baseline):  # noqa: F811
    """One 2-task job on the local SLURM, three runs:

    1. SLURM's own time-limit warning (--time=2 --signal=B:USR1@60) arrives mid-run: the tasks save at
       the current update, the script requeues the job; the restart loads exactly that update.
    2. (time limit raised with scontrol) `scontrol requeue` while rank 1 is about to rename its copy of a save
       to checkpoint_last that rank 0 has renamed: the tasks die of SIGTERM, leaving a mixed set; the restart
       names it and resumes from the newest complete save (that save's numbered files).
    3. A task SIGKILLed inside the all2all: srun ends the other task, the job FAILS within 60 s, nothing
       is left.
    Every logged loss equals the uninterrupted run's at the same update.
    """
    env = {**slurm, "SMLP_FAULT_STEP_SLEEP": "3,restart=0",
           "SMLP_FAULT_SLOW_SAVE": "rank=1,nth=3,sleep=120,restart=1,rename=1",
           "SMLP_FAULT_A2A": "victim=1,call=60,sleep=5,restart=2"}
    out = tmp_path / "job-%j.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", "--job-name=smlp-faults", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
         "--time=2", "--signal=B:USR1@60", f"--output={out}", f"--chdir={tmp_path}", str(SBATCH),
         str(tiny_lm_data), str(tmp_path / "ckpt"), *TRAIN, "--user-dir", FAULT_PLUGIN, "--max-update", "100000"],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    log = tmp_path / f"job-{job}.out"
    run = "train.sbatch .*job {} \\(restart {}\\)"

    # 1. the time limit's warning signal
    wait_log(env, job, log, lambda t: re.search(run.format(job, 1), t), 300, "the restart after the time-limit signal")
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=30"], env=env, check=True)
    text = read(log)
    assert "SIGUSR1 (time limit near" in text and "before training started" not in text, text[-3000:]
    stopped = int(re.search(r"saving a checkpoint at (\d+) updates", text).group(1))

    # 2. requeue while rank 1 saves (the 3rd save of the restarted run)
    m = wait_log(env, job, log, lambda t: re.search(r"rank 1 slow save of update (\d+)", t), 240, "the slow save")
    slow = int(m.group(1))
    time.sleep(1.0)
    subprocess.run(["scontrol", "requeue", job], env=env, check=True)

    # 3. the third run resumes from a complete set; then a task is killed inside the all2all
    wait_log(env, job, log,
             lambda t: "(restart 2)" in t and "rank 1 inside all2all call 60" in t.split("(restart 2)")[-1], 240,
             "rank 1 to enter the all2all in the third run")
    time.sleep(1.0)  # rank 0 sleeps 5 s before entering: rank 1 is blocked inside
    victim = worker_pid(str(tmp_path), 1)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    info = wait_job_end(env, job, 60)
    took = time.monotonic() - t0
    text = read(log)
    assert info["JobState"] == "FAILED" and took < 60, (info, took, text[-3000:])
    assert_no_processes(str(tmp_path), within=30)

    runs = re.split(r"\[train\.sbatch [^\]]*\] job \d+ \(restart \d+\)", text)[1:]
    assert len(runs) == 3, text[-5000:]
    loaded = loaded_updates(text)
    assert loaded == [stopped, slow], (loaded, stopped, slow)
    assert (f"checkpoint_last-rank-0.pt: update {slow}; checkpoint_last-rank-1.pt: update {slow - 1}. Resuming "
            f"from the newest complete save, checkpoint_1_{slow}-rank-*.pt (update {slow})") in runs[2]
    assert max(train_losses(text)) <= BASELINE_UPDATES, train_losses(text)
    logged = [sorted(assert_same_losses(r, baseline)) for r in runs]
    assert logged[0][-1] == stopped and logged[1][0] == stopped + 1 and logged[2][0] == slow + 1
    assert logged[1][-1] >= slow
