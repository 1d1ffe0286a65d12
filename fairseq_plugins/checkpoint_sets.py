"""A checkpoint of an expert-parallel model is a set of rank shards: write each atomically, tag it
with its save, and load only whole sets.

fairseq writes one file per rank when cfg.model.base_layers > 0 (`checkpoint_last-rank-R.pt`), each
rank on its own, then copies it to the other names (checkpoint_last, checkpoint_best) with a plain,
non-atomic copy. A crash or a SLURM requeue while the ranks save can therefore leave
`checkpoint_last-rank-0.pt` at update N and `-rank-1.pt` at N-k (or cut short, or missing), and
fairseq would resume each rank from its own file: experts of different updates, or one rank from
scratch, with no error. Here:

- Writing (`torch_persistent_save`, the copies inside `save_checkpoint`; fairseq_plugins/atomic_files.py):
  the one atomic writer (smlp/files.py). Every rank of a save writes its file, then all of them agree before
  any renames its own (`write_on_every_rank`): a rank that could not write stops every rank with its one line
  (`CheckpointWriteError`) and no file of that save is named. `--write-checkpoints-asynchronously` and, on rank
  shards, `--checkpoint-suffix` are refused before training starts (`check_checkpoint_flags`,
  `check_checkpoint_suffix`). After each save rank 0 prunes and supersedes whole saves (save_dir.py).
- Tagging: every trainer state records its rank, world size, update, epoch and a set id (shard_tags.py; the
  run id is drawn by rank 0 when training starts, `start_run`).
- Loading (checkpoint_sources.plan_and_check_resume, before fairseq reads anything): every rank reads the tag
  of the shard it would load, the ranks exchange what they found, and all of them take the same decision
  (`decide_resume`, pure). A complete set (every rank's shard present, readable, same
  set id, written by this world size) loads as fairseq would; anything else is refused naming each shard and its
  update. Resuming from the default `checkpoint_last.pt`, the newest complete save of the save directory is
  loaded, whichever file and whatever world size holds it (a save of another layout is resharded beside it).
- Also refused before any work: `--restore-file` naming one rank's shard or a file that does not exist
  (fairseq would start from scratch and overwrite checkpoint_last), a checkpoint whose tensors do not fit the
  model being trained (another architecture, expert count or dictionary), and a --save-dir that cannot be
  created or written, or that another job trains in (save_dir.open_save_dir, in place of fairseq's check).

fairseq's own files are not changed: `install()` wraps functions of `fairseq.checkpoint_utils` (looked up as
module attributes by fairseq_cli.train and the trainer), fairseq's distributed_init and call_main and
`Trainer.__init__` when the plugins are imported.
"""
from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass

from smlp.process_group import broadcast_object as _broadcast
from smlp.process_group import gather_objects as _gather
from smlp.process_group import rank_and_world

from .atomic_files import RANK_FILE as _RANK_FILE
from .atomic_files import atomic_copy, atomic_torch_save, write_on_every_rank
from .errors import FlagError, RefusedInput
from .shard_tags import SHARD_KEY, ShardInfo, rank_shards, read_shard, set_problem, shard_path, shard_tag

logger = logging.getLogger(__name__)

DEFAULT_RESTORE = "checkpoint_last.pt"
NO_CHECKPOINT = "checkpoint_none.pt"  # what ranks that start from scratch load: no file has this name
_MAX_LISTED = 8


class CheckpointSetError(ValueError, RefusedInput):
    """The checkpoint to resume from is not one consistent save, or does not fit this run."""


_RUN_ID: str | None = None  # drawn by rank 0 when training starts (load_checkpoint), the same on every rank


def start_run() -> None:
    """Every rank, when training starts: rank 0 draws this run's id (the tags' set ids) and shares it."""
    global _RUN_ID
    _RUN_ID = _broadcast(uuid.uuid4().hex[:12] if rank_and_world()[0] == 0 else None)


# ----------------------------------------------------------------------------- decisions (pure)


