"""Packaged corpora (launch/packaged_corpus.py): the committed kernel-docs archive matches its pin and selection rule,
an archive cut from a package is reproducible and holds exactly the selected files, and smlp-prepare-data --corpus
builds from the archive (its sha256 checked), records the corpus in the manifest and refuses a changed archive."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from smlp_launch import data as D
from smlp_launch import packaged_corpus as P
from smlp_launch.data import DataPrepError


def test_the_committed_kernel_docs_archive_is_its_pin_english_text_and_licensed():
    c = P.KERNEL_DOCS
    assert P.sha256_file(c.archive) == c.archive_sha256
    members = P.read_archive(c.archive)
    assert P.content_digest(members) == c.content_sha256
    assert len(members) > 4000 and all(n.startswith("Documentation/") for n in members)
    assert not [n for n in members if n.startswith("Documentation/translations/") or n.endswith(".gz")]
    assert {Path(n).suffix for n in members} == {".rst", ".txt"}
    words = sum(len(t.split()) for t in members.values())
    assert 3.5e6 < words < 4.0e6  # about 3.8M English words: 7.4M training tokens at 4000 pieces
    for name in c.licences:
        assert (c.folder / name).is_file(), name
    assert "GNU GENERAL PUBLIC LICENSE" in (c.folder / "GPL-2").read_text()
    assert c.version in (c.folder / "LICENCES.md").read_text()


def _deb(tmp: Path, files: dict[str, bytes]) -> Path:
    """A real .deb (dpkg-deb --build) holding `files` (paths from its root)."""
    root = tmp / "pkg"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "DEBIAN").mkdir(parents=True, exist_ok=True)
    (root / "DEBIAN" / "control").write_text("Package: fake-doc\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: t <t@t>\nDescription: fake\n")
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(tmp / "fake.deb")], check=True,
                   capture_output=True)
    return tmp / "fake.deb"


def _fake_corpus(tmp: Path, monkeypatch, **fields) -> P.PackagedCorpus:
    c = dataclasses.replace(P.KERNEL_DOCS, name="fake-docs", package="fake-doc", version="1.0", **fields)
    monkeypatch.setattr(P, "CORPORA_DIR", tmp / "corpora")
    monkeypatch.setitem(P.CORPORA, c.name, c)
    return c


def test_an_archive_cut_from_a_package_holds_the_selected_files_and_is_reproducible(tmp_path, monkeypatch):
    doc = P.KERNEL_DOCS.root + "Documentation/"
    text = {"a.rst": b"A first document.\nWith two lines.\n", "sub/b.txt": b"Plain text.\n",
            "translations/it_IT/c.rst": b"Testo italiano.\n", "devicetree/x.yaml": b"yaml: 1\n"}
    deb = _deb(tmp_path, {doc + n + ".gz": gzip.compress(t) for n, t in text.items()} | {doc + "README": b"x\n"})
    c = _fake_corpus(tmp_path, monkeypatch)
    with pytest.raises(DataPrepError, match=f"pinned at {c.deb_sha256}"):
        P.deb_members(c, deb)  # not the pinned package's bytes
    members = P.deb_members(c, deb, check=False)
    assert members == {"Documentation/a.rst": text["a.rst"], "Documentation/sub/b.txt": text["sub/b.txt"]}
    one, two = tmp_path / "one.tar.xz", tmp_path / "two.tar.xz"
    P.write_archive(members, one)
    P.write_archive(dict(reversed(members.items())), two)
    assert one.read_bytes() == two.read_bytes() and P.read_archive(one) == members
    # the digest covers names and bytes: a renamed or changed file changes it
    d = P.content_digest(members)
    assert d != P.content_digest({"Documentation/a2.rst": text["a.rst"], "Documentation/sub/b.txt": text["sub/b.txt"]})
    assert d != P.content_digest({**members, "Documentation/a.rst": b"changed\n"})


def test_prepare_data_builds_a_packaged_corpus_from_its_archive_and_refuses_a_changed_one(tmp_path, monkeypatch):
    plays = {p.name: p for p in D.demo_inputs()}
    members = {f"Documentation/{n}.rst": plays[f"{n}_gut.txt"].read_bytes() for n in ("macbeth", "tempest")}
    c = _fake_corpus(tmp_path, monkeypatch)
    c.folder.mkdir(parents=True)
    P.write_archive(members, c.archive)
    c = _fake_corpus(tmp_path, monkeypatch, archive_sha256=P.sha256_file(c.archive),
                     content_sha256=P.content_digest(members))
    cache = tmp_path / "cache"
    out, reused = D.prepare_data(tmp_path / "data", corpus=c.name, vocab_size=400, workers=2, log=None,
                                 cache_dir=cache, block_lines=100)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not reused and manifest["params"]["corpus"] == c.name
    assert manifest["corpus"]["archive_sha256"] == c.archive_sha256 and manifest["corpus"]["version"] == "1.0"
    assert sorted(s["name"] for s in manifest["sources"]) == sorted(members)
    assert {s["sha256"] for s in manifest["sources"]} == {hashlib.sha256(t).hexdigest() for t in members.values()}
    # the same corpus again: reused; the --input of the same files is another fingerprint (no corpus in it)
    assert D.prepare_data(tmp_path / "data", corpus=c.name, vocab_size=400, workers=2, log=None, cache_dir=cache,
                          block_lines=100)[1]
    # an archive whose bytes are not its pin is refused, naming both
    c.archive.write_bytes(c.archive.read_bytes() + b"\0")
    with pytest.raises(DataPrepError, match=f"pinned {c.archive_sha256}"):
        D.prepare_data(tmp_path / "other", corpus=c.name, vocab_size=400, log=None, cache_dir=tmp_path / "cache2")
    with pytest.raises(DataPrepError, match="give one of"):
        D.prepare_data(tmp_path / "x", [tmp_path], corpus=c.name, log=None)
