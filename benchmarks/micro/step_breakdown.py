"""Where a training step of each FLOP-matched family goes, per rank, and its operators (issue 38).

    python -m smlp_bench.micro.step_breakdown [--out results/step_breakdown.json] [--size fair|tiny]
        [--families smlp_det,gmlp,transformer,base,switch,hash,gshard] [--ranks 1,2] [--steps 3]
        [--warmup 2] [--decode-steps 16] [--smoe-parallel auto|expert|replicated]

One question: what does one training step of each family spend its time and its operators on, on one
process and on 2 gloo ranks x 1 thread? The models are built from the core (smlp.lm.LanguageModel), in
smlp-bench --fair's configuration (`--size fair`: D=128, F=512, T=128, 8 experts, 16 sequences per rank,
the layer counts of benchmarks/fair.py's FAIR_TARGET matched by smlp_bench.presets.plan_models: sMLP-det
9 dense + 3 sparse blocks, gMLP 12, Transformer 7, Base/Switch/HASH 4 + 3, GShard 3 + 3; it needs
fairseq for the plan) or tiny (`--size tiny`, for the test). The step is a plain loop, as fairseq's
train_step runs it (no fairseq around it): zero_grad, forward, loss (cross-entropy + 0.01 x the
auxiliary loss), backward, the all-reduce of the non-expert gradients (one flat buffer, as legacy_ddp;
2 ranks only), gradient clipping at 1.0 and Adam. On 2 ranks the tMoE's experts are spread over the
ranks (all2all) and the sMoE's take `--smoe-parallel` (auto: what fairseq-train would pick,
smlp.steptime.choose_smoe_layout). Each rank draws its own random tokens.

For each family and world size, on every rank:

- step_ms: --steps steps timed without the profiler (after --warmup untimed ones);
- breakdown_ms: --steps more steps under torch.profiler, each event's own time by part
  (smlp.profiling.step_parts): the forward per block type (embedding_head, gmlp_block, smoe, tmoe,
  attention, ffn; smlp.profiling.BLOCKS says what each holds) and the loss, the backward, the
  optimizer (zero_grad, clipping, Adam), the gradient all-reduce (its flattening and its collective's
  transfer), the all2all (the collectives' transfer), other collectives (the routers' price folds),
  waiting in collectives, the loop's own time between the phases, and `rest`: the profiled steps' wall
  time that no event holds (profiler and stopwatch edges). Waiting: the collectives are timed on
  entry on every rank; a rank that enters the i-th collective before its peer waits for it (latest
  entry - own entry, at most the call's time), the rest of the call is transfer. Also the forward by
  block and range (routing, all2all, experts, token_mixing of smlp.profiling.RANGES; the dispatcher's
  local work counts in its block) and the backward by block;
- ops: the operators of one step that reach the kernels (a TorchDispatchMode below autograd, forward
  and backward: aten's and the collectives', not the profiler's range marks), by phase and block (the
  backward's by the block whose forward made the autograd node), and per block of each type;
  profiler_events: every event the profiler records in a step (composite ops, ranges and autograd
  nodes included: a larger count);
- host_syncs: of one step, on the path an accelerator takes (smlp_bench.micro.host_syncs).

And cached decoding at batch 1 (one process, eval mode) of every family: operators of one step per
block type (the second after the prompt: the first grows the cache), and ms per new token (a prompt
of T/8 tokens, then --decode-steps steps; the families in turns, round by round).

Absolute times on a shared machine are noise: the record keeps the load average; operator counts are
exact whatever the load. `--baseline RECORD` copies an earlier record's operator counts (e.g. of an older
checkout of smlp/ put first on PYTHONPATH, `--label before`) into this one, and the table shows both.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from smlp.gmlp import GMLPBlock
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import SparseBlock, TMoE
from smlp.profiling import BLOCKS, COLLECTIVE, STEP, STEP_RANGES, step_parts
from smlp.token_routed import TokenRoutedGMLPBlock
from smlp.transformer import TransformerBlock

from ..machine import code_identity
from ..store import environment, write_record

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


# ---------------------------------------------------------------- the models


# ---------------------------------------------------------------- the blocks' ranges (smlp.profiling.BLOCKS)


def block_kinds(model) -> list[tuple[object, str, bool]]:
    """(module, block kind of BLOCKS, whether the module is one block of its kind) for every module of
    `model` that opens a block range (a Transformer block's norm opens its attention's range but is no
    block of its own)."""
    out = []
    for module in model.modules():
        if isinstance(module, LanguageModel):
            out.append((module, "embedding_head", True))
        elif isinstance(module, (GMLPBlock, TokenRoutedGMLPBlock)):
            out.append((module, "gmlp_block", True))
        elif isinstance(module, SparseBlock):
            out.append((module, "smoe", True))
        elif isinstance(module, TMoE):
            out.append((module, "tmoe", True))
        elif isinstance(module, TransformerBlock):
            dense = not isinstance(module.ffn, TMoE)
            out += [(module, "ffn" if dense else "tmoe", dense), (module.norm1, "attention", False),
                    (module.attn, "attention", True)]
    return out


@contextlib.contextmanager
def block_ranges(model, listener: Callable[[str, str], None] | None = None):
    """Within the block, every block's `forward` and `step` (cached decoding) runs inside its BLOCKS range;
    `listener(event, kind)`, if given, hears ("enter", kind) and ("exit", kind) around each call."""
    wrapped = []
    for module, kind, _ in block_kinds(model):
        for method in ("forward", "step"):
            original = getattr(module, method, None)
            if original is None or method in vars(module):
                continue
            setattr(module, method, _in_range(original, kind, listener))
            wrapped.append((module, method))
    try:
        yield
    finally:
        for module, method in wrapped:
            delattr(module, method)


def _in_range(method, kind: str, listener):
    name = BLOCKS[kind]

    def run(*args, **kwargs):
        with record_function(name):
            if listener is not None:
                listener("enter", kind)
            try:
                return method(*args, **kwargs)
            finally:
                if listener is not None:
                    listener("exit", kind)
    return run



def configs(size: str, keys: list[str], vocab_size: int) -> dict[str, LMConfig]:
    """The core config of each family: the tiny ones, or the fair configuration's FLOP matches."""
    if size == "tiny":
        return {k: LMConfig(**TINY, **TINY_LAYERS[k]) for k in keys}
    from smlp_eval.flops import parse_model

    from ..fair import FAIR_TARGET
    from ..presets import plan_models

    models, _ = plan_models(vocab_size, 2, keys, FAIR_TARGET)
    out = {}
    for m in models:
        arch = m.flags[m.flags.index("--arch") + 1]
        flags = [f for i, f in enumerate(m.flags) if f != "--arch" and (i == 0 or m.flags[i - 1] != "--arch")]
        out[m.key] = parse_model(arch, flags, vocab_size=vocab_size).cfg
    return out


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