def _listing(infos: list[ShardInfo], world: int | None = None, runs: bool = False) -> str:
    lines = [i.describe(world, runs) for i in infos[:_MAX_LISTED]]
    if len(infos) > _MAX_LISTED:
        lines.append(f"... and {len(infos) - _MAX_LISTED} more")
    return "; ".join(lines)


@dataclass(frozen=True)
class ResumePlan:
    restore_file: str | None   # None: let fairseq do what it would; else the checkpoint name to load
    message: str | None = None  # a warning to log (rank 0)
    from_scratch: bool = False  # every rank starts as if there were no checkpoint


def decide_resume(requested: list[ShardInfo], candidates: dict[str, list[ShardInfo]], *, world: int,
                  sharded: bool, default_restore: bool, restore_name: str, single_file_exists: bool = False,
                  others: list[ShardInfo] = (), first_save: int | None = None, newest: bool = True) -> ResumePlan:
    """What to load, from what every rank found. Raises CheckpointSetError when nothing consistent is.

    Resuming from the default checkpoint_last, the newest complete save is loaded, whichever file holds it: a
    run stopped after it wrote a numbered save and before it copied that save to checkpoint_last resumes from
    the numbered save (and says so), not from the older checkpoint_last.

    requested:  the file each rank would load (one entry when the checkpoint is not sharded).
    candidates: checkpoint base path -> the files of that save, one per rank (every other save of the folder).
    single_file_exists: `restore_name` itself exists as one file (consolidated, or from one process).
    others:     every other checkpoint file any rank found in the save directory.
    first_save: the update of a run's first save (--save-interval-updates), if it saves by updates: when no
                complete save exists and no file is past it, the run was stopped while it wrote its first save
                and starts again from scratch (it loses what any interrupted save loses), instead of refusing.
    newest:     a newer complete save replaces a consistent (or missing) checkpoint_last (False with
                --finetune-from-model or --continue-once, which fairseq reads when checkpoint_last is missing).
    """
    complete = [(infos[0].num_updates or 0, infos[0].epoch or 0, base) for base, infos in candidates.items()
                if len(infos) == len(requested) and set_problem(infos, world, sharded) is None]
    newer = max(complete) if default_restore and newest and complete else None
    if newer is not None:
        shown = os.path.basename(shard_path(newer[2], "-rank-*" if sharded else ""))
    if not any(i.exists for i in requested):
        if not default_restore and sharded and single_file_exists:
            raise CheckpointSetError(
                f"--restore-file {restore_name} is one file (a consolidated or one-process checkpoint) but this "
                f"{world}-rank expert-parallel run resumes from rank shards ({_listing(requested)}); to start "
                f"from it, pass --finetune-from-model {restore_name} instead (each rank takes its experts)")
        if not default_restore:
            raise CheckpointSetError(
                f"--restore-file {restore_name}: {_listing(requested)}. fairseq would silently start from "
                f"scratch and then overwrite the checkpoints in --save-dir; pass an existing checkpoint"
                + (" name without the -rank-R suffix (each rank adds its own)" if sharded else ""))
        if newer is not None:
            return ResumePlan(newer[2], f"{restore_name} does not exist, but a complete save does (the run was stopped "
                                        f"after it wrote that save, before it copied it to {restore_name}). Resuming "
                                        f"from the newest complete save, {shown} (update {newer[0]}).")
        return ResumePlan(None)
    problem = set_problem(requested, world, sharded)
    if problem is None:
        last = requested[0].num_updates or 0
        if newer is not None and newer[0] > last:
            return ResumePlan(newer[2], f"{restore_name} holds update {last}, and a newer save is complete (the run "
                                        f"was stopped after it wrote that save, before it copied it to "
                                        f"{restore_name}). Resuming from the newest complete save, {shown} (update "
                                        f"{newer[0]}).")
        return ResumePlan(None)
    what = (f"{restore_name} is not one consistent save ({problem}): {_listing(requested, world)}" if sharded
            else f"{restore_name} cannot be resumed from: {_listing(requested, world)}")
    hint = ("A crash or requeue while the ranks were saving leaves shards of different updates; resume from "
            "a save whose shards all exist (checkpoint_<epoch>_<update>-rank-*.pt, written with "
            "--save-interval-updates N --keep-interval-updates 2 or more)")
    if not sharded:
        hint = ("The file is damaged; resume from another checkpoint of the save directory "
                "(checkpoint_<epoch>_<update>.pt, written with --save-interval-updates N)")
    if "-rank run" in problem:
        hint = ("Resume on the world size that wrote them, or merge them with `smlp-consolidate` and start "
                "from the result with --finetune-from-model (it loads on any world size dividing the expert count)")
    if not default_restore:
        raise CheckpointSetError(f"{what}. {hint}.")
    if not complete:
        found = [i for i in [*requested, *others] if i.exists]
        if first_save and sharded and all(i.readable and (i.num_updates or 0) <= first_save for i in found):
            return ResumePlan(None, f"{what}, and no complete save exists: the run was stopped while its ranks wrote "
                                    f"their first save (update {max(i.num_updates or 0 for i in found)}, "
                                    f"--save-interval-updates {first_save}). Starting from scratch; the first save "
                                    f"replaces these files.", from_scratch=True)
        raise CheckpointSetError(f"{what}, and no complete older save was found in the save directory. {hint}.")
    updates, _, base = max(complete)
    shown = os.path.basename(shard_path(base, "-rank-*" if sharded else ""))
    return ResumePlan(base, f"{what}. Resuming from the newest complete save, {shown} (update {updates}).")


