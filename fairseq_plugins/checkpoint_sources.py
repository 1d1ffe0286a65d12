"""What a training run loads: the newest complete save of any world size, a --restore-file or a
--finetune-from-model of any layout, each rank its own experts; the user's files are never moved or changed.

fairseq loads `checkpoint_last-rank-R.pt` (its rank suffix), `--restore-file X` with the suffix put into the whole
path, and `--finetune-from-model X` as is on every rank. Before it reads anything (`load_checkpoint`, every rank):

- resuming (the default checkpoint_last.pt): the newest complete save of the save directory, whatever world size or
  layout wrote it (checkpoint_sets.decide_resume for this run's own layout, `newest_other_layout` for the others;
  a tie goes to this run's layout). A save of another layout is resharded (elastic.py) into a new set beside it,
  `checkpoint_resharded_<update>_w<W>`, and that set is loaded; the save stays as it was.
- --restore-file X: a set by its name (`X.pt`, the shards `X-rank-R.pt`) or one file (smlp-consolidate's output,
  a one-process run's) on any number of ranks, resharded the same way under --save-dir. A file without optimizer
  state (smlp-consolidate drops it) still brings its update count and learning-rate schedule with its data
  position (`_restored`), as a full checkpoint does; --reset-* resets them as fairseq does for its own files.
- --finetune-from-model X, when the save directory holds no save: one file loads on every rank (each takes its
  experts); a set of this layout loads each rank's own shard; a set of another layout is resharded first
  (`finetune_resharded_<update>_w<W>`: not a save a resume would pick). One rank's shard is refused in one line
  naming its set (every rank would take rank 0's experts).
The chosen file is handed to fairseq's own load (reset flags, data iterator, meters), with this rank's path
(`_forced_file`: fairseq's whole-path suffix replace breaks a folder named `exp.ptb`).
"""
from __future__ import annotations

import contextlib
import logging
import os

from smlp.process_group import broadcast_object as _broadcast
from smlp.process_group import gather_objects as _gather
from smlp.process_group import rank_and_world

from . import elastic
from .atomic_files import RANK_FILE, remove_stale_temp_files
from .checkpoint_sets import (
    DEFAULT_RESTORE,
    NO_CHECKPOINT,
    CheckpointSetError,
    ResumePlan,
    ShardInfo,
    _candidates_here,
    _check_fits_model,
    _foreign_layout,
    _suffix_info,
    check_same_architecture,
    decide_resume,
    start_run,
)
from .save_dir import saves_by_name
from .shard_tags import rank_shards, read_shard, set_problem, shard_path

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- which save


def _save_sets(save_dir: str) -> list[tuple[str, bool, list]]:
    """(base, sharded, infos in rank order) of every save in `save_dir`: the shards of a name, and a file."""
    out = []
    for stem, files in saves_by_name(save_dir).items():
        base = os.path.join(save_dir, stem + ".pt")
        shards = sorted((int(RANK_FILE.match(os.path.basename(f)).group("rank")), f) for f in files
                        if RANK_FILE.match(os.path.basename(f)))
        if shards:
            out.append((base, True, [read_shard(f) for _, f in shards] if [r for r, _ in shards]
                        == list(range(len(shards))) else []))
        if base in files:
            out.append((base, False, [read_shard(base)]))
    return out


def newest_other_layout(save_dir: str, sharded: bool, world: int):
    """(update, epoch, base, shown name, who wrote it) of the newest complete save in `save_dir` that this run
    (`sharded` files on `world` ranks) cannot load as it is: shards of another world size, or one file on a
    sharded run (or shards on one process); None if there is none. smlp-consolidate's files are not resumed."""
    best = None
    for base, is_set, infos in _save_sets(save_dir):
        if not infos or not all(i.readable for i in infos) or infos[0].consolidated_from:
            continue
        n = len(infos)
        if (is_set and sharded and n == world) or (not is_set and not sharded):
            continue  # this run's own layout: decide_resume's
        if is_set and set_problem(infos, n, sharded=True) is not None:
            continue
        name = os.path.basename(shard_path(base, "-rank-*" if is_set else ""))
        who = f"a {n}-rank run" if is_set else "a one-process run"
        key = (infos[0].num_updates or 0, infos[0].epoch or 0, base, name, who)
        best = key if best is None or key[:2] > best[:2] else best
    return best


