"""Several experts on one process: one product against one small matmul per expert (issue 22).

    python -m smlp_bench.micro.local_experts [--out results/local_experts.json] [--iters 5] [--experts 32]

One question: how long do the 32 experts of a sparse layer take on ONE process (a consolidated
model evaluated on one process, or any run with more experts than ranks) when they run as one
batched or grouped product (smlp/experts.py now) instead of a loop over the experts with the
stacked weights indexed expert by expert (the code before issue 22, reproduced here)? The paper-
small shapes scaled down by 4: D=256, F=1024, T=256, 32 experts; 8 sequences of 256 tokens, so
2048 tokens (FFN experts) and 256 channels x 8 sequences = 2048 rows of 256 positions (sMoE
spatial experts). Counts:

    equal     64 rows per expert (balanced assignment in training, deterministic sMoE)
    unequal   greedy routing of random skewed scores (evaluation, Switch-like), fixed seed

Modes: "train" (forward + backward) and "eval" (forward under no_grad). Forms, timed in turn on the
same inputs (median of --iters, after a warm-up; one thread):

    before    per-expert matmuls, weights indexed per expert (FFN: x @ w1[l] + b1[l]; spatial: the
              masked dense T x T product per expert): the layers before this issue
    loop      the loop as the layers run it where no grouped matmul exists (weights unbound once)
    grouped   the FFN experts through torch's grouped matmul (F.grouped_mm; unequal counts)
    tiled     the FFN experts' rows in tiles of 16 rows, one fixed-shape product per tile (issue 28:
              what evaluation runs wherever the counts depend on the data, so that a row's result
              does not depend on the rows routed with it)
    after     what the layers run now: in training the FFN experts one batched matmul (equal
              counts), the loop on the CPU for unequal counts (grouped on accelerators); at
              evaluation the batched matmul for counts fixed by the shapes (equal: a balanced
              assignment) and the tiles for the others (unequal); the spatial experts one blocked
              causal product for all experts (one autograd node, equal or unequal counts)

Every form is checked against "before" (outputs and gradients) first. Writes a JSON record.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from smlp.experts import FFNExperts, SpatialExperts, grouped_mm_supported
from smlp.spatial import causal_weight

from .harness import environment, parser, summary_ms, time_in_turns, write_record

SIZE = dict(d_model=256, d_ffn=1024, seq_len=256, sequences=8)


def ffn_before(e: FFNExperts, x_RD, counts_L):
    D = x_RD.shape[-1]
    outs = []
    for l, chunk in enumerate(torch.split(x_RD, counts_L)):
        if e.norm_weight is not None:
            chunk = F.layer_norm(chunk, (D,), e.norm_weight[l], e.norm_bias[l])
        h = e.activation(chunk @ e.w1[l] + e.b1[l])
        outs.append(h @ e.w2[l] + e.b2[l])
    return torch.cat(outs)


def spatial_before(e: SpatialExperts, x_RM, counts_L):
    M = x_RM.shape[-1]
    w_LMM = causal_weight(e.weight, M)
    return torch.cat([chunk @ w_LMM[l].t() + e.bias_offset[l, :M]
                      for l, chunk in enumerate(torch.split(x_RM, counts_L))])


def counts_for(kind: str, rows: int, experts: int) -> list[int]:
    if kind == "equal":
        return [rows // experts] * experts
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(rows, experts, generator=g) + torch.randn(experts, generator=g)  # some experts favoured
    return torch.bincount(scores.argmax(-1), minlength=experts).tolist()


def measure(kind: str, counts: list[int], mode: str, iters: int, warmup: int) -> dict:
    S = SIZE
    L = len(counts)
    torch.manual_seed(0)
    if kind == "ffn":
        module = FFNExperts(L, S["d_model"], S["d_ffn"], norm=True)  # Base Layers' experts: the most work
        width = S["d_model"]
        module.train(mode == "train")  # evaluation computes data-dependent counts in tiles
        fixed = len(set(counts)) == 1  # "equal" stands for a balanced assignment: counts fixed by the shapes
        forms = {"before": lambda x: ffn_before(module, x, counts), "loop": lambda x: module.forward_loop(x, counts),
                 "tiled": lambda x: module.forward_tiled(x, counts),
                 "after": lambda x: module(x, counts, fixed_counts=fixed)}
        if len(set(counts)) > 1 and grouped_mm_supported(torch.device("cpu"), torch.float32):
            forms["grouped"] = lambda x: module._grouped(x, counts)
    else:
        module = SpatialExperts(L, S["seq_len"])
        width = S["seq_len"]
        forms = {"before": lambda x: spatial_before(module, x, counts),
                 "loop": lambda x: module.forward_dense(x, counts),
                 "after": lambda x: module(x, counts)}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), width, generator=g)
    grad = torch.randn(sum(counts), width, generator=g)

    def step(fn):
        module.zero_grad(set_to_none=True)
        if mode == "eval":
            with torch.no_grad():
                return [fn(x)]
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(grad)
        return [y.detach(), xi.grad] + [p.grad for p in module.parameters()]

    ref = step(forms["before"])
    for name, fn in forms.items():
        for a, b in zip(step(fn), ref):
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
            if err > 1e-4:
                raise AssertionError(f"{kind} {mode} {name}: differs from the loop by {err:.2e} (relative)")
    times = time_in_turns({name: lambda fn=fn: step(fn) for name, fn in forms.items()}, iters, warmup)
    # CPU time of the timing thread too: steadier than the wall clock when other processes share the cores
    out = {name: {**summary_ms(t.wall), "median_cpu_ms": summary_ms(t.cpu)["median_ms"]} for name, t in times.items()}
    out["speedup_after_over_before"] = out["before"]["median_ms"] / out["after"]["median_ms"]
    out["speedup_after_over_loop"] = out["loop"]["median_ms"] / out["after"]["median_ms"]
    if "tiled" in out:
        out["speedup_tiled_over_loop"] = out["loop"]["median_ms"] / out["tiled"]["median_ms"]
        out["cpu_speedup_tiled_over_loop"] = out["loop"]["median_cpu_ms"] / out["tiled"]["median_cpu_ms"]
    return out


def main(argv=None) -> int:
    p = parser("local_experts", __doc__.split("\n")[0], out="results/local_experts.json", iters=5, warmup=1,
               threads=1)
    p.add_argument("--experts", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = SIZE["sequences"] * SIZE["seq_len"]  # tokens, and channels x sequences (D = T here)
    results = {}
    for kind in ("ffn", "spatial"):
        for counting in ("equal", "unequal"):
            counts = counts_for(counting, rows, args.experts)
            for mode in ("train", "eval"):
                key = f"{kind}-{counting}-{mode}"
                results[key] = {"counts": counts, **measure(kind, counts, mode, args.iters, args.warmup)}
                r = results[key]
                grouped = f"grouped {r['grouped']['median_ms']:8.1f} ms  " if "grouped" in r else ""
                grouped += f"tiled {r['tiled']['median_ms']:8.1f} ms  " if "tiled" in r else ""
                print(f"{key:<22} before {r['before']['median_ms']:8.1f} ms  loop {r['loop']['median_ms']:8.1f} ms  "
                      f"{grouped}after {r['after']['median_ms']:8.1f} ms  ({r['speedup_after_over_before']:.1f}x, "
                      f"{r['speedup_after_over_loop']:.2f}x over the loop)", flush=True)
    record = {"question": "32 experts on one process: one (batched / grouped) product against one matmul per expert",
              "config": {**SIZE, "experts": args.experts, "iters": args.iters, "warmup": args.warmup,
                         "threads": args.threads, "dtype": "float32",
                         "grouped_mm": grouped_mm_supported(torch.device("cpu"), torch.float32)},
              **environment(), "results": results}
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
