"""Every file the tools write has the mode a plain open() gives under the user's umask (smlp/files.py, the one
atomic writer), so a teammate on a shared cluster can read, resume and evaluate a run.

Under umask 022 and 027, once each: a 2-rank training saving every update (rank shards, numbered saves and their
copies), its consolidation, its resharding (the 2-rank set resumed on one process: one file, the old set kept
aside), a Hugging Face export, a data-bin from smlp-prepare-data, a package fetched into the data cache, and a
benchmark's run store, record and figure. The reference is a file made by open() and a folder made by mkdir beside them
under the same umask (tempfile.mkstemp made every rank checkpoint 0600, mkdtemp the data cache's folders 0700).
"""
from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

import pytest

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_fairseq, run_in_process

pytestmark = pytest.mark.slow

UMASKS = (0o022, 0o027)


def _train_flags(data, save) -> list[str]:
    return [str(data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TINY_TRAIN, "--num-experts", "2",
            "--save-interval-updates", "1", "--disable-validation", "--save-dir", str(save)]


def _wheel(folder: Path) -> None:
    folder.mkdir()
    with zipfile.ZipFile(folder / "smlp_probe-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("smlp_probe/data.txt", "probe\n")
        zf.writestr("smlp_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: smlp-probe\nVersion: 1.0\n")
        zf.writestr("smlp_probe-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("smlp_probe-1.0.dist-info/RECORD", "")


@pytest.fixture(scope="module", params=UMASKS, ids=lambda m: f"umask{m:03o}")
def written(request, tiny_lm_data, tmp_path_factory):
    """(root, umask): everything the tools wrote under `umask` lies under root (root itself is pytest's)."""
    from fairseq_plugins.checkpoints import consolidate
    from smlp_bench.report import png_axes
    from smlp_bench.store import RunStore, write_record, write_text
    from smlp_eval import hf_export
    from smlp_eval.pkgdata import fetch_package
    from smlp_launch.data import prepare

    mask = request.param
    root = tmp_path_factory.mktemp(f"modes{mask:03o}")
    save = root / "ckpt"
    assert_ok(run_fairseq("fairseq-train", [*_train_flags(tiny_lm_data, save), "--max-update", "2"], world=2,
                          umask=mask))
    old, env = os.umask(mask), dict(os.environ)
    try:
        _wheel(root.parent / f"index{mask:03o}")  # pip copies a local archive with its mode
        consolidate(str(save / "checkpoint_last.pt"), out=str(root / "merged" / "checkpoint.pt"))
        assert_ok(run_in_process("fairseq-train", [*_train_flags(tiny_lm_data, save), "--max-update", "3"]))
        hf_export.export(str(root / "merged" / "checkpoint.pt"), root / "hf", verify=False)
        lines = [f"line {i} of a small corpus: the quick brown fox jumps over the lazy dog" for i in range(400)]
        splits = {}
        for name, part in (("train", lines[:300]), ("valid", lines[300:350]), ("test", lines[350:])):
            splits[name] = [root.parent / f"{name}{mask:03o}.txt"]
            splits[name][0].write_text("\n".join(part) + "\n")
        prepare(root / "data-bin", vocab_size=300, workers=1, log=None, **splits)
        os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(root.parent / f"index{mask:03o}"))
        fetch_package("smlp-probe==1.0", root / "cache")
        (root / "bench").mkdir()
        RunStore(root / "bench" / "runs.json", {"models": []}).save()
        write_record(root / "bench" / "record.json", {"benchmark": "modes"})
        write_text(root / "bench" / "table.md", "| a |\n")
        with png_axes(root / "bench" / "figure.png", "modes", "x", "y") as ax:
            ax.plot([0, 1], [0, 1], label="line")
        (root / "plain").mkdir()
        with open(root / "plain" / "file", "w"):
            pass
    finally:
        os.umask(old)
        os.environ.clear()
        os.environ.update(env)
    return root, mask


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_every_file_and_folder_has_the_mode_open_and_mkdir_give_under_the_umask(written):
    root, mask = written
    file_mode, dir_mode = _mode(root / "plain" / "file"), _mode(root / "plain")
    assert (file_mode, dir_mode) == (0o666 & ~mask, 0o777 & ~mask)  # the references are what the umask says
    found = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.relative_to(root).parts[0]
             != "plain" and not p.name.endswith(".lock")}
    kinds = {"ckpt/checkpoint_1_1-rank-1.pt", "ckpt/checkpoint_1_2-rank-0.pt",  # training's rank shards
             "ckpt/checkpoint_last.pt",  # resharded to one file, then saved again by the 1-process run
             "ckpt/resharded-from-2-ranks-update-2/checkpoint_last-rank-1.pt",  # the 2-rank set kept aside
             "merged/checkpoint.pt", "hf/model.safetensors", "hf/config.json", "data-bin/train.bin",
             "data-bin/manifest.json", "cache/packages/smlp-probe-1.0/smlp_probe/data.txt", "bench/runs.json",
             "bench/record.json", "bench/table.md", "bench/figure.png"}
    assert kinds <= set(found), sorted(kinds - set(found))
    wrong = {name: oct(_mode(p)) for name, p in found.items()
             if _mode(p) != (dir_mode if p.is_dir() else file_mode) and not p.is_symlink()}
    assert not wrong, (f"expected files {oct(file_mode)}, folders {oct(dir_mode)}", wrong)
    assert not [n for n in found if n.endswith(".tmp") or ".tmp-" in n]  # no temporary file or folder left