def resume_update(plan: ResumePlan, requested: list, candidates: dict) -> tuple[int, int]:
    """(update, epoch) of the save `plan` loads; (-1, -1) for none."""
    if plan.from_scratch:
        return -1, -1
    infos = candidates.get(plan.restore_file) if plan.restore_file else requested
    if not infos or not all(i.exists and i.readable for i in infos):
        return -1, -1
    return infos[0].num_updates or 0, infos[0].epoch or 0


def resharded(source: str, save_dir: str, trainer, kind: str) -> str:
    """Every rank: `source` when this run loads it as it is, else the set it was resharded into under `save_dir`
    (`<kind>_<update>_w<W>.pt`; an earlier one resharded from the same save is loaded again, never rewritten)."""
    check_same_architecture(source, trainer)  # before anything that would name the expert count or reshard
    rank, world = rank_and_world()
    sharded = _suffix_info(trainer)[1]
    target = (None, False)
    if rank == 0:
        shards = rank_shards(source)
        first = read_shard(shards[min(shards)] if shards else source)
        target = _target_name(save_dir, kind, first, world, sharded) if first.readable else target
    target, done = _broadcast(target)
    if target is None:
        return source  # missing or unreadable: refused later, naming the file
    if done:
        return target
    return target if elastic.reshard(source, target, trainer) is not None else source


def _target_name(save_dir: str, kind: str, first, world: int, sharded: bool) -> tuple[str, bool]:
    """(the name of the set a save, its first file's tag `first`, is resharded into; whether a complete set of
    that save in this layout is there already, from an earlier start)."""
    stem = f"{kind}_{first.num_updates or 0}_w{world}"
    for n in range(1, 100):
        base = os.path.join(save_dir, (stem if n == 1 else f"{stem}_{n}") + ".pt")
        files = ([shard_path(base, f"-rank-{r}") for r in range(world)] if sharded else [base])
        present = [f for f in [*rank_shards(base).values(), base] if os.path.exists(f)]
        if not present:
            return base, False
        infos = [read_shard(f) for f in files]
        if (all(i.readable for i in infos) and first.set_id and {i.set_id for i in infos} == {first.set_id}
                and set_problem(infos, world, sharded) is None and len(present) == len(files)):
            return base, True
    raise CheckpointSetError(f"{save_dir} holds 99 resharded sets named {stem}*: remove them")


def refuse_one_shard(path: str | None) -> None:
    """CheckpointSetError when --finetune-from-model names one rank's shard `X-rank-R.pt`, naming its set."""
    m = RANK_FILE.match(os.path.basename(str(path or "")))
    if m:
        base = os.path.join(os.path.dirname(str(path)), m.group("stem") + ".pt")
        ranks = sorted(rank_shards(base))
        raise CheckpointSetError(
            f"--finetune-from-model {path} is one rank's shard of the set {base} (ranks "
            f"{', '.join(map(str, ranks)) or 'none found'}): every rank would load rank {m.group('rank')}'s "
            f"experts; pass the set's name, --finetune-from-model {base}")


def finetune_file(cfg, trainer) -> str | None:
    """This rank's file of --finetune-from-model (module docstring); None when it is one file (fairseq loads it
    on every rank and each takes its experts) or not set."""
    path = cfg.finetune_from_model
    if not path:
        return None
    refuse_one_shard(path)
    if os.path.isfile(path) or not rank_shards(path):
        return None  # one file, or missing (fairseq says so)
    shards = rank_shards(path)
    missing = [r for r in range(max(shards) + 1) if r not in shards]
    infos = [read_shard(shards[r]) for r in sorted(shards)]
    problem = (f"rank(s) {missing} are missing" if missing else set_problem(infos, len(infos), sharded=True))
    if problem:
        raise CheckpointSetError(f"--finetune-from-model {path} is not one save ({problem}): "
                                 f"{'; '.join(i.describe(len(infos)) for i in infos)}; pass a complete save")
    base = resharded(str(path), cfg.save_dir, trainer, "finetune_resharded")
    return shard_path(base, _suffix_info(trainer)[0])