# ---------------------------------------------------------------- the training step


class Loop:
    """One training step as a plain loop; each phase inside its STEP_RANGES range and, if set, inside
    `within(phase)` (a context manager: the operator and host-sync counts)."""

    def __init__(self, model: LanguageModel, world: int):
        from smlp.experts import is_expert

        self.model, self.world = model, world
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98))
        # fairseq's legacy_ddp leaves expert parameters out of the all-reduce, clip_grad_norm_ out of the norm
        self.shared = [p for p in model.parameters() if not is_expert(p)]
        self.within = None

    @contextlib.contextmanager
    def phase(self, name: str):
        with record_function(STEP_RANGES[name]), \
                (self.within(name) if self.within is not None else contextlib.nullcontext()):
            yield

    def step(self, tokens: torch.Tensor) -> None:
        model, cfg = self.model, self.model.cfg
        with self.phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        with self.phase("forward"):
            logits = model(tokens[:, :-1])
        with self.phase("loss"):
            start = cfg.prediction_start  # partial prediction scores the positions after the routing prefix
            loss = F.cross_entropy(logits[:, start:].reshape(-1, cfg.vocab_size), tokens[:, 1 + start:].reshape(-1))
            aux = model.aux_loss()
            if aux is not None:
                loss = loss + AUX_LOSS_WEIGHT * aux
        with self.phase("backward"):
            loss.backward()
        if self.world > 1:
            with self.phase("grad_all_reduce"):
                grads = [p.grad for p in self.shared if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat.div_(self.world)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        with self.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.shared, CLIP_NORM)
            self.optimizer.step()


class CollectiveLog:
    """Within the block, every torch.distributed collective (COLLECTIVES) runs inside a COLLECTIVE range
    and its entry and exit times are kept in order (`calls`: name, entry, exit; time.perf_counter, the
    machine's monotonic clock, alike in every process). Synchronous calls only (async_op is not timed)."""

    def __init__(self):
        self.calls: list[tuple[str, float, float]] = []
        self._saved: dict = {}

    def __enter__(self):
        for name in COLLECTIVES:
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._timed(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)
        return False

    def _timed(self, name: str, original):
        def call(*args, **kwargs):
            with record_function(COLLECTIVE + name):
                t0 = time.perf_counter()
                out = original(*args, **kwargs)
                t1 = time.perf_counter()
            self.calls.append((name, t0, t1))
            return out
        return call


