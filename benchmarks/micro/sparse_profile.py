"""Where a sparse block's training step goes: torch.profiler on 2 gloo ranks (issue 22).

    python -m smlp_bench.micro.sparse_profile [--out results/sparse_profile.json] [--steps 6]
                                              [--layers smlp,base,switch] [--size fair] [--chunks 2]

One question: what does a training step (forward + backward) of one sparse layer spend its time
on, operator by operator, at smlp-bench's size (D=256, F=1024, T=256, 4 sequences per rank, one
expert per rank on 2 gloo ranks x 1 thread; `--size fair`: smlp-bench --fair's D=128, F=512,
T=128, 16 sequences per rank, 8 experts, 4 per rank)? Layers:

    smlp         the sMLP sparse block (deterministic sMoE + Base Layers tMoE, with the shuffle)
    smlp-rep     the same with the sMoE's experts replicated on every rank (--smoe-parallel replicated)
    partial      the same as smlp with partial-prediction sMoE routing
    base         a Base Layers tMoE (with the shuffle) on its own
    switch       a Switch tMoE

`--chunks 2` overlaps each layer's all2all with its experts (the rows in 2 chunks, async collectives;
fairseq's --all2all-chunks); `--compare-chunks` times both, interleaved step by step.

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

SIZES = {"bench": dict(d_model=256, d_ffn=1024, seq_len=256, batch=4, world=2, experts=2),
         "fair": dict(d_model=128, d_ffn=512, seq_len=128, batch=16, world=2, experts=8)}
SIZE = SIZES["bench"]
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::index", "aten::index_select",
            "aten::index_add", "aten::index_copy", "aten::gather", "aten::scatter_add_", "aten::constant_pad_nd")
ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
             "aten::new_zeros", "aten::new_empty", "aten::new_empty_strided")


def build(kind: str, size: dict, chunks: int = 1):
    from smlp.config import SparseBlockConfig, TMoEConfig
    from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
    from smlp.moe import SparseBlock, TMoE

    D, Fw, T, E = size["d_model"], size["d_ffn"], size["seq_len"], size["experts"]
    kw = {"chunks": chunks} if chunks > 1 else {}  # an older checkout's dispatcher has no chunks
    torch.manual_seed(0)
    if kind in ("smlp", "smlp-rep", "partial"):
        cfg = SparseBlockConfig(d_model=D, d_ffn=Fw, seq_len=T, num_experts=E,
                                smoe_routing="partial" if kind == "partial" else "deterministic")
        smoe = (LocalDispatcher(E, replicated=True),) if kind == "smlp-rep" else ()
        return SparseBlock(cfg, AllToAllDispatcher(E, **kw), *smoe).train(), (size["batch"], T, D)
    cfg = TMoEConfig(d_model=D, d_ffn=Fw, num_experts=E, router=kind)
    return TMoE(cfg, AllToAllDispatcher(E, **kw)).train(), (size["batch"] * T, D)


def _worker(rank: int, world: int, init: str, kinds: list[str], steps: int, warmup: int, out: str, size: dict,
            chunks: int, compare: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    report = {}
    try:
        for kind in kinds:
            layer, shape = build(kind, size, chunks)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(shape, generator=g)
            grad = torch.randn(shape, generator=g)

            def step(x=x, layer=layer, grad=grad):  # bound here: called only within this iteration
                xi = x.clone().requires_grad_()
                layer(xi).backward(grad)
                layer.zero_grad(set_to_none=True)

            for _ in range(warmup):
                step()
            times, unchunked = [], []
            if compare:  # the same layer with its exchanges not overlapped, interleaved step by step
                plain, _ = build(kind, size, 1)
                plain.load_state_dict(layer.state_dict())

                def plain_step(x=x, layer=plain, grad=grad):
                    xi = x.clone().requires_grad_()
                    layer(xi).backward(grad)
                    layer.zero_grad(set_to_none=True)

                for _ in range(warmup):
                    plain_step()
            for _ in range(steps):
                for fn, into in ((step, times), (plain_step, unchunked)) if compare else ((step, times),):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    into.append(time.perf_counter() - t0)
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
            ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            per_step = lambda v: v / steps  # noqa: E731
            report[kind] = {
                "step_ms": 1000 * statistics.median(times), "step_ms_min": 1000 * min(times),
                **({"unchunked_step_ms": 1000 * statistics.median(unchunked),
                    "chunked_over_unchunked": [a / b for a, b in zip(times, unchunked)]} if compare else {}),
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
    p.add_argument("--size", choices=tuple(SIZES), default="bench",
                   help="bench: smlp-bench's D=256, T=256, one expert per rank; fair: smlp-bench --fair's D=128, "
                        "T=128, 16 sequences, 8 experts")
    p.add_argument("--chunks", type=int, default=1, help="rows per layer in this many chunks, each chunk's "
                                                         "all2all overlapped with another's experts (1: none)")
    p.add_argument("--compare-chunks", action="store_true",
                   help="also time every layer with --chunks 1, interleaved step by step (the ratio per step)")
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error(f"--chunks {args.chunks} must be >= 1")
    kinds = [k for k in args.layers.split(",") if k]
    size = SIZES[args.size]
    import smlp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(size["world"], f"file://{tmp}/rdzv", kinds, args.steps, args.warmup, tmp, size,
                                args.chunks, args.compare_chunks),
                 nprocs=size["world"], join=True)
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(size["world"])]
    record = {"question": "operators of a sparse layer's training step on 2 gloo ranks", "label": args.label,
              "config": {**size, "size": args.size, "chunks": args.chunks, "steps": args.steps,
                         "warmup": args.warmup, "threads_per_rank": 1},
              "code": str(Path(smlp.__file__).resolve().parent), **environment(),
              "layers": ranks[0], "rank1_step_ms": {k: v["step_ms"] for k, v in ranks[1].items()}}
    for kind, r in ranks[0].items():
        copies = sum(v["self_ms"] for v in r["copies"].values())
        if "unchunked_step_ms" in r:
            ratios = r["chunked_over_unchunked"]
            print(f"{kind:<8} chunked / unchunked step: median {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] ({r['unchunked_step_ms']:.1f} ms unchunked)")
        print(f"{kind:<8} step {r['step_ms']:7.1f} ms (min {r['step_ms_min']:.1f})  copies {copies:6.2f} ms/step in "
              f"{sum(v['calls'] for v in r['copies'].values()):.0f} calls  allocations {r['allocations_per_step']:.0f}"
              f"  ops {r['ops_per_step']:.0f}")
        for op in r["top_ops"][:8]:
            print(f"         {op['name'][:44]:<44} {op['self_ms']:7.2f} ms  x{op['calls']:.0f}")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
