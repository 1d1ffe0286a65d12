"""Where a sparse block's training step goes: torch.profiler on 2 gloo ranks (issue 22).

    python -m smlp_bench.micro.sparse_profile [--out results/sparse_profile.json] [--steps 6]
                                              [--layers smlp,base,switch]

One question: what does a training step (forward + backward) of one sparse layer spend its time
on, operator by operator, at smlp-bench's size (D=256, F=1024, T=256, 4 sequences per rank, one
expert per rank on 2 gloo ranks x 1 thread)? Layers:

    smlp     the sMLP sparse block (deterministic sMoE + Base Layers tMoE, with the shuffle)
    partial  the same with partial-prediction sMoE routing
    base     a Base Layers tMoE (with the shuffle) on its own
    switch   a Switch tMoE

Each rank runs --warmup untimed steps, then --steps steps under torch.profiler; the JSON has the
median step time of the steps timed without the profiler (rank 0; every rank waits for the
others in the all2all), and from the profiled steps the operators by self CPU time, their call
counts per step, the copies (aten::copy_, clone, contiguous, cat, index) and allocations
(aten::empty*) per step. It uses only the layers' public constructors, so the same program
profiles an older checkout (PYTHONPATH) for a before/after comparison.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .harness import environment, parser, write_record

SIZE = dict(d_model=256, d_ffn=1024, seq_len=256, batch=4, world=2)
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::index", "aten::index_select",
            "aten::index_add", "aten::index_copy", "aten::gather", "aten::scatter_add_", "aten::constant_pad_nd")
ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
             "aten::new_zeros", "aten::new_empty", "aten::new_empty_strided")


def build(kind: str):
    from smlp.config import SparseBlockConfig, TMoEConfig
    from smlp.dispatch import AllToAllDispatcher
    from smlp.moe import SparseBlock, TMoE

    D, Fw, T, W = SIZE["d_model"], SIZE["d_ffn"], SIZE["seq_len"], SIZE["world"]
    torch.manual_seed(0)
    if kind in ("smlp", "partial"):
        cfg = SparseBlockConfig(d_model=D, d_ffn=Fw, seq_len=T, num_experts=W,
                                smoe_routing="deterministic" if kind == "smlp" else "partial")
        return SparseBlock(cfg, AllToAllDispatcher(W)).train(), (SIZE["batch"], T, D)
    cfg = TMoEConfig(d_model=D, d_ffn=Fw, num_experts=W, router=kind)
    return TMoE(cfg, AllToAllDispatcher(W)).train(), (SIZE["batch"] * T, D)


def _worker(rank: int, world: int, init: str, kinds: list[str], steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    report = {}
    try:
        for kind in kinds:
            layer, shape = build(kind)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(shape, generator=g)
            grad = torch.randn(shape, generator=g)

            def step(x=x, layer=layer, grad=grad):  # bound here: called only within this iteration
                xi = x.clone().requires_grad_()
                layer(xi).backward(grad)
                layer.zero_grad(set_to_none=True)

            for _ in range(warmup):
                step()
            times = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
            ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            per_step = lambda v: v / steps  # noqa: E731
            report[kind] = {
                "step_ms": 1000 * statistics.median(times), "step_ms_min": 1000 * min(times),
                "top_ops": [{"name": e.key, "self_ms": per_step(e.self_cpu_time_total) / 1000,
                             "calls": per_step(e.count)} for e in ops[:20]],
                "copies": {e.key: {"self_ms": per_step(e.self_cpu_time_total) / 1000, "calls": per_step(e.count)}
                           for e in ops if e.key in COPY_OPS},
                "allocations_per_step": per_step(sum(e.count for e in ops if e.key in ALLOC_OPS)),
                "ops_per_step": per_step(sum(e.count for e in ops)),
            }
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(report))


def main(argv=None) -> int:
    p = parser("sparse_profile", __doc__.split("\n")[0], out="results/sparse_profile.json", warmup=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", default="smlp,partial,base,switch")
    p.add_argument("--label", default="", help="a name for this run in the record (e.g. before, after)")
    args = p.parse_args(argv)
    kinds = [k for k in args.layers.split(",") if k]
    import smlp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(SIZE["world"], f"file://{tmp}/rdzv", kinds, args.steps, args.warmup, tmp),
                 nprocs=SIZE["world"], join=True)
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(SIZE["world"])]
    record = {"question": "operators of a sparse layer's training step on 2 gloo ranks", "label": args.label,
              "config": {**SIZE, "steps": args.steps, "warmup": args.warmup, "threads_per_rank": 1},
              "code": str(Path(smlp.__file__).resolve().parent), **environment(),
              "layers": ranks[0], "rank1_step_ms": {k: v["step_ms"] for k, v in ranks[1].items()}}
    for kind, r in ranks[0].items():
        copies = sum(v["self_ms"] for v in r["copies"].values())
        print(f"{kind:<8} step {r['step_ms']:7.1f} ms (min {r['step_ms_min']:.1f})  copies {copies:6.2f} ms/step in "
              f"{sum(v['calls'] for v in r['copies'].values()):.0f} calls  allocations {r['allocations_per_step']:.0f}"
              f"  ops {r['ops_per_step']:.0f}")
        for op in r["top_ops"][:8]:
            print(f"         {op['name'][:44]:<44} {op['self_ms']:7.2f} ms  x{op['calls']:.0f}")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
