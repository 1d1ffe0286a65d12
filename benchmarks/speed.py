"""Training speed of sMLP-det's layouts against gMLP and the Transformer-MoEs, fair configuration (issues 30, 47).

Words/s on 1 process and on 2 CPU gloo ranks, every ratio from the same round's runs; OUTPUT_DIR/speed.json holds
both sides, the scaling and the targets (docs/benchmarks.md, "sMLP-det's parallel layouts and overlapped all2all")."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import machine, pinned
from .presets import MOE_BASELINES, NAMES, BenchError, plan_models
from .publish import PAGE, replace_section
from .report import report
from .store import atomic_write_json, write_text
from .training import prepare, run_schedule, vocab_size

START, END = "<!-- smlp-speed:start -->", "<!-- smlp-speed:end -->"
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


def settings(updates: int, seeds: int) -> dict:
    from .fair import COMMON, FAIR_TARGET

    return dict(COMMON, seeds=seeds, updates=updates, validate_every=10 * updates, profile_steps=3, target=FAIR_TARGET)


def min_updates() -> int:
    """The fewest updates that leave a clean log interval to read words/s from (training.clean_wps): the first
    interval is warm-up, the last `profile_steps` + 2 updates hold the profiled window."""
    s = settings(1, 1)
    return 2 * s["log_interval"] + s["profile_steps"] + 2


def models(vocab_size: int, nproc: int, keys=MODELS, code=None) -> list:
    """The models of `keys` (sMLP-det, the reference of every ratio, always first), planned by `code` (a pinned
    commit's worktree, benchmarks/pinned.py) or by this checkout; one process runs no variant."""
    from .fair import FAIR_TARGET

    if unknown := [k for k in keys if k not in MODELS]:
        raise BenchError(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    plan = code.plan_models if code is not None else plan_models
    base, _ = plan(vocab_size, nproc, ("smlp_det", *(k for k in BASELINES if k in keys)), FAIR_TARGET)
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
    return {"nproc": record["nproc"], "fastest_moe": fastest, "rows": rows, "wps": wps,
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


def _cell(r: dict | float | None) -> str:
    if isinstance(r, float):  # a record of one side, written before issue 47: ratios without their range
        return f"{r:.3f}x"
    return f"{r['ratio']:.3f}x [{r['lo']:.2f}-{r['hi']:.2f}]" if r else "-"


def markdown(speed: dict) -> str:
    m, s = speed.get("machine") or {}, speed["settings"]
    sides = speed.get("sides") or {"2": speed}  # a record of one side (2 ranks), written before issue 47
    at = f" at commit {_commit(speed)}" if speed.get("code") else ""
    lines = [f"Measured by `python -m smlp_bench.speed`{at} on {m.get('cpu_model') or m.get('cpu', '?')}, gloo "
             f"ranks x 1 thread, {s['updates']} updates x {s['seeds']} interleaved round(s) per model, fair "
             f"configuration (8 experts); {'complete' if speed['complete'] else 'PARTIAL'}. Ratios from "
             f"{speed.get('ratios_from', 'runs adjacent in time, probe-normalized')}: median [range] over rounds.", "",
             "| processes | model | words/s [range] | over gMLP | over the fastest Transformer-MoE "
             "| routing + all2all share |", "|---:|---|---:|---:|---:|---:|"]
    for n, side in sides.items():
        for r in side["rows"]:
            b = r.get("breakdown") or {}
            share = f"{b['routing'] + b['all2all']:.1%}" if "routing" in b and "all2all" in b else "-"
            span = f" [{r['wps_range'][0]:,.0f}-{r['wps_range'][1]:,.0f}]" if r.get("wps_range") else ""
            lines.append(f"| {n} | {r['name']} | {r['wps'] or 0:,.0f}{span} | {_cell(r['gMLP'])} "
                         f"| {_cell(r['fastest Transformer-MoE'])}{f' ({m})' if (m := side['fastest_moe']) else ''} "
                         f"| {share} |")
    if speed.get("scaling"):
        lines += ["", "| scaling (words/s on 2 ranks / 2 x on 1 process) | " +
                  " | ".join(NAMES.get(k, k) for k in speed["scaling"]) + " |",
                  "|---|" + "---:|" * len(speed["scaling"]),
                  "| | " + " | ".join(f"{v:.2f}" for v in speed["scaling"].values()) + " |"]
    lines += ["", "| target | measured | goal | met |", "|---|---:|---|---|"]
    for t in speed["targets"]:
        v = f"{t['measured']:.3f}" if t["measured"] is not None else "-"
        met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {v} | {t['goal']} | {met} |")
    return "\n".join(lines)


def _commit(record: dict) -> str:
    return ((record.get("code") or {}).get("commit") or "?")[:7]


def before_after(before: dict, after: dict) -> str:
    """Two records of the same benchmark, the code before a change and after it: each model's words/s in both
    (runs of different hours: machine drift included), and sMLP-det's same-round ratio over gMLP in both, which
    cancels the drift that both sides share."""
    lines = [f"Before (commit {_commit(before)}) and after (commit {_commit(after)}), each its own run of "
             f"`python -m smlp_bench.speed`; words/s median [range] over rounds.", "",
             "| processes | model | words/s before | words/s after | after / before | sMLP-det over gMLP, before -> "
             "after |", "|---:|---|---:|---:|---:|---:|"]
    for n, side in (after.get("sides") or {}).items():
        old = (before.get("sides") or {}).get(n)
        if old is None:
            continue
        rows_was, rows_now = ({r["model"]: r for r in s["rows"]} for s in (old, side))
        for key, now in side["wps"].items():
            if key not in old["wps"]:
                continue
            was = old["wps"][key]
            ratio = f"{_cell(rows_was[key]['gMLP'])} -> {_cell(rows_now[key]['gMLP'])}" \
                if key in rows_was and key in rows_now else ""
            lines.append(f"| {n} | {NAMES.get(key, key)} | {was['median']:,.0f} [{was['range'][0]:,.0f}-"
                         f"{was['range'][1]:,.0f}] | {now['median']:,.0f} [{now['range'][0]:,.0f}-"
                         f"{now['range'][1]:,.0f}] | {now['median'] / was['median']:.3f}x | {ratio} |")
    return "\n".join(lines)


def publish(path: Path, page: Path = PAGE, before: Path | None = None) -> None:
    """Rewrite the speed section of `page` from the record at `path` (and the before/after table against the
    record at `before`)."""
    speed = json.loads(path.read_text())
    text = markdown(speed) + (f"\n\n{before_after(json.loads(before.read_text()), speed)}" if before else "")
    write_text(page, replace_section(page.read_text(), START, END, text, page))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", type=Path, default=Path("results/speed"))
    p.add_argument("--updates", type=int, default=40, help="updates per training run (40)")
    p.add_argument("--seeds", type=int, default=5, help="rounds: every model once per seed (5)")
    p.add_argument("--nproc", default="1,2", help="the process counts to measure, each a side of the record (1,2)")
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


def run(args) -> int:
    if args.publish:
        publish(args.publish, before=args.before)
        print(f"   {PAGE}: the speed section from {args.publish}{f' against {args.before}' if args.before else ''}")
        return 0
    if args.updates < min_updates() or args.seeds < 1:
        print(f"smlp_bench.speed: error: --updates {args.updates}: a run needs at least {min_updates()} updates "
              f"(--seeds >= 1): words/s are read from log intervals after the first one, outside the profiled steps "
              f"near the end", file=sys.stderr)
        raise SystemExit(2)
    try:
        counts = sorted({int(n) for n in str(args.nproc).split(",") if n.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        print(f"smlp_bench.speed: error: --nproc {args.nproc}: give process counts, e.g. 1,2", file=sys.stderr)
        raise SystemExit(2)
    out = args.output_dir.expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0, sides = time.time(), {}
    try:
        data = prepare(args.data, out)
        code = pinned.checkout(args.code, out, machine.CODE_ROOT) if args.code else None
        if code is not None:
            print(f"   every run executes commit {code.commit[:10]} ({code.root})", flush=True)
        keys = [k.strip() for k in args.models.split(",") if k.strip()]
        for n in counts:  # one side after the other, each in its own interleaved rounds and store
            print(f"== speed: {n} process(es)", flush=True)
            ms = models(vocab_size(data), n, keys, code)
            s = dict(settings(args.updates, args.seeds), models=tuple(m.key for m in ms))
            (out / f"nproc{n}").mkdir(exist_ok=True)
            store = run_schedule("speed", s, ms, {}, data, n, out / f"nproc{n}", resume=args.resume,
                                 reference="smlp_det", code=code)
            sides[n] = analyse(report(store, out / f"nproc{n}", quiet=True))
    except BenchError as exc:
        print(f"smlp_bench.speed: error: {exc}", file=sys.stderr)
        return 1
    speed = dict(combine(sides), code=code.identity() if code is not None else machine.code_identity())
    atomic_write_json(out / "speed.json", speed)
    print(markdown(speed))
    print(f"   {out / 'speed.json'} ({(time.time() - t0) / 60:.0f} min); publish with "
          f"python -m smlp_bench.speed --publish {out / 'speed.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_bench.speed", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
