"""Moving expert weights between world sizes.

Every expert parameter (marked `param.expert = True`) is stacked with the local-expert index
first, and rank r of W owns experts [r*E/W, (r+1)*E/W). So the full model's expert tensor is the
concatenation of the ranks' tensors along dim 0, and re-sharding to W' ranks is a slice.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from .dispatch import expert_parallel_layout

__all__ = ["expert_keys", "merge_expert_shards", "slice_expert_shard", "reshard_expert_states"]


def expert_keys(model: nn.Module) -> list[str]:
    """state_dict keys of the expert parameters of `model`."""
    return [name for name, p in model.named_parameters() if getattr(p, "expert", False)]


def merge_expert_shards(states: Sequence[Mapping[str, Tensor]], keys: Sequence[str]) -> dict[str, Tensor]:
    """Full state from per-rank states (rank order): expert tensors concatenated, the rest from rank 0."""
    if not states:
        raise ValueError("merge_expert_shards needs at least one rank's state")
    full = dict(states[0])
    for k in keys:
        missing = [r for r, s in enumerate(states) if k not in s]
        if missing:
            raise ValueError(f"expert weight {k!r} is missing from the checkpoint shard(s) of rank(s) {missing}")
        full[k] = torch.cat([s[k] for s in states], dim=0)
    return full


def slice_expert_shard(full: Mapping[str, Tensor], keys: Sequence[str], rank: int, world_size: int) -> dict[str, Tensor]:
    """Rank `rank`'s state out of a full state holding all experts."""
    out = dict(full)
    for k in keys:
        num_experts = full[k].shape[0]
        local = expert_parallel_layout(num_experts, world_size)
        out[k] = full[k][rank * local:(rank + 1) * local].clone()
    return out


def reshard_expert_states(states: Sequence[Mapping[str, Tensor]], keys: Sequence[str], rank: int,
                          world_size: int) -> dict[str, Tensor]:
    """Rank `rank` of `world_size` from the shards of any other world size."""
    return slice_expert_shard(merge_expert_shards(states, keys), keys, rank, world_size)