def plan_and_check_resume(cfg, trainer) -> ResumePlan:
    """Every rank calls this before fairseq loads anything; all of them return or raise the same. The plan's
    restore_file is always a save of this run's layout: a save of another (another world size, one file on a
    sharded run, smlp-consolidate's output) is resharded beside it under --save-dir first (checkpoint_sources)."""
    rank, world = rank_and_world()
    start_run()
    suffix, sharded = _suffix_info(trainer)
    default_restore = cfg.restore_file == DEFAULT_RESTORE
    m = RANK_FILE.match(os.path.basename(str(cfg.restore_file)))
    if not default_restore and m:
        raise CheckpointSetError(
            f"--restore-file {cfg.restore_file} names one rank's shard; fairseq adds each rank's -rank-R suffix "
            f"itself (this would look for {os.path.basename(shard_path(cfg.restore_file, suffix or '-rank-R'))}). "
            f"Pass the checkpoint name without the suffix: --restore-file "
            f"{os.path.join(os.path.dirname(cfg.restore_file), m.group('stem') + '.pt')}")
    local_dir = "://" not in str(cfg.save_dir)
    if rank == 0 and local_dir:  # every rank's killed writes: this job holds the folder's lock, nothing writes
        remove_stale_temp_files(cfg.save_dir)
    restore_base = os.path.join(cfg.save_dir, DEFAULT_RESTORE) if default_restore else str(cfg.restore_file)
    check_same_architecture(restore_base, trainer)
    if not default_restore and local_dir:  # a save of another layout is resharded under --save-dir
        restore_base = resharded(restore_base, cfg.save_dir, trainer, "checkpoint_resharded")
    other = _broadcast(newest_other_layout(cfg.save_dir, sharded, world) if rank == 0 and default_restore
                       and local_dir else None)
    reads_file = sharded or rank == 0  # without shards only rank 0 reads (and broadcasts) the checkpoint
    mine = read_shard(shard_path(restore_base, suffix)) if reads_file else None
    foreign = _foreign_layout(cfg.save_dir, sharded, world) if rank == 0 and default_restore else None
    gathered = _gather((mine, foreign))
    requested = [g[0] for g in gathered if g[0] is not None]
    foreign = gathered[0][1]
    if foreign and other is None and not any(i.exists for i in requested) and cfg.finetune_from_model is None:
        raise CheckpointSetError(foreign)
    candidates: dict[str, list[ShardInfo]] = {}
    others: list[ShardInfo] = []
    if default_restore and local_dir:  # every other save: a newer complete one, or the fallback from a mixed set
        local = _candidates_here(cfg.save_dir, suffix) if reads_file else None
        per_rank = [c for c in _gather(local) if c is not None]
        for base in set().union(*[set(c) for c in per_rank]):
            if os.path.basename(base) == DEFAULT_RESTORE:
                continue
            others += [c[base] for c in per_rank if base in c]
            if all(base in c for c in per_rank):
                candidates[base] = [c[base] for c in per_rank]
    single = _broadcast(os.path.isfile(restore_base) if rank == 0 else None)
    restarts_first = not cfg.finetune_from_model and not getattr(cfg, "continue_once", None)
    try:
        plan = decide_resume(requested, candidates, world=world, sharded=sharded, default_restore=default_restore,
                             restore_name=os.path.basename(restore_base) if default_restore else cfg.restore_file,
                             single_file_exists=single, others=others,
                             first_save=(cfg.save_interval_updates or None) if restarts_first else None,
                             newest=restarts_first)
    except CheckpointSetError:
        if other is None:
            raise
        plan = ResumePlan(None, from_scratch=True)  # no complete save of this layout: the other one is newer
    if other is not None and (other[0], other[1]) > resume_update(plan, requested, candidates):
        plan = ResumePlan(resharded(other[2], cfg.save_dir, trainer, "checkpoint_resharded"),
                          f"Resuming from the newest complete save, {other[3]} (update {other[0]}, written by "
                          f"{other[4]}), resharded for this run's {world} rank(s); the save itself is unchanged.")
    elif local_dir and not plan.from_scratch and (plan.restore_file or any(i.exists for i in requested)):
        chosen = plan.restore_file or restore_base  # the same world, another expert-parallel layout
        moved = resharded(chosen, cfg.save_dir, trainer, "checkpoint_resharded")
        if moved != chosen:
            plan = ResumePlan(moved, plan.message)
    if not default_restore and plan.restore_file is None:
        plan = ResumePlan(restore_base, plan.message)  # the named save, or the set it was resharded into
    _check_fits_model(plan, restore_base, suffix, trainer, reads_file)
    if plan.message and rank == 0:
        logger.warning(plan.message)
    return plan


