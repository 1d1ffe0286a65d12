"""The user-facing tools tried with the mistakes a new user makes (issue 40): each is refused with one line on
stderr, `PROG: error: ...`, naming the offending value and what would be valid, before any work starts, and
nothing outside the tool's own files changes (`snapshot` before and after).

The programs run through their console entry points (`main(argv)`) in this process; the cases that need a
trained checkpoint share the one-process run of tests/test_bad_inputs.py's kind (`trained`, 2 updates) and
build what else they need from it (a 2-rank set, a consolidated file older than its shards) by rewriting
files, not by training again. docs/faults.md lists the cases.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(*roots: Path) -> dict[str, str]:
    """path -> sha256 of every file under `roots` (folders as "dir")."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            out[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_error_line(err: str, prog: str) -> str:
    """The single `PROG: error: ...` line of a refusal (other stderr lines are log records, never tracebacks)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- smlp-export


def test_export_force_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """--force into a folder of one's own files: refused before the checkpoint is even read, the files kept."""
    from smlp_eval import hf_export

    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "thesis.tex").write_text("\\documentclass{article}")
    before = snapshot(tmp_path)
    assert hf_export.main([str(tmp_path / "no-such.pt"), "--hf", str(mine), "--force"]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-export")
    assert f"--force replaces only a folder smlp-export wrote, and {mine} is not one" in line
    assert "thesis.tex" in line and "nothing was changed" in line
    assert snapshot(tmp_path) == before


def test_export_hf_under_a_file_is_refused_before_the_work(tmp_path, capsys):
    from smlp_eval import hf_export

    (tmp_path / "hf").write_text("a file")
    before = snapshot(tmp_path)
    assert hf_export.main([str(tmp_path / "no-such.pt"), "--hf", str(tmp_path / "hf" / "plays")]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-export")
    assert f"--hf {tmp_path / 'hf' / 'plays'}: {tmp_path / 'hf'} is a file, not a folder" in line
    assert snapshot(tmp_path) == before
