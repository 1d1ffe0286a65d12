"""torch.compile of a dense block against eager on the CPU (issue 19).

    python -m smlp_bench.compile_dense [--out results/compile_dense.json] [--iters 20] [--threads 2]

One question: where torch.compile traces a whole dense block into one graph (the gMLP block and
the dense Transformer block; smlp_bench.hot_path counts 0 graph breaks for both), how much faster
is a training step (forward + backward) and an inference forward than eager, on this CPU? Both
are timed on the same inputs in the same run; the compiled block is checked against the eager one
(same weights) before it is timed, and the compile time (first call, inductor's caches off) is
reported separately.

Sizes: D=256, F=1024, T=256, batch 8 (the scale of smlp-bench's target), fp32, dropout 0.
Writes a JSON record (config, machine, versions, figures): the median of --iters timed calls after
--warmup untimed ones, eager and compiled calls taking turns.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

from smlp.config import GMLPConfig
from smlp.gmlp import GMLPBlock
from smlp.transformer import TransformerBlock

SIZE = dict(d_model=256, d_ffn=1024, seq_len=256, batch=8, heads=4)


def blocks() -> dict:
    D, Fw, T = SIZE["d_model"], SIZE["d_ffn"], SIZE["seq_len"]
    torch.manual_seed(0)
    return {"gmlp": GMLPBlock(GMLPConfig(d_model=D, d_ffn=Fw, seq_len=T)),
            "transformer": TransformerBlock(D, Fw, SIZE["heads"])}


def _median_seconds(fns, iters: int, warmup: int) -> list[float]:
    """Median time of each function, called in turn (eager, compiled, eager, ...) so that a change
    in the machine's load during the run weighs on both alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure(name: str, block: torch.nn.Module, iters: int, warmup: int) -> dict:
    x = torch.randn(SIZE["batch"], SIZE["seq_len"], SIZE["d_model"], generator=torch.Generator().manual_seed(1))
    g = torch.randn_like(x)
    compiled = torch.compile(block)
    out = {}
    for mode in ("train", "eval"):
        block.train(mode == "train")

        def step(model, mode=mode):  # bound here: called only within this iteration
            if mode == "eval":
                with torch.no_grad():
                    return model(x)
            xi = x.clone().requires_grad_()
            y = model(xi)
            y.backward(g)
            return y

        t0 = time.perf_counter()
        y_compiled = step(compiled)  # compiles
        compile_s = time.perf_counter() - t0
        y_eager = step(block)
        block.zero_grad(set_to_none=True)
        max_diff = float((y_compiled - y_eager).detach().abs().max())
        if max_diff > 1e-4:
            raise AssertionError(f"{name} {mode}: compiled output differs from eager by {max_diff}")
        eager_s, compiled_s = _median_seconds([lambda: step(block), lambda: step(compiled)], iters, warmup)
        out[mode] = {"eager_ms": 1000 * eager_s, "compiled_ms": 1000 * compiled_s, "speedup": eager_s / compiled_s,
                     "first_call_s": compile_s, "max_abs_diff": max_diff}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smlp_bench.compile_dense", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/compile_dense.json")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._inductor.config.force_disable_caches = True  # the first call's time is a real compile
    results = {name: measure(name, block, args.iters, args.warmup) for name, block in blocks().items()}
    record = {"question": "torch.compile (inductor) against eager for a dense block on the CPU",
              "config": {**SIZE, "dtype": "float32", "iters": args.iters, "warmup": args.warmup,
                         "threads": args.threads},
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "versions": {"torch": torch.__version__, "python": platform.python_version()},
              "blocks": results}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"{'block':<12}{'mode':<7}{'eager ms':>10}{'compiled ms':>13}{'speed-up':>10}{'compile s':>11}")
    for name, modes in results.items():
        for mode, r in modes.items():
            print(f"{name:<12}{mode:<7}{r['eager_ms']:>10.2f}{r['compiled_ms']:>13.2f}{r['speedup']:>10.2f}"
                  f"{r['first_call_s']:>11.1f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
