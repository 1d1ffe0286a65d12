"""Benchmark corpora cut from pinned Debian packages and kept in the repository (`smlp-prepare-data --corpus NAME`).

A registry's archive stops serving a package version once a security update replaces it, so the text itself is
committed: `launch/corpora/NAME/NAME.tar.xz` (the selected files, decompressed, in a reproducible tar), with the
package's copyright file and licence beside it. `corpus_inputs` checks the archive against its pin and unpacks it
once into the cache; `archive_from_deb` rebuilds the archive from the package (`apt-get download PKG=VERSION`,
its sha256 checked) and `python -m smlp_launch.packaged_corpus NAME --check` says whether that rebuild holds the same
text as the committed one (`content_sha256`: every member's name and bytes, independent of the compressor).
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from smlp.files import install_dir, temp_dir, write_atomic
from smlp_eval.pkgdata import DEFAULT_CACHE, MARKER, exclusive
from smlp_eval.text import DataPrepError

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"


@dataclass(frozen=True)
class PackagedCorpus:
    """A corpus: which files of which package version, and the archive committed from them."""

    name: str
    package: str             # Debian binary package
    version: str             # its exact version
    deb_sha256: str          # of the .deb file
    root: str                # the package's folder the members are named from
    include: tuple[str, ...]  # fnmatch patterns of member names (relative to root, with .gz)
    exclude: tuple[str, ...]
    archive_sha256: str      # of the committed NAME.tar.xz
    content_sha256: str      # of its members' names and bytes (`content_digest`)
    licences: tuple[str, ...]  # files beside the archive: the package's copyright and the licence texts

    @property
    def folder(self) -> Path:
        return CORPORA_DIR / self.name

    @property
    def archive(self) -> Path:
        return self.folder / f"{self.name}.tar.xz"

    def selects(self, member: str) -> bool:
        return any(fnmatch.fnmatchcase(member, p) for p in self.include) and \
            not any(fnmatch.fnmatchcase(member, p) for p in self.exclude)

    def as_source(self) -> dict:
        """What a data folder's manifest records of the corpus."""
        return {"name": self.name, "package": self.package, "version": self.version, "deb_sha256": self.deb_sha256,
                "include": list(self.include), "exclude": list(self.exclude),
                "archive": f"launch/corpora/{self.name}/{self.archive.name}", "archive_sha256": self.archive_sha256,
                "content_sha256": self.content_sha256, "licences": list(self.licences)}


# The kernel's documentation as reStructuredText and plain text, English only (translations/ left out).
KERNEL_DOCS = PackagedCorpus(
    name="kernel-docs", package="linux-doc-6.12", version="6.12.118-1~deb12u1",
    deb_sha256="57832c90306ded11cadafed9b6f639e54de7a392dfdacf32742d1a57fecdc8e1",
    root="usr/share/doc/linux-doc-6.12/", include=("Documentation/*.rst.gz", "Documentation/*.txt.gz"),
    exclude=("Documentation/translations/*",),
    archive_sha256="7e26ec1e6ac56e790288212938f1c4b22bc9c7c804a4e0a8a7a0bbab203c2d8f",
    content_sha256="42d3202a3be6224b77e908e26814ef048dab30c7d847d94d70668ac66cac3b59",
    licences=("copyright", "GPL-2", "LICENCES.md"))
CORPORA = {c.name: c for c in (KERNEL_DOCS,)}


