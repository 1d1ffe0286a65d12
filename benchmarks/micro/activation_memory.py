"""Activation memory of one training step with and without --checkpoint-activations, measured on CPU.

`smlp-bench activations`: the paper's small sMLP (Table 8: D=1024, F=4096, T=1024, 28 dense + 12 sparse blocks,
32 experts) as one GPU of its 32-rank expert-parallel group holds it (one expert per sparse layer, each routed row
computed by it: eval/flops/one_gpu.py), one step of `--batch` sequences on this process. The CPU allocator's own
record (torch.profiler with profile_memory) gives the bytes a forward leaves allocated for the backward (the
activations) and the highest allocation of the step over what was allocated before it (activations, gradients
and the recompute's working memory). Beside them: the step-time model's activation memory for the same model
(smlp/steptime.py memory_per_gpu, from eval/flops/activations.py's saved-tensor count), and the sequences per
GPU that model then fits in a 32 GB V100 in fp16 with Adam. docs/training.md quotes the record.
"""
from __future__ import annotations

import gc
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from ..machine import code_identity
from ..presets import BenchError, check_at_least, parse_checked
from ..store import environment, write_record

HELP = "activation memory of a paper-small training step with and without --checkpoint-activations (CPU)"
DEFAULT_ARCHS = ("smlp_lm_paper_small",)
CLUSTER = "v100-dgx1"


def _allocations(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """The allocator's events of a profiled step, [(time ns, bytes: + allocated, - freed)] in time order, and the
    (start, end) of its record_function ranges."""
    events = prof.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in ("forward", "backward")}
    return allocations, ranges


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The training loss of a step, as smlp_lm_loss makes it (next-token cross-entropy and the routers' loss)."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, model.cfg.vocab_size), tokens[:, 1:].reshape(-1))
    aux = model.aux_loss()
    return loss + 0.01 * aux if aux is not None else loss


def measure_step(model, tokens: torch.Tensor) -> dict:
    """One training step's memory from the allocator's record: bytes the forward left allocated when it ended
    (what the backward needs), the step's highest allocation above its start, and the seconds of each part."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        with record_function("forward"):
            loss = _loss(model, tokens)  # the logits are gone by its end unless autograd keeps them
        t1 = time.perf_counter()
        with record_function("backward"):
            loss.backward()
        t2 = time.perf_counter()
    del loss
    allocations, ranges = _allocations(prof)
    live = peak = 0
    after_forward = None
    for t, nbytes in allocations:
        if after_forward is None and t > ranges["forward"][1]:
            after_forward = live
        live += nbytes
        peak = max(peak, live)
    return {"forward_held_bytes": after_forward if after_forward is not None else live, "step_peak_bytes": peak,
            "forward_s": t1 - t0, "backward_s": t2 - t1}


def estimated(spec, cfg) -> dict:
    """The step-time model's view of `cfg`: its activations per sequence in fp32 (as measured here) and the
    sequences per GPU that fit the cluster's memory in fp16 with Adam."""
    from smlp.steptime import CLUSTERS, Training, memory_per_gpu
    from smlp_eval.flops.activations import activation_bytes
    from smlp_eval.flops.counting import count

    acts = activation_bytes(cfg, spec.tokens, max(spec.experts_per_gpu, 1))
    c = count(cfg, spec.tokens, experts_per_gpu=max(spec.experts_per_gpu, 1), method="analytic")

    def memory(batch: int, fp16: bool) -> dict:
        train = Training(world_size=spec.world_size, ep_size=spec.ep_size, batch_size=batch, tokens=spec.tokens,
                         fp16=fp16)
        return memory_per_gpu(cfg, params_non_expert=c.params_non_expert,
                              params_expert_per_gpu=c.params_expert_per_gpu, train=train, activations=acts)

    capacity = CLUSTERS[CLUSTER].gpu_memory
    fits = 0
    while memory(fits + 1, True)["total"] <= capacity and fits < 4096:
        fits += 1
    return {"activations_per_sequence_fp32": memory(1, False)["activations"],
            "per_block_fp32": {k: v[0] * 4 + v[1] for k, v in acts.items()},
            f"sequences_per_gpu_{CLUSTER}_fp16": fits}


def run_arch(arch: str, batch: int, vocab: int, flags: list[str]) -> dict:
    from smlp.lm import LanguageModel
    from smlp_eval.flops import parse_model
    from smlp_eval.flops.one_gpu import OneGPUDispatcher

    spec = parse_model(arch, flags, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, vocab, (batch, spec.tokens + 1), generator=g)
    out = {"arch": arch, "flags": " ".join(flags), "tokens": spec.tokens, "experts_per_gpu": spec.experts_per_gpu,
           "model": {f: getattr(spec.cfg, f) for f in ("family", "d_model", "d_ffn", "seq_len", "dense_layers",
                                                       "sparse_layers", "num_experts", "vocab_size")}}
    for name, on in (("plain", False), ("checkpointed", True)):
        cfg = replace(spec.cfg, checkpoint_activations=on)
        torch.manual_seed(0)
        dispatcher = OneGPUDispatcher(cfg.num_experts, spec.experts_per_gpu) if cfg.sparse_layers else None
        model = LanguageModel(cfg, dispatcher).train()
        measured = measure_step(model, tokens)
        del model
        out[name] = {**measured, "estimated": estimated(spec, cfg)}
        print(f"{arch} {name}: forward holds {measured['forward_held_bytes'] / 2 ** 30:.2f} GiB, step peak "
              f"{measured['step_peak_bytes'] / 2 ** 30:.2f} GiB ({measured['forward_s']:.0f} s + "
              f"{measured['backward_s']:.0f} s)", flush=True)
    plain, kept = out["plain"], out["checkpointed"]
    out["held_ratio"] = kept["forward_held_bytes"] / plain["forward_held_bytes"]
    out["peak_ratio"] = kept["step_peak_bytes"] / plain["step_peak_bytes"]
    return out


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f}"