def shape_mismatch(ckpt: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]]) -> list[str]:
    """Human-readable differences between a checkpoint's tensors and the model's (empty if they fit)."""
    out = []
    missing = [k for k in model if k not in ckpt]
    unexpected = [k for k in ckpt if k not in model]
    differ = [k for k in model if k in ckpt and ckpt[k] != model[k]]
    for k in differ[:4]:
        out.append(f"{k}: checkpoint {ckpt[k]}, model {model[k]}")
    if missing:
        out.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint (e.g. {missing[0]})")
    if unexpected:
        out.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model (e.g. {unexpected[0]})")
    return out


def explain_mismatch(ckpt: dict, model: dict) -> str:
    """Say what most likely differs: the dictionary, the experts per rank, or the architecture."""
    for k in ckpt:
        if k.endswith("embed.weight") and k in model and ckpt[k][0] != model[k][0] and ckpt[k][1:] == model[k][1:]:
            return (f"the checkpoint was trained with a {ckpt[k][0]}-symbol dictionary and the data directory's "
                    f"dict.txt has {model[k][0]} symbols: use the data directory the checkpoint was trained on")
    # the tMoE's first: a different --num-experts changes both layers when the sMoE's count follows it
    for k in sorted(ckpt, key=lambda k: ".smoe.experts." in k):
        if ".experts." in k and k in model and ckpt[k][0] != model[k][0] and ckpt[k][1:] == model[k][1:]:
            flags = "--smoe-experts, --smoe-parallel" if ".smoe.experts." in k else "--num-experts"
            return (f"the checkpoint holds {ckpt[k][0]} expert(s) per file and this run {model[k][0]} "
                    f"({flags} or the world size differ)")
    return "the checkpoint is of another architecture or size (--arch, --decoder-layers, --sparse-layers, widths)"


# ----------------------------------------------------------------------------- fairseq hooks


def _suffix_info(trainer) -> tuple[str, bool]:
    suffix = trainer.checkpoint_suffix or ""
    return suffix, bool(re.fullmatch(r"-rank-\d+", suffix))


