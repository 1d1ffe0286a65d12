"""Text handling shared by data preparation, evaluation and generation: the project's one text <->
fairseq token ids path (`Encoder`, the tokenizer of a data folder and its dictionary), the corpus
normalization of a line, and reading a data folder's binarized text back (fairseq's reader; the
routing-prefix fill of partial prediction, sMLP section 3.2.2, reads it in fairseq_plugins/prefix_fill.py).

Data preparation (smlp_launch.data, `smlp-prepare-data`), evaluation (smlp_eval.scoring, zeroshot,
generate) and the fairseq generation patches import it; it imports neither of them, nor any model
code (sentencepiece and fairseq's Dictionary / data reader are imported on first use).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["SPM_MODEL", "DICT", "BOS_ID", "PAD_ID", "EOS_ID", "UNK_ID", "N_SPECIAL", "DataPrepError",
           "TokenizerMismatchError", "Encoder", "load_encoder", "normalize_line", "load_binarized"]

SPM_MODEL = "spm.model"
DICT = "dict.txt"
# fairseq Dictionary's own specials, in its order; the sentencepiece model uses the same ids.
BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
N_SPECIAL = 4


class DataPrepError(Exception):
    """A problem with the user's input or output directory; the message says what to do."""


def normalize_line(line: str) -> str:
    """Strip a line and collapse its whitespace runs (any Unicode whitespace) to one space."""
    return " ".join(line.split())


def load_sentencepiece():
    import sentencepiece as spm
    return spm


class TokenizerMismatchError(DataPrepError, ValueError):
    """A tokenizer and a fairseq dictionary that do not belong together (the message names the fix)."""


