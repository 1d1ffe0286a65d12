"""Training speed of sMLP-det's layouts against gMLP and the Transformer-MoEs, fair configuration (issues 30, 47),
and across model widths (issue 53): `smlp-bench speed`'s plan, runs and analysis.

Words/s on 1 process and on 2 CPU gloo ranks, every ratio from the same round's runs; OUTPUT_DIR/speed.json holds
both sides, the scaling and the targets (docs/benchmarks.md, "sMLP-det's parallel layouts and overlapped all2all");
with several --widths, the same for each width, each FLOP-matched as the fair configuration is, published with a
figure of every model's words/s over gMLP's against width (docs/benchmarks.md, "Speed across widths"). The page
sections, figure and README sentence are written from the record by benchmarks/speed_pages.py."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import machine, pinned
from .fair import COMMON, FAIR_TARGET, at_width
from .presets import (
    MOE_BASELINES,
    NAMES,
    BenchError,
    check_at_least,
    check_names,
    parse_checked,
    parse_counts,
    parse_names,
    plan_models,
    refuse,
)
from .report import report
from .speed_pages import markdown, plot_widths, publish
from .store import atomic_write_json, check_started
from .training import check_data, prepare, run_schedule, vocab_size

FAIR_WIDTH = FAIR_TARGET["d_model"]
CODE_WHY = "to train the speed benchmark's models with its code (--code COMMIT)"
BASELINES = ("gmlp", "switch", "base", "hash", "gshard")
VARIANTS = {  # key -> (display name, extra fairseq-train flags of sMLP-det); they need 2 ranks or more
    "smlp_det_expert": ("sMLP-det, sMoE expert-parallel", ["--smoe-parallel", "expert"]),
    "smlp_det_overlap": ("sMLP-det, all2all overlapped", ["--all2all-chunks", "2"]),
}
MODELS = ("smlp_det", *VARIANTS, *BASELINES)
COLUMNS = ("gMLP", "fastest Transformer-MoE")
# (side: processes, what, goal): sMLP-det's ratio over the column's model; "scaling" in points of gMLP's
TARGETS = ((2, "fastest Transformer-MoE", 1.0), (2, "gMLP", 0.92), (1, "gMLP", 0.95))
SCALING_POINTS = 0.05  # sMLP-det's scaling (words/s on 2 ranks over 2 x on 1 process) within 5 points of gMLP's
# a record of several widths, issue 53's goals: (width, processes, model, goal of sMLP-det's words/s over its)
WIDTH_TARGETS = ((512, 2, "hash", 1.0), (512, 2, "base", 1.0), (512, 2, "gmlp", 0.95), (512, 2, "switch", 0.95),
                 (128, 2, "gmlp", 0.85))


def settings(updates: int, seeds: int, width: int = FAIR_WIDTH) -> dict:
    """A side's settings: the fair configuration's (at `width`: fair.at_width), no validation, 3 profiled steps."""
    return dict(COMMON, seeds=seeds, updates=updates, validate_every=10 * updates, profile_steps=3,
                target=at_width(width))


def min_updates() -> int:
    """The fewest updates that leave a clean log interval to read words/s from (training.clean_wps): the first
    interval is warm-up, the last `profile_steps` + 2 updates hold the profiled window."""
    s = settings(1, 1)
    return 2 * s["log_interval"] + s["profile_steps"] + 2


def models(vocab_size: int, nproc: int, keys=MODELS, code=None, target: dict = FAIR_TARGET) -> list:
    """The models of `keys` (sMLP-det, the reference of every ratio, always first), FLOP-matched at `target` by `code`
    (a pinned commit's worktree, benchmarks/pinned.py) or by this checkout; one process runs no variant."""
    check_names(keys, MODELS, "--models")
    plan = code.plan_models if code is not None else plan_models
    base, _ = plan(vocab_size, nproc, ("smlp_det", *(k for k in BASELINES if k in keys)), target)
    by_key = {m.key: m for m in base}
    det = by_key["smlp_det"]
    if nproc > 1:
        by_key.update({k: replace(det, key=k, name=name, flags=[*det.flags, *extra])
                       for k, (name, extra) in VARIANTS.items() if k in keys})
    return [det, *(by_key[k] for k in MODELS if k in keys and k != "smlp_det" and k in by_key)]


def round_ratio(res: dict, a: str, b: str) -> dict | None:
    """Model a's words/s over model b's from the runs of the same round (seed): median, range, rounds."""
    if a not in res or b not in res:
        return None
    wb = dict(zip(res[b]["seeds"], res[b]["wps_per_seed"]))
    r = [w / wb[s] for s, w in zip(res[a]["seeds"], res[a]["wps_per_seed"]) if w and wb.get(s)]
    return {"ratio": statistics.median(r), "lo": min(r), "hi": max(r), "rounds": len(r)} if r else None


def analyse(record: dict) -> dict:
    """One side (a report of one process count): every sMLP-det variant over gMLP and over the fastest
    Transformer-MoE (the one with the most words/s), each from the same rounds' runs."""
    res = {k: m for k, m in record["models"].items() if m.get("wps")}
    moe = [k for k in MOE_BASELINES if k in res]
    fastest = max(moe, key=lambda k: res[k]["wps"]) if moe else None
    rows = []
    for key in ("smlp_det", *VARIANTS):
        if key in res:
            wps = res[key]["wps_per_seed"]
            row = {"model": key, "name": res[key].get("name") or NAMES.get(key, key), "wps": statistics.median(wps),
                   "wps_range": [min(wps), max(wps)], "rounds": len(wps), "breakdown": res[key].get("breakdown")}
            for label, other in zip(COLUMNS, ("gmlp", fastest)):
                row[label] = round_ratio(res, key, other) if other else None
            rows.append(row)
    wps = {k: {"median": statistics.median(m["wps_per_seed"]), "range": [min(m["wps_per_seed"]),
                                                                          max(m["wps_per_seed"])]}
           for k, m in res.items()}
    # every model over gMLP (the width figure), the share of routing slots its experts processed (None: no experts),
    # its training FLOPs per token (the calculator's), sMLP-det's words/s over its (the width goals) and where its
    # step goes (shares of the profiled steps)
    each = {k: {"name": m.get("name") or NAMES.get(k, k), "gMLP": round_ratio(res, k, "gmlp") if k != "gmlp" else None,
                "tokens_kept": m.get("tokens_kept"), "flops_per_token": m.get("flops_per_token"),
                "smlp_det_over": round_ratio(res, "smlp_det", k) if k != "smlp_det" else None,
                "breakdown": m.get("breakdown")}
            for k, m in res.items()}
    return {"nproc": record["nproc"], "fastest_moe": fastest, "rows": rows, "wps": wps, "models": each,
            "complete": record["complete"], "settings": record["settings"], "seconds": record.get("seconds"),
            "machine": record.get("machine"), "ratios_from": "the same round's runs (raw words/s, no probes)"}


def combine(sides: dict[int, dict]) -> dict:
    """Both sides, the scaling of every model run on both (words/s on N ranks over N x words/s on 1 process,
    medians) and the targets."""
    scaling = {}
    if 1 in sides and (many := max(sides)) > 1:
        one, n = sides[1]["wps"], sides[many]["wps"]
        scaling = {k: n[k]["median"] / (many * one[k]["median"]) for k in n if k in one}
    targets = []
    for nproc, label, goal in TARGETS:
        side = sides.get(nproc)
        row = side["rows"][0] if side and side["rows"] and side["rows"][0]["model"] == "smlp_det" else None
        v = row[label]["ratio"] if row and row[label] else None
        name = f"{label} ({side['fastest_moe'] or 'none measured'})" if label.startswith("fastest") and side else label
        targets.append({"target": f"sMLP-det words/s over {name}, {nproc} process(es)", "goal": f">= {goal:.2f}x",
                        "measured": v, "met": None if v is None else v >= goal})
    if "smlp_det" in scaling and "gmlp" in scaling:
        gap = scaling["gmlp"] - scaling["smlp_det"]
        targets.append({"target": "sMLP-det's scaling, points below gMLP's", "goal": f"<= {SCALING_POINTS:.2f}",
                        "measured": gap, "met": gap <= SCALING_POINTS})
    first = next(iter(sides.values()))
    return {"kind": "speed", "sides": {str(k): v for k, v in sorted(sides.items())}, "scaling": scaling,
            "targets": targets, "complete": all(s["complete"] for s in sides.values()),
            "machine": first.get("machine"), "settings": first["settings"], "ratios_from": first["ratios_from"]}


def by_width(records: dict[int, dict]) -> dict:
    """The record of several widths: each width's record (`combine`'s) under its width, the targets of all."""
    first = records[min(records)]
    return {"kind": "speed", "widths": {str(w): r for w, r in sorted(records.items())},
            "targets": [dict(t, target=f"D={w}: {t['target']}") for w, r in sorted(records.items())
                        for t in r["targets"]] + width_targets(records),
            "complete": all(r["complete"] for r in records.values()), "machine": first.get("machine"),
            "settings": first["settings"], "ratios_from": first["ratios_from"]}


def width_targets(records: dict[int, dict]) -> list[dict]:
    """Issue 53's goals (WIDTH_TARGETS) at the widths and process counts measured, each sMLP-det's same-round
    ratio over the model's (None where the model was not measured)."""
    found = []
    for width, nproc, key, goal in WIDTH_TARGETS:
        side = (records.get(width) or {}).get("sides", {}).get(str(nproc))
        if side is None:
            continue
        r = (side["models"].get(key) or {}).get("smlp_det_over")
        v = r["ratio"] if r else None
        found.append({"target": f"issue 53, D={width}: sMLP-det words/s over {NAMES.get(key, key)}, "
                                f"{nproc} process(es)",
                      "goal": f">= {goal:.2f}x", "measured": v, "met": None if v is None else v >= goal,
                      "range": [r["lo"], r["hi"]] if r else None})
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", type=Path, default=Path("results/speed"))
    p.add_argument("--updates", type=int, default=40, help="updates per training run (40)")
    p.add_argument("--seeds", "--rounds", type=int, default=5, help="rounds: every model once per seed (5)")
    p.add_argument("--nproc", default="1,2", help="the process counts to measure, each a side of the record (1,2)")
    p.add_argument("--widths", default=str(FAIR_WIDTH), metavar="D,...",
                   help=f"the model widths to measure, each FLOP-matched as the fair configuration is, with d_ffn = "
                        f"4 x D ({FAIR_WIDTH}: the fair configuration); several give a record of every width, "
                        f"published with a figure against width (e.g. 128,256,512)")
    p.add_argument("--models", default=",".join(MODELS), help=f"a subset of {', '.join(MODELS)} (all)")
    p.add_argument("--data", type=Path, default=None, help="a fairseq data-bin (default: the demo corpus)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--code", default=None, metavar="COMMIT",
                   help="train with the code of COMMIT (a git worktree under OUTPUT_DIR/code/), e.g. the commit before "
                        "a change, to measure before and after with the same harness (default: this checkout)")
    p.add_argument("--publish", type=Path, default=None, metavar="SPEED_JSON",
                   help="do not train: rewrite the speed section of docs/benchmarks.md from SPEED_JSON")
    p.add_argument("--before", type=Path, default=None, metavar="BEFORE_JSON",
                   help="with --publish: add a before/after table against this record (the code before a change, "
                        "measured with --code COMMIT)")
    p.add_argument("--then-publish", action="store_true",
                   help="once measured, rewrite the record's section of docs/benchmarks.md (and the width figure) as "
                        "--publish does; run from the checkout's root")


def side_dir(out: Path, width: int, nproc: int, several: bool) -> Path:
    """The run store's folder of one side: OUTPUT_DIR/nproc<N>, or OUTPUT_DIR/d<D>/nproc<N> with several widths."""
    return (out / f"d{width}" if several else out) / f"nproc{nproc}"


def check_args(args) -> None:
    """`smlp-bench speed`'s arguments, before any work (no corpus built, no folder made, no model planned)."""
    if args.publish:
        for flag, path in (("--publish", args.publish), ("--before", args.before)):
            if path is not None and not Path(path).is_file():
                raise BenchError(f"{flag} {path}: no such record")
        return
    if args.before is not None:
        raise BenchError("--before BEFORE_JSON goes with --publish AFTER_JSON (it adds a before/after table)")
    if args.updates < min_updates():
        raise BenchError(f"--updates {args.updates}: a run needs at least {min_updates()} updates: words/s are read "
                         f"from log intervals after the first one, outside the profiled steps near the end")
    check_at_least(args.seeds, 1, "--seeds")
    counts, widths = parse_counts(args.nproc, "--nproc", "1,2"), parse_counts(args.widths, "--widths", "128,256,512")
    parse_names(args.models, MODELS, "--models")
    if odd := [w for w in widths if w % FAIR_TARGET["experts"]]:
        raise BenchError(f"--widths {args.widths}: {', '.join(map(str, odd))} is not a multiple of the "
                         f"{FAIR_TARGET['experts']} experts (sMLP-det's sMoE gives each expert an equal chunk of D)")
    check_data(args.data)
    if args.code:
        pinned.resolve(args.code, machine.CODE_ROOT, CODE_WHY)
    out = args.output_dir.expanduser()
    stores = [side_dir(out, w, n, len(widths) > 1) / "runs.json" for w in widths for n in counts]
    started = [str(p.relative_to(out)) for p in stores if p.exists()]
    check_started(out, started, args.resume)
    if args.resume and not started:
        raise BenchError(f"--resume: no measurement of these widths and process counts in {out}; start one without "
                         f"--resume")


def run(args) -> int:
    """Measure (arguments checked by `check_args`), or publish a record."""
    if args.publish:
        print(f"   {publish(args.publish, before=args.before)}")
        return 0
    counts, widths = parse_counts(args.nproc, "--nproc", "1,2"), parse_counts(args.widths, "--widths", "128,256,512")
    keys = parse_names(args.models, MODELS, "--models")
    out = args.output_dir.expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0, records = time.time(), {}
    data = prepare(args.data, out)
    code = pinned.checkout(args.code, out, machine.CODE_ROOT, CODE_WHY) if args.code else None
    if code is not None:
        print(f"   every run executes commit {code.commit[:10]} ({code.root})", flush=True)
    for w in widths:
        sides = {}
        for n in counts:  # one side after the other, each in its own interleaved rounds and store
            print(f"== speed: D={w}, {n} process(es)", flush=True)
            ms = models(vocab_size(data), n, keys, code, at_width(w))
            s = dict(settings(args.updates, args.seeds, w), models=tuple(m.key for m in ms))
            folder = side_dir(out, w, n, len(widths) > 1)
            folder.mkdir(parents=True, exist_ok=True)
            store = run_schedule("speed", s, ms, {}, data, n, folder, resume=args.resume and
                                 (folder / "runs.json").exists(), reference="smlp_det", code=code)
            sides[n] = analyse(report(store, folder, quiet=True))
        records[w] = combine(sides)
    speed = dict(records[widths[0]] if len(widths) == 1 else by_width(records),
                 code=code.identity() if code is not None else machine.code_identity())
    atomic_write_json(out / "speed.json", speed)
    print(markdown(speed, str(plot_widths(speed, out / "widths.png")) if "widths" in speed else None))
    print(f"   {out / 'speed.json'} ({(time.time() - t0) / 60:.0f} min)", flush=True)
    if args.then_publish:
        print(f"   {publish(out / 'speed.json')}")
    else:
        print(f"   publish with: smlp-bench speed --publish {out / 'speed.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_bench.speed", description=__doc__)
    add_arguments(p)
    args = parse_checked(p, argv, check_args)
    try:
        return run(args)
    except BenchError as exc:
        refuse(p.prog, exc, 1)


if __name__ == "__main__":
    sys.exit(main())
