"""Benchmark: smlp.routing.assignment.balanced_assignment against fairseq's C++ libbase auction.

    python -m smlp_bench.micro.balanced_assignment [--out results/bench_balanced_assignment.json] [--repeats N]

Shapes: 2048 x 2 and 4096 x 4 are what the routers see at the CPU benchmark scale (tokens per
rank x experts for d_model 256, sequence 256, batch 8-16 on 2 ranks); 1024 x 8 to 8192 x 64 are
larger expert counts. For each shape and score distribution both implementations see the same
matrix. Reported:
  - median wall time per call (after one warm-up call; calls alternate between the two, at
    least --repeats of each and more until each has run for --min-time seconds), and
    libbase_time / ours_time, also with the thread's CPU time, which is steadier when other
    processes share the cores;
  - quality against the optimum from scipy.optimize.linear_sum_assignment on the score matrix
    with each expert column repeated capacity times:
      frac_opt  = ours / optimum, only for nonnegative scores (uniform, softmax);
      frac_gap  = (ours - random) / (optimum - random), for every distribution, where random is
                  the expected total of a uniformly random balanced assignment
                  (sum_s sum_e scores[s, e] * capacity[e] / S). 1 is optimal, 0 is no better than
                  chance; it is stricter than (ours - min) / (optimum - min).
Both run with torch.set_num_threads(--threads) (default 1: the machine is shared).
"""
from __future__ import annotations

import inspect
import os
import statistics
import time

import numpy as np
import torch

from smlp.routing.assignment import balanced_assignment, expert_capacities

from .harness import environment, parser, time_in_turns, write_record

SHAPES = [(2048, 2), (4096, 4), (1024, 8), (4096, 32), (8192, 64)]
DISTRIBUTIONS = ["uniform", "softmax", "randn"]


