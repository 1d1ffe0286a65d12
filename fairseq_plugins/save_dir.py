"""The save folder of a training run: one job at a time, checked before anything is written, and kept tidy.

- `open_save_dir` replaces fairseq's start-up check (`verify_checkpoint_directory`, which writes and deletes a
  file named `dummy`: a user's `dummy` would be emptied and deleted). On rank 0, before any file is touched: the
  folder is created, its lock taken for the run's life (smlp/folder_lock.py: a second job refuses in one line
  naming the holder), and a probe file of the one writer's temporary form created and removed. A folder that
  cannot be created or written is refused in one line (`SaveDirError`), from smlp-launch and plain fairseq-train.
- `remove_superseded`: a run on fewer ranks (resumed from a resharded set) overwrites the first shards of each
  name it saves (checkpoint_best-rank-0.pt) and would leave the others of the earlier run (checkpoint_best-rank-1.pt);
  after each save rank 0 removes the files of an earlier run that this run's save of the same name supersedes, so
  every name is one run's whole set.
- `prune_saves` applies --keep-interval-updates, --keep-last-epochs and --keep-best-checkpoints to whole saves,
  whatever world size wrote them: fairseq prunes on each rank the files of that rank's own suffix, so the shards of
  ranks a run no longer has (a requeue on fewer ranks) were never removed. Sets the resharder derived
  (`checkpoint_resharded_*`) are removed once this run has a newer complete save.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re

from smlp import folder_lock
from smlp.files import temp_name

from .atomic_files import RANK_FILE
from .errors import RefusedInput
from .shard_tags import read_shard, set_problem

logger = logging.getLogger(__name__)

RESHARDED = ("checkpoint_resharded_", "finetune_resharded_")  # the stems of the sets the resharder derives


class SaveDirError(OSError, RefusedInput):
    """A --save-dir that cannot be created, written or locked, said in one line."""

    def __str__(self) -> str:
        return str(self.strerror)


def open_save_dir(save_dir: str, program: str = "fairseq-train") -> None:
    """Create `save_dir`, hold its lock for the run and check it can be written (module docstring); rank 0."""
    if "://" in str(save_dir):
        return
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as exc:
        raise SaveDirError(exc.errno, f"--save-dir {save_dir} cannot be created ({exc.strerror}: {exc.filename}); "
                                      f"choose a folder you can write") from None
    try:
        folder_lock.hold(save_dir, program)
        probe = os.path.join(save_dir, temp_name("write-probe"))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.remove(probe)
    except folder_lock.FolderInUse as exc:
        raise SaveDirError(0, str(exc)) from None
    except OSError as exc:
        raise SaveDirError(exc.errno, f"--save-dir {save_dir} cannot be written ({exc.strerror}); training would "
                                      f"fail at its first save. Choose a writable folder") from None


# ----------------------------------------------------------------------------- pruning whole saves


def superseded_files(save_dir: str, run_id: str, world: int, sharded: bool) -> list[str]:
    """The files of `save_dir` that this run's saves made obsolete: for every checkpoint name whose first file
    (X-rank-0.pt, or X.pt when this run writes one file) this run (`run_id`) wrote, the rank shards X-rank-R.pt
    no rank of this run writes (R >= world, or every R for one file) that an earlier run on more ranks left
    (they carry its tag), and on a sharded run the file X.pt an earlier one-process run wrote (not a merged one).
    Beside the files of this run they would form a mixed set that nothing can load."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    ranks_of: dict[str, list[int]] = {}
    for name in names:
        m = RANK_FILE.match(name)
        if m and m.group("stem").startswith("checkpoint"):
            ranks_of.setdefault(m.group("stem"), []).append(int(m.group("rank")))
    out = []
    for stem, ranks in sorted(ranks_of.items()):
        left = sorted(r for r in ranks if r >= world or not sharded)
        if not left:
            continue
        own = read_shard(os.path.join(save_dir, f"{stem}-rank-0.pt" if sharded else f"{stem}.pt"))
        if not own.readable or own.run_id != run_id:
            continue
        for r in left:
            path = os.path.join(save_dir, f"{stem}-rank-{r}.pt")
            info = read_shard(path)
            if info.run_id is not None and info.run_id != run_id:
                out.append(path)
    for stem in sorted(ranks_of) if sharded else ():
        one = os.path.join(save_dir, f"{stem}.pt")
        if os.path.isfile(one) and read_shard(os.path.join(save_dir, f"{stem}-rank-0.pt")).run_id == run_id:
            info = read_shard(one)
            if info.run_id is not None and info.run_id != run_id and not info.consolidated_from:
                out.append(one)
    return out