def waits(calls: list[tuple[str, float, float]], world: int) -> list[float]:
    """Seconds this rank waited in each of its collective calls for the last rank to enter it."""
    if world == 1:
        return [0.0] * len(calls)
    every: list = [None] * world
    dist.all_gather_object(every, [c[1] for c in calls])
    n = min(len(e) for e in every)
    out = []
    for i, (_, t0, t1) in enumerate(calls):
        latest = max(e[i] for e in every) if i < n else t0
        out.append(min(max(latest - t0, 0.0), t1 - t0))
    return out


def breakdown_ms(parts, waited: list[float], wall: float, steps: int) -> tuple[dict, dict, dict]:
    """(ms per step by part, the forward by (block, range), the backward by block) of the profiled steps."""
    out: dict = defaultdict(float)
    forward_ranges: dict = defaultdict(float)
    for (block, within), s in parts.forward.items():
        out[f"forward/{block}"] += s
        forward_ranges[f"{block}/{within}"] += s
    backward_blocks: dict = defaultdict(float)
    for (block, _), s in parts.backward.items():
        out["backward"] += s
        backward_blocks[block] += s
    out["optimizer"] += parts.phases.get("optimizer", 0.0)
    out["grad_all_reduce"] += parts.phases.get("grad_all_reduce", 0.0)
    for (name, phase, s), w in zip(parts.collectives, waited + [0.0] * (len(parts.collectives) - len(waited))):
        w = min(w, s)
        kind = ("all2all" if name == "all_to_all_single" else
                "grad_all_reduce" if phase == "grad_all_reduce" else "other_collectives")
        out[kind] += s - w
        out["collective_wait"] += w
    out["loop_overhead"] += parts.loop
    out["rest"] = max(wall - parts.total, 0.0)
    scale = lambda d: {k: 1000 * v / steps for k, v in d.items()}  # noqa: E731
    return scale(out), scale(forward_ranges), scale(backward_blocks)


# ---------------------------------------------------------------- operator counts


class OpCounter(TorchDispatchMode):
    """Operators by (phase, block): aten's and the collectives' (c10d), not the profiler's range marks.

    Forward ops count for the innermost block running (smlp.profiling.block_ranges tells it); backward
    ops for the block whose forward created the autograd node that runs them: each block's span of
    autograd sequence numbers is marked on entry and exit, and a gradient accumulation counts for the
    block that owns the parameter."""

    def __init__(self, model):
        super().__init__()
        self.counts: Counter = Counter()
        self.phase: str | None = None
        self.blocks: list[tuple[str, int]] = []
        self.spans: list[tuple[int, int, str]] = []
        self.param_block = {}
        for module, kind, _ in block_kinds(model):  # outer blocks first: an inner one overrides
            for p in module.parameters():
                self.param_block[p] = kind
        self._paused = False
        self._node_block: dict = {}

    @contextlib.contextmanager
    def within(self, phase: str):  # Loop.within
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def _sequence_nr(self) -> int:
        """The next autograd sequence number (a throwaway node takes it; not counted)."""
        self._paused = True
        try:
            with torch.enable_grad():
                return torch.ones((), requires_grad=True).mul(1).grad_fn._sequence_nr()
        finally:
            self._paused = False

    def __call__(self, event: str, kind: str) -> None:  # block_ranges' listener
        if event == "enter":
            self.blocks.append((kind, self._sequence_nr()))
        else:
            kind, first = self.blocks.pop()
            self.spans.append((first, self._sequence_nr(), kind))

    def _block_of_node(self, node) -> str:
        if node not in self._node_block:
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad
                block = self.param_block.get(variable, "unknown")
            else:
                seq = node._sequence_nr()
                inside = [(first, kind) for first, last, kind in self.spans if first <= seq < last]
                block = max(inside)[1] if inside else ("loss" if self.spans and seq >= self.spans[-1][1] else "unknown")
            self._node_block[node] = block
        return self._node_block[node]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and func.namespace != "profiler":
            node = torch._C._current_autograd_node()
            if node is not None:
                self.counts["backward", self._block_of_node(node)] += 1
            elif self.phase == "forward":
                self.counts["forward", self.blocks[-1][0] if self.blocks else "embedding_head"] += 1
            elif self.phase == "backward":
                self.counts["backward", "engine"] += 1
            else:
                self.counts[self.phase or "loop", ""] += 1
        return func(*args, **(kwargs or {}))


