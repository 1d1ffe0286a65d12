"""Cached incremental decoding: the per-model cache and how layers append to it.

Generation feeds a causal LM its sequence a few positions at a time (the prompt, then one token
per step). Recomputing every earlier position at each step costs O(t^2) per step for the spatial
layers (the SGU's T x T weight, gMLP section 2.1; the sMoE experts, sMLP section 3.1) and O(t^2)
for attention; a cache makes it O(t), as a key/value cache does for a Transformer:

    SGU / multi-head SGU      the normalized gated half z2 of past positions; step t computes
                              W[t, :t+1] z2[:t+1] + b_t (per head)
    sMoE spatial experts      the same normalized rows, kept where they were computed (the source
                              rank); each step sends every row's prefix to its expert, which
                              computes only the new position(s) (moe.py, SMoE.step)
    sMoE partial prediction   plus the routing decision (expert and weight per hidden dimension),
                              taken once when the routing prefix is complete (section 3.2.2)
    HyperMixer                its running prefix sum S_t = sum_{s<=t} W1[s] (x) x_s (float64)
    NiNformer                 the normalized inputs and the hidden units of its causal token MLP
    attention                 keys and values
    tMoE / dense FFN, norms   nothing: they act on each position alone (routers route the new
                              token on its own, greedily, as eval mode always does)

API (the fairseq wrapper and `smlp.generation` call only this):

    cache = model.new_cache()                 # empty; the batch size is fixed by the first call
    logits_BkV = model(tokens_Bk, cache=cache)   # the next k positions of every sequence;
                                              # logits for those k positions only
    cache.length                              # positions processed so far (the same for all rows)
    cache.reorder(new_order_B)                # beam search / dropping finished rows: row i of the
                                              # cache becomes old row new_order[i] (index_select on
                                              # the batch dimension of every cached tensor; new_order
                                              # may repeat rows and be shorter or longer)

`model(tokens_Bk, cache=cache)` needs eval mode (training-time routing couples the rows of a batch)
and `cache.length + k <= seq_len`: the spatial weights have T positions, and longer input raises a
ValueError naming the limit (there is no sliding window: a spatial weight is tied to absolute
positions). A step with an empty batch (B = 0, e.g. after `reorder` dropped every row) reads and
advances no position and only takes part in the expert exchanges, so an expert-parallel rank whose
sequences are done can keep stepping in lockstep with the others.

For fairseq's `FairseqIncrementalDecoder` (one object per model in `incremental_state`):

    cache = self.get_incremental_state(incremental_state, "cache") or a new one (set it back)
    logits = core(prev_output_tokens[:, cache.length:], cache=cache)
    reorder_incremental_state(incremental_state, new_order) -> cache.reorder(new_order)

Expert parallelism: every cached tensor, including the sMoE's normalized rows, lives on the rank
that owns the sequence; experts hold no decoding state. Each sMoE step exchanges, like the full
forward, one all-gather of the span of positions every rank wants computed, the row counts, the
rows (their prefix, O(t) per row) and the results; ranks may be at different positions and hold
different batch sizes. So `reorder` never communicates. Keeping the rows at the experts instead
would send O(1) per row and step, but every reorder (beam search, finished rows) would then have
to be all-gathered and replayed on every expert's copy, for each source rank: more state to keep
consistent, while the O(t) per step of the design here matches the step's O(t) compute.

Shapes: the core's legend (smlp/__init__.py); here B batch, k new positions, t positions in the cache,
D model width.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DecodingCache", "cache_append"]


class DecodingCache:
    """The decoding state of one LanguageModel: a dict of tensors per layer, batch first.

    Every cached tensor has the batch on dimension 0, so `reorder` is an index_select on all of
    them. Position-indexed tensors are buffers whose capacity may exceed `length` (they grow by
    doubling, so appending a position copies O(1) amortized instead of the whole prefix).
    """

    def __init__(self, num_layers: int):
        self.layers: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
        self.length = 0
        self.batch_size: int | None = None

    def reorder(self, new_order: Tensor) -> None:
        """Row i becomes old row new_order[i], in every layer (beam search, finished rows)."""
        new_order = torch.as_tensor(new_order, dtype=torch.long)
        if new_order.dim() != 1:
            raise ValueError(f"new_order must be a 1-D tensor of row indices, got shape {tuple(new_order.shape)}")
        # checked on the host only when the indices are there already (no device sync per beam step)
        if self.batch_size is not None and new_order.numel() and new_order.device.type == "cpu" and (
                int(new_order.min()) < 0 or int(new_order.max()) >= self.batch_size):
            raise ValueError(f"new_order holds rows {int(new_order.min())}..{int(new_order.max())} but the cache "
                             f"holds {self.batch_size} rows (valid: 0..{self.batch_size - 1})")
        for state in self.layers:
            for key, value in state.items():
                state[key] = value.index_select(0, new_order.to(value.device))
        if self.batch_size is not None:
            self.batch_size = new_order.numel()

    def __repr__(self) -> str:
        return f"DecodingCache(layers={len(self.layers)}, length={self.length}, batch_size={self.batch_size})"


def cache_append(state: dict[str, Tensor], key: str, new: Tensor, start: int, dim: int = 1,
                 limit: int | None = None) -> Tensor:
    """Write `new` at positions start.. (along `dim`) of the cached buffer state[key]; return positions 0..end.

    The buffer grows by doubling, to at most `limit` positions (the layer's seq_len) unless more
    are needed; positions >= start of an existing buffer are overwritten (a step always continues
    at the cache's length).
    """
    end = start + new.shape[dim]
    buf = state.get(key)
    if buf is None or buf.shape[dim] < end:
        capacity = max(end, 2 * buf.shape[dim]) if buf is not None else end
        if limit is not None:
            capacity = max(end, min(capacity, limit))
        shape = list(new.shape)
        shape[dim] = capacity
        grown = new.new_empty(shape)
        if buf is not None and start:
            grown.narrow(dim, 0, start).copy_(buf.narrow(dim, 0, start))
        state[key] = buf = grown
    buf.narrow(dim, start, new.shape[dim]).copy_(new)
    return buf.narrow(dim, 0, end)
