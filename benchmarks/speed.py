"""Training speed of sMLP-det's layouts against gMLP and the Transformer-MoEs, fair configuration (issue 30).

    smlp-bench speed [--output-dir results/speed] [--updates 40] [--seeds 2] [--resume]   (python -m smlp_bench.speed)
    smlp-bench speed --publish results/speed/speed.json      # rewrite its section of docs/benchmarks.md

In words/s on 2 CPU gloo ranks, in the fair comparison's configuration, sMLP-det with its sMoE's layout chosen
(`smlp_det`, replicated here), expert-parallel (`smlp_det_expert`) and with its all2all overlapped
(`smlp_det_overlap`) against gMLP and the fastest Transformer-MoE, in the harness's interleaved rounds with probes,
no validation, 3 profiled steps per model; OUTPUT_DIR/speed.json has the issue's targets (1.0x the fastest
Transformer-MoE, 0.92x gMLP). Take the ratios from a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from .presets import MOE_BASELINES, NAMES, BenchError, plan_models
from .publish import PAGE, replace_section
from .report import report
from .store import atomic_write_json
from .training import prepare, run_schedule, vocab_size

START, END = "<!-- smlp-speed:start -->", "<!-- smlp-speed:end -->"
BASELINES = ("gmlp", "switch", "base", "hash", "gshard")
VARIANTS = {  # key -> (display name, extra fairseq-train flags of sMLP-det)
    "smlp_det_expert": ("sMLP-det, sMoE expert-parallel", ["--smoe-parallel", "expert"]),
    "smlp_det_overlap": ("sMLP-det, all2all overlapped", ["--all2all-chunks", "2"]),
}
MODELS = ("smlp_det", *VARIANTS, *BASELINES)
TARGETS = (("fastest Transformer-MoE", 1.0), ("gMLP", 0.92))


def settings(updates: int, seeds: int) -> dict:
    from .fair import COMMON, FAIR_TARGET

    return dict(COMMON, seeds=seeds, updates=updates, validate_every=10 * updates, profile_steps=3, target=FAIR_TARGET)


def min_updates() -> int:
    """The fewest updates that leave a clean log interval to read words/s from (training.clean_wps): the first
    interval is warm-up, the last `profile_steps` + 2 updates hold the profiled window."""
    s = settings(1, 1)
    return 2 * s["log_interval"] + s["profile_steps"] + 2


def models(vocab_size: int, nproc: int, keys=MODELS) -> list:
    """The models of `keys` (sMLP-det, the reference of every ratio, always first)."""
    from .fair import FAIR_TARGET

    if unknown := [k for k in keys if k not in MODELS]:
        raise BenchError(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    base, _ = plan_models(vocab_size, nproc, ("smlp_det", *(k for k in BASELINES if k in keys)), FAIR_TARGET)
    by_key = {m.key: m for m in base}
    det = by_key["smlp_det"]
    by_key.update({k: replace(det, key=k, name=name, flags=[*det.flags, *extra])
                   for k, (name, extra) in VARIANTS.items() if k in keys})
    return [det, *(by_key[k] for k in MODELS if k in keys and k != "smlp_det")]


def analyse(record: dict) -> dict:
    """The issue's targets from the report: each sMLP-det variant against gMLP and the fastest Transformer-MoE
    (ratios of runs adjacent in time: a variant over another model = (reference over it) / (reference over variant))."""
    res, ratio = record["models"], record["ratios"]["smlp_det_wps_over"]
    moe = [k for k in MOE_BASELINES if k in res and res[k].get("wps")]
    fastest = max(moe, key=lambda k: res[k].get("speed_vs_reference") or 0.0) if moe else None
    rows = []
    for key in ("smlp_det", *VARIANTS):
        if key in res:
            own = 1.0 if key == "smlp_det" else ratio.get(key)
            row = {"model": key, "name": res[key].get("name") or NAMES.get(key, key), "wps": res[key].get("wps"),
                   "breakdown": res[key].get("breakdown")}
            for label, other in (("fastest Transformer-MoE", fastest), ("gMLP", "gmlp")):
                r = ratio.get(other) if other else None
                row[label] = r / own if r and own else None
            rows.append(row)
    targets = [{"target": f"sMLP-det words/s over {label}" + (f" ({fastest})" if label.startswith("fastest") else ""),
                "goal": f">= {goal:.2f}x", "measured": rows[0][label] if rows else None,
                "met": None if not rows or rows[0][label] is None else rows[0][label] >= goal}
               for label, goal in TARGETS]
    return {"fastest_moe": fastest, "rows": rows, "targets": targets, "complete": record["complete"],
            "machine": record.get("machine"), "settings": record["settings"], "seconds": record.get("seconds")}


def markdown(speed: dict) -> str:
    m = speed.get("machine") or {}
    lines = [f"Measured by `python -m smlp_bench.speed` on {m.get('cpu_model') or m.get('cpu', '?')}, 2 gloo ranks x "
             f"1 thread, {speed['settings']['updates']} updates x {speed['settings']['seeds']} seed(s) per model, fair "
             f"configuration (8 experts); {'complete' if speed['complete'] else 'PARTIAL'}.", "",
             f"| sMLP-det | words/s | over gMLP | over the fastest Transformer-MoE ({speed['fastest_moe']}) "
             "| routing + all2all share |", "|---|---:|---:|---:|---:|"]
    for r in speed["rows"]:
        b = r.get("breakdown") or {}
        share = f"{b['routing'] + b['all2all']:.1%}" if "routing" in b and "all2all" in b else "-"
        cells = [f"{r[k]:.3f}x" if r[k] else "-" for k in ("gMLP", "fastest Transformer-MoE")]
        lines.append(f"| {r['name']} | {r['wps'] or 0:,.0f} | {cells[0]} | {cells[1]} | {share} |")
    lines += ["", "| target | measured | goal | met |", "|---|---:|---|---|"]
    for t in speed["targets"]:
        v = f"{t['measured']:.3f}" if t["measured"] is not None else "-"
        met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {v} | {t['goal']} | {met} |")
    return "\n".join(lines)


def publish(path: Path, page: Path = PAGE) -> None:
    page.write_text(replace_section(page.read_text(), START, END, markdown(json.loads(path.read_text())), page))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", type=Path, default=Path("results/speed"))
    p.add_argument("--updates", type=int, default=40, help="updates per training run (40)")
    p.add_argument("--seeds", type=int, default=2, help="rounds: every model once per seed (2)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS), help=f"a subset of {', '.join(MODELS)} (all)")
    p.add_argument("--data", type=Path, default=None, help="a fairseq data-bin (default: the demo corpus)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--publish", type=Path, default=None, metavar="SPEED_JSON",
                   help="do not train: rewrite the speed section of docs/benchmarks.md from SPEED_JSON")


def run(args) -> int:
    if args.publish:
        publish(args.publish)
        print(f"   {PAGE}: the speed section from {args.publish}")
        return 0
    if args.updates < min_updates() or args.seeds < 1:
        print(f"smlp_bench.speed: error: --updates {args.updates}: a run needs at least {min_updates()} updates "
              f"(--seeds >= 1): words/s are read from log intervals after the first one, outside the profiled steps "
              f"near the end", file=sys.stderr)
        raise SystemExit(2)
    out = args.output_dir.expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        data = prepare(args.data, out)
        ms = models(vocab_size(data), args.nproc, [k.strip() for k in args.models.split(",") if k.strip()])
        s = dict(settings(args.updates, args.seeds), models=tuple(m.key for m in ms))
        store = run_schedule("speed", s, ms, {}, data, args.nproc, out, resume=args.resume, reference="smlp_det")
        speed = analyse(report(store, out, quiet=True))
    except BenchError as exc:
        print(f"smlp_bench.speed: error: {exc}", file=sys.stderr)
        return 1
    atomic_write_json(out / "speed.json", speed)
    print(markdown(speed))
    print(f"   {out / 'speed.json'} ({(time.time() - t0) / 60:.0f} min); publish with "
          f"python -m smlp_bench.speed --publish {out / 'speed.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_bench.speed", description=__doc__.split("\n\n")[2])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