def get_corpus(name: str) -> PackagedCorpus:
    if name not in CORPORA:
        raise DataPrepError(f"--corpus {name!r}: unknown; the packaged corpora are {', '.join(CORPORA)}")
    return CORPORA[name]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_digest(members: dict[str, bytes]) -> str:
    """sha256 over the sorted members' names and contents (length-prefixed: no two corpora collide)."""
    h = hashlib.sha256()
    for name in sorted(members):
        data, raw = members[name], name.encode()
        h.update(len(raw).to_bytes(8, "little") + raw + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def select_members(corpus: PackagedCorpus, fs_tar: tarfile.TarFile) -> dict[str, bytes]:
    """The corpus's files of a package's file-system tar: name (relative to root, .gz dropped) -> text bytes."""
    out = {}
    for info in fs_tar:
        name = info.name.removeprefix("./")
        if not info.isfile() or not name.startswith(corpus.root):
            continue
        rel = name[len(corpus.root):]
        if corpus.selects(rel):
            data = fs_tar.extractfile(info).read()
            out[rel.removesuffix(".gz")] = gzip.decompress(data) if rel.endswith(".gz") else data
    return out


def write_archive(members: dict[str, bytes], path: Path) -> None:
    """A reproducible tar.xz: sorted names, no times, owners or modes but 0644 (written through smlp.files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(members[name]), 0, 0o644
            tf.addfile(info, io.BytesIO(members[name]))
    write_atomic(path, lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, mode="r:xz") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}


def deb_members(corpus: PackagedCorpus, deb: Path, *, check: bool = True) -> dict[str, bytes]:
    """The corpus's files of the package file `deb` (its sha256 checked against the pin unless `check` is False)."""
    if check and (got := sha256_file(deb)) != corpus.deb_sha256:
        raise DataPrepError(f"{deb}: sha256 {got}, but {corpus.package}={corpus.version} is pinned at "
                            f"{corpus.deb_sha256}; download the pinned version")
    if shutil.which("dpkg-deb") is None:
        raise DataPrepError("dpkg-deb is not installed (Debian's dpkg): it unpacks the package")
    proc = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True)
    if proc.returncode != 0:
        raise DataPrepError(f"dpkg-deb could not read {deb}: {proc.stderr.decode(errors='replace').strip()[:300]}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout), mode="r:") as tf:
        members = select_members(corpus, tf)
    if not members:
        raise DataPrepError(f"{deb} holds no file matching {', '.join(corpus.include)} under {corpus.root}")
    return members


def download_deb(corpus: PackagedCorpus, folder: Path) -> Path:
    """`apt-get download PACKAGE=VERSION` into `folder`; a clear error where the archive no longer serves it."""
    proc = subprocess.run(["apt-get", "download", f"{corpus.package}={corpus.version}"], cwd=folder,
                          capture_output=True, text=True)
    found = sorted(folder.glob(f"{corpus.package}_*.deb"))
    if proc.returncode != 0 or not found:
        raise DataPrepError(f"apt-get download {corpus.package}={corpus.version} failed "
                            f"({(proc.stderr or proc.stdout).strip()[-300:]}); the committed {corpus.archive.name} "
                            f"still rebuilds the corpus")
    return found[0]


def corpus_inputs(name: str, cache_dir: str | Path | None = None) -> list[Path]:
    """The top-level folders of a packaged corpus (each file under them one document), from its committed archive
    (sha256 checked), unpacked once into CACHE/corpora/NAME-SHA12/ (concurrent callers wait for the one that
    unpacks)."""
    corpus = get_corpus(name)
    if not corpus.archive.is_file():
        raise DataPrepError(f"{corpus.archive} is missing: it is part of the repository (git checkout -- "
                            f"{corpus.archive.relative_to(CORPORA_DIR.parent.parent)})")
    out = Path(cache_dir or DEFAULT_CACHE) / "corpora" / f"{name}-{corpus.archive_sha256[:12]}"
    if not (out / MARKER).exists():
        if (got := sha256_file(corpus.archive)) != corpus.archive_sha256:
            raise DataPrepError(f"{corpus.archive}: sha256 {got}, pinned {corpus.archive_sha256}: the file was "
                                f"changed; restore it from git")
        out.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(out.parent / f".{out.name}.lock"):
            if not (out / MARKER).exists():
                tmp = temp_dir(out)
                try:
                    with tarfile.open(corpus.archive, mode="r:xz") as tf:
                        tf.extractall(tmp, filter="data")
                    (tmp / MARKER).touch()
                    install_dir(tmp, out, replace=True)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    return sorted(p for p in out.iterdir() if p.name != MARKER)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_launch.packaged_corpus",
                                description="Rebuild a packaged corpus's archive from its pinned package.")
    p.add_argument("name", choices=tuple(CORPORA))
    p.add_argument("--deb", type=Path, help="the package file (default: apt-get download the pinned version)")
    p.add_argument("--check", action="store_true", help="compare with the committed archive; write nothing")
    args = p.parse_args(argv)
    corpus = CORPORA[args.name]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            members = deb_members(corpus, args.deb or download_deb(corpus, Path(tmp)))
        digest = content_digest(members)
        print(f"{len(members)} files, {sum(map(len, members.values())):,} bytes, content sha256 {digest}")
        if args.check:
            same = digest == corpus.content_sha256
            print("the same text as the committed archive" if same else
                  f"DIFFERENT from the committed archive (content sha256 {corpus.content_sha256})")
            return 0 if same else 1
        os.makedirs(corpus.folder, exist_ok=True)
        write_archive(members, corpus.archive)
        print(f"wrote {corpus.archive} (sha256 {sha256_file(corpus.archive)}): pin it in KERNEL_DOCS")
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