def _candidates_here(save_dir: str, suffix: str) -> dict[str, ShardInfo]:
    """Checkpoint base path -> this rank's file of that save, for every save in save_dir."""
    found = {}
    try:
        names = os.listdir(save_dir)
    except OSError:
        return found
    end = suffix + ".pt"
    for name in names:
        if not name.startswith("checkpoint") or not name.endswith(end):
            continue
        stem = name[: -len(end)]
        if "-rank-" in stem or not stem:
            continue
        base = os.path.join(save_dir, stem + ".pt")
        found[base] = read_shard(os.path.join(save_dir, name))
    return found


def _foreign_layout(save_dir: str, sharded: bool, world: int) -> str | None:
    """A checkpoint_last of the other layout in save_dir (fairseq would ignore it and start over)."""
    if not os.path.isdir(save_dir):
        return None
    names = set(os.listdir(save_dir))
    shards = sorted(n for n in names if re.fullmatch(r"checkpoint_last-rank-\d+\.pt", n))
    if not sharded and shards:
        return (f"{save_dir} holds the expert-parallel checkpoint {', '.join(shards[:4])}"
                f"{' ...' if len(shards) > 4 else ''} (one file per rank) but this run is one process: resume it "
                f"on {len(shards)} ranks, or merge it with `smlp-consolidate` and start from it with "
                f"--finetune-from-model in another --save-dir")
    if sharded and not shards and "checkpoint_last.pt" in names:
        return (f"{save_dir} holds checkpoint_last.pt of a single-file run but this {world}-rank expert-parallel "
                f"run looks for checkpoint_last-rank-R.pt and would start from scratch, overwriting it; start from "
                f"it with --finetune-from-model in another --save-dir")
    return None


def _run_arch(trainer) -> tuple[str | None, str]:
    """(model name, --arch) of the run `trainer` trains."""
    model_cfg = getattr(getattr(trainer, "cfg", None), "model", None)
    name = getattr(model_cfg, "_name", None)
    return name, getattr(model_cfg, "arch", None) or name or "?"


def check_same_architecture(base: str, trainer) -> None:
    """Refuse, first of all (before resharding or the set checks), a checkpoint `base` (a file or a set's name) of
    another model, or whose non-expert tensors do not fit this run's model (widths, layers, dictionary): any later
    message (the expert count, the precision) would point the wrong way. Every rank reads the same file, so all
    decide alike. Expert tensors are left to the later checks: their shapes change with the world size."""
    if _RANK_FILE.match(os.path.basename(str(base))):
        return  # refused later with the name to pass instead
    shards = rank_shards(base)
    path = shards[min(shards)] if shards else base
    if not os.path.isfile(path):
        return
    model = trainer.get_model() if hasattr(trainer, "get_model") else trainer.model
    ours = hasattr(model, "core")
    info = read_shard(path, with_shapes=ours)
    if not info.readable or info.model_name is None:
        return
    name, arch = _run_arch(trainer)
    what = None
    if name is not None and model_of(info.model_name) != model_of(name):
        what = (f"the checkpoint is of another architecture or size (checkpoint: --arch {info.arch}, this run: "
                f"--arch {arch}; the models {model_of(info.model_name)} and {model_of(name)} differ)")
    elif ours:
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        keep = [k for k in own if not _is_expert_name(k)]
        diff = shape_mismatch({k: v for k, v in info.shapes.items() if not _is_expert_name(k)},
                              {k: own[k] for k in keep})
        why = explain_mismatch(info.shapes, own) if diff else ""
        if diff and "expert(s) per file" not in why:
            what = f"{why} (checkpoint: --arch {info.arch}, this run: --arch {arch}; {'; '.join(diff)})"
    if what:
        raise CheckpointSetError(
            f"{path} does not fit the model of this run: {what}. Resume it with the flags that trained it, or start "
            f"this model in another --save-dir")


