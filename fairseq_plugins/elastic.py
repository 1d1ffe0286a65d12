"""Elastic resume: a training checkpoint written by W ranks resumes on W' ranks.

A cluster that hands back fewer (or more) nodes after a requeue must not end the run. fairseq
resumes each rank from its own `checkpoint_last-rank-R.pt` (or one `checkpoint_last.pt` on one
process), so on another world size it would start from scratch, load the wrong experts, or drop
the optimizer state. Before fairseq loads anything, `reshard` writes the checkpoint in the layout
of this run:

- model: the experts of every sparse layer are re-sliced for each rank's position in its
  expert-parallel group (smlp.resharding; replicas of expert-data parallelism get identical files);
  a layer replicated on every rank (the sMoE's --smoe-parallel replicated) gets all its experts in
  every file, merged from the source shards when the saving run spread it, and is sliced again
  when this run spreads a layer the saving run replicated;
- optimizer: the per-parameter state of expert parameters (Adam's exp_avg and exp_avg_sq) moves
  with its experts; the state of shared parameters is the same on every rank and is kept;
- data position: fairseq counts the batches each rank consumed (`iterations_in_epoch`), and rank r
  of W reads batches r, r + W, ... of the epoch's shuffled list, so W x that count batches are
  done; the new ranks skip (W x count) / W' each. With the same global batch (W x --update-freq x
  --batch-size unchanged) the resumed run sees the batches an uninterrupted run would have seen,
  and logs its losses.

The resharding runs on all ranks: rank 0 inspects the saved set and broadcasts the plan; every
rank reads the source shards holding its experts and writes its own file of a new set beside, under
--save-dir (`checkpoint_resharded_<update>_w<W>-rank-R.pt`, or `finetune_resharded_...` for the model a
fine-tuning starts from), named only once every rank has written its own (atomic_files.write_on_every_rank).
The source is never moved, changed or deleted: a user's consolidated file, a set in another folder, or the
newest complete save of the save directory stays as it was, and a kill while resharding leaves it whole.
What loads which set is decided in fairseq_plugins/checkpoint_sources.py.

Refused with a clear error: a run whose model holds another number of experts than the
checkpoint (e.g. --num-experts 0, one per rank, on another world size), an optimizer state that
is not kept per parameter (--fp16 with flattened parameters: use --fp16-no-flatten-grads), and
a save set that is not complete.

Evaluation programs never reshard: they merge a set in memory (checkpoints.read_checkpoint_any_layout).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from smlp.expert_data_parallel import ExpertDataLayout
from smlp.experts import is_expert
from smlp.process_group import broadcast_object as _broadcast
from smlp.process_group import gather_objects as _gather
from smlp.process_group import rank_and_world
from smlp.resharding import replicated_keys, reshard_model_state, reshard_optimizer_state, source_positions

from .atomic_files import atomic_torch_save, write_on_every_rank
from .checkpoints import is_expert_key
from .errors import RefusedInput
from .shard_tags import SHARD_KEY, rank_shards, read_shard, set_problem, shard_path

logger = logging.getLogger(__name__)


class ReshardError(ValueError, RefusedInput):
    """The checkpoint cannot be moved to this run's layout; the message says why and what to do."""


@dataclass(frozen=True)
class SavedSet:
    """A checkpoint as saved: one file (one process, or consolidated) or one shard per rank."""

    base: str                 # the name without rank suffix, e.g. <save_dir>/checkpoint_last.pt
    files: tuple[str, ...]    # rank order; one file when not sharded
    sharded: bool
    world_size: int           # ranks of the run that wrote it
    ep_size: int              # its expert-parallel group size (1 when one file holds every expert)
    num_experts: int          # experts per sparse layer (0 for a dense model)
    local_experts: int        # experts per file
    num_updates: int | None
    problem: str | None = None  # why the shards are not one save (then the other fields are not read)
    replicated: tuple[str, ...] = ()  # expert keys every file holds whole (a replicated layer)
    smoe_experts: int = 0     # the sMoE's experts where they differ from num_experts (--smoe-experts), else 0

    def describe(self) -> str:
        what = (f"{len(self.files)} rank shards" if self.sharded else "one file")
        experts = (f", {self.num_experts} experts in groups of {self.ep_size}" if self.num_experts else "")
        experts += f" ({self.smoe_experts} in each sMoE)" if self.smoe_experts else ""
        return (f"{os.path.basename(self.base)} ({what} from a {self.world_size}-rank run{experts}, "
                f"update {self.num_updates})")


