"""Where a training step of each FLOP-matched family goes, on one process and on 2 gloo ranks x 1 thread.

`smlp-bench breakdown` (issue 38); docs/benchmarks.md, "Where sMLP-det's step goes", says what it measures."""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from smlp.files import write_atomic
from smlp.lm import LanguageModel, LMConfig
from smlp.profiling import COLLECTIVE, STEP, STEP_RANGES, step_parts

from ..machine import code_identity
from ..presets import BenchError, check_at_least, parse_checked, parse_counts, parse_names
from ..store import environment, write_record
from .op_count import block_ranges, count_ops, decoding_ops

FAMILIES = ("smlp_det", "gmlp", "transformer", "base", "switch", "hash", "gshard")
PLANNED = (*FAMILIES, "smlp_partial")  # what --families may name
# tiny: the test's size, every family in a second or two
TINY = dict(vocab_size=64, d_model=32, d_ffn=64, seq_len=32, num_experts=4, heads=2, padding_idx=1)
TINY_LAYERS = {"smlp_det": dict(family="smlp", dense_layers=2, sparse_layers=1),
               "smlp_partial": dict(family="smlp", dense_layers=2, sparse_layers=1, smoe_routing="partial"),
               "gmlp": dict(family="gmlp", dense_layers=3),
               "transformer": dict(family="transformer", dense_layers=2),
               **{r: dict(family="transformer", dense_layers=1, sparse_layers=1, moe_router=r)
                  for r in ("base", "switch", "hash", "gshard")}}
SIZES = {"fair": dict(batch=16, vocab=4000), "tiny": dict(batch=4, vocab=TINY["vocab_size"])}
AUX_LOSS_WEIGHT, CLIP_NORM, LR = 0.01, 1.0, 2e-3
COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")
# the parts of a step, in the table's order (forward/<block> first)
PARTS = ("backward", "optimizer", "grad_all_reduce", "all2all", "other_collectives", "collective_wait",
         "loop_overhead", "rest")


def configs(size: str, keys: list[str], vocab_size: int) -> dict[str, LMConfig]:
    """The core config of each family: the tiny ones, or the fair configuration's FLOP matches."""
    if size == "tiny":
        return {k: LMConfig(**TINY, **TINY_LAYERS[k]) for k in keys}
    from smlp_eval.flops import parse_model

    from ..fair import FAIR_TARGET
    from ..presets import plan_models

    models, _ = plan_models(vocab_size, 2, keys, FAIR_TARGET)  # each model's flags: --arch ARCH, then the rest
    return {m.key: parse_model(m.flags[1], m.flags[2:], vocab_size=vocab_size).cfg for m in models}


def build(cfg: LMConfig, world: int, batch: int, smoe_parallel: str) -> tuple[LanguageModel, str]:
    """The model on this rank (seeded alike on every rank) and the sMoE's layout."""
    from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
    from smlp.steptime import choose_smoe_layout

    torch.manual_seed(0)
    if world == 1 or not cfg.sparse_layers:
        return LanguageModel(cfg).train(), "local"
    layout = smoe_parallel
    if cfg.family == "smlp" and layout == "auto":
        layout, _ = choose_smoe_layout(cfg, world_size=world, ep_size=world, batch_size=batch, tokens=cfg.seq_len,
                                       device_type="cpu")
    smoe = LocalDispatcher(cfg.num_experts, replicated=True) if cfg.family == "smlp" and layout == "replicated" \
        else None
    model = LanguageModel(cfg, AllToAllDispatcher(cfg.num_experts), smoe_dispatcher=smoe).train()
    return model, layout if cfg.family == "smlp" else "expert"


def batches(cfg: LMConfig, batch: int, rank: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(4, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g) for _ in range(count)]