# ----------------------------------------------------------------------------- handing it to fairseq


@contextlib.contextmanager
def _forced_file(trainer, path: str | None, restored: bool):
    """fairseq's load reads `path` (this rank's file, whatever name fairseq derived), and a file without optimizer
    state continues its update count and schedule (`restored`: a restore or resume, not a fine-tuning)."""
    real = trainer.load_checkpoint

    def load_checkpoint(filename, reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides=None,
                        reset_meters=False):
        filename = path or filename
        extra = real(filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters=reset_meters)
        if restored and not reset_optimizer and extra is not None:
            _restored(trainer, filename, reset_lr_scheduler)
        return extra

    trainer.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        del trainer.load_checkpoint


def _restored(trainer, filename: str, reset_lr_scheduler: bool) -> None:
    """A file without optimizer state (smlp-consolidate's): fairseq would restore its data position but start
    the update count and the learning-rate schedule again at 0; they continue together, Adam's moments start
    afresh (said once)."""
    history = getattr(trainer, "_optim_history", None) or [{}]
    last = history[-1]
    if read_shard(filename).has_optimizer or "num_updates" not in last:
        return
    if not reset_lr_scheduler and last.get("lr_scheduler_state") is not None:
        trainer.lr_scheduler.load_state_dict(last["lr_scheduler_state"])
    trainer.set_num_updates(last["num_updates"])
    if rank_and_world()[0] == 0:
        logger.warning("%s holds no optimizer state (smlp-consolidate leaves it out): the update count (%d), the "
                       "learning-rate schedule and the data position continue from it; the optimizer's moments "
                       "start afresh", os.path.basename(filename), last["num_updates"])


def load_checkpoint_wrapper(original):
    """fairseq's checkpoint_utils.load_checkpoint, loading what the module docstring says."""

    def load_checkpoint(cfg, trainer, **passthrough_args):
        finetune = cfg.finetune_from_model
        refuse_one_shard(finetune)
        plan = plan_and_check_resume(cfg, trainer)
        suffix = _suffix_info(trainer)[0]
        previous = cfg.restore_file, cfg.finetune_from_model
        path = None
        if plan.from_scratch:
            cfg.restore_file = os.path.join(cfg.save_dir, NO_CHECKPOINT)  # a name no save has
            cfg.finetune_from_model = None
            path = cfg.restore_file
        elif plan.restore_file is not None:
            cfg.restore_file, cfg.finetune_from_model = plan.restore_file, None
            path = shard_path(plan.restore_file, suffix)
        elif finetune and not os.path.exists(os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")):
            mine = finetune_file(cfg, trainer)
            if mine is not None:
                cfg.finetune_from_model = path = mine
        if path is not None and not plan.from_scratch and not os.path.isfile(path):  # fairseq would start afresh
            raise CheckpointSetError(f"{path} does not exist: nothing to load for {plan.restore_file or finetune}")
        try:
            with _forced_file(trainer, path, restored=cfg.finetune_from_model is None):
                return original(cfg, trainer, **passthrough_args)
        finally:
            cfg.restore_file, cfg.finetune_from_model = previous

    load_checkpoint.__wrapped__ = original
    load_checkpoint.__doc__ = original.__doc__
    return load_checkpoint


def install() -> bool:
    """Wrap fairseq.checkpoint_utils.load_checkpoint (looked up as a module attribute by fairseq_cli.train)."""
    from fairseq import checkpoint_utils

    if getattr(checkpoint_utils.load_checkpoint, "_smlp_sources", False):
        return False
    wrapper = load_checkpoint_wrapper(checkpoint_utils.load_checkpoint)
    wrapper._smlp_sources = True
    checkpoint_utils.load_checkpoint = wrapper
    return True