def shard_name(base: str, rank: int) -> str:
    """fairseq's name of rank `rank`'s file of checkpoint `base` (it inserts the suffix before .pt)."""
    return shard_path(base, f"-rank-{rank}")


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise ReshardError(f"cannot read checkpoint {path} ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _cfg_section(state: dict, name: str) -> dict:
    cfg = state.get("cfg") or {}
    section = cfg.get(name) if hasattr(cfg, "get") else None
    return section if hasattr(section, "get") else {}


def _updates(state: dict) -> int | None:
    history = state.get("optimizer_history") or [{}]
    return history[-1].get("num_updates")


def inspect_saved(base: str) -> SavedSet | None:
    """The saved set of checkpoint `base` (its rank shards, else the file itself), or None if absent."""
    from .checkpoints import SMOE_EXPERT_KEY, saved_ep_size, saved_totals

    shards = rank_shards(base)
    problem = None
    if shards:
        files = tuple(shards[r] for r in sorted(shards))
        infos = [read_shard(f) for f in files]
        recorded = [i.world_size for i in infos if i.world_size]
        writer = max(recorded) if recorded else None  # the world size the shards say wrote them
        missing = [r for r in range(max(max(shards) + 1, writer or 0)) if r not in shards]
        problem = (f"rank(s) {missing} are missing ({len(shards)} found)" if missing
                   else set_problem(infos, len(files), sharded=True))
        if problem:  # raised only if this set must be resharded: on its own world size checkpoint_sets falls back
            problem = (f"the rank shards of {base} are not one save ({problem}): "
                       f"{'; '.join(i.describe(len(files)) for i in infos)}; resume from a complete save "
                       f"(--restore-file checkpoint_<epoch>_<update>.pt) or on the world size that wrote it")
            return SavedSet(base, files, True, writer or len(files), 1, -1, 0, None, problem)
    elif os.path.isfile(base):
        files = (base,)
        if not read_shard(base).readable:
            return None  # damaged: checkpoint_sets refuses it (naming the file) or falls back to an older save
    else:
        return None
    first = _load(files[0])
    keys = [k for k in first["model"] if is_expert_key(k)]
    W = len(files)
    saved_world = int(_cfg_section(first, "distributed_training").get("distributed_world_size", W) or W)
    if shards and saved_world != W:
        raise ReshardError(f"{base}: {W} rank shards on disk but they were written by a {saved_world}-rank run: "
                           f"the save set is mixed or incomplete (a crash while saving?); resume from a complete "
                           f"save (--restore-file checkpoint_<epoch>_<update>.pt)")
    if not keys:
        return SavedSet(base, files, bool(shards), saved_world if not shards else W, 1, 0, 0, _updates(first))
    totals = saved_totals(first, W, keys)  # the experts of each layer (the sMoE's may differ: --smoe-experts)
    tmoe = [k for k in keys if not SMOE_EXPERT_KEY.search(k)] or keys
    G = saved_ep_size(first, W, keys) if shards else 1
    replicated = tuple(replicated_keys(first["model"], keys, totals)) if shards else ()
    local = min(int(first["model"][k].shape[0]) for k in tmoe if k not in replicated)  # the tMoE's per file
    smoe = {totals[k] for k in keys if SMOE_EXPERT_KEY.search(k)} if totals else set()
    N = smoe.pop() if len(smoe) == 1 and local * G not in smoe else 0
    return SavedSet(base, files, bool(shards), W if shards else saved_world, G, local * G, local, _updates(first),
                    replicated=replicated, smoe_experts=N)


@dataclass(frozen=True)
class Plan:
    saved: SavedSet
    target: ExpertDataLayout | None   # None for a dense model
    world_size: int
    sharded: bool                     # this run writes / reads one file per rank
    targets: tuple[str, ...]          # the file of each rank of this run
    replicated: tuple[str, ...] = ()  # expert keys this run holds whole on every rank (a replicated layer)


def plan_resume(base: str, *, world_size: int, sharded: bool, layout: ExpertDataLayout | None,
                num_experts: int, replicated: tuple[str, ...] = (), smoe_experts: int = 0,
                target: str | None = None) -> Plan | None:
    """What must change for a run of `world_size` ranks (expert layout `layout`; `replicated`: the expert
    keys of its layers replicated on every rank; `smoe_experts`: its sMoE's experts where they differ from
    `num_experts`, else 0) to resume `base`; None when fairseq can load it as it is (or there is nothing to
    load). The resharded set is written under the name `target` (default: `base`'s, for a plan only read)."""
    saved = inspect_saved(base)
    if saved is None:
        return None
    targets = tuple(shard_name(base, r) for r in range(world_size)) if sharded else (base,)
    if saved.problem:
        if sharded and saved.world_size == world_size:
            return None  # written by this world size: checkpoint_sets refuses it or falls back to a complete save
        raise ReshardError(saved.problem)
    same_files = saved.files == targets and saved.world_size == world_size
    if saved.num_experts != num_experts:
        if same_files:
            return None  # nothing to reshard: checkpoint_sets says how the checkpoint does not fit this model
        raise ReshardError(
            f"{saved.describe()} holds {saved.num_experts} experts per sparse layer but this run builds "
            f"{num_experts}; resuming cannot change the number of experts. Pass --num-experts {saved.num_experts}"
            + (" (--num-experts 0 means one per rank)" if saved.num_experts else ""))
    if (saved.smoe_experts or saved.num_experts) != (smoe_experts or num_experts):
        if same_files:
            return None
        raise ReshardError(
            f"{saved.describe()} holds {saved.smoe_experts or saved.num_experts} experts in each sMoE but this run "
            f"builds {smoe_experts or num_experts}; resuming cannot change the number of experts. Pass --smoe-experts "
            f"{saved.smoe_experts or saved.num_experts}")
    same = same_files
    target_replicated = tuple(replicated) if sharded and layout is not None and layout.ep_size > 1 else ()
    N, G = smoe_experts or num_experts, layout.ep_size if sharded and layout is not None else 1
    if N % G and not target_replicated:
        raise ReshardError(f"this run spreads the sMoE's {N} experts over expert-parallel groups of {G}, which do not "
                           f"divide them: resume with --smoe-parallel replicated")
    if num_experts:
        same = same and saved.ep_size == (layout.ep_size if layout is not None else 1)
        same = same and set(saved.replicated) == set(target_replicated)
    if same:
        return None
    if target is not None:
        targets = tuple(shard_name(target, r) for r in range(world_size)) if sharded else (target,)
    return Plan(saved, layout, world_size, sharded, targets, target_replicated)


def _ranges(plan: Plan, keys) -> dict[str, tuple[int, int | None, int, bool]]:
    """{key: (source experts per file, first, count, whole in the source)} of the keys laid out otherwise than
    the tMoE's spread layers (smlp.resharding.reshard_model_state): replicated in the saved files (each holds all
    its layer's experts) or in this run (first 0, count all), or of a layer with its own expert count (the sMoE's
    --smoe-experts); first None: this rank's position in its group times count (`_rank_ranges`)."""
    from .checkpoints import SMOE_EXPERT_KEY

    saved, E = plan.saved, plan.saved.num_experts
    G = plan.target.ep_size if plan.target is not None else 1
    out = {}
    for k in keys:
        T = saved.smoe_experts if saved.smoe_experts and SMOE_EXPERT_KEY.search(k) else E  # the layer's experts
        whole_there, whole_here = k in saved.replicated, k in plan.replicated
        if whole_there or whole_here or T != E:
            out[k] = (T if whole_there else T // saved.ep_size, 0 if whole_here else None, T if whole_here else T // G,
                      whole_there)
    return out


def _rank_ranges(plan: Plan, rank: int, keys) -> dict[str, tuple[int, int, int, bool]]:
    position = plan.target.ep_rank(rank) if plan.target is not None else 0
    return {k: (local, position * count if f is None else f, count, whole)
            for k, (local, f, count, whole) in _ranges(plan, keys).items()}


def resharded_state(plan: Plan, rank: int, sources: dict[int, dict], expert_params: list) -> dict:
    """Rank `rank`'s checkpoint in the new layout, from the source files {source position: state}.

    expert_params: for each parameter in the optimizer's order, whether it is an expert parameter: True /
    False, or its state_dict key (an expert key: one of a layer that may be replicated) or None."""
    saved = plan.saved
    base = sources[min(sources)]
    state = dict(base)
    if saved.num_experts:
        L = plan.target.num_local_experts if plan.target is not None else saved.num_experts
        first = (plan.target.first_expert(rank) if plan.target is not None else 0)
        keys = [k for k in base["model"] if is_expert_key(k)]
        ranges = _rank_ranges(plan, rank, keys)
        state["model"] = reshard_model_state({i: s["model"] for i, s in sources.items()}, keys,
                                             saved.local_experts, first, L, ranges)
        optim = base.get("last_optimizer_state")
        if isinstance(optim, dict) and "state" in optim:
            indices = [i for g in optim["param_groups"] for i in g["params"]]
            if len(indices) != len(expert_params):
                raise ReshardError(
                    f"the optimizer state of {saved.base} covers {len(indices)} parameter tensor(s) but the model has "
                    f"{len(expert_params)}: it is not kept per parameter (--fp16 flattens the parameters into one; "
                    f"train with --fp16-no-flatten-grads or --memory-efficient-fp16 to resume on another world size, "
                    f"or resume with --reset-optimizer)")
            experts = {idx for idx, expert in zip(indices, expert_params) if expert}
            by_index = {idx: ranges[key] for idx, key in zip(indices, expert_params) if key in ranges}
            state["last_optimizer_state"] = reshard_optimizer_state(
                {i: s["last_optimizer_state"] for i, s in sources.items()}, experts, saved.local_experts, first, L,
                by_index)
    state["extra_state"] = _moved_iterator(base.get("extra_state"), saved.world_size, plan.world_size)
    state["cfg"] = _retagged_cfg(base.get("cfg"), plan, rank)
    if isinstance(base.get(SHARD_KEY), dict):
        tag = dict(base[SHARD_KEY])
        tag.update(rank=rank, world_size=plan.world_size if plan.sharded else 1, sharded=plan.sharded)
        state[SHARD_KEY] = tag
    return state


def _moved_iterator(extra_state, old_world: int, new_world: int):
    """Each new rank skips the batches the old ranks consumed together (see the module docstring)."""
    if not isinstance(extra_state, dict) or "train_iterator" not in extra_state:
        return extra_state
    itr = dict(extra_state["train_iterator"])
    done = int(itr.get("iterations_in_epoch", 0) or 0) * old_world
    per_rank, extra = divmod(done, new_world)
    if extra:
        logger.warning("%d batches of epoch %s were consumed by %d ranks; %d ranks cannot split them evenly, so "
                       "each resumes after %d of its batches and %d batch(es) are seen twice this epoch", done,
                       itr.get("epoch"), old_world, new_world, per_rank, new_world - extra)
    itr["iterations_in_epoch"] = per_rank
    out = dict(extra_state)
    out["train_iterator"] = itr
    return out


def _retagged_cfg(cfg, plan: Plan, rank: int):
    """The saved config describes the layout of the file (smlp-consolidate and later resumes read it)."""
    if not isinstance(cfg, dict):
        return cfg
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}
    if isinstance(cfg.get("distributed_training"), dict):
        cfg["distributed_training"].update(distributed_world_size=plan.world_size, distributed_rank=rank)
    if isinstance(cfg.get("model"), dict):
        cfg["model"]["distributed_world_size"] = plan.world_size
        if plan.saved.num_experts:
            cfg["model"]["num_experts"] = plan.saved.num_experts
            cfg["model"]["expert_parallel_size"] = plan.target.ep_size if plan.target is not None else 0
    return cfg


