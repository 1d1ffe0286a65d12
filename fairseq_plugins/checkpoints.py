"""Checkpoints of expert-parallel models: safe loading, re-sharding and consolidation.

fairseq writes one checkpoint per rank when cfg.model.base_layers > 0 (`checkpoint_best-rank-R.pt`),
each holding that rank's experts. Here:
- `allow_fairseq_checkpoints()` lets torch.load (weights_only, the default since torch 2.6) read
  fairseq checkpoints by allowlisting exactly the classes fairseq pickles, instead of turning the
  safety off for everything (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD).
- `adapt_expert_state` fits a loaded state to the current world size: a shard of the same
  layout loads as is, a consolidated state (all experts) is sliced for this rank, anything else
  is refused with the command that fixes it.
- `consolidate` (the console script `smlp-consolidate`, smlp_launch.consolidate) merges the rank shards of one
  save into one file holding every expert, written atomically, never over a training checkpoint; it loads on
  any world size that divides the number of experts
  (fairseq-eval-lm, smlp-zeroshot). With expert-data parallelism (--expert-parallel-size G < W)
  ranks r and r + G write identical expert shards: the first G are merged and the replicas are
  checked to agree (`saved_ep_size`, `smlp.resharding.check_replicas`). The sMoE's replicated layout
  (--smoe-parallel replicated) puts all E of its experts in every rank's file: those keys are taken
  once (`smlp.resharding.replicated_keys`), so a merged checkpoint is the same whichever layout wrote it
  and loads into either.
- `check_current`: a file X.pt beside rank shards X-rank-R.pt of another save (merged at update 10, then
  training went on to update 12) is refused by every loading path, naming both, instead of evaluating the
  older one.
- `save_differences`: what two checkpoint files of one training hold differently, bitwise (every tensor of the
  model, criterion and optimizer state, the update count, the learning-rate scheduler and the data position),
  each entry by name: a run interrupted and resumed must end with none (benchmarks/chaos.py).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from smlp.resharding import merge_expert_shards, replicated_keys, slice_expert_shard

from .checkpoint_sets import CheckpointSetError
from .shard_tags import rank_shards

EXPERT_KEY = re.compile(r"(^|\.)experts\.")
SMOE_EXPERT_KEY = re.compile(r"(^|\.)smoe\.experts\.")


def is_expert_key(key: str) -> bool:
    """Expert weights live in the core's `experts` modules (FFNExperts, SpatialExperts)."""
    return bool(EXPERT_KEY.search(key))


def layer_totals(keys, num_experts: int, smoe_experts: int = 0) -> dict[str, int]:
    """{expert key: the experts of its layer}: the sMoE's keys `smoe_experts` (0: `num_experts`, the paper's tie,
    --smoe-experts), every other expert key `num_experts`."""
    return {k: (smoe_experts or num_experts) if SMOE_EXPERT_KEY.search(k) else num_experts for k in keys}


def saved_totals(state, num_shards: int, keys) -> dict[str, int] | None:
    """layer_totals of a checkpoint from its saved configuration (--num-experts 0: one per rank of the group of
    the `num_shards` ranks that wrote it); None when it has none."""
    from .config import configured_ep_size, read, resolve_num_experts

    model_cfg = _model_cfg(state)
    if model_cfg is None:
        return None
    E = resolve_num_experts(int(read(model_cfg, "num_experts") or 0), num_shards, configured_ep_size(model_cfg))
    return layer_totals(keys, E, int(read(model_cfg, "smoe_experts", default=0) or 0))


def model_totals(model) -> dict[str, int] | None:
    """layer_totals of one of our built models (its core config); None for another module."""
    core = getattr(getattr(model, "core", None), "cfg", None)
    if core is None:
        return None
    return layer_totals([k for k in model.state_dict() if is_expert_key(k)], core.num_experts, core.smoe_experts)


