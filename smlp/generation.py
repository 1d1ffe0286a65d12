"""Text generation with the core LanguageModel: greedy, sampling and beam search, cached or not.

    generate(model, prompts, max_new_tokens)                          greedy, cached
    generate(..., sample=True, temperature=0.8, top_k=40, generator=g)  sampling
    generate(..., beam_size=4)                                        beam search (best beam)
    generate(..., use_cache=False)                                    full recompute at every step

Cached and recomputed decoding give the same tokens. Prompts of different lengths share one batch:
rows are prefilled to the shortest prompt's length, then fed one position per step, a row still
inside its prompt taking its own next token (as fairseq's `prefix_tokens`); finished rows leave the
batch. Every rank of an expert-parallel group must make the same model calls: this loop stops when
this rank's rows are done, and the fairseq-side driver keeps a finished rank stepping with an empty
batch. Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["fill_prefix", "prefix_fill_needed", "generate"]


def prefix_fill_needed(first: int, prediction_start: int) -> int:
    """Tokens to put before a sequence whose first wanted prediction comes from position `first`,
    so that it comes from position >= prediction_start (partial prediction's routing prefix P)."""
    return max(0, prediction_start - first)


def fill_prefix(fill: Sequence[int], first: int, prediction_start: int) -> list[int]:
    """The left fill for a sequence whose first wanted prediction is made at position `first`:
    the last `prefix_fill_needed(first, P)` tokens of `fill` (text ending at a line end, or </s>
    repeated). The zero-shot scorer (smlp_eval.scoring) fills its rows by the same rule."""
    n = prefix_fill_needed(first, prediction_start)
    if n > len(fill):
        raise ValueError(f"the routing prefix needs {n} fill tokens before this sequence but the fill has only "
                         f"{len(fill)}; give at least {prediction_start} tokens (the model's routing prefix)")
    return [int(i) for i in fill[len(fill) - n:]] if n else []


def _check_args(model, prompts, max_new_tokens, temperature, top_k, beam_size, sample) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt needs at least one token "
                         "(e.g. </s>, which starts a line)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if top_k < 0 or top_k > model.cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must be in [0, {model.cfg.vocab_size}] (0: no limit)")
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    if beam_size > 1 and sample:
        raise ValueError("beam search is deterministic: give beam_size > 1 or sample=True, not both")


def _prepare(model, prompts, max_new_tokens, prefix_fill) -> list[list[int]]:
    P, T = model.cfg.prediction_start, model.cfg.seq_len
    out = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        need = prefix_fill_needed(len(prompt) - 1, P)
        if need:
            if prefix_fill is None:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens but this partial-prediction model predicts only from "
                    f"position {P} on (its routing prefix): give prefix_fill (>= {P} tokens of text, or </s> "
                    f"repeated) to fill the prompt from the left, as the zero-shot evaluator does")
            prompt = fill_prefix(prefix_fill, len(prompt) - 1, P) + prompt
        if len(prompt) + max_new_tokens - 1 > T:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens{' with its routing-prefix fill' if need else ''}) plus "
                f"{max_new_tokens} generated tokens needs {len(prompt) + max_new_tokens - 1} positions but the "
                f"model has {T} (seq_len, the size of its spatial weights): generate at most "
                f"{T + 1 - len(prompt)} tokens after it")
        out.append(prompt)
    return out


def _choose(logits_BV: Tensor, sample: bool, temperature: float, top_k: int, generator) -> Tensor:
    logits_BV = logits_BV.float()
    if not sample:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k:
        kth_B = logits_BV.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)


class _Runner:
    """Feeds positions to the model, with a cache or by recomputing the whole prefix (a model without
    a cached step, such as the token-routed gMLP, recomputes even with use_cache=True)."""

    def __init__(self, model, use_cache: bool, on_step: Callable[[int], None] | None):
        self.model, self.on_step = model, on_step
        stepwise = getattr(model, "supports_cached_decoding", True)
        self.cache = model.new_cache() if use_cache and stepwise else None

    def __call__(self, seq_BN: Tensor, start: int) -> Tensor:
        """Logits of the last position after feeding positions start..N-1, (B, V)."""
        if self.cache is not None:
            logits = self.model(seq_BN[:, start:], cache=self.cache)[:, -1]
        else:
            logits = self.model(seq_BN)[:, -1]
        if self.on_step is not None:
            self.on_step(seq_BN.shape[1])
        return logits

    def reorder(self, new_order: Tensor) -> None:
        if self.cache is not None:
            self.cache.reorder(new_order)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, use_cache: bool = True,
             sample: bool = False, temperature: float = 1.0, top_k: int = 0, beam_size: int = 1,
             eos: int | None = None, generator: torch.Generator | None = None,
             prefix_fill: Sequence[int] | None = None,
             on_step: Callable[[int], None] | None = None) -> list[list[int]]:
    """The tokens generated after each prompt (eos, when produced, ends a row and is not returned).

    model:        a core LanguageModel in eval mode (its device is that of its parameters).
    use_cache:    decode incrementally (smlp/decoding_cache.py) instead of recomputing the prefix.
    sample:       sample with `temperature` and `top_k` (0: no limit) from `generator`; else greedy.
    beam_size:    > 1: beam search scored by the sum of token log-probabilities.
    prefix_fill:  text to left-fill the prompts of a partial-prediction model (sMLP sec. 3.2.2),
                  which predicts nothing from its first P positions (`fill_prefix`).
    on_step(n):   called after each model call with the number of positions fed so far (timing).

    A prompt of n tokens followed by m generated ones needs n + m - 1 <= seq_len positions (the last
    token is never fed); more raises a ValueError before anything runs.
    """
    _check_args(model, prompts, max_new_tokens, temperature, top_k, beam_size, sample)
    if model.training:
        raise RuntimeError("generate needs the model in eval mode (model.eval()): training-time routing and "
                           "dropout couple the rows of a batch")
    filled = _prepare(model, prompts, max_new_tokens, prefix_fill)
    device = next(model.parameters()).device
    run = _Runner(model, use_cache, on_step)
    if beam_size > 1:
        return _beam_search(run, filled, max_new_tokens, beam_size, eos, device)
    B = len(filled)
    seq_BN, lengths = _padded(filled, max_new_tokens, device)
    rows = list(range(B))  # prompt of each row still in the batch
    out: list[list[int]] = [[] for _ in range(B)]
    pos = min(lengths)  # positions fed so far
    logits_BV = run(seq_BN[:, :pos], 0)
    while True:
        chosen_B = _choose(logits_BV, sample, temperature, top_k, generator).tolist()
        keep = []
        for i, b in enumerate(rows):
            if pos < lengths[b]:  # still inside its prompt
                keep.append(i)
                continue
            token = chosen_B[i]
            seq_BN[i, pos] = token
            if eos is not None and token == eos:
                continue
            out[b].append(token)
            if len(out[b]) < max_new_tokens:
                keep.append(i)
        if not keep:
            return out
        if len(keep) < len(rows):  # finished rows leave the batch
            order = torch.tensor(keep, dtype=torch.long, device=device)
            seq_BN, rows = seq_BN[order], [rows[i] for i in keep]
            run.reorder(order)
        pos += 1
        logits_BV = run(seq_BN[:, :pos], pos - 1)