def sources_for(plan: Plan, rank: int) -> dict[int, str]:
    """{source position: file} that rank `rank` of the new layout reads."""
    saved = plan.saved
    if not saved.num_experts:
        return {0: saved.files[0]}
    L = plan.target.num_local_experts if plan.target is not None else saved.num_experts
    first = plan.target.first_expert(rank) if plan.target is not None else 0
    positions = set(source_positions(first, L, saved.local_experts))
    for _key, (local, f, count, whole) in _rank_ranges(plan, rank, saved_expert_keys(plan)).items():
        if not whole:  # a layer with its own count or replicated here: its pieces too
            positions |= set(source_positions(f, count, local))
    return {i: saved.files[i] for i in sorted(positions)}


def saved_expert_keys(plan: Plan) -> list[str]:
    """The expert keys of the saved files (read from the first: every file holds the same keys)."""
    from .checkpoints import is_expert_key

    return [k for k in _load(plan.saved.files[0])["model"] if is_expert_key(k)]


def reshard_checkpoint(plan: Plan, rank: int, expert_params: list) -> None:
    """Every rank of the new run calls this with the same plan: each writes its file of the new set (rank 0 the
    one file of a one-file layout), named once every rank has written its own; the source is left as it is."""
    if set(plan.targets) & set(plan.saved.files):
        raise ReshardError(f"resharding {plan.saved.describe()} would overwrite it: write the new set under another "
                           f"name (plan_resume's target)")
    def write(commit):
        sources = {i: _load(p) for i, p in sources_for(plan, rank).items()}
        atomic_torch_save(resharded_state(plan, rank, sources, expert_params), plan.targets[rank], commit)

    if plan.sharded:
        write_on_every_rank(plan.targets[rank], write, every_rank=True)
    else:  # one file, written by rank 0 while the others wait for its outcome
        error = None
        if rank == 0:
            try:
                write(None)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in _gather(error) if e]
        if errors:
            raise ReshardError(f"resharding {plan.saved.describe()} for {plan.world_size} rank(s) failed, the "
                               f"source is unchanged: {errors[0]}")
    if rank == 0:
        name = os.path.basename(plan.targets[0])
        logger.info("resharded %s for %d rank(s)%s into %s; the source is unchanged", plan.saved.describe(),
                    plan.world_size, f" in expert-parallel groups of {plan.target.ep_size}" if plan.target else "",
                    name.replace("-rank-0.pt", "-rank-*.pt") if plan.sharded else name)


