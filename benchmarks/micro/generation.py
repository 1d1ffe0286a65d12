"""Generation speed: cached incremental decoding against full recomputation, per position.

    smlp-bench-generation [--models smlp_det,transformer,...] [--batch-size 1] [--threads 1]
                          [--device cpu] [--out results/bench_generation.json] [--plot results/bench_generation.png]
    python -m smlp_bench.micro.generation ...

One question: how much faster is generating with the decoding cache (smlp/decoding_cache.py) than
running the whole prefix through the model for every new token, and how does the time per token
grow with its position?

1. models:  the benchmark target of smlp-bench (TARGET: D=256, F=1024, T=256, sMLP-deterministic
            with 9 dense + 3 sparse blocks, --experts experts held by this one process) and the
            other families FLOP-matched to it by the FLOPs calculator (`smlp_eval.flops.match`,
            analytic counts, the same matches smlp-bench trains); randomly initialized weights
            (the cost of a step does not depend on what the weights say);
2. prompt:  </s> (a new line), so the model generates T = 256 tokens (positions 0..255 are fed);
            partial prediction predicts nothing from its routing prefix (P = 51 of 256), so its
            prompt is P tokens of fill plus </s> and it generates T - P = 205 tokens;
3. runs:    greedy `smlp.generation.generate` with the cache and without it (`use_cache=False`:
            the whole prefix recomputed per token), after a short warm-up run of each; both must
            produce the same tokens;
4. figures: time per token against the number of positions fed (wall clock and this thread's CPU
            time, which leaves out time spent waiting for a core of a shared machine), the
            total time of each run, and the speedup full / cached. With --repeats N > 1 each run
            is repeated and the per-position median kept.

The time of a token is the interval between two consecutive model calls (the call itself plus
choosing the token); the first interval is the prompt's prefill and is reported apart. On an
accelerator every interval ends with a device synchronisation.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from smlp.dispatch import synchronize
from smlp.generation import generate
from smlp.lm import LanguageModel, LMConfig

from ..presets import MATCH_TOLERANCE, MOE_BASELINES, NAMES, OUR_FAMILIES, TARGET
from ..store import environment, write_record
from . import parser

PROG = "smlp-bench-generation"
EOS = 2
FAMILIES = OUR_FAMILIES  # smlp-bench's FLOP-matched families (the token routers from smlp/routing/registry.py)
MODEL_ORDER = ("smlp_det", "smlp_partial", "gmlp", "hypermixer", "ninformer", "transformer", *MOE_BASELINES)
# Full recomputation of causal HyperMixing is elementwise-bound (smlp/hypermixer.py): minutes per run
# at this size on one CPU thread. Benchmarked only when asked for, as in smlp-bench.
DEFAULT_MODELS = tuple(k for k in MODEL_ORDER if k != "hypermixer")
REPORT_POSITIONS = (1, 16, 32, 64, 128, 192, 255)


def model_configs(vocab_size: int, experts: int, keys) -> dict[str, LMConfig]:
    """The target and its FLOP matches (analytic counts of the FLOPs calculator)."""
    from smlp_eval import flops as F

    t = TARGET
    target = LMConfig(family="smlp", vocab_size=vocab_size, d_model=t["d_model"], d_ffn=t["d_ffn"],
                      seq_len=t["seq_len"], dense_layers=t["dense"], sparse_layers=t["sparse"], num_experts=experts)
    cfgs = {"smlp_det": target,
            "smlp_partial": LMConfig(**{**target.__dict__, "smoe_routing": "partial"})}
    wanted = [f for f in FAMILIES if f in keys]
    if wanted:
        rows = F.match(F.count(target, method="analytic"), tolerance=MATCH_TOLERANCE, method="analytic",
                       families=wanted)
        cfgs.update({r.family: r.count.cfg for r in rows})
    return {k: cfgs[k] for k in keys}


class StepClock:
    """Wall and thread-CPU time at every model call (generate's on_step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[tuple[int, float, float]] = []

    def start(self) -> None:
        synchronize(self.device)
        self.marks = [(0, time.perf_counter(), time.thread_time())]

    def __call__(self, positions: int) -> None:
        synchronize(self.device)
        self.marks.append((positions, time.perf_counter(), time.thread_time()))

    def intervals(self) -> tuple[dict, list[tuple[int, float, float]]]:
        """(prefill, [(positions fed, wall s, cpu s) per generated token after the prefill])."""
        steps = [(p, t1 - t0, c1 - c0) for (_, t0, c0), (p, t1, c1) in zip(self.marks, self.marks[1:])]
        (p0, w0, c0), rest = steps[0], steps[1:]
        return {"positions": p0, "wall_s": w0, "cpu_s": c0}, rest


def bench_model(key: str, cfg: LMConfig, args, device) -> dict:
    torch.manual_seed(args.seed)
    model = LanguageModel(cfg).to(device).eval()
    P, T = cfg.prediction_start, cfg.seq_len
    fill = torch.randint(3, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    prompt = [EOS]
    new_tokens = T + 1 - (P + 1)  # every position of the window is fed once
    if args.max_new_tokens:
        new_tokens = min(new_tokens, args.max_new_tokens)
    result = {"name": NAMES.get(key, key), "layers": f"{cfg.dense_layers}+{cfg.sparse_layers}" if cfg.sparse_layers
              else str(cfg.dense_layers), "config": {k: v for k, v in cfg.__dict__.items()},
              "params": sum(p.numel() for p in model.parameters()), "prompt_positions": P + 1,
              "new_tokens": new_tokens, "batch_size": args.batch_size}
    prompts = [prompt] * args.batch_size
    with torch.inference_mode():
        for use_cache in (True, False):  # warm-up (allocator, kernels)
            generate(model, prompts, min(8, new_tokens), use_cache=use_cache, prefix_fill=fill)
        modes = (("cached", True), ("full", False))
        per_pos = {name: {} for name, _ in modes}  # position -> [(wall s, cpu s)] over repeats
        totals = {name: [] for name, _ in modes}
        tokens = {}
        for _ in range(args.repeats):  # the two modes alternate, so a change in machine load hits both
            for name, use_cache in modes:
                clock = StepClock(device)
                clock.start()
                tokens[name] = generate(model, prompts, new_tokens, use_cache=use_cache, prefix_fill=fill,
                                        on_step=clock)
                prefill, steps = clock.intervals()
                totals[name].append((clock.marks[-1][1] - clock.marks[0][1],
                                     clock.marks[-1][2] - clock.marks[0][2], prefill["wall_s"]))
                for p, w, c in steps:
                    per_pos[name].setdefault(p, []).append((w, c))
        runs = {}
        for name, _ in modes:
            positions = sorted(per_pos[name])
            runs[name] = {
                "total_wall_s": statistics.median(t[0] for t in totals[name]),
                "total_cpu_s": statistics.median(t[1] for t in totals[name]),
                "prefill_wall_s": statistics.median(t[2] for t in totals[name]),
                "positions": positions,  # positions fed when the token's interval ended
                "per_token_wall_ms": [1e3 * statistics.median(w for w, _ in per_pos[name][p]) for p in positions],
                "per_token_cpu_ms": [1e3 * statistics.median(c for _, c in per_pos[name][p]) for p in positions],
            }
            runs[name]["tokens_per_s"] = new_tokens * args.batch_size / runs[name]["total_wall_s"]
    result.update(runs)
    result["same_tokens"] = tokens["cached"] == tokens["full"]
    result["speedup_wall"] = runs["full"]["total_wall_s"] / runs["cached"]["total_wall_s"]
    result["speedup_cpu"] = runs["full"]["total_cpu_s"] / runs["cached"]["total_cpu_s"]
    return result


def _at(run: dict, position: int, unit: str = "wall") -> float | None:
    try:
        return run[f"per_token_{unit}_ms"][run["positions"].index(position)]
    except ValueError:
        return None


def summary_table(results: list[dict]) -> str:
    lines = [f"{'model':<24} {'layers':>6} {'tokens':>6} {'cached s':>9} {'full s':>9} {'speedup':>8} {'(cpu)':>7} "
             f"{'same tokens':>11}"]
    for r in results:
        lines.append(f"{r['name']:<24} {r['layers']:>6} {r['new_tokens']:>6} {r['cached']['total_wall_s']:9.2f} "
                     f"{r['full']['total_wall_s']:9.2f} {r['speedup_wall']:7.1f}x {r['speedup_cpu']:6.1f}x "
                     f"{str(r['same_tokens']):>11}")
    lines += ["", "ms per token (cached / full) when the given number of positions has been fed:",
              f"{'model':<24} " + " ".join(f"{p:>13}" for p in REPORT_POSITIONS)]
    for r in results:
        cells = []
        for p in REPORT_POSITIONS:
            c, f = _at(r["cached"], p), _at(r["full"], p)
            cells.append(f"{c:6.1f}/{f:6.1f}" if c is not None and f is not None else "-")
        lines.append(f"{r['name']:<24} " + " ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        color = f"C{i % 10}"
        ax.plot(r["full"]["positions"], r["full"]["per_token_wall_ms"], color=color, lw=1, label=f"{r['name']} full")
        ax.plot(r["cached"]["positions"], r["cached"]["per_token_wall_ms"], color=color, lw=1, ls="--",
                label=f"{r['name']} cached")
    ax.set_xlabel("positions fed (token position + 1)")
    ax.set_ylabel("ms per token")
    ax.set_yscale("log")
    ax.set_title("Greedy generation: cached decoding (dashed) vs full recompute (solid)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    run(argv)
    return 0


def run(argv=None) -> dict:
    """The benchmark; returns the JSON record it writes."""
    ap = parser(PROG, __doc__.split("\n\n")[2], out="results/bench_generation.json")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated, of {', '.join(MODEL_ORDER)} (default: all but hypermixer)")
    ap.add_argument("--experts", type=int, default=2, help="experts per sparse layer, all in this process (smlp-bench "
                                                           "uses one per rank: 2 on its default 2 ranks)")
    ap.add_argument("--vocab-size", type=int, default=4000, help="about the demo corpus's sentencepiece dictionary")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="fewer tokens than the window holds (0: all)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="also draw time per token against position (PNG)")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODEL_ORDER]
    if unknown or not keys:
        ap.error(f"--models {args.models!r}: unknown {', '.join(unknown) or '(none given)'}; valid: "
                 f"{', '.join(MODEL_ORDER)}")
    for name in ("batch_size", "repeats", "threads", "experts"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    started = time.perf_counter()
    cfgs = model_configs(args.vocab_size, args.experts, keys)
    results = []
    for key, cfg in cfgs.items():
        r = bench_model(key, cfg, args, device)
        r["key"] = key
        results.append(r)
        print(f"{r['name']}: {r['new_tokens']} tokens, cached {r['cached']['total_wall_s']:.2f} s, full "
              f"{r['full']['total_wall_s']:.2f} s, speedup {r['speedup_wall']:.1f}x, same tokens {r['same_tokens']}",
              flush=True)
    record = {
        "benchmark": "generation",
        "question": "time per generated token with the decoding cache against full recomputation of the prefix",
        "target": {**TARGET, "experts": args.experts, "vocab_size": args.vocab_size},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "notes": {
            "positions": "number of positions fed when the token's interval ended; the token generated from "
                         "the last of them is the next one",
            "speedup_wall": "full recompute total wall time / cached total wall time, same tokens, same run",
            "speedup_cpu": "the same with this thread's CPU time (time.thread_time): leaves out waiting for a core",
            "prefill": "the prompt's first model call, not in per_token figures",
        },
        **environment(machine={"device": str(device),
                               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}),
        "results": results,
        "min_speedup_wall": min(r["speedup_wall"] for r in results),
        "all_same_tokens": all(r["same_tokens"] for r in results),
        "total_runtime_s": time.perf_counter() - started,
    }
    print()
    print(summary_table(results))
    if args.plot:
        plot(results, args.plot)
    print(f"\n{record['total_runtime_s']:.0f} s, load average {os.getloadavg()[0]:.1f}")
    write_record(args.out, record)
    return record


if __name__ == "__main__":
    raise SystemExit(main())
