"""Batched log-likelihood scoring of continuations with our language models.

A request is (context ids, continuation ids); its score is
    sum over continuation tokens t of log P(t | </s>, context, earlier continuation tokens),
the number of tokens, and whether every token is the model's argmax (lm-eval's is_greedy).

Sequence layout. Every request starts with one </s>: fairseq stores a line break as </s>, so an
example begins as a new line of text would (fairseq's own inference datasets prepend </s> too).
Rows are right-padded with <pad>; our models are causal, so padding never reaches a scored
position, and eval-mode routing is per token, so a score does not depend on the batch.

Long inputs. A model reads at most T = model.max_positions() tokens. The context is truncated
from the left so that context + continuation fit; a continuation longer than the window is
scored in consecutive windows, each token predicted from as many preceding tokens as fit
(rolling evaluation), so no token is ever dropped.

Partial prediction (sMLP section 3.2.2). The first P = prediction_start positions of such a
model are its routing prefix and predict nothing. Every row is therefore left-filled with </s>
until the first scored token is predicted from position >= P: the prefix then holds document
boundaries, the same token the model saw between lines in training, and all scored positions
are trained ones. For other models P = 0 and nothing is filled.

Distributed evaluation. When torch.distributed is initialized with more than one rank (an
expert-parallel model holds a slice of the experts on each rank), every rank must call `score`
with the same requests. Rows are dealt round-robin to the ranks; all ranks run the same number of
forward calls (ranks that run out of rows run a one-row filler batch, because the experts
exchange rows with all2all inside every forward), and the results are all-gathered, so every
rank returns every score.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Score", "TextEncoder", "LMScorer", "EncoderMismatchError"]


class EncoderMismatchError(ValueError):
    """The tokenizer files and the dictionary (or the model) do not belong together."""


@dataclass(frozen=True)
class Score:
    logprob: float  # sum of the continuation's token log-probabilities (natural log)
    num_tokens: int
    greedy: bool    # every continuation token is the argmax of its prediction


# ----------------------------------------------------------------------------------- text -> ids


def _normalize_line(line: str) -> str:
    # the corpus pipeline's normalization (smlp_launch.data.normalize_line): collapsed whitespace
    return " ".join(line.split())


class _SentencePiecePieces:
    """Per-line sentencepiece pieces, for data folders whose dict.txt is not in spm id order."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=model_file)

    def pieces(self, line: str) -> list[str]:
        return self.sp.encode(_normalize_line(line), out_type=str)

    def detok(self, pieces: list[str]) -> str:
        return self.sp.decode_pieces(pieces)


class _CorpusEncoderPieces:
    """The data pipeline's encoder (smlp_launch.data.load_encoder), used line by line."""

    def __init__(self, encoder):
        self.encoder = encoder

    def pieces(self, line: str) -> list[str]:
        return self.encoder.encode(line)

    def detok(self, pieces: list[str]) -> str:
        return self.encoder.decode(pieces)


class _WhitespacePieces:
    """Whitespace tokens, for corpora binarized from pre-tokenized text (no spm.model)."""

    def pieces(self, line: str) -> list[str]:
        return line.split()

    def detok(self, pieces: list[str]) -> str:
        return " ".join(pieces)