def make_scores(S: int, E: int, distribution: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if distribution == "uniform":
        return torch.rand(S, E, generator=g)
    if distribution == "softmax":  # router probabilities
        return torch.softmax(torch.randn(S, E, generator=g), dim=1)
    if distribution == "randn":  # router logits
        return torch.randn(S, E, generator=g)
    raise ValueError(f"unknown distribution {distribution!r}")


def libbase_assignment(libbase, scores_SE: torch.Tensor) -> torch.Tensor:
    """fairseq's calling convention: libbase.balanced_assignment(scores (S, E) float32) returns the
    row indices grouped by expert, S / E per expert (it loops forever unless E divides S; it
    works on a transposed copy, the input is left alone). Converted to an expert per row."""
    S, E = scores_SE.shape
    if S % E:
        raise ValueError(f"libbase needs S divisible by E, got {S} x {E}")
    order_S = libbase.balanced_assignment(scores_SE)
    if order_S.shape != (S,) or torch.unique(order_S).numel() != S:
        raise AssertionError("libbase did not return a permutation of the rows")
    expert_S = torch.empty(S, dtype=torch.long)
    expert_S[order_S] = torch.arange(S) // (S // E)
    return expert_S


def optimum(scores_SE: torch.Tensor) -> float:
    from scipy.optimize import linear_sum_assignment

    S, E = scores_SE.shape
    cap = expert_capacities(S, E).tolist()
    cols = np.repeat(np.arange(E), cap)
    big = scores_SE.double().numpy()[:, cols]
    rows, slots = linear_sum_assignment(big, maximize=True)
    return float(big[rows, slots].sum())


def total(scores_SE: torch.Tensor, expert_S: torch.Tensor) -> float:
    return float(scores_SE.double()[torch.arange(scores_SE.shape[0]), expert_S].sum())


def check_balanced(expert_S: torch.Tensor, S: int, E: int, name: str) -> None:
    counts = torch.bincount(expert_S, minlength=E)
    if not torch.equal(counts, expert_capacities(S, E)):
        raise AssertionError(f"{name} returned an unbalanced assignment: {counts.tolist()}")


def main(argv=None) -> dict:
    ap = parser("balanced_assignment", __doc__, out="results/bench_balanced_assignment.json", threads=1, raw=True)
    ap.add_argument("--repeats", type=int, default=7, help="at least this many timed calls of each")
    ap.add_argument("--min-time", type=float, default=0.5,
                    help="and more (up to 1000) until each has run for this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fairseq import libbase  # imported late: fairseq's import is slow and noisy

    started = time.perf_counter()
    rows = []
    for S, E in SHAPES:
        for i, dist in enumerate(DISTRIBUTIONS):
            scores = make_scores(S, E, dist, args.seed + 1000 * i + S)
            ours = balanced_assignment(scores)
            theirs = libbase_assignment(libbase, scores)
            check_balanced(ours, S, E, "smlp")
            check_balanced(theirs, S, E, "libbase")
            # the calls above were the warm-up; alternate so background load hits both alike (the closures
            # run within this iteration; the default argument only pins `scores` for the linter)
            times = time_in_turns({"ours": lambda scores=scores: balanced_assignment(scores),
                                   "libbase": lambda scores=scores: libbase.balanced_assignment(scores)},
                                  args.repeats, min_seconds=args.min_time, max_iters=1000)
            t_ours, t_libbase = times["ours"], times["libbase"]
            t0 = time.perf_counter()
            opt = optimum(scores)
            t_opt = time.perf_counter() - t0
            cap = expert_capacities(S, E).double()
            rand = float((scores.double() * cap).sum() / S)
            nonneg = bool((scores >= 0).all())
            row = {
                "S": S, "E": E, "distribution": dist,
                "ours_s": statistics.median(t_ours.wall), "libbase_s": statistics.median(t_libbase.wall),
                "ours_cpu_s": statistics.median(t_ours.cpu), "libbase_cpu_s": statistics.median(t_libbase.cpu),
                "ours_times_s": t_ours.wall, "libbase_times_s": t_libbase.wall,
                "optimum": opt, "random": rand, "ours": total(scores, ours), "libbase": total(scores, theirs),
                "scipy_s": t_opt,
            }
            row["speedup"] = row["libbase_s"] / row["ours_s"]
            row["speedup_cpu"] = row["libbase_cpu_s"] / row["ours_cpu_s"]
            for name in ("ours", "libbase"):
                row[f"{name}_frac_opt"] = row[name] / opt if nonneg else None
                row[f"{name}_frac_gap"] = (row[name] - rand) / (opt - rand)
            rows.append(row)
            print(f"done {S}x{E} {dist} (scipy {t_opt:.1f}s)", flush=True)

    def pct(v):
        return "    -   " if v is None else f"{100 * v:8.3f}"

    print()
    print(f"{'shape':>9} {'scores':>8} {'ours ms':>8} {'libbase ms':>10} {'speedup':>8} {'(cpu)':>7} "
          f"{'ours %opt':>9} {'lib %opt':>9} {'ours %gap':>9} {'lib %gap':>9}")
    for r in rows:
        print(f"{r['S']:>5}x{r['E']:<3} {r['distribution']:>8} {1e3 * r['ours_s']:8.1f} "
              f"{1e3 * r['libbase_s']:10.1f} {r['speedup']:7.2f}x {r['speedup_cpu']:6.2f}x "
              f"{pct(r['ours_frac_opt'])}  {pct(r['libbase_frac_opt'])}  "
              f"{pct(r['ours_frac_gap'])}  {pct(r['libbase_frac_gap'])}")
    result = {
        "benchmark": "balanced_assignment",
        "notes": {
            "frac_opt": "ours / optimum (nonnegative scores only)",
            "frac_gap": "(ours - random) / (optimum - random); random = expected total of a uniformly random "
                        "balanced assignment",
            "optimum": "scipy.optimize.linear_sum_assignment on the score matrix with columns repeated to capacity",
            "speedup": "libbase median wall time / ours median wall time, same matrix, same thread count",
            "speedup_cpu": "the same with the calling thread's CPU time (time.thread_time), which "
                           "excludes time the process waited for a shared core",
        },
        **environment(machine={"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
                      versions={"numpy": np.__version__}),
        "ours_settings": {k: v.default for k, v in inspect.signature(balanced_assignment).parameters.items()
                          if v.kind is inspect.Parameter.KEYWORD_ONLY},
        "repeats": args.repeats, "min_time_s": args.min_time, "seed": args.seed,
        "results": rows,
        "total_runtime_s": time.perf_counter() - started,
    }
    print(f"\n{result['total_runtime_s']:.0f} s, load average {os.getloadavg()[0]:.1f}")
    write_record(args.out, result)
    return result


if __name__ == "__main__":
    main()
