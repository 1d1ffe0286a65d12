"""Cached incremental decoding: the per-model cache and how layers append to it.

A cache makes each generation step O(t) instead of recomputing every earlier position. The SGU keeps
the normalized gated half z2 of past positions (gMLP sec. 2.1); the sMoE the same rows on the rank
that owns the sequence, and its routing decision once the prefix is complete (sMLP sec. 3.1, 3.2.2);
HyperMixer its running prefix sum; NiNformer its normalized inputs and hidden units; attention its
keys and values. FFNs, tMoEs and norms keep nothing.

    cache = model.new_cache()
    logits_BkV = model(tokens_Bk, cache=cache)   # eval mode, cache.length + k <= T
    cache.reorder(new_order)                      # beam search, dropped rows

Experts hold no decoding state: each sMoE step sends every row's prefix (O(t), like the step's
compute), so `reorder` never communicates. A step with B = 0 still joins the expert exchanges, so a
rank whose sequences are done stays in lockstep. Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DecodingCache", "cache_append"]


class DecodingCache:
    """The decoding state of one LanguageModel: a dict of tensors per layer, batch on dimension 0.

    Position-indexed buffers may hold more than `length` positions: they grow by doubling.
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

    The buffer grows by doubling, to at most `limit` positions (the layer's seq_len) unless more are needed.
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
