"""The last N saves of a training averaged into one checkpoint (`smlp-consolidate DIR --num-update-checkpoints N`).

fairseq's averaging script (average_checkpoints in its repository's scripts folder) averages
`checkpoint_<epoch>_<update>.pt` (or `checkpoint<epoch>.pt`) files; an expert-parallel run writes each save as
rank shards (`checkpoint_1_800-rank-R.pt`), which its pattern does not match ("Found 0 checkpoint files"), and
one shard holds only its rank's experts. Here each save is
found by its shards (or its one file, for a one-process run), checked to be one save (checkpoint_sets' tags),
merged into every expert (checkpoints.merged_state), and the floating-point tensors of the N models are averaged
in fp32 (each stored back in its own dtype), as fairseq's script does; integer tensors (HASH's table) must be
equal in every save. The result is the newest save's checkpoint, for evaluation (no optimizer state), with the
averaged model and `smlp_averaged_from` naming the saves.
"""
from __future__ import annotations

import os
import re

import torch

from .checkpoint_sets import CheckpointSetError

__all__ = ["SAVE_PATTERNS", "average", "average_last", "last_saves"]

# a numbered save's name (without the rank suffix) -> the number that orders it, as fairseq's script reads them
SAVE_PATTERNS = {"update": re.compile(r"^checkpoint_\d+_(\d+)$"), "epoch": re.compile(r"^checkpoint(\d+)$")}


def last_saves(folder: str, n: int, kind: str = "update") -> list[str]:
    """The checkpoint names `folder/checkpoint_E_U.pt` (kind "update") or `folder/checkpoint<E>.pt` ("epoch") of
    the newest `n` saves, newest first, whether written as one file or as rank shards; ValueError naming what
    the folder holds when it has fewer."""
    if n < 1:
        raise ValueError(f"--num-{kind}-checkpoints {n}: give the number of saves to average, 1 or more")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is not a folder of checkpoints (give the --save-dir of the training)")
    numbered = {}
    for entry in os.listdir(folder):
        stem = re.sub(r"(-rank-\d+)?\.pt$", "", entry) if entry.endswith(".pt") else None
        m = SAVE_PATTERNS[kind].match(stem) if stem else None
        if m:
            numbered[int(m.group(1))] = os.path.join(folder, stem + ".pt")
    if len(numbered) < n:
        other = "epoch" if kind == "update" else "update"
        found = ", ".join(map(str, sorted(numbered))) or "none"
        raise ValueError(f"{folder} holds {len(numbered)} {kind} save(s) ({found}), fewer than "
                         f"--num-{kind}-checkpoints {n}; save more often (--save-interval-updates) or average the "
                         f"{other} saves (--num-{other}-checkpoints)")
    return [numbered[k] for k in sorted(numbered, reverse=True)[:n]]


def _state(path: str) -> dict:
    from .checkpoints import load_checkpoint, merged_state, rank_shards

    return merged_state(path) if rank_shards(path) else load_checkpoint(path)


def average(paths: list[str]) -> dict:
    """The checkpoint of the first save in `paths` with the model averaged over all of them (module docstring)."""
    states = [_state(p) for p in paths]
    models = [s["model"] for s in states]
    keys = list(models[0])
    for p, m in zip(paths[1:], models[1:]):
        if list(m) != keys or any(m[k].shape != models[0][k].shape for k in keys):
            raise CheckpointSetError(f"{p} holds another model than {paths[0]} (other tensors or shapes): only saves "
                                     f"of one training average")
    averaged = {}
    for k in keys:
        first = models[0][k]
        if first.is_floating_point():
            total = torch.zeros_like(first, dtype=torch.float32)
            for m in models:
                total += m[k].float()
            averaged[k] = (total / len(models)).to(first.dtype)
        else:
            unequal = [p for p, m in zip(paths, models) if not torch.equal(m[k], first)]
            if unequal:
                raise CheckpointSetError(f"{k} (not floating point) differs between {paths[0]} and {unequal[0]}: it "
                                         f"cannot be averaged, and the saves are not of one training")
            averaged[k] = first
    out = dict(states[0])
    out["model"] = averaged
    out["last_optimizer_state"] = None
    out["smlp_consolidated_from"] = out.get("smlp_consolidated_from") or 1
    out["smlp_averaged_from"] = [os.path.basename(p) for p in paths]
    return out


def average_last(folder: str, n: int, out: str, kind: str = "update") -> list[str]:
    """Average the newest `n` saves of `folder` into `out` (written atomically, never over a training
    checkpoint); returns the saves' names, newest first."""
    from .atomic_files import atomic_torch_save
    from .checkpoints import check_consolidate_output

    paths = last_saves(folder, n, kind)
    check_consolidate_output(out)
    state = average(paths)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_torch_save(state, out)
    return paths
