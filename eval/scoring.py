"""Batched log-likelihood scoring of continuations with our language models.

A request is (context ids, continuation ids); its score is
    sum over continuation tokens t of log P(t | </s>, context, earlier continuation tokens),
the number of tokens, and whether every token is the model's argmax (lm-eval's is_greedy).
Text becomes ids through the project's one encoder (`smlp_eval.text.Encoder`, shared with the
data pipeline); `encode_pair` is lm-eval's rule for cutting a (context, continuation) pair.

Sequence layout. Every request starts with one </s>: fairseq stores a line break as </s>, so an
example begins as a new line of text would (fairseq's own inference datasets prepend </s> too).
Rows are right-padded with <pad>; our models are causal, so padding never reaches a scored
position, and eval-mode routing is per token, so a score does not depend on the batch.
Batches are formed from the rows' contents alone (sorted by length, then tokens), so the same
set of requests gives bit-identical scores whatever order it arrives in (smlp-zeroshot and
lm-eval through our adapter agree exactly).

Long inputs. A model reads at most T = model.max_positions() tokens. The context is truncated
from the left so that context + continuation fit; a continuation longer than the window is
scored in consecutive windows, each token predicted from as many preceding tokens as fit
(rolling evaluation), so no token is ever dropped. Such a request's `Score.truncated` is True
(smlp-zeroshot counts those examples per task).

Partial prediction (sMLP section 3.2.2). The first P = prediction_start positions of such a
model are its routing prefix: they predict nothing and decide how the hidden dimensions are
routed. A row whose first scored token would be predicted from a position < P is left-filled
until it is predicted from position P, with `prefix_fill`'s last tokens: smlp-zeroshot passes real
text (the end of the data folder's valid split, ending at a line end), so the router reads text
like what it read in training, and the prompt follows after a document boundary (the row's own
leading </s> after the fill's final one: an empty line, the corpus's document separator). Without
`prefix_fill` the fill is </s> repeated (`--prefix-fill eos`), which a router never saw in
training. For other models P = 0 and nothing is filled.

Distributed evaluation. When torch.distributed is initialized with more than one rank (an
expert-parallel model holds a slice of the experts on each rank), every rank must call `score`
with the same requests. Rows are dealt round-robin to the ranks; all ranks run the same number of
forward calls (ranks that run out of rows run a one-row filler batch, because the experts
exchange rows with all2all inside every forward), and the results are summed over the ranks (each
row is scored on exactly one rank), so every rank returns every score. Every tensor that reaches a
collective lives on `collective_device()`: NCCL accepts only CUDA tensors.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.distributed as dist

from smlp.generation import fill_prefix
from smlp.process_group import collective_device
from smlp.process_group import rank_and_world as world

from .text import Encoder, TokenizerMismatchError

__all__ = ["Score", "LMScorer", "Encoder", "EncoderMismatchError", "encode_pair", "common_prefix_suffix",
           "collective_device", "world", "progress"]

EncoderMismatchError = TokenizerMismatchError


@dataclass(frozen=True)
class Score:
    logprob: float  # sum of the continuation's token log-probabilities (natural log)
    num_tokens: int
    greedy: bool    # every continuation token is the argmax of its prediction
    truncated: bool = False  # longer than the model's T positions: context cut from the left, or scored in windows


# ----------------------------------------------------------------------------------- text -> ids


def encode_pair(encoder: Encoder, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Ids of context and continuation, cut from the encoding of their concatenation (lm-eval's rule).

    The scored sequence is then exactly the encoding of context + continuation. Trailing spaces
    of the context move to the continuation (as lm-eval's `_encode_pair` does), so a word is
    encoded with its leading space; a trailing newline stays in the context.
    """
    stripped = context.rstrip(" \t")
    if len(stripped) < len(context):
        continuation = context[len(stripped):] + continuation
        context = stripped
    whole = encoder.encode_ids(context + continuation)
    n = len(encoder.encode_ids(context)) if context else 0
    n = min(n, len(whole))
    return whole[:n], whole[n:]