def remove_superseded(save_dir: str, run_id: str | None, world: int, sharded: bool) -> list[str]:
    """Rank 0, after each save: delete `superseded_files` (see there) and log which run they belonged to."""
    if run_id is None:
        return []
    stale = superseded_files(save_dir, run_id, world, sharded)
    for path in stale:
        info = read_shard(path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        logger.info("removed %s (update %s, written by a %s-rank run, run %s): this %d-rank run's save of the same "
                    "name supersedes it", os.path.basename(path), info.num_updates, info.world_size or 1,
                    info.run_id, world)
    return stale



def saves_by_name(save_dir: str, prefixes: tuple[str, ...] = ("checkpoint",)) -> dict[str, list[str]]:
    """Checkpoint stem -> its files in `save_dir`: the rank shards `STEM-rank-R.pt` and a file `STEM.pt`, for the
    stems starting with one of `prefixes`."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for name in sorted(names):
        if not (name.startswith(prefixes) and name.endswith(".pt")):
            continue
        m = RANK_FILE.match(name)
        out.setdefault(m.group("stem") if m else name[:-3], []).append(os.path.join(save_dir, name))
    return out


def _ranked(stems, pattern: str) -> list[tuple[float, str]]:
    found = []
    for stem in stems:
        m = re.fullmatch(pattern, stem)
        if m:
            found.append((float(m.group(1)), stem))
    return sorted(found, reverse=True)


def prune_saves(cfg, save_dir: str) -> list[str]:
    """Rank 0, after a save: remove every file (any rank, any world size) of the saves that --keep-interval-updates,
    --keep-last-epochs and --keep-best-checkpoints drop (`cfg`: the checkpoint config). Returns the removed paths."""
    saves = saves_by_name(save_dir)
    removed = []
    if cfg.keep_interval_updates > 0:
        drop = _ranked(saves, r"checkpoint_\d+_(\d+)")[cfg.keep_interval_updates:]
        removed += _remove([f for _, s in drop for f in saves[s]],
                           f"an older save than --keep-interval-updates {cfg.keep_interval_updates} keeps")
    if cfg.keep_last_epochs > 0:
        drop = _ranked(saves, r"checkpoint(\d+)")[cfg.keep_last_epochs:]
        removed += _remove([f for _, s in drop for f in saves[s]],
                           f"an older save than --keep-last-epochs {cfg.keep_last_epochs} keeps")
    if cfg.keep_best_checkpoints > 0:
        best = _ranked(saves, rf"checkpoint\.best_{re.escape(cfg.best_checkpoint_metric)}_(\d+\.?\d*)")
        if not cfg.maximize_best_checkpoint_metric:
            best = best[::-1]
        removed += _remove([f for _, s in best[cfg.keep_best_checkpoints:] for f in saves[s]],
                           f"a worse save than --keep-best-checkpoints {cfg.keep_best_checkpoints} keeps")
    return removed


def remove_resharded(save_dir: str, newest_update: int) -> list[str]:
    """Rank 0, after a complete save of update `newest_update`: remove the sets the resharder derived
    (`checkpoint_resharded_*`, and `finetune_resharded_*` once fine-tuning has saved) of earlier updates; their
    sources are kept."""
    old = []
    for stem, files in saves_by_name(save_dir, RESHARDED).items():
        info = read_shard(files[0])
        if stem.startswith(RESHARDED[1]) or not info.readable or (info.num_updates or 0) < newest_update:
            old += files
    return _remove(old, f"a resharded copy older than this run's save of update {newest_update}")


def _remove(paths: list[str], why: str) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
        logger.info("removed %s: %s", os.path.basename(path), why)
    return removed


# ----------------------------------------------------------------------------- the SLURM script's repair


def repair_checkpoint_last(save_dir: str) -> str | None:
    """Before a job's tasks start (launch/slurm/train.sbatch, holding the folder's lock): when a file of
    checkpoint_last cannot be read, copy the newest complete save of the same layout (the same rank files, of one
    save, written by that many ranks) onto the checkpoint_last names through the one writer. Returns what was done,
    None if nothing was needed; raises SaveDirError when no complete save can replace it. The plugins resume from
    the newest complete save by themselves; this keeps a run without them (SMLP_USER_DIR=none) from a torn file."""
    from .atomic_files import atomic_copy

    saves = saves_by_name(save_dir)
    lasts = sorted(saves.get("checkpoint_last", []))
    infos = [read_shard(f) for f in lasts]
    if all(i.readable for i in infos):
        return None
    names = [os.path.basename(f)[len("checkpoint_last"):] for f in lasts]  # "-rank-R.pt" or ".pt"
    sharded = names != [".pt"]
    best = None
    for stem, files in saves.items():
        if not re.fullmatch(r"checkpoint(\d+|_\d+_\d+)", stem):
            continue
        if sorted(os.path.basename(f)[len(stem):] for f in files) != sorted(names):
            continue
        found = [read_shard(os.path.join(save_dir, stem + n)) for n in names]
        if set_problem(found, len(names), sharded) is None and not found[0].consolidated_from:
            key = (found[0].num_updates or 0, found[0].epoch or 0, stem)
            best = max(best, key) if best else key
    damaged = ", ".join(os.path.basename(i.path) for i in infos if not i.readable)
    if best is None:
        raise SaveDirError(0, f"{damaged} in {save_dir} cannot be read (killed while copying?) and no complete save "
                              f"of the same {len(names)} file(s) can replace it; move it aside to start from scratch")
    for n in names:
        atomic_copy(os.path.join(save_dir, best[2] + n), os.path.join(save_dir, "checkpoint_last" + n))
    return f"{damaged} could not be read: replaced by {best[2]}{'-rank-*.pt' if sharded else '.pt'} (update {best[0]})"
