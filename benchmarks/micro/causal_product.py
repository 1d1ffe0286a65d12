"""The blocked causal product (smlp/spatial.py) against the masked dense form, and its block size.

    python -m smlp_bench.micro.causal_product [--out results/causal_product.json] [--iters 15] [--blocks 32,64,128,256]

One question: how much faster is a training step (forward + backward) of the causal spatial
products when the zero triangle is skipped, and which block size is fastest? Each case is one
spatial product as the model runs it (the mixers' layouts, fp32, one thread as each benchmark
rank runs):

    sgu-T256     the dense gMLP block's SGU at smlp-bench's size: B=4, T=256, C=512 (F=1024)
    smoe-T256    one rank's sMoE experts at that size: 1024 rows of 256 positions (C=256 x B=4)
    sgu-T1024    the paper's sequence length (B=1, T=1024, C=512: the paper-small SGU scaled down)
    smoe-T1024   sMoE rows of 1024 positions (512 rows)

The dense form is what the layers ran before (einsum / matmul with the masked T x T weight).
Every form is checked against the dense one first; then all are timed in turn (dense, block 32,
block 64, ..., dense, ...) so that a change of the machine's load weighs on all alike, and the
median of --iters calls is reported (the minimum too). Writes a JSON record.
"""
from __future__ import annotations

import sys

import torch

from smlp.spatial import causal_product, causal_weight, executed_pairs

from .harness import environment, parser, summary_ms, time_in_turns, write_record

CASES = {  # name: (layout, A or rows, n, K)
    "sgu-T256": ("sgu", 4, 256, 512),
    "smoe-T256": ("smoe", 1024, 256, None),
    "sgu-T1024": ("sgu", 1, 1024, 512),
    "smoe-T1024": ("smoe", 512, 1024, None),
}


def forms(case: str, blocks: list[int]):
    """(name, fn(w, x) -> y) of the dense form and each block size, in the case's layout."""
    layout = CASES[case][0]
    if layout == "sgu":  # x: (B, n, C), one head
        def dense(w, x):
            return torch.einsum("hts,bshc->bthc", causal_weight(w, x.shape[1]), x[:, :, None]).squeeze(2)

        def blocked(block):
            return lambda w, x: causal_product(w, x[:, :, None], block).squeeze(2)
    else:  # x: (R, M) rows of one expert
        def dense(w, x):
            return x @ causal_weight(w, x.shape[1])[0].t()

        def blocked(block):
            return lambda w, x: causal_product(w, x.t()[None, :, None], block)[0, :, 0].t()
    return [("dense", dense)] + [(f"block{b}", blocked(b)) for b in blocks]


def inputs(case: str):
    layout, a, n, k = CASES[case]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1, n, n, generator=g) / n ** 0.5).requires_grad_()
    x = torch.randn(*((a, n, k) if layout == "sgu" else (a, n)), generator=g).requires_grad_()
    return w, x, torch.randn(x.shape, generator=g)


def measure(case: str, blocks: list[int], iters: int, warmup: int) -> dict:
    w, x, grad = inputs(case)
    fns = forms(case, blocks)

    def step(fn):
        w.grad = x.grad = None
        fn(w, x).backward(grad)
        return w.grad.clone(), x.grad.clone()

    ref = step(fns[0][1])
    ref_y = fns[0][1](w, x).detach()
    errors = {}
    for name, fn in fns[1:]:
        y = fn(w, x).detach()
        gw, gx = step(fn)
        err = max(float((y - ref_y).abs().max() / ref_y.abs().max()),
                  float((gw - ref[0]).abs().max() / ref[0].abs().max()),
                  float((gx - ref[1]).abs().max() / ref[1].abs().max()))
        if err > 1e-5:
            raise AssertionError(f"{case} {name}: differs from the dense form by {err:.2e} (relative)")
        errors[name] = err
    times = time_in_turns({name: lambda fn=fn: step(fn) for name, fn in fns}, iters, warmup)
    n = CASES[case][2]
    out = {}
    for name, t in times.items():
        block = None if name == "dense" else int(name[5:])
        out[name] = {**summary_ms(t.wall),
                     "executed_fraction": 1.0 if block is None else executed_pairs(n, block) / n ** 2,
                     "max_rel_error": errors.get(name, 0.0)}
    dense = out["dense"]["median_ms"]
    for r in out.values():
        r["speedup"] = dense / r["median_ms"]
    return out


def main(argv=None) -> int:
    p = parser("causal_product", __doc__.split("\n")[0], out="results/causal_product.json", iters=15, warmup=2,
               threads=1)
    p.add_argument("--blocks", default="32,64,128,256")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    results = {}
    for case in args.cases.split(","):
        results[case] = measure(case, blocks, args.iters, args.warmup)
        best = max((r["speedup"], name) for name, r in results[case].items())
        print(f"{case:<11} " + "  ".join(f"{name} {r['median_ms']:.2f}/{r['min_ms']:.2f} ms ({r['speedup']:.2f}x)"
                                         for name, r in results[case].items()) + f"   best: {best[1]}", flush=True)
    record = {"question": "blocked causal products (smlp/spatial.py) against the masked dense form, fwd + bwd",
              "config": {"cases": {k: CASES[k] for k in results}, "dtype": "float32", "iters": args.iters,
                         "warmup": args.warmup, "threads": args.threads, "blocks": blocks},
              **environment(), "cases": results}
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