def allow_fairseq_checkpoints() -> None:
    """Allowlist the non-tensor objects fairseq stores in checkpoints for weights_only loading."""
    import argparse as _argparse
    import collections
    import typing

    import numpy as np
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode, BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

    safe = [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, BooleanNode, EnumNode, FloatNode,
            IntegerNode, StringNode, typing.Any, dict, list, int, float, str, bool, tuple, set,
            collections.defaultdict, collections.OrderedDict, _argparse.Namespace,
            np.dtype, np.ndarray, np.core.multiarray.scalar if hasattr(np, "core") else np.ndarray]
    for name in ("Float64DType", "Int64DType", "Float32DType", "Int32DType", "BoolDType"):
        cls = getattr(np.dtypes, name, None)
        if cls is not None:
            safe.append(cls)
    # trainer.load_checkpoint broadcasts the state from rank 0 with tensors swapped for placeholders
    from fairseq.distributed.utils import _TensorPlaceholder
    safe.append(_TensorPlaceholder)
    try:
        from numpy._core.multiarray import _reconstruct, scalar
        safe += [_reconstruct, scalar]
    except ImportError:  # older numpy
        pass
    torch.serialization.add_safe_globals(safe)


def pin_sequence_length() -> bool:
    """A checkpoint of our models keeps the sequence length T its weights were trained with.

    --seq-len 0 (the default) means --tokens-per-sample, and fairseq-validate applies every flag given on its
    command line to the saved model config, so `fairseq-validate --tokens-per-sample 16` would build a T = 16
    model and fail on the T = 32 spatial weights with PyTorch's "size mismatch". Wrapping
    `checkpoint_utils.load_checkpoint_to_cpu` (every program's loader), the saved config's seq_len is set to
    the training T before the command line's overrides apply: a shorter --tokens-per-sample evaluates in
    shorter blocks, a longer one is refused naming both values (config.to_core_config)."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name
    from omegaconf import open_dict

    from .checkpoint_sets import model_of
    from .config import FAMILIES_BY_MODEL

    original = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(original, "_smlp_patch", False):
        return False

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        state = original(path, None, load_on_all_ranks)
        cfg = state.get("cfg") if isinstance(state, dict) else None
        model = cfg.get("model") if cfg is not None else None
        if model is not None and model_of(model.get("_name")) in FAMILIES_BY_MODEL and not model.get("seq_len"):
            tokens = model.get("tokens_per_sample")
            if isinstance(tokens, int) and tokens > 0:  # the positions it trained on (config.sequence_tokens)
                with open_dict(model):
                    model.seq_len = tokens + (1 if model.get("add_bos_token") else 0)
        if arg_overrides is not None and cfg is not None:
            overwrite_args_by_name(cfg, arg_overrides)
        return state

    load_checkpoint_to_cpu._smlp_patch = True
    load_checkpoint_to_cpu.__wrapped__ = original
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    return True


def load_checkpoint(path: str, arg_overrides: dict | None = None) -> dict:
    """fairseq's checkpoint reader (config upgraded to omegaconf) with clear errors for bad files."""
    from fairseq import checkpoint_utils

    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path, arg_overrides)
    except Exception as exc:  # corrupt, truncated or not a checkpoint
        raise ValueError(f"cannot read checkpoint {path} ({type(exc).__name__}: {str(exc)[:300]}); "
                         f"it is truncated, corrupt or not a fairseq checkpoint") from exc
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state


def adapt_expert_state(model, state: Mapping[str, torch.Tensor], rank: int, world: int) -> Mapping[str, torch.Tensor]:
    """`state` fitted to this rank's model, key by key: a key that holds every expert (a consolidated
    checkpoint, or a layer the saving run replicated) is sliced to this rank's experts where this model
    spreads that layer over `world` positions; a shard that holds fewer experts than this model keeps of
    that layer (another world size, or a layer this run replicates) is refused with the command that fixes it."""
    own = model.state_dict()
    keys = [k for k in own if is_expert_key(k)]
    mismatched = [k for k in keys if k in state and state[k].shape[0] != own[k].shape[0]]
    if not mismatched:
        return state
    totals = model_totals(model)  # the experts of each layer (the sMoE's may differ from the tMoE's)
    whole = replicated_keys(own, keys, totals) if world > 1 else []
    spread = [k for k in keys if k not in whole]  # this model's layers over the group
    if totals is None:  # every layer has as many experts
        totals = {k: min(own[k].shape[0] for k in keys) * world for k in keys}
    if all(state[k].shape[0] == totals[k] for k in mismatched) and all(k in spread for k in mismatched):
        return slice_expert_shard(state, mismatched, rank, world)  # whole layers: take this rank's experts
    k = next(k for k in mismatched if state[k].shape[0] != totals[k] or k not in spread)
    local, saved, total = own[k].shape[0], state[k].shape[0], totals[k]
    if local == total and saved < total:  # a replicated layer here, one rank's shard of it in the file
        raise ValueError(
            f"the checkpoint holds one rank's shard of {k} ({saved} of {total} experts, written with the layer "
            f"spread over an expert-parallel group) but this run holds all {total} on every rank (--smoe-parallel "
            f"replicated). Merge the shards first with `smlp-consolidate <checkpoint.pt>` (it loads into either "
            f"layout), or pass --smoe-parallel expert; fairseq-train resumes across layouts by itself.")
    raise ValueError(
        f"the checkpoint holds {saved} of the {total} experts of each sparse layer (one rank's shard of a "
        f"{total // saved if saved and total % saved == 0 else '?'}-rank run; e.g. {k} has shape "
        f"{tuple(state[k].shape)}), but this run has {world} rank(s) with {local} expert(s) each. Merge the "
        f"shards first with `smlp-consolidate <checkpoint.pt>`; the result loads on any number of ranks "
        f"that divides {total}."
    )