def derived_name(save_dir: str, kind: str, saved: SavedSet, world: int) -> str:
    """`save_dir/<kind>_<update>_w<world>.pt`, the name of a set the resharder derives (kind: checkpoint_resharded
    for a resume or restore, finetune_resharded for a fine-tuning's start)."""
    return os.path.join(save_dir, f"{kind}_{saved.num_updates or 0}_w{world}.pt")


def reshard(source: str, target: str, trainer) -> Plan | None:
    """Every rank, before fairseq loads: write checkpoint `source` in this run's layout as the set `target` (a
    name under --save-dir, elastic.derived_name) when it is laid out otherwise; None when it loads as it is."""
    model = trainer.get_model() if hasattr(trainer, "get_model") else trainer.model
    if not hasattr(model, "core"):
        return None  # not one of our models
    rank, world = rank_and_world()
    layout = getattr(model, "expert_layout", None)
    core = model.core.cfg
    num_experts = core.num_experts if core.sparse_layers else 0
    if num_experts and layout is None:  # one process, every expert local
        layout = ExpertDataLayout(world_size=1, ep_size=1, num_experts=num_experts)
    sharded = bool(trainer.checkpoint_suffix)
    plan, error = None, None
    # the expert keys of layers this run replicates (the sMoE's --smoe-parallel replicated: not marked expert)
    replicated = tuple(n for n, p in model.named_parameters() if is_expert_key(n) and not is_expert(p))
    if rank == 0:
        try:
            smoe = core.smoe_num_experts
            plan = plan_resume(source, world_size=world, sharded=sharded, layout=layout, num_experts=num_experts,
                               replicated=replicated, smoe_experts=smoe if smoe not in (0, num_experts) else 0,
                               target=target)
        except ReshardError as exc:
            error = str(exc)
    plan, error = _broadcast((plan, error))
    if error:
        raise ReshardError(error)
    if plan is None:
        return None
    criterion = trainer.get_criterion()
    named = [(n, p) for n, p in list(model.named_parameters()) + list(criterion.named_parameters()) if p.requires_grad]
    reshard_checkpoint(plan, rank, [n if is_expert_key(n) else None for n, p in named])
    return plan