def common_prefix_suffix(token_lists: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(common prefix length, common suffix length) of the candidates' token sequences.

    The few-shot harness's rule (its `get_common_prefix_and_suffix_lengths`): both are
    measured within the length n of the shortest sequence, so neither exceeds n.
    """
    n = min(len(t) for t in token_lists)
    first = list(token_lists[0])
    prefix = n
    for t in token_lists[1:]:
        prefix = min(prefix, next((i for i in range(n) if t[i] != first[i]), n))
    suffix = n
    for t in token_lists[1:]:
        a, b = first[len(first) - n:], list(t[len(t) - n:])
        mismatches = [i for i in range(n) if a[i] != b[i]]
        if mismatches:
            suffix = min(suffix, n - 1 - mismatches[-1])
    return prefix, suffix


# ----------------------------------------------------------------------------------- distributed


# ----------------------------------------------------------------------------------- progress


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _LogProgress:
    """One line per ~10% of the work, for logs that are not terminals (SLURM output files).

    By hand because tqdm has no such mode: its mininterval/miniters only thin out the updates of a
    bar, which in a file are still carriage-return redraws without line ends.
    """

    def __init__(self, total: int, desc: str, stream: TextIO):
        self.total, self.desc, self.stream = total, desc, stream
        self.n, self.next_pct, self.t0 = 0, 10, time.time()

    def update(self, n: int = 1) -> None:
        self.n += n
        pct = 100 * self.n // max(self.total, 1)
        if pct >= self.next_pct:
            print(f"{self.desc}: {pct}% ({self.n}/{self.total}, {time.time() - self.t0:.0f} s)",
                  file=self.stream, flush=True)
            self.next_pct = (pct // 10 + 1) * 10

    def close(self) -> None:
        pass


def progress(total: int, desc: str, enabled: bool = True, stream: TextIO | None = None, unit: str = "batch"):
    """A tqdm bar on a terminal; on anything else (a log file) a line every ~10%."""
    stream = sys.stderr if stream is None else stream
    if not enabled or total <= 0:
        return _NoProgress()
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=stream)
    return _LogProgress(total, desc, stream)


# ----------------------------------------------------------------------------------- scoring


@dataclass
class _Row:
    request: int
    tokens: list[int]     # model input
    first: int            # input position that predicts targets[0]
    targets: list[int]
    dropped: int = 0      # leading tokens of the request's sequence this row leaves out (T is too short)


class LMScorer:
    """Scores (context ids, continuation ids) requests with a causal LM in padded batches."""

    def __init__(self, model: torch.nn.Module, *, eos: int, pad: int, batch_size: int = 16,
                 progress: bool = True, device: torch.device | str | None = None,
                 prefix_fill: Sequence[int] | None = None):
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
        P = self.prediction_start
        self.prefix_fill = [eos] * P if prefix_fill is None else [int(i) for i in prefix_fill]
        if len(self.prefix_fill) < P:
            raise ValueError(f"prefix_fill has {len(self.prefix_fill)} tokens but the model's routing prefix "
                             f"is {P} positions")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.forward_calls = 0

    # -- layout
    def fill(self, first: int) -> list[int]:
        """The tokens that precede a row whose first scored token is predicted from position `first`
        (none when first >= P; smlp.generation.fill_prefix, the rule generation uses too)."""
        return fill_prefix(self.prefix_fill, first, self.prediction_start)

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
            fill = self.fill(first)            # partial prediction: push scored positions past the prefix
            out.append(_Row(request, fill + tokens, first + len(fill), seq[j:e], lo))
            j = e
        return out

    # -- scoring
    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], desc: str = "scoring") -> list[Score]:
        rows = [r for i, (ctx, cont) in enumerate(requests) for r in self.rows(i, ctx, cont)]
        rank, world_size = world()
        # batches depend on the rows' contents only, never on the order the requests came in
        order = sorted(range(len(rows)), key=lambda k: (-len(rows[k].tokens), rows[k].tokens, rows[k].targets))
        mine = order[rank::world_size]
        batches = [mine[k:k + self.batch_size] for k in range(0, len(mine), self.batch_size)]
        n_batches = len(batches)
        if world_size > 1:  # every rank runs the same number of forward calls (experts exchange rows)
            dev = collective_device()
            t = torch.tensor([n_batches], dtype=torch.long, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n_batches = int(t.item())
        result_R2 = torch.zeros(len(rows), 2, dtype=torch.float64)  # (log-prob, all greedy) per row
        bar = progress(n_batches, desc, self.progress and rank == 0)
        with torch.inference_mode():
            for b in range(n_batches):
                if b < len(batches):
                    batch = [rows[k] for k in batches[b]]
                    for k, lp, greedy in zip(batches[b], *self._forward(batch)):
                        result_R2[k, 0], result_R2[k, 1] = lp, float(greedy)
                else:
                    self._forward([_Row(-1, self.fill(0) + [self.eos], self.prediction_start,
                                        [self.eos])])
                bar.update(1)
        bar.close()
        if world_size > 1:  # each row was scored on exactly one rank, the others hold zeros: a sum is exact
            summed = result_R2.to(collective_device())
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
            result_R2 = summed.cpu()
        logprob = [0.0] * len(requests)
        greedy = [True] * len(requests)
        truncated = [False] * len(requests)
        for k, row in enumerate(rows):
            logprob[row.request] += float(result_R2[k, 0])
            greedy[row.request] = greedy[row.request] and bool(result_R2[k, 1] > 0.5)
            truncated[row.request] = truncated[row.request] or row.dropped > 0
        return [Score(logprob[i], len(cont), greedy[i], truncated[i]) for i, (_, cont) in enumerate(requests)]

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
        tgt_K = torch.tensor(tgt, device=dev)
        lp_K = sel_KV.log_softmax(-1).gather(1, tgt_K[:, None])[:, 0].double().cpu()
        hit_K = (sel_KV.argmax(-1) == tgt_K).cpu()
        owner_K = torch.tensor(owner, dtype=torch.long)
        lp_B = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, owner_K, lp_K)
        miss_B = torch.zeros(len(batch), dtype=torch.long).index_add_(0, owner_K, (~hit_K).long())
        return lp_B.tolist(), (miss_B == 0).tolist()

    # -- generation
    def greedy_continuation(self, context: Sequence[int], max_tokens: int, stop=None, *,
                            use_cache: bool = True) -> list[int]:
        """Greedy decoding after `context` until </s>, `stop(new_ids)` is true, or `max_tokens`.

        </s> ends the text (it is a line end, and lm-eval's models stop at their end-of-text
        token) and is not returned. With several ranks every rank must call this with the same
        arguments: rank 0's choice of each token is broadcast, so all ranks run the same forward
        calls even if their logits differ in the last bit.

        With `use_cache` (and a model with the core's decoding cache, smlp/decoding_cache.py) the row
        `fill + </s> + context` is run once and each new token costs one position; when the next
        token would not fit the model's T positions, decoding goes on as without the cache: the
        last T tokens, recomputed at every step (a sliding window). Without the cache every step
        recomputes its row, whose routing-prefix fill (partial prediction) shrinks as the text
        grows; with it the fill is chosen once for the context, as `smlp.generation.generate`
        does, so the two agree exactly except for a partial-prediction context shorter than the
        routing prefix.
        """
        T = self.max_positions
        _, world_size = world()
        core = getattr(self.model, "core", None)
        cache = core.new_cache() if use_cache and hasattr(core, "new_cache") else None
        new: list[int] = []
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = None
                if cache is not None:
                    if cache.length == 0:
                        seq = [self.eos, *context][-T:]  # left truncation
                        step = self.fill(len(seq) - 1) + seq  # predict from position >= P
                    else:
                        step = new[-1:]
                    if cache.length + len(step) <= T:
                        logits = core(torch.tensor([step], device=self.device), cache=cache)[0, -1]
                    else:
                        cache = None  # the window slides from here on: recompute
                if logits is None:
                    seq = [self.eos, *context, *new][-T:]  # left truncation
                    tokens = self.fill(len(seq) - 1) + seq  # predict from position >= P
                    out = self.model(torch.tensor([tokens], device=self.device))
                    logits = (out[0] if isinstance(out, (tuple, list)) else out)[0, -1]
                self.forward_calls += 1
                nxt = logits.float().argmax().reshape(1)
                if world_size > 1:
                    nxt = nxt.to(collective_device())
                    dist.broadcast(nxt, src=0)
                token = int(nxt.item())
                if token == self.eos:
                    break
                new.append(token)
                if stop is not None and stop(new):
                    break
        return new