def _model_cfg(state):
    cfg = state.get("cfg") if isinstance(state, Mapping) else None
    if cfg is None:
        return None
    model = cfg.get("model") if hasattr(cfg, "get") else None
    return model if hasattr(model, "get") else None


def saved_ep_size(state, num_shards: int, keys=()) -> int:
    """G, the expert-parallel group size of the run that wrote `num_shards` rank shards (shard 0's
    `state`): ranks r and r + G hold the same experts. From the saved config (--num-experts,
    --expert-parallel-size; checkpoints written before that flag used G = W), checked against the
    experts each shard holds: its share of each layer, or a replicated sMoE's whole layer."""
    from .config import configured_ep_size, expert_layout, read, resolve_num_experts

    model_cfg = _model_cfg(state)
    if model_cfg is None:
        return num_shards
    ep_cfg = configured_ep_size(model_cfg)  # the flag table (a saved config may lack it)
    num_experts = resolve_num_experts(int(read(model_cfg, "num_experts") or 0), num_shards, ep_cfg)
    try:
        G = expert_layout(num_experts, num_shards, ep_cfg).ep_size
    except ValueError as exc:
        raise ValueError(f"{num_shards} rank shards do not fit the saved configuration ({exc})") from None
    totals = saved_totals(state, num_shards, keys)
    for k in keys:
        n, total = int(state["model"][k].shape[0]), totals[k]
        if n * G == total or (n == total and SMOE_EXPERT_KEY.search(k)):  # spread, or the sMoE replicated
            continue
        what = f"{total} experts in that layer" + (" (--smoe-experts)" if SMOE_EXPERT_KEY.search(k) else "")
        raise ValueError(
            f"the shards hold {n} expert(s) of {k} each, but the saved configuration ({what}, expert-parallel "
            f"groups of {G} on {num_shards} ranks) gives {total // G}: the files are not one save")
    return G


def merge_rank_models(states: list) -> dict:
    """The model state of one save's rank shards (rank order) with every expert: each spread layer's pieces from
    the first G ranks concatenated (the replicas checked to agree), a replicated layer taken once."""
    models = [s["model"] for s in states]
    keys = [k for k in models[0] if is_expert_key(k)]
    G = saved_ep_size(states[0], len(states), keys)
    return merge_expert_shards(models, keys, G, replicated_keys(models[0], keys,
                                                                saved_totals(states[0], len(states), keys)))


def shard_paths(path: str) -> list[str]:
    """The rank shards `X-rank-R.pt` of checkpoint `X.pt`, in rank order; ValueError if any is missing."""
    stem = path[:-3] if path.endswith(".pt") else path
    found = rank_shards(path)
    if not found:
        raise FileNotFoundError(f"no rank shards {stem}-rank-<R>.pt found next to {path}")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise ValueError(f"checkpoint shards of rank(s) {missing} are missing for {stem}: cannot merge the experts")
    return [found[r] for r in range(len(found))]


