"""torch.compile of a dense block against eager on the CPU (issue 19).

    python -m smlp_bench.micro.compile_dense [--out results/compile_dense.json] [--iters 20] [--threads 2]

One question: where torch.compile traces a whole dense block into one graph (the gMLP block and
the dense Transformer block; smlp_bench.micro.hot_path counts 0 graph breaks for both), how much faster
is a training step (forward + backward) and an inference forward than eager, on this CPU? Both
are timed on the same inputs in the same run; the compiled block is checked against the eager one
(same weights) before it is timed, and the compile time (first call, inductor's caches off) is
reported separately.

Sizes: D=256, F=1024, T=256, batch 8 (the scale of smlp-bench's target), fp32, dropout 0.
Writes a JSON record (config, machine, versions, figures): the median of --iters timed calls after
--warmup untimed ones, eager and compiled calls taking turns.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch._inductor.config

from smlp.config import GMLPConfig
from smlp.gmlp import GMLPBlock
from smlp.transformer import TransformerBlock

from .harness import environment, parser, time_in_turns, write_record

SIZE = dict(d_model=256, d_ffn=1024, seq_len=256, batch=8, heads=4)


def blocks() -> dict:
    D, Fw, T = SIZE["d_model"], SIZE["d_ffn"], SIZE["seq_len"]
    torch.manual_seed(0)
    return {"gmlp": GMLPBlock(GMLPConfig(d_model=D, d_ffn=Fw, seq_len=T)),
            "transformer": TransformerBlock(D, Fw, SIZE["heads"])}


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
        # in turn (eager, compiled, eager, ...): a change of the machine's load weighs on both alike
        times = time_in_turns({"eager": lambda: step(block), "compiled": lambda: step(compiled)}, iters, warmup)
        eager_s, compiled_s = (statistics.median(times[k].wall) for k in ("eager", "compiled"))
        out[mode] = {"eager_ms": 1000 * eager_s, "compiled_ms": 1000 * compiled_s, "speedup": eager_s / compiled_s,
                     "first_call_s": compile_s, "max_abs_diff": max_diff}
    return out


def main(argv=None) -> int:
    args = parser("compile_dense", __doc__.split("\n")[0], out="results/compile_dense.json", iters=20, warmup=3,
                  threads=os.cpu_count() or 1).parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._inductor.config.force_disable_caches = True  # the first call's time is a real compile
    results = {name: measure(name, block, args.iters, args.warmup) for name, block in blocks().items()}
    record = {"question": "torch.compile (inductor) against eager for a dense block on the CPU",
              "config": {**SIZE, "dtype": "float32", "iters": args.iters, "warmup": args.warmup,
                         "threads": args.threads},
              **environment(), "blocks": results}
    print(f"{'block':<12}{'mode':<7}{'eager ms':>10}{'compiled ms':>13}{'speed-up':>10}{'compile s':>11}")
    for name, modes in results.items():
        for mode, r in modes.items():
            print(f"{name:<12}{mode:<7}{r['eager_ms']:>10.2f}{r['compiled_ms']:>13.2f}{r['speedup']:>10.2f}"
                  f"{r['first_call_s']:>11.1f}")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
