"""The `smlp-flops` command line: argument parsing, dispatch to the calculator, the step-time model and the
printed tables (the package docstring, eval/flops/__init__.py, lists the commands)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from smlp.steptime import smoe_expert_params
from smlp.third_party import quiet_imports

from .counting import METHODS
from .matching import match
from .model_spec import DEFAULT_VOCAB, count_spec, parse_model
from .steptime import (
    compare_smoe_layouts,
    smoe_layout_report,
    smoe_layout_sentence,
    step_time_for,
    table4,
)
from .tables import (
    format_count,
    format_match,
    format_paper_tables,
    format_smoe_layouts,
    format_step_time,
    format_table4,
    paper_tables,
)

__all__ = ["PROG", "build_parser", "cli", "cluster_from_args", "main", "run"]

PROG = "smlp-flops"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="FLOPs and parameters of sMLP / gMLP / (MoE) Transformer models, and FLOP matching.",
        epilog="Other flags are fairseq model flags (e.g. --decoder-layers 30 --tokens-per-sample 512 "
               "--distributed-world-size 16), applied on top of the --arch preset.")
    p.add_argument("--arch", help="a registered architecture, e.g. smlp_lm_paper_small")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary size (default {DEFAULT_VOCAB}, the paper's; {TINY_VOCAB}, the demo corpus's, for "
                        f"the *_tiny presets)")
    p.add_argument("--method", choices=METHODS, default="fvcore", help="how FLOPs are counted (default fvcore)")
    p.add_argument("--match", action="store_true", help="FLOP-matched layer counts of every family for --arch")
    p.add_argument("--match-tolerance", type=float, default=0.015,
                   help="relative FLOPs tolerance of a match (default 0.015)")
    p.add_argument("--smlp-sparse-layers", type=int,
                   help="sparse blocks of the sMLP row of --match (default: the target's; "
                        "without it a dense target gets no sMLP row)")
    p.add_argument("--paper-tables", action="store_true", help="our figures for the paper's Tables 3, 5, 8-10")
    st = p.add_argument_group("step-time model (eval/flops/steptime.py)")
    st.add_argument("--step-time", action="store_true",
                    help="all2all / all-reduce bytes, memory per GPU and the time of one update of --arch on "
                         "--cluster; training flags as in fairseq-train (--distributed-world-size, "
                         "--expert-parallel-size, --batch-size, --update-freq, --fp16, --zero-sharding os)")
    st.add_argument("--table4", choices=("top", "bottom", "both"),
                    help="predicted ranking and words/s of the paper's 32-GPU Table 4 configurations "
                         "beside the paper's")
    st.add_argument("--smoe-layouts", action="store_true",
                    help="the sMoE's two parallel layouts (experts spread over the expert-parallel group, or "
                         "replicated on every rank) compared for the paper's small and large sMLP on 32 V100s and "
                         "smlp-bench --fair's sMLP-det on 2 CPU ranks: which is faster and by how much")
    st.add_argument("--smoe-parallel", choices=("faster", "expert", "replicated"), default="faster",
                    help="the sMLP's sMoE layout in --step-time and --table4: expert (spread over the expert-"
                         "parallel group, all2all), replicated (every expert on every rank), or faster (default: "
                         "--step-time prints both, --table4 ranks the faster)")
    st.add_argument("--all2all-chunks", type=int, choices=(1, 2),
                    help="--table4: every model's all2all overlapped with its experts in 2 chunks (default 1: none); "
                         "--step-time takes the model flag of the same name")
    st.add_argument("--cluster", default="v100-dgx1",
                    help="cluster preset: v100-dgx1 (the paper's 32 V100s; default), a100-dgx, cpu-gloo "
                         "(smlp-bench's 2 gloo ranks of one thread)")
    st.add_argument("--capacity-padding", choices=("auto", "on", "off"), default="auto",
                    help="GShard / Switch send E x capacity buffers (their implementations: on) or the routed rows "
                         "only (ours: off); auto = on for --table4, off for --step-time")
    st.add_argument("--gpu-tflops", type=float, help="peak dense TFLOP/s per GPU at the training precision")
    st.add_argument("--matmul-efficiency", type=float, help="fraction of the peak the matmuls reach")
    st.add_argument("--hbm-gbps", type=float, help="HBM bandwidth per GPU, GB/s")
    st.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB")
    st.add_argument("--gpus-per-node", type=int, help="GPUs per node (consecutive ranks share a node)")
    st.add_argument("--nvlink-gbps", type=float, help="all2all bandwidth per GPU inside a node, GB/s")
    st.add_argument("--nvlink-latency-us", type=float, help="latency of a collective inside a node, microseconds")
    st.add_argument("--ib-gbps", type=float, help="InfiniBand bandwidth per node (all NICs), GB/s")
    st.add_argument("--ib-latency-us", type=float, help="latency of a collective across nodes, microseconds")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--markdown", action="store_true", help="print a markdown table")
    return p


TINY_VOCAB = 4000  # smlp-demo's sentencepiece vocabulary: the corpus the tiny recipes train on


def recipe_tokens(arch: str) -> tuple[int, str] | None:
    """(--tokens-per-sample, the file) of the configs/*.args recipe that trains `arch`, if the repository has one."""
    import importlib.util

    spec = importlib.util.find_spec("fairseq_plugins")
    if spec is None or not spec.submodule_search_locations:
        return None
    configs = Path(spec.submodule_search_locations[0]).resolve().parent / "configs"
    for path in sorted(configs.glob("*.args")):
        flags = path.read_text().split()
        if "--arch" in flags and flags[flags.index("--arch") + 1] == arch and "--tokens-per-sample" in flags:
            return int(flags[flags.index("--tokens-per-sample") + 1]), f"configs/{path.name}"
    return None


def as_trained(arch: str, flags: list[str], vocab_size: int | None) -> tuple[list[str], int]:
    """--arch's model as its recipe trains it where the flags leave T and V open: T from its configs/*.args
    recipe (fairseq's own default is 1024), V the demo corpus's for the tiny presets (else the paper's); said on
    stderr, so that a count is never of a sequence length nobody trains."""
    said = []
    given = any(f == "--tokens-per-sample" or f.startswith("--tokens-per-sample=") for f in flags)
    recipe = None if given else recipe_tokens(arch)
    if recipe is not None:
        flags = ["--tokens-per-sample", str(recipe[0]), *flags]
        said.append(f"--tokens-per-sample {recipe[0]} ({recipe[1]})")
    if vocab_size is None:
        tiny = arch.endswith("_tiny")
        vocab_size = TINY_VOCAB if tiny else DEFAULT_VOCAB
        if tiny:
            said.append(f"--vocab-size {TINY_VOCAB} (smlp-demo's corpus)")
    if said:
        print(f"{PROG}: {arch} as its recipe trains it: {', '.join(said)}; give the flag to count another",
              file=sys.stderr)
    return flags, vocab_size


def run(argv: Sequence[str] | None = None) -> str:
    parser = build_parser()
    args, flags = parser.parse_known_args(argv)
    if args.arch:
        flags, args.vocab_size = as_trained(args.arch, flags, args.vocab_size)
    elif args.vocab_size is None:
        args.vocab_size = DEFAULT_VOCAB
    if args.smoe_layouts:
        if args.arch or args.step_time or args.table4 or args.match or args.paper_tables or flags:
            raise ValueError("--smoe-layouts takes no --arch, --step-time, --table4, --match, --paper-tables or "
                             "model flags: it compares its three fixed configurations")
        rows = smoe_layout_report("analytic" if args.method == "analytic" else "fvcore")
        return json.dumps(rows, indent=2) if args.json else format_smoe_layouts(rows, args.markdown)
    if args.table4 or args.step_time:
        return _run_step_time(args, flags)
    if args.paper_tables:
        if args.arch or args.match or flags:
            raise ValueError("--paper-tables takes no --arch, --match or model flags")
        tables = paper_tables(args.method)
        return json.dumps(tables, indent=2) if args.json else format_paper_tables(tables, args.markdown)
    if not args.arch:
        raise ValueError("--arch is required (or --paper-tables); e.g. --arch smlp_lm_paper_small")
    if args.smlp_sparse_layers is not None and args.smlp_sparse_layers < 1:
        raise ValueError(f"--smlp-sparse-layers {args.smlp_sparse_layers} must be >= 1")
    spec = parse_model(args.arch, flags, vocab_size=args.vocab_size)
    target = count_spec(spec, args.method)
    if not args.match:
        if args.json:
            return json.dumps({"arch": args.arch, **target.as_dict()}, indent=2)
        return format_count(args.arch, target, args.markdown)
    rows = match(target, tolerance=args.match_tolerance, smlp_sparse=args.smlp_sparse_layers, method=args.method,
                 experts_per_gpu=max(spec.experts_per_gpu, 1))
    if args.json:
        return json.dumps({"target": {"arch": args.arch, **target.as_dict()}, "tolerance": args.match_tolerance,
                           "matches": [r.as_dict() for r in rows]}, indent=2)
    return format_match(args.arch, target, rows, args.match_tolerance, args.markdown)


def cluster_from_args(args):
    from smlp.steptime import CLUSTERS, with_cluster_overrides

    if args.cluster not in CLUSTERS:
        raise ValueError(f"--cluster {args.cluster!r} is unknown: valid presets are {', '.join(CLUSTERS)}")
    scale = lambda v, k: None if v is None else v * k  # noqa: E731
    return with_cluster_overrides(
        CLUSTERS[args.cluster], peak_flops=scale(args.gpu_tflops, 1e12), matmul_efficiency=args.matmul_efficiency,
        hbm_bandwidth=scale(args.hbm_gbps, 1e9), gpu_memory=scale(args.gpu_memory_gib, 2 ** 30),
        gpus_per_node=args.gpus_per_node, nvlink_bandwidth=scale(args.nvlink_gbps, 1e9),
        nvlink_latency=scale(args.nvlink_latency_us, 1e-6), ib_bandwidth=scale(args.ib_gbps, 1e9),
        ib_latency=scale(args.ib_latency_us, 1e-6))


def _run_step_time(args, flags) -> str:
    cluster = cluster_from_args(args)
    if args.table4:
        if args.arch or args.step_time or args.match or args.paper_tables or flags:
            raise ValueError("--table4 takes no --arch, --step-time, --match, --paper-tables or model flags")
        if args.capacity_padding == "off":
            raise ValueError("--table4 predicts the paper's runs, whose GShard / Switch pad to capacity; "
                             "use --step-time --capacity-padding off for our dispatcher")
        rows = table4(args.table4, cluster, "analytic" if args.method == "analytic" else "fvcore",
                      smoe_layout=args.smoe_parallel, all2all_chunks=args.all2all_chunks or 1)
        return json.dumps(rows, indent=2) if args.json else format_table4(rows, args.markdown)
    if not args.arch:
        raise ValueError("--step-time needs --arch (and --batch-size); e.g. --arch smlp_lm_paper_small "
                         "--distributed-world-size 32 --batch-size 4 --update-freq 4 --fp16")
    if args.all2all_chunks is not None:  # fairseq's flag of the model
        flags = [*flags, "--all2all-chunks", str(args.all2all_chunks)]
    spec = parse_model(args.arch, flags, vocab_size=args.vocab_size)
    method = "analytic" if args.method == "analytic" else "fvcore"
    padding = args.capacity_padding == "on"
    if args.smoe_parallel == "faster" and smoe_expert_params(spec.cfg, 1):  # an sMLP: both layouts
        both = compare_smoe_layouts(spec, cluster, padding=padding, method=method)
        if args.json:
            return json.dumps({"faster": both["faster"], "speedup": both["speedup"],
                               **{k: v.as_dict() for k, v in both["step_times"].items()}}, indent=2)
        return "\n\n".join([*(f"[sMoE {k}] " + format_step_time(v) for k, v in both["step_times"].items()),
                             smoe_layout_sentence(both)])
    layout = "expert" if args.smoe_parallel == "faster" else args.smoe_parallel
    st = step_time_for(spec, cluster, padding=padding, method=method, smoe_layout=layout)
    return json.dumps(st.as_dict(), indent=2) if args.json else format_step_time(st)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        print(run(argv))
    except (ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """Console entry point of ``smlp-flops``: fairseq's parser and registry without DeepSpeed (no
    optimizer is built here) and without third-party import warnings (smlp/third_party.py)."""
    quiet_imports(deepspeed=False)
    sys.exit(main())