def model_of(name: str | None) -> str | None:
    """The registered model of an architecture name (fairseq saves the --arch preset as the model's _name)."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return ARCH_MODEL_NAME_REGISTRY.get(name, name)


def _is_expert_name(key: str) -> bool:
    return bool(re.search(r"(^|\.)experts\.", key))


def _check_fits_model(plan: ResumePlan, restore_base: str, suffix: str, trainer, reads_file: bool) -> None:
    """Refuse a checkpoint whose tensors do not fit our model (only our models: fairseq's own may
    upgrade old key names while loading)."""
    model = trainer.get_model() if hasattr(trainer, "get_model") else trainer.model
    ours = hasattr(model, "core")
    problem = None
    if ours and reads_file and not plan.from_scratch:
        path = shard_path(plan.restore_file or restore_base, suffix)
        if os.path.isfile(path):
            info = read_shard(path, with_shapes=True)
            own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            diff = shape_mismatch(info.shapes, own) if info.readable else []
            if diff:
                model_cfg = getattr(getattr(trainer, "cfg", None), "model", None)
                arch = getattr(model_cfg, "arch", None) or getattr(model_cfg, "_name", None) or "?"
                problem = (f"{path} does not fit the model of this run: {explain_mismatch(info.shapes, own)} "
                           f"(checkpoint: --arch {info.arch or '?'}, this run: --arch {arch}; {'; '.join(diff)})")
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointSetError(problems[0])


def check_checkpoint_flags(cfg) -> None:
    """Refuse, before anything is read or written, a checkpoint option that would skip the atomic tagged writes
    (`cfg`: fairseq's checkpoint config; every rank's Trainer and smlp-launch's preflight call it)."""
    if getattr(cfg, "write_checkpoints_asynchronously", False):
        raise FlagError("--write-checkpoints-asynchronously (--save-async) writes each rank's file from a thread, "
                        "neither atomically nor tagged with its save, and fairseq then copies nothing to "
                        "checkpoint_last, so a resumed run would start again from update 0; drop the flag: "
                        "checkpoints are written atomically, as one set of rank shards, in the training loop")


_EVERY_RANK_SAVES = False  # inside save_checkpoint of a run on several ranks that each write their shard
_NO_SAVE = False  # this process's run writes no checkpoint (--no-save): its save folder is not locked


class _AtomicCopies:
    """fairseq's PathManager, except that local copies are atomic (used while a checkpoint is saved)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def copy(self, src_path: str, dst_path: str, overwrite: bool = False, **kwargs) -> bool:
        if "://" in src_path or "://" in dst_path or kwargs:
            return self._real.copy(src_path, dst_path, overwrite, **kwargs)
        if not overwrite and os.path.exists(dst_path):
            return False
        write_on_every_rank(dst_path, lambda commit: atomic_copy(src_path, dst_path, commit), _EVERY_RANK_SAVES)
        return True


class _PruningOs:
    """The os module for fairseq's save_checkpoint, except that removing a file already gone is no error: every rank
    prunes its own old shards there (--keep-*) while rank 0's prune_saves removes every rank's, and either may come
    first."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def remove(path) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def check_checkpoint_suffix(cfg) -> None:
    """Refuse --checkpoint-suffix on a run that writes one file per rank (`cfg`: fairseq's whole config, read
    before distributed_init replaces the suffix with `-rank-R`, which would ignore it without a word)."""
    suffix = getattr(cfg.checkpoint, "checkpoint_suffix", "") or ""
    world = getattr(cfg.distributed_training, "distributed_world_size", 1) or 1
    if suffix and world > 1 and getattr(cfg.model, "base_layers", 0):
        raise FlagError(f"--checkpoint-suffix {suffix}: an expert-parallel run on {world} ranks names its files by "
                        f"rank (checkpoint_last-rank-R.pt) and fairseq would drop the suffix; keep runs apart with "
                        f"another --save-dir instead")


def install() -> bool:
    """Wrap fairseq.checkpoint_utils' save, copy and save-dir check entry points, fairseq's distributed_init and
    call_main, and fairseq-train's main (once per process); loading is checkpoint_sources.py's."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    from .save_dir import open_save_dir, prune_saves, remove_resharded, remove_superseded

    if getattr(checkpoint_utils, "_smlp_checkpoint_sets", False):
        return False
    original_persist = checkpoint_utils.torch_persistent_save
    original_save = checkpoint_utils.save_checkpoint

    def torch_persistent_save(obj, filename, async_write: bool = False):
        if "://" in str(filename):
            return original_persist(obj, filename, async_write=async_write)
        # async_write (--write-checkpoints-asynchronously) is refused before training starts
        if isinstance(obj, dict) and "model" in obj and "optimizer_history" in obj:
            obj = {**obj, SHARD_KEY: shard_tag(obj, str(filename), _RUN_ID)}
        write_on_every_rank(str(filename), lambda commit: atomic_torch_save(obj, str(filename), commit),
                            _EVERY_RANK_SAVES)

    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        global _EVERY_RANK_SAVES
        rank, world = rank_and_world()
        real = checkpoint_utils.PathManager
        checkpoint_utils.PathManager, checkpoint_utils.os = _AtomicCopies(real), _PruningOs()
        _EVERY_RANK_SAVES = world > 1 and _suffix_info(trainer)[1]
        try:
            result = original_save(cfg, trainer, epoch_itr, val_loss)
        finally:
            checkpoint_utils.PathManager, checkpoint_utils.os = real, os
            _EVERY_RANK_SAVES = False
        if rank == 0 and "://" not in str(cfg.save_dir) and result is not None:  # a save was written
            remove_superseded(cfg.save_dir, _RUN_ID, world, _suffix_info(trainer)[1])
            prune_saves(cfg, cfg.save_dir)
            remove_resharded(cfg.save_dir, trainer.get_num_updates())
        return result

    original_verify = checkpoint_utils.verify_checkpoint_directory

    def verify_checkpoint_directory(save_dir: str) -> None:  # rank 0, before any file is read or written
        if not _NO_SAVE:  # runs that save nothing (benchmarks, tests) may share a folder, the default one too
            open_save_dir(save_dir)

    original_init = distributed_utils.distributed_init
    original_call_main = distributed_utils.call_main

    def distributed_init(cfg):  # every rank, before the rendezvous and before fairseq sets the rank suffix
        check_checkpoint_suffix(cfg)
        return original_init(cfg)

    def call_main(cfg, main, **kwargs):
        from smlp import folder_lock

        global _NO_SAVE
        before, _NO_SAVE = _NO_SAVE, bool(cfg.checkpoint.no_save)  # hydra-train calls train's main as imported
        try:
            return original_call_main(cfg, main, **kwargs)
        finally:
            _NO_SAVE = before  # a program run in a longer-lived process leaves no setting behind
            folder_lock.release()  # nor the save folder's lock

    from fairseq_cli import train as train_cli

    original_main = train_cli.main

    def main(cfg, *args, **kwargs):  # fairseq-train's main on every rank (call_main looks it up when it runs)
        global _NO_SAVE
        before, _NO_SAVE = _NO_SAVE, bool(cfg.checkpoint.no_save)
        try:
            return original_main(cfg, *args, **kwargs)
        finally:
            _NO_SAVE = before

    from fairseq.trainer import Trainer

    original_init_trainer = Trainer.__init__

    def __init__(self, cfg, *args, **kwargs):  # every rank, before any checkpoint is read or written
        check_checkpoint_flags(cfg.checkpoint)
        original_init_trainer(self, cfg, *args, **kwargs)

    for wrapper, original in ((save_checkpoint, original_save), (torch_persistent_save, original_persist),
                              (verify_checkpoint_directory, original_verify), (distributed_init, original_init),
                              (call_main, original_call_main), (__init__, original_init_trainer),
                              (main, original_main)):
        wrapper.__wrapped__ = original
        wrapper.__doc__ = original.__doc__
    Trainer.__init__ = __init__
    train_cli.main = main
    distributed_utils.distributed_init = distributed_init
    distributed_utils.call_main = call_main
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory
    checkpoint_utils.torch_persistent_save = torch_persistent_save
    checkpoint_utils.save_checkpoint = save_checkpoint
    checkpoint_utils._smlp_checkpoint_sets = True
    return True