class Encoder:
    """The project's one text -> fairseq token ids path (data preparation, zero-shot, lm-eval adapter).

        text -> lines (a line break is </s>, the symbol fairseq stores at every line end)
             -> normalize_line (the corpus normalization: stripped, whitespace runs collapsed)
             -> pieces of the tokenizer: the folder's sentencepiece model, or whitespace tokens
                for a folder binarized from pre-tokenized text (it has no spm.model)
             -> ids of the fairseq dictionary (dict.txt); a piece it lacks becomes <unk>

    `dictionary` may be None while a data folder is being built (dict.txt does not exist yet):
    ids are then the sentencepiece ids, which is what this pipeline's dict.txt maps them to.
    A wrong tokenizer does not fail here: its pieces turn into <unk>; callers measure that
    (`unk_rate`) and `check_dictionary` compares the two vocabularies up front.
    """

    def __init__(self, dictionary=None, spm_model: str | Path | None = None, *,
                 data_dir: str | Path | None = None):
        if dictionary is None and spm_model is None:
            raise ValueError("Encoder needs a fairseq dictionary, a sentencepiece model, or both")
        self.dictionary = dictionary
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.spm_model = Path(spm_model) if spm_model is not None else None
        self.sp = (load_sentencepiece().SentencePieceProcessor(model_file=str(spm_model))
                   if spm_model is not None else None)
        if dictionary is not None:
            d = dictionary
            self.eos, self.unk, self.pad, self.bos = d.eos(), d.unk(), d.pad(), d.bos()
            self.eos_piece = dictionary[self.eos]
        else:
            self.eos, self.unk, self.pad, self.bos = EOS_ID, UNK_ID, PAD_ID, BOS_ID
            self.eos_piece = self.sp.id_to_piece(EOS_ID)

    @classmethod
    def from_data_dir(cls, data_dir: str | Path, dictionary=None) -> Encoder:
        """The encoder of a binarized data folder: its spm.model (whitespace tokens without one) and
        its dict.txt (or `dictionary`, e.g. the one a checkpoint was loaded with)."""
        data_dir = Path(data_dir)
        if dictionary is None:
            path = data_dir / DICT
            if not path.is_file():
                raise DataPrepError(f"{path} is missing: {data_dir} is not a binarized data folder")
            from fairseq.data import Dictionary
            dictionary = Dictionary.load(str(path))
        model = data_dir / SPM_MODEL
        return cls(dictionary, model if model.is_file() else None, data_dir=data_dir)

    @property
    def description(self) -> str:
        if self.sp is None:
            where = f" (no {SPM_MODEL} in {self.data_dir})" if self.data_dir is not None else ""
            return f"whitespace tokens{where}"
        return f"sentencepiece {self.spm_model}"

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary) if self.dictionary is not None else self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.eos

    # -- text -> pieces
    def normalize(self, text: str) -> str:
        return "\n".join(normalize_line(line) for line in text.split("\n"))

    def pieces_batch(self, lines: Sequence[str], num_threads: int = 1) -> list[list[str]]:
        """Pieces of each line (no line may contain a newline)."""
        lines = [normalize_line(line) for line in lines]
        if self.sp is None:
            return [line.split() for line in lines]
        return self.sp.encode(lines, out_type=str, num_threads=max(1, num_threads))

    def encode(self, text: str) -> list[str]:
        """Pieces of `text`, with the </s> piece between lines."""
        out: list[str] = []
        for i, pieces in enumerate(self.pieces_batch(text.split("\n"))):
            if i:
                out.append(self.eos_piece)
            out.extend(pieces)
        return out

    # -- pieces -> ids
    def piece_ids(self, pieces: Sequence[str]) -> list[int]:
        if self.dictionary is not None:
            index = self.dictionary.index
            return [index(p) for p in pieces]
        return list(self.sp.piece_to_id(list(pieces))) if pieces else []

    def encode_ids(self, text: str, append_eos: bool = False) -> list[int]:
        """fairseq token ids of `text`; line breaks become </s> (and one ends it with append_eos)."""
        ids = self.piece_ids(self.encode(text))
        if append_eos:
            ids.append(self.eos)
        return ids

    # -- ids -> text
    def decode(self, pieces: Sequence[str]) -> str:
        lines: list[list[str]] = [[]]
        for p in pieces:
            if p == self.eos_piece:
                lines.append([])
            else:
                lines[-1].append(p)
        if self.sp is None:
            return "\n".join(" ".join(ps) for ps in lines)
        return "\n".join(self.sp.decode_pieces(ps) for ps in lines)

    def decode_ids(self, ids: Iterable[int]) -> str:
        skip = (self.bos, self.pad)
        ids = [int(i) for i in ids if int(i) not in skip]
        if self.dictionary is not None:
            return self.decode([self.dictionary[i] for i in ids])
        return self.decode([self.sp.id_to_piece(i) for i in ids])

    # -- checks
    def unk_rate(self, ids: Iterable[int]) -> tuple[int, int]:
        """(<unk> tokens, tokens) among `ids`."""
        n = unk = 0
        for i in ids:
            n += 1
            unk += i == self.unk
        return unk, n

    def check_dictionary(self, max_foreign: float = 0.01) -> None:
        """Refuse a sentencepiece model whose pieces are not the dictionary's symbols."""
        if self.sp is None or self.dictionary is None:
            return
        d = self.dictionary
        symbols = [d[i] for i in range(d.nspecial, len(d)) if not d[i].startswith("madeupword")]
        foreign = [s for s in symbols if self.sp.piece_to_id(s) == self.sp.unk_id()]
        if symbols and len(foreign) > max_foreign * len(symbols):
            where = self.data_dir if self.data_dir is not None else self.spm_model.parent
            raise TokenizerMismatchError(
                f"{self.spm_model} does not match the dictionary in {where}: {len(foreign)} of {len(symbols)} "
                f"dictionary symbols are not sentencepiece pieces (e.g. {foreign[:3]}); the tokenizer and "
                f"dict.txt must come from the same data folder")

    def check_spm_id_order(self) -> None:
        """This pipeline's promise: dict.txt lists the pieces in sentencepiece id order, so a
        fairseq token id equals the sentencepiece id."""
        d = self.dictionary
        expected = [self.sp.id_to_piece(i) for i in range(N_SPECIAL, self.sp.get_piece_size())] if self.sp else None
        if expected is None or [d[i] for i in range(d.nspecial, len(d))] != expected:
            raise DataPrepError(f"{self.data_dir / DICT} does not match {SPM_MODEL} (mixed-up files?); "
                                f"prepare {self.data_dir} again with --force")


def load_encoder(data_dir: str | Path) -> Encoder:
    """The encoder of a folder this pipeline prepared (fairseq ids == sentencepiece ids, checked)."""
    data_dir = Path(data_dir)
    if not (data_dir / SPM_MODEL).is_file():
        raise DataPrepError(f"{data_dir / SPM_MODEL} is missing: {data_dir} is not a prepared data directory "
                            f"(run smlp-prepare-data --out {data_dir} ...)")
    enc = Encoder.from_data_dir(data_dir)
    enc.check_spm_id_order()
    return enc


def load_binarized(prefix: str | Path, dictionary=None):
    """fairseq's own reader of a binarized split PREFIX.bin/.idx (MMapIndexedDataset), or None."""
    from fairseq.data import data_utils
    return data_utils.load_indexed_dataset(str(prefix), dictionary)
