"""A stage of the fair benchmark runs the code of the commit it started at (benchmarks/pinned.py), whatever the
checkout holds later: a tiny stage of real 2-rank trainings is started at commit A of a copy of the project,
stopped after its first run, commit B changes smlp/, and the resumed run still executes A's code (a marker
that only A's smlp/ writes, from every process that imports it)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smlp_bench import cli, fair, machine, training

ROOT = Path(fair.__file__).resolve().parents[1]
PROJECT = ("smlp", "fairseq_plugins", "launch", "benchmarks", "eval", "pyproject.toml", ".gitignore")
MARKER = ("\nimport os as _os\nif _os.environ.get('SMLP_TEST_MARKER'):\n"
          "    with open(_os.environ['SMLP_TEST_MARKER'], 'a') as _f:\n        _f.write('{0}\\n')\n")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _project_copy(repo: Path) -> None:
    repo.mkdir()
    for name in PROJECT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, repo / name)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t"), _git(repo, "config", "user.name", "t")


def _commit_marker(repo: Path, mark: str) -> str:
    init = repo / "smlp" / "__init__.py"
    text = init.read_text().split("\nimport os as _os\n")[0]
    init.write_text(text + MARKER.format(mark))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"marker {mark}")
    return _git(repo, "rev-parse", "HEAD")


@pytest.mark.slow
def test_a_resumed_stage_runs_the_commit_it_started_at(tmp_path, tiny_lm_data, monkeypatch):
    repo = tmp_path / "repo"
    _project_copy(repo)
    commit_a = _commit_marker(repo, "A")
    marks = tmp_path / "marks.txt"
    monkeypatch.setenv("SMLP_TEST_MARKER", str(marks))
    monkeypatch.setattr(machine, "CODE_ROOT", repo)  # the repository the benchmark's code comes from
    monkeypatch.setattr(machine, "matmul_peak", lambda n: {"total": 1e11, "per_rank": [5e10] * n})
    # a tiny sweep: sMLP-det at two rates, 4 updates each, nothing widened
    monkeypatch.setattr(fair, "FAMILIES", ("smlp_det",))
    monkeypatch.setattr(fair, "RATES", (1e-3, 2e-3))
    monkeypatch.setattr(fair, "WIDEN", 0)
    monkeypatch.setattr(fair, "FAIR_TARGET", dict(d_model=32, d_ffn=64, seq_len=32, dense=1, sparse=1, experts=2))
    monkeypatch.setitem(fair.TARGETS, "lr-sweep", fair.FAIR_TARGET)
    monkeypatch.setitem(fair.STAGE_SETTINGS, "lr-sweep", dict(
        batch_size=2, log_interval=1, validate_every=2, valid_steps=1, warmup=1, lr=1e-3, seeds=[1], updates=4,
        probe_updates=0, profile_steps=0))
    out, work = repo / "docs" / "fair", tmp_path / "work"
    args = ["--fair", "--stages", "lr-sweep", "--output-dir", str(out), "--work-dir", str(work), "--data",
            str(tiny_lm_data), "--commit-store"]
    real, calls = training.run_training, []

    def stop_before_the_second(*a, **kw):
        calls.append(kw.get("code"))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(training, "run_training", stop_before_the_second)
    assert cli.main(args) == 130
    first = marks.read_text().split()
    assert first and set(first) == {"A"}  # the planning and the first run's processes imported A's smlp

    commit_b = _commit_marker(repo, "B")  # main moves on: a change under smlp/
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, "-c", "import smlp"], cwd=repo, env=env, check=True)
    assert marks.read_text().split()[-1] == "B"  # the checkout's own code now writes B
    marks.write_text("")

    monkeypatch.setattr(training, "run_training", real)
    assert cli.main([*args, "--resume"]) == 0
    resumed = marks.read_text().split()
    assert resumed and set(resumed) == {"A"}  # ... the resumed stage still ran A
    store = json.loads((out / "lr-sweep" / "runs.json").read_text())
    runs = [r for r in store["records"].values() if r["kind"] == "train"]
    assert len(runs) == 2 and all(r["code"] == {"commit": commit_a, "dirty": False, "pinned": True} for r in runs)
    assert store["extra"]["code"]["commit"] == commit_a != commit_b
    assert [c.commit for c in calls] == [commit_a, commit_a]
    tree = work / "code" / commit_a[:12]
    assert _git(tree, "rev-parse", "HEAD") == commit_a and not _git(tree, "status", "--porcelain")
    # the store went to the checkout's folder and was committed there, on top of B
    assert "stage lr-sweep: finished" in _git(repo, "log", "-1", "--format=%s", "--", "docs/fair/lr-sweep")