def _blocks(side: dict) -> str:
    return " / ".join(_mib(side["estimated"]["per_block_fp32"].get(k, 0)) for k in ("dense", "sparse", "head"))


def markdown(record: dict) -> str:
    """The table docs/training.md shows of a record (between its smlp-bench-activations markers)."""
    config, lines = record["config"], []
    fits = f"sequences_per_gpu_{config['cluster']}_fp16"
    for a in record["archs"]:
        plain, kept, m = a["plain"], a["checkpointed"], a["model"]
        estimated = [_gib(side["estimated"]["activations_per_sequence_fp32"]) for side in (plain, kept)]
        lines += [f"`{a['arch']}` (D={m['d_model']}, F={m['d_ffn']}, T={m['seq_len']}, {m['dense_layers']} dense + "
                  f"{m['sparse_layers']} sparse blocks, {m['num_experts']} experts, {a['experts_per_gpu']} per GPU), "
                  f"{config['batch']} sequence(s) of {a['tokens']} tokens, {config['dtype']}:",
                  "",
                  "| per step | plain | `--checkpoint-activations` |", "|---|---:|---:|",
                  f"| held by the forward for the backward | {_gib(plain['forward_held_bytes'])} | "
                  f"{_gib(kept['forward_held_bytes'])} ({a['held_ratio']:.2f}x) |",
                  f"| the step's peak above its start (activations, gradients, recompute) | "
                  f"{_gib(plain['step_peak_bytes'])} | {_gib(kept['step_peak_bytes'])} ({a['peak_ratio']:.2f}x) |",
                  f"| the step-time model's activations | {estimated[0]} | {estimated[1]} |",
                  f"| of a dense block / a sparse block / the head, MiB | {_blocks(plain)} | {_blocks(kept)} |",
                  f"| the step-time model's sequences per GPU ({config['cluster']}, fp16, Adam) | "
                  f"{plain['estimated'][fits]} | {kept['estimated'][fits]} |", ""]
    commit = (record.get("code") or {}).get("commit") or "?"
    lines.append(f"Measured by `smlp-bench activations` at commit {commit[:7]} on {record['machine']['cores']} CPU "
                 f"cores (the allocator's record, torch.profiler); written into this page by `smlp-bench activations "
                 f"--publish`.")
    return "\n".join(lines)


PAGE_START, PAGE_END = "<!-- smlp-bench-activations:start -->", "<!-- smlp-bench-activations:end -->"


def publish(record_path: Path, page: Path) -> None:
    """Rewrite `page`'s section between PAGE_START and PAGE_END with `markdown` of the record."""
    import json

    from ..publish import replace_section
    from ..store import write_text

    record = json.loads(record_path.read_text())
    write_text(page, replace_section(page.read_text(), PAGE_START, PAGE_END, markdown(record), page))
    print(f"wrote {page}")


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, default=Path("results/activation_memory.json"), help="the JSON record")
    p.add_argument("--archs", default=",".join(DEFAULT_ARCHS), help="registered architectures, comma-separated "
                                                                    f"({','.join(DEFAULT_ARCHS)})")
    p.add_argument("--batch", type=int, default=1, help="sequences in the measured step (1)")
    p.add_argument("--vocab", type=int, default=51200, help="vocabulary (51200: Table 9's non-expert parameters)")
    p.add_argument("--flags", default="", help="fairseq model flags added to every architecture (e.g. "
                                               "\"--num-experts 2 --tokens-per-sample 64\" for a tiny one)")
    p.add_argument("--publish", type=Path, default=None, metavar="PAGE",
                   help="rewrite PAGE's smlp-bench-activations section from the record (docs/training.md)")
    p.add_argument("--report-only", action="store_true", help="measure nothing: publish the record at --out")


def check_args(args) -> None:
    check_at_least(args.batch, 1, "--batch")
    check_at_least(args.vocab, 5, "--vocab", "the tokens drawn start at 4")
    from smlp_eval.flops.model_spec import plugin_archs

    unknown = [a for a in args.archs.split(",") if a not in plugin_archs()]
    if unknown:
        raise BenchError(f"--archs {','.join(unknown)}: not registered architectures of ours")


def run(args) -> int:
    if args.report_only:
        if args.publish is None or not args.out.is_file():
            raise BenchError(f"--report-only publishes the record at --out ({args.out}, which must exist) into "
                             f"--publish PAGE")
        publish(args.out, args.publish)
        return 0
    code = code_identity()  # the code that measures, before it runs
    archs = [run_arch(a, args.batch, args.vocab, shlex.split(args.flags)) for a in args.archs.split(",")]
    record = {"question": "how much activation memory --checkpoint-activations saves at the paper's small "
                          "configuration, one GPU's share of an expert-parallel step, measured on CPU",
              "code": code, **environment(),
              "config": {"batch": args.batch, "vocab": args.vocab, "dtype": "float32",
                         "threads": torch.get_num_threads(), "cluster": CLUSTER},
              "archs": archs}
    write_record(args.out, record)
    if args.publish is not None:
        publish(args.out, args.publish)
    return 0


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m smlp_bench.micro.activation_memory", description=HELP)
    add_arguments(p)
    return run(parse_checked(p, argv, check_args))


if __name__ == "__main__":
    sys.exit(main())
