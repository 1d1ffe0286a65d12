"""Moving expert weights and their optimizer state between layouts.

An expert parameter (`param.expert = True`) is stacked with the local-expert index first, and
position j of an expert-parallel group of G ranks owns experts [j*E/G, (j+1)*E/G). So the full
expert tensor is the concatenation of the G positions' tensors along dim 0, and resharding to G'
positions is a slice; with expert-data parallelism (smlp/expert_data_parallel.py) rank r holds
position r % G's shard. Optimizer state shaped like its parameter (Adam's moments, momentum) moves
with the weights, so a resumed run continues with the moments it would have had. A layer may be
replicated instead (the sMoE's replicated layout): every rank holds all E of its experts, and
resharding reads it as a per-key range (`replicated_keys`, `ranges`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from .expert_data_parallel import expert_parallel_layout
from .experts import is_expert

__all__ = ["expert_keys", "merge_expert_shards", "slice_expert_shard", "check_replicas", "replicated_keys",
           "source_positions", "expert_slice", "reshard_model_state", "reshard_optimizer_state"]


def expert_keys(model: nn.Module) -> list[str]:
    """state_dict keys of the expert parameters of `model`."""
    return [name for name, p in model.named_parameters() if is_expert(p)]


def check_replicas(states: Sequence[Mapping[str, Tensor]], keys: Sequence[str], ep_size: int,
                   rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """ValueError unless rank r's expert tensors equal those of rank r % ep_size (the replicas agree).

    Replicas receive the same all-reduced gradients, so they stay equal; a difference means the
    shards come from different runs or the expert gradients were not averaged over the replicas."""
    if ep_size < 1 or len(states) % ep_size:
        raise ValueError(f"{len(states)} rank shards cannot form replicas of an expert-parallel group of {ep_size}")
    for r in range(ep_size, len(states)):
        for k in keys:
            a, b = states[r].get(k), states[r % ep_size].get(k)
            if a is None or b is None:
                raise ValueError(f"expert weight {k!r} is missing from the shard of rank "
                                 f"{r if a is None else r % ep_size}")
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                raise ValueError(
                    f"rank {r} should hold a replica of rank {r % ep_size}'s experts but {k!r} differs "
                    f"(max difference {diff}): the shards are not one save of one expert-data-parallel run")


def replicated_keys(state: Mapping[str, Tensor], keys: Sequence[str],
                    totals: Mapping[str, int] | None = None) -> list[str]:
    """The expert keys of one rank's `state` that hold their whole layer while other layers are spread over the
    group: the layers replicated on every rank. On a single-process or consolidated state every key holds its
    whole layer, and none is called replicated.

    totals: {key: the experts of its layer} (layers may differ: the sMoE's --smoe-experts apart from the tMoE's);
    without it every layer has as many experts, and the replicated keys are those holding more than the fewest."""
    counts = {k: state[k].shape[0] for k in keys if k in state}
    if totals is None:
        fewest = min(counts.values(), default=0)
        return [k for k, n in counts.items() if n > fewest]
    if not any(n < totals[k] for k, n in counts.items()):
        return []
    return [k for k, n in counts.items() if n == totals[k]]


def merge_expert_shards(states: Sequence[Mapping[str, Tensor]], keys: Sequence[str],
                        ep_size: int | None = None, replicated: Sequence[str] = ()) -> dict[str, Tensor]:
    """Full state from per-rank states (rank order): expert tensors of the first `ep_size` ranks
    (default: all of them) concatenated, the rest from rank 0; replicas are checked, not merged. The
    `replicated` keys (every rank holds all experts) are checked to agree on every rank and taken whole."""
    if not states:
        raise ValueError("merge_expert_shards needs at least one rank's state")
    ep_size = len(states) if ep_size is None else ep_size
    replicated = [k for k in replicated if k in keys]
    check_replicas(states, replicated, 1)
    keys = [k for k in keys if k not in replicated]
    check_replicas(states, keys, ep_size)
    full = dict(states[0])
    for k in keys:
        missing = [r for r, s in enumerate(states[:ep_size]) if k not in s]
        if missing:
            raise ValueError(f"expert weight {k!r} is missing from the checkpoint shard(s) of rank(s) {missing}")
        full[k] = torch.cat([s[k] for s in states[:ep_size]], dim=0)
    return full


def slice_expert_shard(full: Mapping[str, Tensor], keys: Sequence[str], rank: int,
                       world_size: int) -> dict[str, Tensor]:
    """The state of position `rank` of an expert-parallel group of `world_size`, from a full state."""
    out = dict(full)
    for k in keys:
        num_experts = full[k].shape[0]
        local = expert_parallel_layout(num_experts, world_size)
        out[k] = full[k][rank * local:(rank + 1) * local].clone()
    return out


# ---------------------------------------------------------------- resharding without the full model


def source_positions(first: int, count: int, source_local: int) -> list[int]:
    """Positions of the source layout (source_local experts each) that hold experts [first, first+count)."""
    if count < 1 or first < 0 or source_local < 1:
        raise ValueError(f"invalid expert range first={first} count={count} for {source_local} local experts")
    return list(range(first // source_local, (first + count - 1) // source_local + 1))


def expert_slice(pieces: Mapping[int, Tensor], source_local: int, first: int, count: int) -> Tensor:
    """Experts [first, first+count) stacked, from {source position: its tensor of source_local experts}."""
    need = source_positions(first, count, source_local)
    missing = [i for i in need if i not in pieces]
    if missing:
        raise ValueError(f"experts [{first}, {first + count}) need the shards of positions {need}; missing {missing}")
    for i in need:
        if pieces[i].shape[0] != source_local:
            raise ValueError(f"the shard of position {i} holds {pieces[i].shape[0]} experts, expected {source_local}")
    stacked = torch.cat([pieces[i] for i in need], dim=0)
    offset = first - need[0] * source_local
    return stacked[offset:offset + count].clone()


def _range_of(ranges: Mapping | None, key, source_local: int, first: int, count: int
              ) -> tuple[int, int, int, bool]:
    local, f, c, *whole = ranges.get(key, (source_local, first, count)) if ranges else (source_local, first, count)
    return local, f, c, bool(whole and whole[0])


def _by_position(pieces: Mapping[int, Tensor], whole: bool) -> dict[int, Tensor]:
    """The source tensors by position. A layer replicated in the source (`whole`): every file holds all of its
    experts, so any one file serves, as position 0."""
    return {0: pieces[min(pieces)]} if whole else dict(pieces)


def reshard_model_state(sources: Mapping[int, Mapping[str, Tensor]], keys: Sequence[str], source_local: int,
                        first: int, count: int, ranges: Mapping[str, tuple[int, int, int]] | None = None
                        ) -> dict[str, Tensor]:
    """A model state holding experts [first, first+count), from the shards {source position: state}
    that hold them (every non-expert tensor is the same in every shard: taken from the first).

    ranges: {key: (source experts per file, first, count[, whole])} for the keys laid out otherwise than
    (source_local, first, count): a layer with its own expert count (the sMoE's --smoe-experts), replicated in
    the source (whole: every file holds all its experts, read from any one file) or in the target (first 0,
    count all)."""
    out = dict(sources[min(sources)])
    for k in keys:
        local, f, c, whole = _range_of(ranges, k, source_local, first, count)
        out[k] = expert_slice(_by_position({i: s[k] for i, s in sources.items()}, whole), local, f, c)
    return out


def reshard_optimizer_state(sources: Mapping[int, Mapping], expert_indices: set[int] | Sequence[int],
                            source_local: int, first: int, count: int,
                            ranges: Mapping[int, tuple] | None = None) -> dict:
    """The optimizer state (torch's `state_dict()` format, per-parameter entries) for a rank holding
    experts [first, first+count), from the source positions' optimizer states.

    Entries of an expert parameter that are tensors stacked like it (local expert first: Adam's
    exp_avg and exp_avg_sq, momentum buffers) are re-sliced; scalars (`step`) and the entries of
    non-expert parameters are the same on every rank and are taken from the first source. `ranges`:
    {parameter index: (source experts per file, first, count)} as for `reshard_model_state`."""
    base = sources[min(sources)]
    if not isinstance(base, Mapping) or "state" not in base or "param_groups" not in base:
        raise ValueError("the optimizer state is not a torch optimizer state_dict (no 'state' / 'param_groups')")
    expert_indices = set(expert_indices)
    state = {}
    for idx, entry in base["state"].items():
        if idx not in expert_indices:
            state[idx] = entry
            continue
        new = {}
        local, f, c, whole = _range_of(ranges, idx, source_local, first, count)
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() >= 1:
                pieces = {}
                for i, s in sources.items():
                    if idx not in s["state"] or name not in s["state"][idx]:
                        raise ValueError(f"optimizer state {name!r} of parameter {idx} is missing from position {i}")
                    pieces[i] = s["state"][idx][name]
                new[name] = expert_slice(_by_position(pieces, whole), local, f, c)
            else:
                new[name] = value
        state[idx] = new
    out = dict(base)
    out["state"] = state
    return out