class Loop:
    """One training step as a plain loop (zero_grad, forward, loss + 0.01 x the auxiliary loss, backward, the
    non-expert gradients' all-reduce on 2 ranks, clipping, the routers' price fold, Adam); each phase inside its
    STEP_RANGES range and, if given, inside `within(phase)` (a context manager: the operator and host-sync counts)."""

    def __init__(self, model: LanguageModel, world: int):
        from smlp.experts import is_expert
        from smlp.routing.prices import install_price_fold

        self.model, self.world = model, world
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98))
        install_price_fold(self.optimizer, model)  # the balanced routers' prices, folded before each step (fairseq's)
        # fairseq's legacy_ddp leaves expert parameters out of the all-reduce, clip_grad_norm_ out of the norm
        self.shared = [p for p in model.parameters() if not is_expert(p)]

    def step(self, tokens: torch.Tensor, within=None) -> None:
        @contextlib.contextmanager
        def phase(name: str):
            with record_function(STEP_RANGES[name]), within(name) if within else contextlib.nullcontext():
                yield

        model, cfg = self.model, self.model.cfg
        with phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            logits = model(tokens[:, :-1])
        with phase("loss"):
            start = cfg.prediction_start  # partial prediction scores the positions after the routing prefix
            loss = F.cross_entropy(logits[:, start:].reshape(-1, cfg.vocab_size), tokens[:, 1 + start:].reshape(-1))
            aux = model.aux_loss()
            if aux is not None:
                loss = loss + AUX_LOSS_WEIGHT * aux
        with phase("backward"):
            loss.backward()
        if self.world > 1:
            with phase("grad_all_reduce"):
                grads = [p.grad for p in self.shared if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat.div_(self.world)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.shared, CLIP_NORM)
            self.optimizer.step()


@contextlib.contextmanager
def collective_log():
    """Within the block, every torch.distributed collective (COLLECTIVES) runs inside a COLLECTIVE range and its entry
    and exit times are kept in order (the yielded list of (name, entry, exit); time.perf_counter, the machine's
    monotonic clock, alike in every process). Synchronous calls only (async_op is not timed)."""
    calls, saved = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def timed(name, original):
        def call(*args, **kwargs):
            with record_function(COLLECTIVE + name):
                t0 = time.perf_counter()
                out = original(*args, **kwargs)
                calls.append((name, t0, time.perf_counter()))
            return out
        return call

    for name, original in saved.items():
        setattr(dist, name, timed(name, original))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def waits(calls: list[tuple[str, float, float]], world: int) -> list[float]:
    """Seconds this rank waited in each of its collective calls for the last rank to enter it."""
    if world == 1:
        return [0.0] * len(calls)
    every: list = [None] * world
    dist.all_gather_object(every, [c[1] for c in calls])
    n = min(len(e) for e in every)
    return [min(max((max(e[i] for e in every) if i < n else t0) - t0, 0.0), t1 - t0)
            for i, (_, t0, t1) in enumerate(calls)]


def breakdown_ms(parts, waited: list[float], wall: float, steps: int) -> tuple[dict, dict, dict]:
    """(ms per step by part, the forward by (block, range), the backward by block) of the profiled steps."""
    out, forward_ranges, backward_blocks = defaultdict(float), defaultdict(float), defaultdict(float)
    for (block, within), s in parts.forward.items():
        out[f"forward/{block}"] += s
        forward_ranges[f"{block}/{within}"] += s
    for (block, _), s in parts.backward.items():
        out["backward"] += s
        backward_blocks[block] += s
    for phase in ("optimizer", "grad_all_reduce"):
        out[phase] += parts.phases.get(phase, 0.0)
    for (name, phase, s), w in zip(parts.collectives, waited):
        w = min(w, s)
        kind = ("all2all" if name == "all_to_all_single" else
                "grad_all_reduce" if phase == "grad_all_reduce" else "other_collectives")
        out[kind] += s - w
        out["collective_wait"] += w
    out["loop_overhead"] += parts.loop
    out["rest"] = max(wall - parts.total, 0.0)
    scale = lambda d: {k: 1000 * v / steps for k, v in d.items()}  # noqa: E731
    return scale(out), scale(forward_ranges), scale(backward_blocks)


