"""The tags of a save: what each checkpoint file records about the save it belongs to, and how its files are named.

Every trainer state written through the plugins carries under `smlp_shard` its rank, world size, update, epoch and a
set id `<run id>:<update>` (the run id is drawn by rank 0 when training starts), so the shards of one save carry the
same id and shards of different saves or runs never do. `read_shard` reads a file's tag cheaply (torch.load with
mmap: the tensors are not read); `set_problem` says why files are not one loadable save. A set `X.pt` is the files
`X-rank-R.pt` (`shard_path`, `rank_shards`: the suffix goes before the file name's `.pt`, never into its folders).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from smlp.process_group import rank_and_world

from .atomic_files import RANK_FILE as _RANK_FILE

SHARD_KEY = "smlp_shard"


def shard_tag(state: dict, path: str, run_id: str | None) -> dict:
    """What `smlp_shard` records for a trainer state about to be written to `path`."""
    rank, world = rank_and_world()
    m = _RANK_FILE.match(os.path.basename(path))
    history = state.get("optimizer_history") or [{}]
    updates = history[-1].get("num_updates")
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    return {
        "format": 1,
        "rank": int(m.group("rank")) if m else rank,
        "world_size": world if m else 1,
        "sharded": bool(m),
        "num_updates": updates,
        "epoch": itr.get("epoch"),
        "iterations_in_epoch": itr.get("iterations_in_epoch"),
        "set_id": f"{run_id}:{updates}" if run_id else None,
    }


@dataclass
class ShardInfo:
    """What one rank found in one checkpoint file (a plain, picklable record exchanged between ranks)."""

    path: str
    exists: bool = False
    readable: bool = False
    error: str | None = None
    num_updates: int | None = None
    epoch: int | None = None
    world_size: int | None = None
    set_id: str | None = None
    arch: str | None = None
    model_name: str | None = None  # the saved config's _name: the --arch preset (model_of gives its model)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    consolidated_from: int | None = None  # smlp-consolidate merged this many rank shards into the file
    has_optimizer: bool = True  # holds an optimizer state (smlp-consolidate's files do not)

    def describe(self, world: int | None = None, runs: bool = False) -> str:
        """`NAME: update N`, with the world size that wrote it when it is not `world`, and with `runs` which
        run wrote it (its world size and run id)."""
        name = os.path.basename(self.path)
        if not self.exists:
            return f"{name}: missing"
        if not self.readable:
            return f"{name}: unreadable ({self.error})"
        if self.consolidated_from:
            return f"{name}: update {self.num_updates}, merged by smlp-consolidate from {self.consolidated_from} shards"
        if runs:
            ranks = f"a {self.world_size}-rank run" if self.world_size else "a one-process run"
            return f"{name}: update {self.num_updates}, written by {ranks}" + (f" (run {self.run_id})"
                                                                               if self.run_id else "")
        extra = f", written by a {self.world_size}-rank run" if self.world_size not in (None, world) else ""
        return f"{name}: update {self.num_updates}{extra}"

    @property
    def run_id(self) -> str | None:
        """The id of the training run that wrote the file (drawn when it started), if recorded."""
        return self.set_id.rsplit(":", 1)[0] if self.set_id else None

    @property
    def save_key(self):
        """Shards of one save agree on this: the set id when recorded, else the update."""
        return self.set_id if self.set_id else ("update", self.num_updates)


def read_shard(path: str, with_shapes: bool = False) -> ShardInfo:
    """The tag of a checkpoint file; tensors are memory-mapped, not read."""
    info = ShardInfo(path=path, exists=os.path.isfile(path))
    if not info.exists:
        return info
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # truncated, corrupt, not a checkpoint
        info.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}".rstrip(": ")
        if "zip archive" in str(exc) or "central directory" in str(exc) or isinstance(exc, EOFError):
            info.error = "truncated or corrupt file, cut short while it was written?"
        return info
    if not isinstance(state, dict) or "model" not in state:
        info.error = "not a fairseq checkpoint (no 'model' entry)"
        return info
    info.readable = True
    tag = state.get(SHARD_KEY) or {}
    history = state.get("optimizer_history") or [{}]
    info.num_updates = tag.get("num_updates", history[-1].get("num_updates"))
    info.epoch = tag.get("epoch", ((state.get("extra_state") or {}).get("train_iterator") or {}).get("epoch"))
    info.world_size = tag.get("world_size") if tag.get("sharded") else None
    info.set_id = tag.get("set_id")
    info.consolidated_from = state.get("smlp_consolidated_from")
    info.has_optimizer = state.get("last_optimizer_state") is not None
    cfg = state.get("cfg")
    model_cfg = cfg.get("model") if isinstance(cfg, dict) else None
    if isinstance(model_cfg, dict):
        info.arch = model_cfg.get("arch") or model_cfg.get("_name")
        info.model_name = model_cfg.get("_name")
    if with_shapes:
        info.shapes = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    return info


def shard_path(base: str, suffix: str) -> str:
    """This rank's file of checkpoint `base`: `suffix` inserted before the file name's final `.pt` (fairseq
    replaces every `.pt` of the whole path, which breaks a folder named `exp.ptb`); the folders are kept."""
    directory, name = os.path.split(str(base))
    stem = name[:-3] if name.endswith(".pt") else name
    return os.path.join(directory, stem + suffix + ".pt")


def rank_shards(base: str) -> dict[int, str]:
    """Rank -> path of each rank shard `X-rank-R.pt` of checkpoint `X.pt` that exists (fairseq's
    names: `shard_path(base, f"-rank-{R}")`); empty when there is none."""
    stem = base[:-3] if base.endswith(".pt") else base
    directory, name = os.path.split(stem)
    try:
        listed = os.listdir(directory or ".")
    except OSError:
        return {}
    found = {}
    for entry in listed:
        m = _RANK_FILE.match(entry)
        if m and m.group("stem") == name:
            found[int(m.group("rank"))] = os.path.join(directory, entry)
    return found


def set_problem(infos: list[ShardInfo], world: int, sharded: bool) -> str | None:
    """Why the files (one per rank, or one) are not one loadable save; None when they are."""
    if not all(i.exists for i in infos):
        return "some shards are missing"
    if not all(i.readable for i in infos):
        return "some files cannot be read"
    if sharded:
        worlds = {i.world_size for i in infos if i.world_size is not None}
        if len(worlds) > 1:
            return (f"the shards come from runs on {' and '.join(str(w) for w in sorted(worlds))} ranks: a run on "
                    f"fewer ranks wrote the first shards of this name and left the others of an earlier run")
        if worlds and worlds != {world}:
            return f"the shards were written by a {max(worlds)}-rank run and this run has {world} ranks"
        if len({i.save_key for i in infos}) > 1:
            runs = {i.run_id for i in infos}
            return "the shards come from different runs" if len(runs) > 1 else "the shards come from different saves"
    return None


def from_several_runs(infos: list[ShardInfo]) -> bool:
    """The files were written by more than one training run (run ids or world sizes differ)."""
    return (len({i.run_id for i in infos if i.run_id}) > 1
            or len({i.world_size for i in infos if i.world_size is not None}) > 1)
