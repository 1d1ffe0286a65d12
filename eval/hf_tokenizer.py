"""The training pipeline's tokenizer as a transformers tokenizer (`tokenization_smlp.py` of an exported folder).

It reproduces `smlp_eval.text.Encoder`, the one text -> fairseq ids path of data preparation,
evaluation and generation, step by step:

    text -> lines (a line break is </s>, the symbol fairseq stores at every line end)
         -> each line stripped, its whitespace runs collapsed to one space (the corpus normalization)
         -> pieces of the folder's sentencepiece model (`spm.model`), or whitespace tokens for a
            model trained on pre-tokenized text (then the folder has no spm.model)
         -> ids of the fairseq dictionary (`vocab.json`: piece -> id, specials <s>=0 <pad>=1 </s>=2
            <unk>=3 included); a piece it lacks becomes <unk>

`tokenizer(text)` puts </s> first (add_special_tokens=True, the default), as the model's sequences
start: `bos_token` is "</s>" (fairseq LMs start every line with it; <s> is in the vocabulary but
unused). Text is never searched for special-token strings (split_special_tokens=True): a literal
"</s>" in the text is encoded as the pipeline encodes it, as characters.

Decoding inverts it as the Encoder does: </s> is a line break, <s> and <pad> are dropped, each
line's pieces are decoded by sentencepiece; `skip_special_tokens=True` also drops </s> and <unk>.

Imports: the standard library, transformers and, for a folder with spm.model, sentencepiece.
"""
from __future__ import annotations

import json
import os
import shutil

from transformers import PreTrainedTokenizer

__all__ = ["SMLPTokenizer"]

VOCAB_FILE = "vocab.json"
SPM_FILE = "spm.model"


def normalize_line(line: str) -> str:
    """The corpus normalization of a line (smlp_eval.text.normalize_line)."""
    return " ".join(line.split())


class SMLPTokenizer(PreTrainedTokenizer):
    """sentencepiece (or whitespace) pieces -> fairseq dictionary ids (module docstring)."""

    vocab_files_names = {"vocab_file": VOCAB_FILE, "spm_file": SPM_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, spm_file: str | None = None, bos_token="</s>", eos_token="</s>",
                 unk_token="<unk>", pad_token="<pad>", **kwargs):
        with open(vocab_file, encoding="utf-8") as f:
            self.vocab: dict[str, int] = json.load(f)
        self.pieces = {i: p for p, i in self.vocab.items()}
        if len(self.pieces) != len(self.vocab) or sorted(self.pieces) != list(range(len(self.vocab))):
            raise ValueError(f"{vocab_file} must map every id 0..{len(self.vocab) - 1} to exactly one piece")
        self.vocab_file, self.spm_file = vocab_file, spm_file if spm_file and os.path.isfile(spm_file) else None
        self.sp = None
        if self.spm_file is not None:
            try:  # a folder of whitespace tokens (no spm.model) does not need it
                import sentencepiece
            except ImportError as exc:
                raise ImportError(f"this tokenizer reads {self.spm_file} with sentencepiece: pip install "
                                  f"sentencepiece") from exc
            self.sp = sentencepiece.SentencePieceProcessor(model_file=self.spm_file)
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         **kwargs)

    # -- the pipeline's fairseq ids of the specials (by piece, as fairseq's Dictionary knows them)
    @property
    def _line_break(self) -> str:
        return self.pieces[self.vocab[self.eos_token]]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    # -- text -> pieces -> ids
    def _tokenize(self, text: str, **kwargs) -> list[str]:
        lines = [normalize_line(line) for line in text.split("\n")]
        if self.sp is None:
            per_line = [line.split() for line in lines]
        else:
            per_line = self.sp.encode(lines, out_type=str)
        out: list[str] = []
        for i, pieces in enumerate(per_line):
            if i:
                out.append(self._line_break)
            out.extend(pieces)
        return out

    def _convert_token_to_id(self, token: str) -> int:
        return self.vocab.get(token, self.vocab[self.unk_token])

    def _convert_id_to_token(self, index: int) -> str:
        return self.pieces[int(index)]

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        """</s> first, as every sequence of the training data starts (a pair: </s> a </s> b)."""
        out = [self.bos_token_id] + list(token_ids_0)
        return out if token_ids_1 is None else out + [self.bos_token_id] + list(token_ids_1)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            special = set(self.all_special_ids)
            return [int(i in special) for i in token_ids_0 + (token_ids_1 or [])]
        mask = [1] + [0] * len(token_ids_0)
        return mask if token_ids_1 is None else mask + [1] + [0] * len(token_ids_1)

    # -- ids -> text
    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        lines: list[list[str]] = [[]]
        for piece in tokens:
            if piece == self._line_break:
                lines.append([])
            else:
                lines[-1].append(piece)
        if self.sp is None:
            return "\n".join(" ".join(pieces) for pieces in lines)
        return "\n".join(self.sp.decode_pieces(pieces) for pieces in lines)

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                **kwargs) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        dropped = {self.vocab["<s>"], self.pad_token_id} if "<s>" in self.vocab else {self.pad_token_id}
        if skip_special_tokens:
            dropped |= set(self.all_special_ids)
        text = self.convert_tokens_to_string([self.pieces[i] for i in ids if i not in dropped])
        if clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None else \
                self.clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        vocab = os.path.join(save_directory, prefix + VOCAB_FILE)
        with open(vocab, "w", encoding="utf-8") as f:
            json.dump(self.vocab, f, ensure_ascii=False, indent=0)
        if self.spm_file is None:
            return (vocab,)
        spm = os.path.join(save_directory, prefix + SPM_FILE)
        if os.path.abspath(spm) != os.path.abspath(self.spm_file):
            shutil.copyfile(self.spm_file, spm)
        return vocab, spm
