"""The vocabulary of smlp-prepare-data: a sentencepiece BPE model trained on the train split, every
split encoded into its pieces, and dict.txt laid out so that a fairseq id is the sentencepiece id.

BPE with byte fallback (no <unk> ever), character coverage 0.9999, the special ids where fairseq's
Dictionary puts them: why, in smlp_launch.data's docstring.
"""
from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterable
from pathlib import Path

from smlp_eval.text import (
    BOS_ID,
    EOS_ID,
    N_SPECIAL,
    PAD_ID,
    SPM_MODEL,
    UNK_ID,
    DataPrepError,
    Encoder,
    load_sentencepiece,
)

from .binarize import SplitWriter
from .corpus import SPLITS

CHARACTER_COVERAGE = 0.9999
ENCODE_CHUNK = 20000  # lines per sentencepiece batch when encoding a split
# sentencepiece's refusals of a vocabulary size (its message's pattern -> ours, naming a size that works)
_VOCAB_SIZE_REFUSALS = (
    (r"Vocabulary size too high \((\d+)\).*?<= (\d+)",
     "--vocab-size {0} is too large for this corpus: sentencepiece can learn at most {1} pieces from the training "
     "split; pass --vocab-size {1} or less, or add more text"),
    (r"smaller than required_chars\. (\d+) vs (\d+)",
     "--vocab-size {0} is too small: the training split needs at least {1} pieces (4 specials, 256 byte-fallback "
     "pieces and its characters); pass --vocab-size {1} or more"),
)


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
        for pattern, message in _VOCAB_SIZE_REFUSALS:
            if m := re.search(pattern, msg):
                raise DataPrepError(message.format(*m.groups())) from None
        raise DataPrepError(f"sentencepiece training failed: {msg}") from None
    return buf.getvalue()


def train_tokenizer(tmp: Path, train_text: Path, params: dict, workers: int) -> Encoder:
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


def encode_splits(text_dir: Path, dest: Path, encoder: Encoder, workers: int, counts: dict) -> tuple[list, dict]:
    """Encode each split and write its ids in fairseq's binary format (dest/SPLIT.bin and .idx: one sentence per
    line, </s> after each); adds the token counts to `counts`; returns the train split's piece frequencies and, per
    split, the sha256 of the id stream written (little-endian int32), which fairseq's reader must give back."""
    import numpy as np

    size = encoder.sp.get_piece_size()
    freq = np.zeros(size, dtype=np.int64)
    digests: dict[str, str] = {}
    for s in SPLITS:
        digest = hashlib.sha256()
        out = SplitWriter(dest / s, size)
        with open(text_dir / f"{s}.txt", encoding="utf-8") as src:
            while True:
                chunk = [line.rstrip("\n") for _, line in zip(range(ENCODE_CHUNK), src)]
                if not chunk:
                    break
                ids = out.add([encoder.piece_ids(pieces) + [EOS_ID]
                               for pieces in encoder.pieces_batch(chunk, num_threads=workers)])
                digest.update(ids.astype("<i4").tobytes())
                if s == "train":  # </s> is counted too: dict.txt lists the pieces from N_SPECIAL on only
                    freq += np.bincount(ids, minlength=size)
        out.close()
        counts[s]["tokens"] = sum(out.sizes) - len(out.sizes)  # one </s> a sentence
        counts[s]["fairseq_tokens"] = counts[s]["tokens"] + counts[s]["sentences"]
        digests[s] = digest.hexdigest()
    return freq.tolist(), digests


def write_dictionary(path: Path, sp, freq: list[int]) -> list[str]:
    """dict.txt: the sentencepiece pieces 4.. in id order, so that fairseq ids == sentencepiece ids."""
    pieces = [sp.id_to_piece(i) for i in range(N_SPECIAL, sp.get_piece_size())]
    bad = [p for p in pieces if re.search(r"\s", p) or not p]
    if bad:
        raise DataPrepError(f"sentencepiece produced pieces fairseq cannot store: {bad[:3]!r}")
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(pieces, start=N_SPECIAL):
            f.write(f"{p} {freq[i]}\n")
    return pieces
