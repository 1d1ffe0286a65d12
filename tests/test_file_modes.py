"""Every file the tools write has the mode a plain open() gives under the user's umask (smlp/files.py, the one
atomic writer), so a teammate on a shared cluster can read, resume and evaluate a run.

Under umask 022 and 027, once each: a 2-rank training saving every update (rank shards, numbered saves and their
copies), its consolidation, its resharding (the 2-rank set resumed on one process: one file written beside it),
a Hugging Face export, a data-bin from smlp-prepare-data, a package fetched into the data cache, and a
benchmark's run store, record and figure. The reference is a file made by open() and a folder made by mkdir beside them
under the same umask (tempfile.mkstemp made every rank checkpoint 0600, mkdtemp the data cache's folders 0700).
The one writer itself is also checked, in one process, under umasks 022, 027 and 077 and in a folder whose default
ACL gives the group rw and others nothing (the mode then comes from the ACL, not the umask: a mode computed from
the umask gave 0600 with the ACL's mask emptied, or 0644 against it).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_fairseq, run_in_process

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


@pytest.mark.slow
def test_every_file_and_folder_has_the_mode_open_and_mkdir_give_under_the_umask(written):
    root, mask = written
    file_mode, dir_mode = _mode(root / "plain" / "file"), _mode(root / "plain")
    assert (file_mode, dir_mode) == (0o666 & ~mask, 0o777 & ~mask)  # the references are what the umask says
    found = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.relative_to(root).parts[0]
             != "plain" and not p.name.endswith(".lock")}
    kinds = {"ckpt/checkpoint_1_1-rank-1.pt", "ckpt/checkpoint_1_2-rank-0.pt",  # training's rank shards
             "ckpt/checkpoint_last.pt", "ckpt/checkpoint_1_3.pt",  # the 1-process run's, resumed from a resharded file
             "merged/checkpoint.pt", "hf/model.safetensors", "hf/config.json", "data-bin/train.bin",
             "data-bin/manifest.json", "cache/packages/smlp-probe-1.0/smlp_probe/data.txt", "bench/runs.json",
             "bench/record.json", "bench/table.md", "bench/figure.png"}
    assert kinds <= set(found), sorted(kinds - set(found))
    wrong = {name: oct(_mode(p)) for name, p in found.items()
             if _mode(p) != (dir_mode if p.is_dir() else file_mode) and not p.is_symlink()}
    assert not wrong, (f"expected files {oct(file_mode)}, folders {oct(dir_mode)}", wrong)
    assert not [n for n in found if n.endswith(".tmp") or ".tmp-" in n]  # no temporary file or folder left


# ---------------------------------------------------------------------------- the one writer, umask and ACL


def acl_tools() -> None:
    """setfacl/getfacl (Debian's `acl`), installed as launch/slurm/local_cluster.sh installs SLURM: with apt-get
    as root unless SMLP_ACL_NO_INSTALL=1; else the test is skipped saying why, or fails under SMLP_REQUIRE_ACL=1
    (.ci/run installs the package and sets it)."""
    if shutil.which("setfacl") is None and os.geteuid() == 0 and shutil.which("apt-get") \
            and os.environ.get("SMLP_ACL_NO_INSTALL") != "1":
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(["apt-get", "install", "-y", "-q", "acl"], capture_output=True, env=env).returncode:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
            subprocess.run(["apt-get", "install", "-y", "-q", "acl"], capture_output=True, env=env)
    if shutil.which("setfacl") is None:
        reason = "setfacl is missing: install Debian's acl package (apt-get install -y acl)"
        if os.environ.get("SMLP_REQUIRE_ACL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _acl(path: Path) -> str:
    """getfacl's entries of `path` (without its header), the mode bits included."""
    out = subprocess.run(["getfacl", "-p", "--omit-header", str(path)], capture_output=True, text=True, check=True)
    return out.stdout


def _writes(folder: Path) -> dict[str, Path]:
    """A file of each of the one writer's forms in `folder`, and the reference made by open()."""
    from fairseq_plugins.atomic_files import atomic_torch_save
    from smlp.files import write_atomic, write_atomic_by_name

    def replacing(tmp: str) -> None:  # a library that writes its own file over ours (safetensors did, 0600)
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"weights")
        os.close(fd)

    with open(folder / "plain", "w"):
        pass
    write_atomic(folder / "record.json", "{}")
    atomic_torch_save({"w": 1}, str(folder / "checkpoint_last.pt"))
    write_atomic_by_name(folder / "model.safetensors", replacing)
    return {name: folder / name for name in ("plain", "record.json", "checkpoint_last.pt", "model.safetensors")}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
@pytest.mark.parametrize("acl", [False, True], ids=["no-acl", "default-acl"])
def test_the_one_writer_gives_the_mode_open_gives_under_the_umask_and_the_default_acl(tmp_path, mask, acl):
    """In a folder with a default ACL (group rw, others nothing) the kernel ignores the umask: open() gives 0660
    and an access ACL like the default. The writer's files match open()'s reference bit for bit (mode and ACL),
    under each umask; a file that exists keeps its own mode."""
    folder = tmp_path / "runs"
    folder.mkdir()
    if acl:
        acl_tools()
        done = subprocess.run(["setfacl", "-d", "-m", "u::rw,g::rw,o::-", str(folder)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"this filesystem has no ACLs: {done.stderr.strip()}")
    with _umask(mask):
        files = _writes(folder)
    expected = 0o660 if acl else 0o666 & ~mask
    modes = {name: oct(stat.S_IMODE(p.stat().st_mode)) for name, p in files.items()}
    assert modes == dict.fromkeys(files, oct(expected)), modes
    if acl:
        reference = _acl(files["plain"])
        assert {name: _acl(p) for name, p in files.items()} == dict.fromkeys(files, reference)
    from smlp.files import write_atomic

    os.chmod(files["record.json"], 0o604)
    with _umask(mask):
        write_atomic(files["record.json"], "[]")
    assert stat.S_IMODE(files["record.json"].stat().st_mode) == 0o604
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no temporary file left