def count_ops(loop: Loop, tokens: torch.Tensor) -> dict:
    """aten operators of one training step by phase and block."""
    counter = OpCounter(loop.model)
    loop.within = counter.within
    try:
        with block_ranges(loop.model, counter), counter:
            loop.step(tokens)
    finally:
        loop.within = None
    forward = {b: n for (p, b), n in counter.counts.items() if p == "forward"}
    backward = {b: n for (p, b), n in counter.counts.items() if p == "backward"}
    instances = Counter(kind for _, kind, whole in block_kinds(loop.model) if whole)
    return {"total": sum(counter.counts.values()), "forward": forward, "backward": backward,
            **{p: sum(n for (q, _), n in counter.counts.items() if q == p)
               for p in ("loss", "optimizer", "grad_all_reduce", "loop")},
            "per_block": {b: {"blocks": instances[b], "forward": forward.get(b, 0) // max(instances[b], 1),
                              "backward": backward.get(b, 0) // max(instances[b], 1)}
                          for b in sorted(instances)}}


# ---------------------------------------------------------------- one family on one rank


def count_syncs(loop: Loop, tokens: torch.Tensor) -> dict:
    """Host syncs of one training step by phase, on the paths an accelerator takes, and where they came from.
    The optimizer is left out: torch's Adam keeps its step counts on the host (its `.item()` calls read no
    device), which the counter, not having seen them made, would count."""
    from .host_syncs import HostSyncCounter, accelerator_paths

    counters: dict = {}
    loop.within = lambda phase: (contextlib.nullcontext() if phase == "optimizer"
                                 else counters.setdefault(phase, HostSyncCounter()))
    try:
        with accelerator_paths():
            loop.step(tokens)
    finally:
        loop.within = None
    return {"total": sum(c.count for c in counters.values()), **{p: c.count for p, c in counters.items()},
            "sites": {p: dict(c.by_site) for p, c in counters.items() if c.count}}


def measure(cfg: LMConfig, rank: int, world: int, batch: int, steps: int, warmup: int, smoe_parallel: str) -> dict:
    model, layout = build(cfg, world, batch, smoe_parallel)
    loop = Loop(model, world)
    data = batches(cfg, batch, rank, warmup + 2 * steps + 3)
    it = iter(data)
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
    walls = []
    # the profiler's first step pays its start-up: one step of warm-up, then the steps kept
    window = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with CollectiveLog() as log, block_ranges(model), \
            profile(activities=[ProfilerActivity.CPU], schedule=window) as prof:
        for i in range(steps + 1):
            if i == 1:
                del log.calls[:]
            t0 = time.perf_counter()
            with record_function(STEP):
                loop.step(next(it))
            walls.append(time.perf_counter() - t0)
            prof.step()
    walls = walls[1:]
    events = prof.events()
    parts = step_parts(events)
    waited = waits(log.calls, world)
    if len(waited) != len(parts.collectives):
        raise RuntimeError(f"{len(log.calls)} collectives timed but {len(parts.collectives)} profiled")
    parts_ms, forward_ranges, backward_blocks = breakdown_ms(parts, waited, sum(walls), steps)
    ops = count_ops(loop, next(it))
    syncs = count_syncs(loop, next(it))
    return {"rank": rank, "world": world, "smoe_layout": layout, "layers": f"{cfg.dense_layers}+{cfg.sparse_layers}",
            "step_ms": 1000 * statistics.median(times), "step_ms_all": [1000 * t for t in times],
            "profiled_step_ms": 1000 * sum(walls) / steps, "breakdown_ms": parts_ms,
            "forward_by_range_ms": forward_ranges, "backward_by_block_ms": backward_blocks,
            "ops": ops, "profiler_events": len(events) // steps,
            "host_syncs": syncs}


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
    Path(out, f"{world}-{rank}.json").write_text(json.dumps(report))


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


# ---------------------------------------------------------------- cached decoding


class _ForwardOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.blocks: list[str] = []

    def __call__(self, event: str, kind: str) -> None:
        if event == "enter":
            self.blocks.append(kind)
        else:
            self.blocks.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "profiler":
            self.counts[self.blocks[-1] if self.blocks else "embedding_head"] += 1
        return func(*args, **(kwargs or {}))


def decoding(cfgs: dict, steps: int, rounds: int = 5) -> dict:
    """Per family: aten operators of one cached decoding step at batch 1 by block, and ms per new token."""
    torch.set_num_threads(1)
    models, out = {}, {}
    for key, cfg in cfgs.items():
        torch.manual_seed(0)
        models[key] = LanguageModel(cfg).eval()
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
            counter = _ForwardOps()
            with block_ranges(model, counter), counter:
                model(tokens[:, prompt + 1:prompt + 2], cache=cache)
            out[key] = {"ops": sum(counter.counts.values()), "ops_by_block": dict(counter.counts)}
        for _ in range(rounds):  # the families in turns, so that a change of load weighs on all alike
            for key in out:
                model, cache = models[key], models[key].new_cache()
                model(tokens[:, :prompt], cache=cache)
                for i in range(prompt, prompt + steps):
                    t0 = time.perf_counter()
                    model(tokens[:, i:i + 1], cache=cache)
                    times[key].append(time.perf_counter() - t0)
    for key in out:
        out[key]["step_ms"] = 1000 * statistics.median(times[key])
    return out


# ---------------------------------------------------------------- the record and the table


def op_counts(record: dict) -> dict:
    """A record's operator counts: per world size and family (rank 0's), and of a decoding step."""
    return {"training": {w: {k: {"total": f["ops"]["total"], "per_block": f["ops"]["per_block"]}
                             for k, f in ranks[0]["families"].items()} for w, ranks in record["training"].items()},
            "decoding": {k: {"ops": d["ops"], "ops_by_block": d["ops_by_block"]}
                         for k, d in record.get("decoding", {}).items()}}


def _compared(record: dict) -> list[str]:
    """Operator counts of the baseline against this run's, per family."""
    base, now = record["baseline"], op_counts(record)
    lines = [f"\noperators: {base['label'] or 'baseline'} -> {record['label'] or 'this run'} "
             "(per block of each kind: forward + backward)"]
    for world, families in now["training"].items():
        for key, f in families.items():
            old = base["training"].get(world, {}).get(key)
            if old is None:
                continue
            blocks = ", ".join(f"{b} {_fb(old['per_block'].get(b))} -> {_fb(p)}" for b, p in f["per_block"].items()
                               if p["blocks"])
            lines.append(f"  {world} rank(s) {key:<12} step {old['total']} -> {f['total']}   ({blocks})")
    for key, d in now["decoding"].items():
        old = base["decoding"].get(key)
        if old is not None:
            lines.append(f"  decoding    {key:<12} step {old['ops']} -> {d['ops']}")
    return lines


def _fb(p: dict | None) -> str:
    return "-" if p is None else f"{p['forward']}+{p['backward']}"


def _share(f: dict, part: str) -> str:
    ms = f["breakdown_ms"].get(part, 0.0)
    return f"{ms:.1f} ({ms / f['profiled_step_ms']:.0%})"


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
                    *((p, lambda f, p=p: _share(f, p)) for p in parts),
                    ("aten ops per step", lambda f: f"{f['ops']['total']}"),
                    ("profiler events", lambda f: f"{f['profiler_events']}"),
                    ("host syncs (CUDA path)", lambda f: f"{f['host_syncs']['total']}")]
            for label, cell in rows:
                lines.append(f"{label:<26}" + "".join(f"{cell(f):>16}" for f in families.values()))
    if record.get("decoding"):
        lines.append("\ncached decoding, batch 1: aten ops per step (by block) and ms per token")
        for key, d in record["decoding"].items():
            blocks = ", ".join(f"{b} {n}" for b, n in sorted(d["ops_by_block"].items()))
            lines.append(f"  {key:<14} {d['ops']:>6} ops  {d['step_ms']:7.2f} ms   ({blocks})")
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
    return run(p.parse_args(argv))


def run(args) -> int:
    def error(msg):
        raise SystemExit(f"step_breakdown: error: {msg}")

    keys = [k for k in args.families.split(",") if k]
    unknown = [k for k in keys if k not in PLANNED]
    if unknown or not keys:
        error(f"--families: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(PLANNED)}")
    worlds = sorted({int(w) for w in args.ranks.split(",") if w})
    if args.steps < 1 or any(w < 1 for w in worlds):
        error("--steps and --ranks must be positive")
    size = SIZES[args.size]
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    cfgs = configs(args.size, keys, args.vocab or size["vocab"])
    settings = dict(batch=size["batch"], steps=args.steps, warmup=args.warmup, smoe_parallel=args.smoe_parallel)
    training = {}
    for world in worlds:
        ranks = run_world(cfgs, world, settings)
        training[str(world)] = [{"rank": r, "families": ranks[r]} for r in range(world)]
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