def check_one_save(path: str, shards: list[str]) -> None:
    """ValueError naming every shard and its update unless the shards are one save (checkpoint_sets tags)."""
    from .shard_tags import from_several_runs, read_shard, set_problem

    infos = [read_shard(p) for p in shards]
    problem = set_problem(infos, len(shards), sharded=True)
    if problem:
        runs = from_several_runs(infos)
        hint = ("The files of one save are those of one run at one update; use a save one run wrote whole "
                "(e.g. checkpoint_<epoch>_<update>-rank-*.pt of the later run)" if runs else
                "A run was interrupted while its ranks saved; use the shards of one save "
                "(e.g. checkpoint_<epoch>_<update>-rank-*.pt)")
        raise CheckpointSetError(
            f"the shards of {path} are not one save ({problem}): "
            f"{'; '.join(i.describe(len(shards), runs) for i in infos)}. {hint}")


def check_current(path: str) -> None:
    """CheckpointSetError when the file `path` and rank shards of the same name (`X-rank-R.pt`) both exist and
    hold different saves: e.g. `smlp-consolidate X.pt` wrote X.pt at update 10, then training went on and wrote
    shards of update 12 beside it. Evaluating X.pt would silently evaluate the older save."""
    from .shard_tags import read_shard

    found = rank_shards(path)
    if not found or not os.path.isfile(path):
        return
    one = read_shard(path)
    infos = [read_shard(found[r]) for r in sorted(found)]
    if not one.readable or not all(i.readable for i in infos):
        return  # the loader names the unreadable file
    if one.set_id and all(i.set_id == one.set_id for i in infos):
        return  # merged from these very shards
    if not one.set_id and {i.num_updates for i in infos} == {one.num_updates}:
        return  # written before saves were tagged: the updates agree
    shown = "; ".join([one.describe(runs=True), *(i.describe(runs=True) for i in infos[:4])])
    if one.consolidated_from and all((i.num_updates or 0) > (one.num_updates or 0) for i in infos):
        fix = (f"training went on after {os.path.basename(path)} was merged: run `smlp-consolidate {path}` again to "
               f"merge the newer shards (or, to evaluate the older save, rename the file first and pass that name)")
    else:
        fix = (f"which one is meant cannot be told: move aside the files of the save you do not want (the shards "
               f"{os.path.basename(shard_path_any(path))} or {os.path.basename(path)}) and run again")
    raise CheckpointSetError(f"{path} and its rank shards hold different saves ({shown}); {fix}")


def shard_path_any(path: str) -> str:
    stem = path[:-3] if path.endswith(".pt") else path
    return f"{stem}-rank-*.pt"


def check_consolidate_output(out: str) -> None:
    """ValueError before any work unless replacing `out` loses nothing: it is absent or a file smlp-consolidate
    wrote (a training checkpoint of the same name is never overwritten)."""
    from .shard_tags import read_shard

    if os.path.isfile(out):
        info = read_shard(out)
        if not info.consolidated_from:
            what = f"a training checkpoint, {info.describe(runs=True)}" if info.readable else "not a merged checkpoint"
            raise CheckpointSetError(f"{out} exists and was not written by smlp-consolidate ({what}); it is not "
                                     f"replaced: pass --out with another file name")


def consolidate(path: str, out: str | None = None) -> str:
    """Merge the rank shards of `path` into one checkpoint holding every expert; returns its path."""
    shard_paths(path)  # FileNotFoundError / ValueError before anything is checked or read
    check_consolidate_output(out or path)
    merged = merged_state(path)
    out = out or path
    from .atomic_files import atomic_torch_save

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_torch_save(merged, out)
    return out


def merged_state(path: str) -> dict:
    """The checkpoint state of one save's rank shards `path` (X-rank-R.pt) holding every expert, for evaluation:
    no optimizer state, the expert count the writing run resolved; ValueError unless they are one save."""
    shards = shard_paths(path)
    check_one_save(path, shards)
    states = [load_checkpoint(p) for p in shards]
    merged = dict(states[0])
    merged["model"] = merge_rank_models(states)
    merged["last_optimizer_state"] = None  # per-rank optimizer states are not mergeable; this is for evaluation
    merged["smlp_consolidated_from"] = len(shards)
    tmoe = [k for k in merged["model"] if is_expert_key(k) and not SMOE_EXPERT_KEY.search(k)]
    if tmoe and merged.get("cfg") is not None:
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(merged["cfg"], resolve=True, enum_to_str=True)
        # --num-experts 0 meant one per rank of the writing run: the count it resolved to (the sMoE's
        # --smoe-experts 0 follows it; another count is kept as saved)
        cfg["model"]["num_experts"] = int(merged["model"][tmoe[0]].shape[0])
        merged["cfg"] = cfg  # stored as plain containers, as fairseq stores it
    return merged


