"""The output directory of smlp-prepare-data: its manifest, its lock, and installing a finished build.

The manifest (written last) holds a fingerprint of the parameters and inputs, so a re-run reuses a
complete directory and refuses one prepared differently; a build happens in a hidden temporary
sibling that is renamed into place, and a run killed halfway is cleaned up (or its swapped-out
predecessor put back) by the next one, under an exclusive lock: smlp_launch.data's docstring.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from smlp.files import write_atomic
from smlp_eval.text import BOS_ID, EOS_ID, PAD_ID, SPM_MODEL, UNK_ID, DataPrepError

from .corpus import DEMO_PACKAGE, SPLITS, Document

PROG = "smlp-prepare-data"
FORMAT = "smlp-lm-data/1"
# Bump when a change to data preparation (smlp_launch.data and the modules it uses) changes the bytes it
# produces: old directories then rebuild.
BUILDER_VERSION = 1
MANIFEST = "manifest.json"


def read_manifest(data_dir: str | Path) -> dict | None:
    """The manifest of a prepared directory, or None (none there, or unreadable)."""
    path = Path(data_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_complete(out: Path, manifest: dict) -> bool:
    """Every file the manifest lists is there with its size."""
    files = manifest.get("files", {})
    return bool(files) and all((out / name).is_file() and (out / name).stat().st_size == size
                               for name, size in files.items())


def describe_difference(old: dict, new: dict) -> str:
    """What differs between an existing manifest and the requested build, for the refusal's message."""
    diffs = []
    for k in sorted(set(old.get("params", {})) | set(new["params"])):
        a, b = old.get("params", {}).get(k), new["params"].get(k)
        if a != b:
            diffs.append(f"{k}: existing {a!r}, requested {b!r}")
    a = {(s["role"], s["name"], s["sha256"]) for s in old.get("sources", [])}
    b = {(s["role"], s["name"], s["sha256"]) for s in new["sources"]}
    if a != b:
        an = {(r, n) for r, n, _ in a}
        bn = {(r, n) for r, n, _ in b}
        changed = sorted(n for r, n, _ in b - a if (r, n) in an)
        added, removed = sorted(n for r, n in bn - an), sorted(n for r, n in an - bn)
        for what, names in (("changed", changed), ("new", added), ("missing", removed)):
            if names:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                diffs.append(f"{len(names)} input file(s) {what}: {', '.join(names[:3])}{more}")
    return "; ".join(diffs) or "different builder version"


@contextlib.contextmanager
def locked(out: Path):
    """Hold the exclusive lock of `out` (a sibling lock file) for the block; refuse if another run holds it."""
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataPrepError(f"another {PROG} is writing {out} right now; wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_alive(name: str) -> bool:
    pid = name.rsplit("-", 1)[-1]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def recover(out: Path) -> None:
    """Clean up after runs that were killed (the lock is held, so none of them is running):
    unfinished temporary builds are deleted; a previous directory that was swapped out but never
    replaced (killed between the two renames) is put back."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        if not _pid_alive(p.name):
            shutil.rmtree(p, ignore_errors=True)
    for p in sorted(out.parent.glob(f".{out.name}.old-*")):
        if _pid_alive(p.name):
            continue
        if not out.exists():
            os.rename(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)


def write_json(path: Path, obj) -> None:
    """Write JSON whole (smlp.files: into the temporary build, which is renamed into place as a whole)."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def build_manifest(tmp: Path, docs: list[Document], params: dict, sources: list[dict], fingerprint: str, *,
                   demo: bool, sp, dict_entries: int, counts: dict, timings: dict[str, float],
                   corpus: dict | None = None) -> dict:
    """manifest.json of the build in `tmp`: inputs (sha256), parameters, vocabulary, splits, files and sizes."""
    import sentencepiece
    try:
        from importlib.metadata import version
        fairseq_version = version("fairseq-fixed")
    except Exception:  # pragma: no cover
        fairseq_version = "unknown"
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(tmp).as_posix()] = p.stat().st_size
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": params,
        "demo_package": DEMO_PACKAGE if demo else None,
        "corpus": corpus,  # a packaged corpus's pin (smlp_launch.packaged_corpus), or None
        "sources": [dict(src, path=str(d.path.absolute()), bytes=d.n_bytes, lines=d.n_lines,
                         body_raw_lines=[d.body[0] + 1, d.body[1]])
                    for src, d in zip(sources, docs)],
        "vocab": {"size": sp.get_piece_size(), "dict_entries": dict_entries, "specials": {
                      "<s>": BOS_ID, "<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID},
                  "spm_model": SPM_MODEL, "fairseq_id_equals_spm_id": True},
        "splits": {s: {k: counts[s][k] for k in ("lines", "sentences", "tokens", "fairseq_tokens")}
                   | {"blocks": counts[s]["blocks"]} for s in SPLITS},
        "files": files,
        "tools": {"sentencepiece": sentencepiece.__version__, "fairseq": fairseq_version},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }


def summary(out: Path, manifest: dict, reused: bool) -> str:
    """A few lines describing a prepared directory (what the CLI prints at the end)."""
    sp = manifest["splits"]
    state = "reused, up to date" if reused else f"built in {manifest.get('seconds', 0):.1f} s"
    lines = [f"{out} ({state})",
             f"  {'split':<6} {'lines':>10} {'tokens':>12} {'+</s>':>12}"]
    for s in SPLITS:
        lines.append(f"  {s:<6} {sp[s]['lines']:>10,} {sp[s]['tokens']:>12,} {sp[s]['fairseq_tokens']:>12,}")
    v = manifest["vocab"]
    lines.append(f"  vocab {v['size']:,} sentencepiece BPE pieces (byte fallback) = fairseq dict.txt "
                 f"+ 4 specials; {len(manifest['sources'])} source file(s)")
    lines.append(f"  train with: fairseq-train {out} --task language_modeling ...")
    return "\n".join(lines)