def count_syncs(loop: Loop, tokens: torch.Tensor) -> dict:
    """Host syncs of one training step by phase, on the paths an accelerator takes, and where they came from.
    The optimizer is left out: torch's Adam keeps its step counts on the host (its `.item()` calls read no
    device), which the counter, not having seen them made, would count."""
    from .host_syncs import HostSyncCounter, accelerator_paths

    counters: dict = {}
    with accelerator_paths():
        loop.step(tokens, lambda phase: contextlib.nullcontext() if phase == "optimizer"
                  else counters.setdefault(phase, HostSyncCounter()))
    return {"total": sum(c.count for c in counters.values()), **{p: c.count for p, c in counters.items()},
            "sites": {p: dict(c.by_site) for p, c in counters.items() if c.count}}


def measure(cfg: LMConfig, rank: int, world: int, batch: int, steps: int, warmup: int, smoe_parallel: str) -> dict:
    model, layout = build(cfg, world, batch, smoe_parallel)
    loop, it = Loop(model, world), iter(batches(cfg, batch, rank, warmup + 2 * steps + 3))
    for _ in range(warmup):
        loop.step(next(it))
    barrier = dist.barrier if world > 1 else (lambda: None)
    barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.step(next(it))
        times.append(time.perf_counter() - t0)
    barrier()
    # the profiler's first step pays its start-up: one step of warm-up, then the steps kept
    walls, window = [], torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with collective_log() as calls, block_ranges(model), \
            profile(activities=[ProfilerActivity.CPU], schedule=window) as prof:
        for i in range(steps + 1):
            if i == 1:
                del calls[:]
            t0 = time.perf_counter()
            with record_function(STEP):
                loop.step(next(it))
            walls.append(time.perf_counter() - t0)
            prof.step()
    walls, events = walls[1:], prof.events()
    parts, waited = step_parts(events), waits(calls, world)
    if len(waited) != len(parts.collectives):
        raise RuntimeError(f"{len(calls)} collectives timed but {len(parts.collectives)} profiled")
    parts_ms, forward_ranges, backward_blocks = breakdown_ms(parts, waited, sum(walls), steps)
    return {"rank": rank, "world": world, "smoe_layout": layout, "layers": f"{cfg.dense_layers}+{cfg.sparse_layers}",
            "step_ms": 1000 * statistics.median(times), "step_ms_all": [1000 * t for t in times],
            "profiled_step_ms": 1000 * sum(walls) / steps, "breakdown_ms": parts_ms,
            "forward_by_range_ms": forward_ranges, "backward_by_block_ms": backward_blocks,
            "ops": count_ops(loop, next(it)), "profiler_events": len(events) // steps,
            "host_syncs": count_syncs(loop, next(it))}