def read_checkpoint_any_layout(path: str, arg_overrides: dict | None = None) -> tuple[dict, str]:
    """The state of checkpoint `path`, merging its rank shards in memory when `path` itself is absent.

    Returns (state, an existing file of this checkpoint).
    """
    if os.path.isfile(path):
        check_current(path)
        return load_checkpoint(path, arg_overrides), path
    shards = shard_paths(path)
    check_one_save(path, shards)
    states = [load_checkpoint(p, arg_overrides) for p in shards]
    merged = dict(states[0])
    merged["model"] = merge_rank_models(states)
    return merged, shards[0]


def load_for_eval(path: str, data_dir: str | None = None, overrides: dict | None = None):
    """Build a model of any of our families from a checkpoint, ready for evaluation.

    Works on one process (every expert local) and on any world size that divides the number of
    experts (each rank keeps its slice). `data_dir` replaces the training data folder recorded in
    the checkpoint (the dictionary is read from it). Returns (model in eval mode, task).
    """
    from fairseq import checkpoint_utils

    arg_overrides = dict(overrides or {})
    if data_dir is not None:
        if not os.path.isfile(os.path.join(data_dir, "dict.txt")):
            raise FileNotFoundError(f"{data_dir} has no dict.txt: pass the binarized data folder the model was "
                                    "trained on")
        arg_overrides["data"] = data_dir
    state, existing = read_checkpoint_any_layout(path, arg_overrides or None)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([existing], state=state, strict=True)
    return models[0].eval(), task


# what a training's checkpoint holds that decides its continuation (the rest: config, meters, timings, history)
TRAINING_STATE = ("model", "criterion", "last_optimizer_state", "optimizer_history[-1]", "extra_state.train_iterator")


def _training_state(state: Mapping) -> dict:
    history = state.get("optimizer_history") or [{}]
    return {"model": state.get("model"), "criterion": state.get("criterion"),
            "last_optimizer_state": state.get("last_optimizer_state"),
            "optimizer_history[-1]": {k: history[-1].get(k) for k in ("num_updates", "lr_scheduler_state")},
            "extra_state.train_iterator": (state.get("extra_state") or {}).get("train_iterator")}


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b are the same bits (dtype, shape and every byte: -0.0 and 0.0 or two NaNs with other
    payloads differ), else what differs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    bits_a, bits_b = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    if torch.equal(bits_a, bits_b):
        return None
    unequal = int((bits_a != bits_b).reshape(a.numel(), -1).any(dim=1).sum())
    flat_a, flat_b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    text = f"{unequal} of {a.numel()} values differ"
    if a.is_floating_point() and unequal:
        text += f", max |a - b| {float((flat_a.double() - flat_b.double()).abs().nan_to_num(float('inf')).max()):.3g}"
    return text


def _differences(a, b, name: str, out: dict[str, str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out[name] = f"{type(a).__name__} vs {type(b).__name__}"
        elif (why := _tensor_difference(a, b)) is not None:
            out[name] = why
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in list(a) + [k for k in b if k not in a]:
            child = f"{name}.{key}" if name else str(key)
            if key not in b or key not in a:
                out[child] = f"only in {'the first' if key in a else 'the second'}"
            else:
                _differences(a[key], b[key], child, out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{name}[{i}]", out)
    elif type(a) is not type(b) or a != b:
        out[name] = f"{a!r} vs {b!r}"


def save_differences(a: str | os.PathLike, b: str | os.PathLike) -> dict[str, str]:
    """Name -> what differs, for every entry of TRAINING_STATE in which checkpoint files `a` and `b` differ
    (tensors compared bit for bit); empty when `b` continues exactly as `a` would. Names are the state's keys,
    e.g. `model.decoder.core.layers.1.tmoe.router.eval_prices.price_E` or `last_optimizer_state.state.3.exp_avg`.
    Compare files of the same rank (`X-rank-R.pt`): each holds that rank's experts and optimizer state."""
    allow_fairseq_checkpoints()
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in (a, b)]
    out: dict[str, str] = {}
    _differences(*(_training_state(s) for s in states), "", out)
    return out