def _padded(filled: list[list[int]], max_new_tokens: int, device) -> tuple[torch.Tensor, list[int]]:
    """The prompts left-aligned in one (B, longest prompt + max_new_tokens) token matrix, and their lengths."""
    lengths = [len(p) for p in filled]
    seq_BN = torch.zeros(len(filled), max(lengths) + max_new_tokens, dtype=torch.long, device=device)
    for b, p in enumerate(filled):
        seq_BN[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    return seq_BN, lengths


def _beam_search(run: _Runner, filled: list[list[int]], max_new_tokens: int, Q: int, eos: int | None,
                 device) -> list[list[int]]:
    """Beam search over a batch of prompts; returns each prompt's best beam. A beam that produced
    `eos` is finished and carried along unchanged."""
    B = len(filled)
    seq_BN, lengths = _padded(filled, max_new_tokens, device)
    pos = min(lengths)
    logits_BV = run(seq_BN[:, :pos], 0)
    # Q copies of every prompt (the prefill ran once per prompt); only beam 0 may expand at first
    expand = torch.arange(B, device=device).repeat_interleave(Q)
    seq_YN, logits_YV = seq_BN[expand], logits_BV[expand]
    run.reorder(expand)
    score_BQ = torch.full((B, Q), float("-inf"), dtype=torch.float64)
    score_BQ[:, 0] = 0.0
    done_BQ = torch.zeros(B, Q, dtype=torch.bool)
    new = [0] * B  # tokens generated for each prompt so far
    V = logits_YV.shape[-1]
    while True:
        logp_BQV = torch.log_softmax(logits_YV.float(), dim=-1).double().cpu().view(B, Q, V)
        order_BQ = torch.arange(B * Q).view(B, Q).clone()
        token_BQ = torch.zeros(B, Q, dtype=torch.long)
        active = False
        for b in range(B):
            if pos < lengths[b]:  # inside its prompt: every beam takes the prompt's token
                token_BQ[b] = filled[b][pos]
                active = True
                continue
            if new[b] >= max_new_tokens or bool(done_BQ[b].all()):
                token_BQ[b] = eos if eos is not None else 0  # finished prompt: rows ride along
                continue
            cand_QV = score_BQ[b][:, None] + logp_BQV[b]
            if done_BQ[b].any():  # a finished beam continues only as itself, at no cost
                cand_QV[done_BQ[b]] = float("-inf")
                cand_QV[done_BQ[b], eos] = score_BQ[b][done_BQ[b]]
            top = cand_QV.reshape(-1).topk(Q)
            origin_Q, token_Q = top.indices // V, top.indices % V
            order_BQ[b] = b * Q + origin_Q
            token_BQ[b] = token_Q
            score_BQ[b] = top.values
            done_BQ[b] = done_BQ[b][origin_Q] | (token_Q == eos if eos is not None else False)
            new[b] += 1
            active = active or (new[b] < max_new_tokens and not bool(done_BQ[b].all()))
        order_Y = order_BQ.reshape(-1).to(device)
        seq_YN = seq_YN[order_Y]
        seq_YN[:, pos] = token_BQ.reshape(-1).to(device)
        run.reorder(order_Y)
        if not active:
            break
        pos += 1
        logits_YV = run(seq_YN[:, :pos], pos - 1)
    out = []
    for b in range(B):
        best = int(score_BQ[b].argmax())
        tokens = seq_YN[b * Q + best, lengths[b]:lengths[b] + new[b]].tolist()
        out.append(tokens[:tokens.index(eos)] if eos is not None and eos in tokens else tokens)
    return out