def _worker(rank: int, world: int, init: str, cfgs: dict, settings: dict, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        report = {key: measure(cfg, rank, world, **settings) for key, cfg in cfgs.items()}
        if world > 1:
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()
    write_atomic(Path(out, f"{world}-{rank}.json"), json.dumps(report))


def run_world(cfgs: dict, world: int, settings: dict) -> list[dict]:
    """Every family on `world` ranks (1: in this process); one report per rank."""
    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            threads = torch.get_num_threads()
            try:
                _worker(0, 1, "", cfgs, settings, tmp)
            finally:
                torch.set_num_threads(threads)
        else:  # forked from a server that imported this module once, not each rank importing it anew
            mp.get_context("forkserver").set_forkserver_preload([__name__])
            mp.start_processes(_worker, args=(world, f"file://{tmp}/rendezvous", cfgs, settings, tmp), nprocs=world,
                               join=True, start_method="forkserver")
        return [json.loads(Path(tmp, f"{world}-{r}.json").read_text()) for r in range(world)]


def decoding(cfgs: dict, steps: int, rounds: int = 5) -> dict:
    """Per family: operators of one cached decoding step at batch 1 by block, and ms per new token with the cache
    and recomputing the prefix without it."""
    torch.set_num_threads(1)
    models, out = {key: torch.manual_seed(0) and LanguageModel(cfg).eval() for key, cfg in cfgs.items()}, {}
    prompt = max(1, next(iter(cfgs.values())).seq_len // 8)
    steps = min(steps, min(c.seq_len for c in cfgs.values()) - prompt - 1)
    tokens = torch.randint(4, min(c.vocab_size for c in cfgs.values()), (1, prompt + steps + 1),
                           generator=torch.Generator().manual_seed(0))
    times = defaultdict(list)
    with torch.no_grad():
        for key, model in models.items():
            if not model.supports_cached_decoding:
                continue
            cache = model.new_cache()
            model(tokens[:, :prompt], cache=cache)
            model(tokens[:, prompt:prompt + 1], cache=cache)  # the first step grows the cache's buffers
            by_block = decoding_ops(model, tokens[:, prompt + 1:prompt + 2], cache)
            out[key] = {"ops": sum(by_block.values()), "ops_by_block": by_block}
        for _ in range(rounds):  # the families in turns, so that a change of load weighs on all alike
            for key in out:
                model, cache = models[key], models[key].new_cache()
                model(tokens[:, :prompt], cache=cache)
                for i in range(prompt, prompt + steps):
                    t0 = time.perf_counter()
                    model(tokens[:, i:i + 1], cache=cache)
                    t1 = time.perf_counter()
                    model(tokens[:, :i + 1])  # the same token without the cache: the whole prefix again
                    times[key].append((t1 - t0, time.perf_counter() - t1))
    for key in out:
        out[key]["step_ms"] = 1000 * statistics.median(c for c, _ in times[key])
        out[key]["recompute_ms"] = 1000 * statistics.median(f for _, f in times[key])
    return out


def op_counts(record: dict) -> dict:
    """A record's operator counts: per world size and family (rank 0's), and of a decoding step."""
    return {"training": {w: {k: {"total": f["ops"]["total"], "per_block": f["ops"]["per_block"]}
                             for k, f in ranks[0]["families"].items()} for w, ranks in record["training"].items()},
            "decoding": {k: {"ops": d["ops"], "ops_by_block": d["ops_by_block"]}
                         for k, d in record.get("decoding", {}).items()}}


def _compared(record: dict) -> list[str]:
    """Operator counts of the baseline against this run's, per family."""
    base, now = record["baseline"], op_counts(record)
    fb = lambda p: "-" if p is None else f"{p['forward']}+{p['backward']}"  # noqa: E731
    lines = [f"\noperators: {base['label'] or 'baseline'} -> {record['label'] or 'this run'} "
             "(per block of each kind: forward + backward)"]
    for world, families in now["training"].items():
        for key, f in families.items():
            old = base["training"].get(world, {}).get(key)
            if old is None:
                continue
            blocks = ", ".join(f"{b} {fb(old['per_block'].get(b))} -> {fb(p)}" for b, p in f["per_block"].items()
                               if p["blocks"])
            lines.append(f"  {world} rank(s) {key:<12} step {old['total']} -> {f['total']}   ({blocks})")
    for key, d in now["decoding"].items():
        old = base["decoding"].get(key)
        if old is not None:
            lines.append(f"  decoding    {key:<12} step {old['ops']} -> {d['ops']}")
    return lines


def table(record: dict) -> str:
    """The record as text: per world size and rank, the parts of a step by family; then decoding."""
    lines = []
    for world, ranks in record["training"].items():
        for r in ranks:
            families = r["families"]
            lines += [f"\n{world} rank(s), rank {r['rank']}: ms per step (share of the profiled step)",
                      f"{'':<26}" + "".join(f"{k:>16}" for k in families)]
            parts = sorted({p for f in families.values() for p in f["breakdown_ms"] if p.startswith("forward/")})
            parts += [p for p in PARTS if any(p in f["breakdown_ms"] for f in families.values())]
            rows = [("step (no profiler)", lambda f: f"{f['step_ms']:.1f}"),
                    ("step (profiled)", lambda f: f"{f['profiled_step_ms']:.1f}"),
                    *((p, lambda f, p=p: f"{f['breakdown_ms'].get(p, 0.0):.1f} "
                          f"({f['breakdown_ms'].get(p, 0.0) / f['profiled_step_ms']:.0%})") for p in parts),
                    ("aten ops per step", lambda f: f"{f['ops']['total']}"),
                    ("profiler events", lambda f: f"{f['profiler_events']}"),
                    ("host syncs (CUDA path)", lambda f: f"{f['host_syncs']['total']}")]
            for label, cell in rows:
                lines.append(f"{label:<26}" + "".join(f"{cell(f):>16}" for f in families.values()))
    if record.get("decoding"):
        lines.append("\ncached decoding, batch 1: aten ops per step (by block) and ms per token (without the cache)")
        for key, d in record["decoding"].items():
            blocks = ", ".join(f"{b} {n}" for b, n in sorted(d["ops_by_block"].items()))
            full = f" ({d['recompute_ms']:.2f})" if "recompute_ms" in d else ""
            lines.append(f"  {key:<14} {d['ops']:>6} ops  {d['step_ms']:7.2f} ms{full}   ({blocks})")
    if record.get("baseline"):
        lines += _compared(record)
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, default=Path("results/step_breakdown.json"), help="the JSON record")
    p.add_argument("--size", choices=tuple(SIZES), default="fair")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"a subset of {', '.join(PLANNED)}")
    p.add_argument("--ranks", default="1,2", help="world sizes to run (1,2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled (3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--decode-steps", type=int, default=16, help="cached decoding steps per round (16; 0: none)")
    p.add_argument("--smoe-parallel", choices=("auto", "expert", "replicated"), default="auto")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (fair: 4000, the demo corpus's size)")
    p.add_argument("--label", default="", help="a name for this run in the record (e.g. before, after)")
    p.add_argument("--baseline", type=Path, default=None, help="an earlier record whose operator counts to keep "
                                                               "beside this run's")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m smlp_bench.micro.step_breakdown", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(parse_checked(p, argv, check_args))


def check_args(args) -> None:
    """`smlp-bench breakdown`'s arguments, before any work (no model built, no rank started)."""
    parse_names(args.families, PLANNED, "--families")
    parse_counts(args.ranks, "--ranks", "1,2")
    check_at_least(args.steps, 1, "--steps")
    check_at_least(args.warmup, 0, "--warmup")
    check_at_least(args.decode_steps, 0, "--decode-steps")
    if args.vocab is not None:
        check_at_least(args.vocab, 5, "--vocab", "the tokens drawn start at 4")
    if args.baseline is not None and not args.baseline.is_file():
        raise BenchError(f"--baseline {args.baseline}: no such record")


def run(args) -> int:
    keys = parse_names(args.families, PLANNED, "--families")
    worlds = parse_counts(args.ranks, "--ranks", "1,2")
    size = SIZES[args.size]
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    cfgs = configs(args.size, keys, args.vocab or size["vocab"])
    settings = dict(batch=size["batch"], steps=args.steps, warmup=args.warmup, smoe_parallel=args.smoe_parallel)
    training = {str(w): [{"rank": r, "families": f} for r, f in enumerate(run_world(cfgs, w, settings))]
                for w in worlds}
    record = {"question": "where a training step of each FLOP-matched family goes, per rank, and its operators",
              "label": args.label, "code": code_identity(),
              "config": {"size": args.size, **size, "vocab": args.vocab or size["vocab"], "steps": args.steps,
                         "warmup": args.warmup, "threads_per_rank": 1, "smoe_parallel": args.smoe_parallel,
                         "models": {k: {f: getattr(c, f) for f in ("family", "d_model", "d_ffn", "seq_len",
                                                                   "dense_layers", "sparse_layers", "num_experts",
                                                                   "heads", "moe_router", "smoe_routing")}
                                    for k, c in cfgs.items()}},
              **environment(), "training": training,
              "decoding": decoding(cfgs, args.decode_steps) if args.decode_steps else {}}
    if baseline is not None:
        record["baseline"] = {"label": baseline.get("label", ""), "path": args.baseline.name,
                              "code": baseline.get("code"), **op_counts(baseline)}
    print(table(record))
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
