"""`smlp-prepare-data`: raw text -> sentencepiece BPE -> fairseq binarized LM data.

One real build of four Shakespeare plays (vocab 500) is shared by most tests; the error paths stop
before binarizing; fairseq-preprocess run on the same pieces is the binary files' reference.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smlp_launch import corpus
from smlp_launch import data as D

PLAYS = ["comedy_of_errors_gut.txt", "macbeth_gut.txt", "tempest_gut.txt",
         "midsummer_nights_dream_gut.txt"]
VOCAB = 500
KW = dict(vocab_size=VOCAB, workers=2, log=None)


class Stop(Exception):
    """Raised by a monkeypatched step to end a run early."""


@pytest.fixture(scope="module")
def plays() -> list[Path]:
    files = {p.name: p for p in D.demo_inputs()}
    return [files[name] for name in PLAYS]


@pytest.fixture(scope="module")
def built(plays, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare4"
    D.prepare(out, plays, demo=True, **KW)
    return out


def split_lines(data_dir: Path, split: str) -> list[str]:
    return (data_dir / "text" / f"{split}.txt").read_text(encoding="utf-8").split("\n")[:-1]


def snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(d).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")
            and not p.name.endswith(".lock")]


# ------------------------------------------------------------------ pure pieces


def test_normalize_line():
    assert D.normalize_line("  Give me   your hands,\tif we be friends,  \r") == \
        "Give me your hands, if we be friends,"
    assert D.normalize_line(" \u00a0 \t") == ""


def test_gutenberg_body_strips_license_header_and_footer():
    lines = ["The Project Gutenberg EBook of Hamlet", "license blah",
             "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***", "", "ACT I.", "Who's there?",
             "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***", "more license"]
    assert corpus.gutenberg_body(lines) == (3, 6)
    old = ["header", "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*", "text",
           "End of the Project Gutenberg Etext of Hamlet", "x"]
    assert corpus.gutenberg_body(old) == (2, 3)
    assert corpus.gutenberg_body(["plain", "text"]) == (0, 2)


def test_split_blocks_partition_fractions_and_determinism():
    counts = [1200, 800, 3000, 50]
    a = corpus.split_blocks(counts, 0.05, 0.1, 100, seed=3)
    assert a == corpus.split_blocks(counts, 0.05, 0.1, 100, seed=3)
    assert a != corpus.split_blocks(counts, 0.05, 0.1, 100, seed=4)
    covered = {}
    for split, blocks in a.items():
        assert blocks, split
        for b in blocks:
            for i in range(b.start, b.end):
                assert (b.doc, i) not in covered, "a line landed in two splits"
                covered[(b.doc, i)] = split
    assert len(covered) == sum(counts)
    total = sum(counts)
    n = {s: sum(b.n for b in bl) for s, bl in a.items()}
    assert 0.05 * total <= n["valid"] < 0.05 * total + 100
    assert 0.1 * total <= n["test"] < 0.1 * total + 100
    # whole documents
    docs = corpus.split_blocks([10, 20, 30, 40], 0.1, 0.1, 0, seed=1)
    assert all(b.start == 0 and b.end == [10, 20, 30, 40][b.doc] for bl in docs.values() for b in bl)
    with pytest.raises(D.DataPrepError, match="too few"):
        corpus.split_blocks([5], 0.05, 0.05, 500, seed=1)


# ------------------------------------------------------------------ the real build


def test_demo_subset_is_a_loadable_fairseq_dataset(built):
    from fairseq.data import Dictionary, data_utils

    m = D.read_manifest(built)
    for name in ("dict.txt", "spm.model", "manifest.json", "train.bin", "train.idx", "valid.bin",
                 "valid.idx", "test.bin", "test.idx"):
        assert (built / name).is_file(), name
    assert m["vocab"]["size"] == VOCAB
    assert [s["name"] for s in m["sources"]] == PLAYS and all(len(s["sha256"]) == 64 for s in m["sources"])
    d = Dictionary.load(str(built / "dict.txt"))
    assert len(d) == VOCAB                       # fairseq dict == spm vocabulary, no padding
    for split in D.SPLITS:
        ds = data_utils.load_indexed_dataset(str(built / split), d)
        assert ds is not None and len(ds) > 0, split
        sp = m["splits"][split]
        assert len(ds) == sp["sentences"] and int(ds.sizes.sum()) == sp["fairseq_tokens"] > 0
        assert sp["tokens"] > sp["lines"] > 0
        toks = ds[0]
        assert int(toks[-1]) == d.eos() and int(toks.max()) < len(d)
        assert all(int(t) != d.unk() for i in range(min(len(ds), 200)) for t in ds[i])
    # the language_modeling task reads the directory as it is
    from fairseq import options, tasks
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(built), "--task", "language_modeling", "--arch", "transformer_lm", "--tokens-per-sample", "64"])
    task = tasks.setup_task(args)
    task.load_dataset("valid")
    assert len(task.dictionary) == VOCAB and len(task.dataset("valid")) > 0


def test_valid_and_test_are_contiguous_blocks_disjoint_from_train(built, plays):
    m = D.read_manifest(built)
    docs = D.collect_documents(plays)
    for doc in docs:
        corpus.scan(doc, True)
    kept = [[line for _, line in corpus.iter_document_lines(doc)] for doc in docs]
    owner = {}
    for split in D.SPLITS:
        # the text file is exactly the manifest's blocks, in order, a blank line between runs
        expect, prev = [], None
        for b in m["splits"][split]["blocks"]:
            s, (lo, hi) = b["source"], b["lines"]
            if prev is not None and prev != (s, lo):
                expect.append("")
            expect += kept[s][lo:hi]
            prev = (s, hi)
            assert hi - lo == 500 or hi == len(kept[s])     # --block-lines 500 (default) blocks
            for i in range(lo, hi):
                assert (s, i) not in owner, f"line {i} of {PLAYS[s]} is in {owner[(s, i)]} and {split}"
                owner[(s, i)] = split
        assert split_lines(built, split) == expect
    assert len(owner) == sum(map(len, kept))     # every kept line is in exactly one split
    # a few distinctive held-out lines never occur in train
    train = set(split_lines(built, "train"))
    for split in ("valid", "test"):
        lines = split_lines(built, split)
        assert len(lines) > 100
        long = [x for x in lines if len(x) > 40][::10][:8]
        assert len(long) >= 4 and not [x for x in long if x in train]
        assert len(m["splits"][split]["blocks"]) >= 1


def test_demo_text_has_no_gutenberg_boilerplate_and_no_blank_lines_inside_blocks(built):
    for split in D.SPLITS:
        text = (built / "text" / f"{split}.txt").read_text()
        assert "gutenberg" not in text.lower()
        lines = split_lines(built, split)
        assert lines.count("") == D.read_manifest(built)["splits"][split]["sentences"] - \
            D.read_manifest(built)["splits"][split]["lines"]


def test_encoder_round_trip_and_ids_match_the_binarized_data(built):
    from fairseq.data import Dictionary, data_utils

    enc = D.load_encoder(built)
    lines = split_lines(built, "valid")
    real = [x for x in lines if x][:300]
    for x in real:
        pieces = enc.encode(x)
        assert enc.decode(pieces) == x
        assert "<unk>" not in pieces
    # characters the corpus never had go through byte fallback and come back intact
    odd = "Café naïve — “quoted” 東京 🙂"
    assert enc.decode(enc.encode(odd)) == odd
    assert enc.decode_ids(enc.encode_ids(odd)) == odd
    assert any(p.startswith("<0x") for p in enc.encode(odd))
    assert enc.decode(enc.encode("Who's there?\nNay, answer me")) == "Who's there?\nNay, answer me"
    assert enc.normalize("  a   b \n c") == "a b\nc"
    # fairseq ids: the encoder, dict.txt and the binarized valid split agree
    d = Dictionary.load(str(built / "dict.txt"))
    for x in real[:50]:
        pieces = enc.encode(x)
        want = d.encode_line(" ".join(pieces), add_if_not_exist=False, append_eos=True).tolist()
        assert enc.encode_ids(x, append_eos=True) == want
    ds = data_utils.load_indexed_dataset(str(built / "valid"), d)
    for i in range(20):
        assert ds[i].tolist() == enc.encode_ids(lines[i], append_eos=True)
    assert enc.encode_ids("a\nb") == enc.encode_ids("a") + [d.eos()] + enc.encode_ids("b")


def test_the_binary_files_are_fairseq_preprocess_s_byte_for_byte(built, tmp_path):
    """fairseq-preprocess (the reference) run on each split's pieces with the folder's dict.txt as --srcdict writes
    the same .bin, .idx and dict.txt bytes as the pipeline's own binarizing; the pieces come from the folder's
    encoder, line by line, from the text it kept."""
    from fairseq_helpers import fairseq_preprocess

    enc = D.load_encoder(built)
    for split in D.SPLITS:
        lines = split_lines(built, split)
        (tmp_path / f"{split}.spm").write_text("".join(" ".join(p) + "\n" for p in enc.pieces_batch(lines)),
                                              encoding="utf-8")
    fairseq_preprocess("--only-source", "--task", "language_modeling", "--dataset-impl", "mmap", "--srcdict",
                       str(built / "dict.txt"), "--destdir", str(tmp_path / "ref"), "--workers", "1",
                       *(a for split in D.SPLITS for a in (f"--{split}pref", str(tmp_path / f"{split}.spm"))))
    names = [f"{split}.{ext}" for split in D.SPLITS for ext in ("bin", "idx")] + ["dict.txt"]
    for name in names:
        assert (built / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert (built / "train.bin").stat().st_size == 2 * D.read_manifest(built)["splits"]["train"]["fairseq_tokens"]


def test_second_run_reuses_and_force_rebuilds_identically(built, plays, tmp_path):
    before = snapshot(built)
    t0 = time.time()
    out, reused = D.prepare_data(built, plays, demo=True, **KW)
    assert reused and out == built and snapshot(built) == before
    assert time.time() - t0 < 5
    # the console script, in a fresh process, also reuses (fast, prints the summary, exit 0)
    proc = subprocess.run([str(Path(sys.executable).parent / "smlp-prepare-data"), "--input",
                           *map(str, plays), "--strip-gutenberg", "--vocab-size", str(VOCAB),
                           "--workers", "2", "--out", str(built)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "reused" in proc.stdout and "up to date" in proc.stderr
    assert snapshot(built) == before
    # --force on a copy rebuilds, and the build is deterministic
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    old_manifest, old_inode = D.read_manifest(copy), copy.stat().st_ino
    out, reused = D.prepare_data(copy, plays, demo=True, force=True, **KW)
    assert not reused and copy.stat().st_ino != old_inode    # a new directory took its place
    new_manifest = D.read_manifest(copy)
    for name in ("spm.model", "dict.txt", "train.bin", "valid.bin", "test.idx", "text/test.txt"):
        assert (copy / name).read_bytes() == (built / name).read_bytes(), name
    assert new_manifest["fingerprint"] == old_manifest["fingerprint"]
    assert leftovers(copy) == []


def test_a_directory_missing_files_is_rebuilt_not_reused(built, plays, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    (copy / "valid.bin").unlink()
    calls = []

    def stop(*a, **k):
        calls.append(1)
        raise Stop()

    monkeypatch.setattr(D, "encode_splits", stop)
    with pytest.raises(Stop):
        D.prepare(copy, plays, demo=True, **KW)
    assert calls and not (copy / "valid.bin").exists() and (copy / "manifest.json").exists()


# ------------------------------------------------------------------ interruption


def test_interrupted_run_leaves_no_complete_looking_directory(plays, tmp_path, monkeypatch):
    out = tmp_path / "new"

    def half_then_die(text_dir, dest, encoder, workers, counts):
        (dest / "train.bin").write_bytes(b"\0" * 100)   # a partial binarization
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "encode_splits", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(out, plays[:2], **KW)
    assert not out.exists() and leftovers(out) == []


def test_interrupted_forced_rebuild_keeps_the_previous_directory(built, plays, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    before = snapshot(copy)
    monkeypatch.setattr(D, "check_binarized", lambda *a: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        D.prepare(copy, plays, demo=True, force=True, **{**KW, "vocab_size": 400})
    assert snapshot(copy) == before and leftovers(copy) == []
    # a run killed between the two renames of a swap: the old directory is put back next time
    dead_pid = 4_000_000
    while True:   # find a pid that no process has
        try:
            os.kill(dead_pid, 0)
            dead_pid += 1
        except ProcessLookupError:
            break
        except PermissionError:
            dead_pid += 1
    moved = copy.parent / f".{copy.name}.old-{dead_pid}"
    os.rename(copy, moved)
    stale_tmp = copy.parent / f".{copy.name}.tmp-{dead_pid}"
    stale_tmp.mkdir()
    (stale_tmp / "train.bin").write_bytes(b"x")
    out, reused = D.prepare_data(copy, plays, demo=True, **KW)
    assert reused and snapshot(copy) == before and leftovers(copy) == []


def test_a_failing_step_cleans_up_and_the_cli_reports_it(plays, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    monkeypatch.setattr(D, "check_binarized",
                        lambda *a: (_ for _ in ()).throw(D.DataPrepError("fairseq's reader gives 3 sentences")))
    rc = D.main(["--input", str(plays[0]), str(plays[1]), "--out", str(out), "--vocab-size", "400", "--quiet"])
    assert rc == 2 and "fairseq's reader gives 3 sentences" in capsys.readouterr().err
    assert not out.exists() and leftovers(out) == []


# ------------------------------------------------------------------ bad input


def run_cli(args, capsys) -> tuple[int, str]:
    rc = D.main([*map(str, args), "--quiet"])
    return rc, capsys.readouterr().err


def test_missing_input_path(tmp_path, capsys):
    rc, err = run_cli(["--input", tmp_path / "nope.txt", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "nope.txt" in err and "does not exist" in err
    assert not (tmp_path / "o").exists()


def test_empty_inputs(tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\t\n")
    rc, err = run_cli(["--input", blank, "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "blank.txt" in err and "no text" in err
    (tmp_path / "emptydir").mkdir()
    rc, err = run_cli(["--input", tmp_path / "emptydir", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "emptydir" in err and "*.txt" in err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    rc, err = run_cli(["--input", bad, "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "not UTF-8" in err and "iconv" in err
    assert not (tmp_path / "o").exists()


def test_vocab_size_too_large_names_a_value_that_works(plays, tmp_path, monkeypatch, capsys):
    small = tmp_path / "small.txt"
    small.write_text("\n".join(plays[0].read_text().splitlines()[:1500]) + "\n")
    rc, err = run_cli(["--input", small, "--out", tmp_path / "o", "--vocab-size", "8000",
                       "--block-lines", "100"], capsys)
    assert rc == 2 and "--vocab-size 8000 is too large" in err, err
    suggested = int(err.split("pass --vocab-size ")[1].split()[0])
    assert 300 < suggested < 8000
    assert not (tmp_path / "o").exists() and leftovers(tmp_path / "o") == []
    # the suggested value trains (stop before binarizing)
    seen = {}

    def stop(dest, counts, digests):
        seen["dict"] = len((dest / "dict.txt").read_text().splitlines())
        raise Stop()

    monkeypatch.setattr(D, "check_binarized", stop)
    with pytest.raises(Stop):
        D.prepare(tmp_path / "o", [small], vocab_size=suggested, block_lines=100, log=None)
    assert seen["dict"] == suggested - D.N_SPECIAL
    rc, err = run_cli(["--input", small, "--out", tmp_path / "o", "--vocab-size", "50",
                       "--block-lines", "100"], capsys)
    assert rc == 2 and "--vocab-size 50 is too small" in err and "or more" in err


def test_out_dir_with_different_inputs_is_refused_unless_forced(built, plays, tmp_path, capsys):
    before = snapshot(built)
    rc, err = run_cli(["--input", *plays, "--strip-gutenberg", "--out", built, "--vocab-size", "600"], capsys)
    assert rc == 2 and "vocab_size: existing 500, requested 600" in err and "--force" in err
    rc, err = run_cli(["--input", *plays[:3], "--strip-gutenberg", "--out", built,
                       "--vocab-size", str(VOCAB)], capsys)
    assert rc == 2 and "missing: midsummer_nights_dream_gut.txt" in err
    changed = tmp_path / PLAYS[0]
    changed.write_text(plays[0].read_text() + "\nA new line.\n")
    rc, err = run_cli(["--input", changed, *plays[1:], "--strip-gutenberg", "--out", built,
                       "--vocab-size", str(VOCAB)], capsys)
    assert rc == 2 and f"changed: {PLAYS[0]}" in err
    assert snapshot(built) == before


def test_foreign_directory_is_never_replaced(plays, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    rc, err = run_cli(["--input", plays[0], "--out", foreign, "--force"], capsys)
    assert rc == 2 and "not an smlp-prepare-data data directory" in err
    assert (foreign / "notes.txt").read_text() == "precious" and len(list(foreign.iterdir())) == 1


def test_argument_errors(plays, tmp_path, capsys):
    out = tmp_path / "o"
    for args, msg in [
        (["--out", out], "nothing to prepare"),
        (["--input", plays[0], "--valid-fraction", "0.7", "--out", out], "--valid-fraction 0.7"),
        (["--train", plays[0], "--valid", plays[1], "--out", out], "missing --test"),
        (["--input", plays[0], "--train", plays[0], "--valid", plays[1], "--test", plays[2], "--out", out],
         "give one of --input/--demo, --corpus, or --train/--valid/--test"),
        (["--corpus", "kernel-docs", "--input", plays[0], "--out", out], "give one of"),
        (["--input", plays[0], "--vocab-size", "3", "--out", out], "--vocab-size 3"),
        (["--input", plays[0], "--block-lines", "100000", "--out", out], "--block-lines"),
    ]:
        rc, err = run_cli(args, capsys)
        assert rc == 2 and msg in err, (args, err)
    assert not out.exists()


def test_explicit_split_files(plays, tmp_path):
    lines = [x for x in plays[1].read_text().splitlines() if x.strip()]
    files = {}
    for name, part in (("train", lines[:2500]), ("valid", lines[2500:2700]), ("test", lines[2700:2900])):
        files[name] = tmp_path / f"{name}-in.txt"
        files[name].write_text("\n\n".join(part) + "\n")    # blank lines between lines are dropped
    out = D.prepare(tmp_path / "o", train=[files["train"]], valid=[files["valid"]],
                    test=[files["test"]], vocab_size=400, workers=2, log=None)
    m = D.read_manifest(out)
    assert m["params"]["split"] == "explicit"
    assert [(s["role"], s["name"]) for s in m["sources"]] == \
        [("train", "train-in.txt"), ("valid", "valid-in.txt"), ("test", "test-in.txt")]
    assert m["splits"]["valid"]["lines"] == 200 and m["splits"]["valid"]["sentences"] == 200
    assert split_lines(out, "test") == [" ".join(x.split()) for x in lines[2700:2900]]
    assert (out / "test.bin").stat().st_size > 0


def test_gutenberg_boilerplate_is_stripped_from_wrapped_files(plays, tmp_path, monkeypatch):
    body = plays[2].read_text()
    wrapped = tmp_path / "pg.txt"
    wrapped.write_text("The Project Gutenberg EBook of The Tempest\nThis eBook is for the use of anyone\n"
                       "*** START OF THIS PROJECT GUTENBERG EBOOK THE TEMPEST ***\n" + body +
                       "\n*** END OF THIS PROJECT GUTENBERG EBOOK THE TEMPEST ***\n"
                       "Updated editions will replace the previous one\n")
    seen = {}

    def grab(text_dir, dest, encoder, workers, counts):
        seen["text"] = "\n".join((text_dir / f"{s}.txt").read_text() for s in D.SPLITS)
        raise Stop()

    monkeypatch.setattr(D, "encode_splits", grab)
    for strip in (True, False):
        with pytest.raises(Stop):
            D.prepare(tmp_path / "o", [wrapped], strip_gutenberg=strip, vocab_size=400, log=None)
        assert ("Gutenberg" in seen["text"]) is not strip
        assert "Our revels now are ended." in seen["text"]


def test_the_binarized_ids_digest_reads_the_stream_as_sentence_by_sentence_does(tmp_path):
    """check_binarized's digest of a split read as one stream from fairseq's reader equals the digest of reading it
    sentence by sentence (the reference); a reader whose sentences do not lie end to end is read sentence by
    sentence."""
    import hashlib

    import numpy as np
    import torch
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    from smlp_eval.text import DataPrepError, load_binarized
    from smlp_launch import binarize as B

    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.uint16)
    for n in rng.integers(1, 40, size=300):
        builder.add_item(torch.from_numpy(rng.integers(0, 60000, size=n).astype(np.int64)))
    builder.finalize(str(tmp_path / "s.idx"))
    ds = load_binarized(tmp_path / "s")
    reference = hashlib.sha256()
    for i in range(len(ds)):
        reference.update(ds[i].numpy().astype("<i4").tobytes())
    sizes, digest = B._mmap_digest(tmp_path / "s")
    assert B._id_stream(ds) is not None and digest == reference.hexdigest() and list(sizes) == list(ds.sizes)
    ds._index._pointers = ds._index._pointers[::-1].copy()  # sentences not end to end: no stream
    assert B._id_stream(ds) is None
    # ids that differ from the sentencepiece ids: the error names fairseq's counts (read after the reader is gone)
    for split in ("train", "valid", "test"):
        for ext in ("bin", "idx"):
            shutil.copy(tmp_path / f"s.{ext}", tmp_path / f"{split}.{ext}")
    counts = {split: {"sentences": 300, "fairseq_tokens": int(sizes.sum())} for split in ("train", "valid", "test")}
    with pytest.raises(DataPrepError, match=f"gives 300 sentences / {int(sizes.sum())} tokens for train"):
        B.check_binarized(tmp_path, counts, {split: "0" * 64 for split in ("train", "valid", "test")})