class TextEncoder:
    """Text -> fairseq token ids of a model's dictionary; a newline becomes </s>.

    Token ids are dictionary.index(piece) (unknown pieces map to <unk>). Each line is
    whitespace-normalized as the training corpus was.
    """

    def __init__(self, pieces, dictionary, description: str):
        self._pieces = pieces
        self.dictionary = dictionary
        self.description = description
        self.eos = dictionary.eos()

    @classmethod
    def from_data_dir(cls, data_dir: str | os.PathLike, dictionary) -> "TextEncoder":
        """The tokenizer of a data folder: its spm.model, or whitespace tokens if it has none."""
        data_dir = Path(data_dir)
        model = data_dir / "spm.model"
        if not model.is_file():
            enc = cls(_WhitespacePieces(), dictionary, f"whitespace tokens (no spm.model in {data_dir})")
        else:
            pieces = None
            try:
                from smlp_launch.data import DataPrepError, load_encoder
            except ModuleNotFoundError:
                load_encoder = None
            if load_encoder is not None:
                try:
                    pieces = _CorpusEncoderPieces(load_encoder(data_dir))
                except DataPrepError:  # dict.txt not in spm id order: map pieces through the dictionary
                    pieces = None
            enc = cls(pieces or _SentencePiecePieces(str(model)), dictionary, f"sentencepiece {model}")
            enc._check_spm_matches_dictionary(str(model), str(data_dir / "dict.txt"))
        return enc

    def _check_spm_matches_dictionary(self, model_file: str, dict_file: str) -> None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=model_file)
        d = self.dictionary
        symbols = [d[i] for i in range(d.nspecial, len(d)) if not d[i].startswith("madeupword")]
        unknown = [s for s in symbols if sp.piece_to_id(s) == sp.unk_id()]
        if symbols and len(unknown) > 0.01 * len(symbols):
            raise EncoderMismatchError(
                f"{model_file} does not match the dictionary {dict_file}: {len(unknown)} of {len(symbols)} "
                f"dictionary symbols are not sentencepiece pieces (e.g. {unknown[:3]}); the tokenizer and "
                f"dict.txt must come from the same data folder")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, line in enumerate(text.split("\n")):
            if i:
                ids.append(self.eos)
            ids.extend(self.dictionary.index(p) for p in self._pieces.pieces(line))
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Ids of context and continuation, cut from the encoding of their concatenation.

        The scored sequence is then exactly the encoding of context + continuation. Trailing
        spaces of the context move to the continuation (as lm-eval does), so a word is encoded
        with its leading space; a trailing newline stays in the context.
        """
        stripped = context.rstrip(" \t")
        if len(stripped) < len(context):
            continuation = context[len(stripped):] + continuation
            context = stripped
        whole = self.encode(context + continuation)
        n = len(self.encode(context)) if context else 0
        n = min(n, len(whole))
        return whole[:n], whole[n:]

    def decode(self, ids: Sequence[int]) -> str:
        lines: list[list[str]] = [[]]
        d = self.dictionary
        for i in ids:
            i = int(i)
            if i == self.eos:
                lines.append([])
            elif i not in (d.pad(), d.bos()):
                lines[-1].append(d[i])
        return "\n".join(self._pieces.detok(p) for p in lines)


# ----------------------------------------------------------------------------------- scoring


@dataclass
class _Row:
    request: int
    tokens: list[int]     # model input
    first: int            # input position that predicts targets[0]
    targets: list[int]


class LMScorer:
    """Scores (context ids, continuation ids) requests with a causal LM in padded batches."""

    def __init__(self, model: torch.nn.Module, *, eos: int, pad: int, batch_size: int = 16,
                 progress: bool = True, device: torch.device | str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model = model
        self.eos, self.pad = eos, pad
        self.batch_size = batch_size
        self.progress = progress
        self.max_positions = int(model.max_positions())
        core = getattr(model, "core", None)
        self.prediction_start = int(getattr(getattr(core, "cfg", None), "prediction_start", 0) or 0)
        if self.max_positions - self.prediction_start < 1:
            raise ValueError(f"the model reads {self.max_positions} positions of which the first "
                             f"{self.prediction_start} predict nothing: it cannot score any token")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.forward_calls = 0

    # -- layout
    def rows(self, request: int, context: Sequence[int], continuation: Sequence[int]) -> list[_Row]:
        """Model inputs scoring every continuation token (see the module docstring)."""
        seq = [self.eos, *context, *continuation]
        T, P = self.max_positions, self.prediction_start
        out = []
        j, n = 1 + len(context), len(seq)
        while j < n:
            e = min(n, j + (T - P))            # tokens seq[j:e] are scored by this row
            lo = max(0, e - 1 - T)             # input seq[lo:e-1] predicts seq[lo+1:e]
            tokens = seq[lo:e - 1]
            first = j - 1 - lo
            fill = max(0, P - first)           # partial prediction: push scored positions past the prefix
            out.append(_Row(request, [self.eos] * fill + tokens, first + fill, seq[j:e]))
            j = e
        return out

    # -- scoring
    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], desc: str = "scoring") -> list[Score]:
        rows = [r for i, (ctx, cont) in enumerate(requests) for r in self.rows(i, ctx, cont)]
        rank, world = _world()
        order = sorted(range(len(rows)), key=lambda k: -len(rows[k].tokens))
        mine = order[rank::world]
        batches = [mine[k:k + self.batch_size] for k in range(0, len(mine), self.batch_size)]
        n_batches = len(batches)
        if world > 1:  # every rank runs the same number of forward calls (experts exchange rows)
            t = torch.tensor([n_batches], dtype=torch.long)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n_batches = int(t.item())
        results: dict[int, tuple[float, bool]] = {}
        bar = _progress(n_batches, desc, self.progress and rank == 0)
        with torch.inference_mode():
            for b in range(n_batches):
                if b < len(batches):
                    batch = [rows[k] for k in batches[b]]
                    for k, lp, greedy in zip(batches[b], *self._forward(batch)):
                        results[k] = (lp, greedy)
                else:
                    self._forward([_Row(-1, [self.eos] * (self.prediction_start + 1), self.prediction_start,
                                        [self.eos])])
                bar.update(1)
        bar.close()
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, results)
            results = {k: v for part in gathered for k, v in part.items()}
        logprob = [0.0] * len(requests)
        greedy = [True] * len(requests)
        for k, row in enumerate(rows):
            lp, g = results[k]
            logprob[row.request] += lp
            greedy[row.request] = greedy[row.request] and g
        return [Score(logprob[i], len(cont), greedy[i]) for i, (_, cont) in enumerate(requests)]

    def _forward(self, batch: list[_Row]) -> tuple[list[float], list[bool]]:
        width = max(len(r.tokens) for r in batch)
        tokens = torch.full((len(batch), width), self.pad, dtype=torch.long)
        b_idx, p_idx, tgt, owner = [], [], [], []
        for b, r in enumerate(batch):
            tokens[b, :len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
            m = len(r.targets)
            b_idx += [b] * m
            p_idx += range(r.first, r.first + m)
            tgt += r.targets
            owner += [b] * m
        out = self.model(tokens.to(self.device))
        logits_BNV = out[0] if isinstance(out, (tuple, list)) else out
        self.forward_calls += 1
        dev = logits_BNV.device
        sel_KV = logits_BNV[torch.tensor(b_idx, device=dev), torch.tensor(p_idx, device=dev)].float()
        tgt_K = torch.tensor(tgt, device=sel_KV.device)
        lp_K = sel_KV.log_softmax(-1).gather(1, tgt_K[:, None])[:, 0].double().cpu()
        hit_K = (sel_KV.argmax(-1) == tgt_K).cpu()
        owner_K = torch.tensor(owner, dtype=torch.long)
        lp_B = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, owner_K, lp_K)
        miss_B = torch.zeros(len(batch), dtype=torch.long).index_add_(0, owner_K, (~hit_K).long())
        return lp_B.tolist(), (miss_B == 0).tolist()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True)
