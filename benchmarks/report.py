"""The report of a benchmark, complete or not: results.json, the Table 4 style table.md and Figure 5.

`report` reads the recorded runs (runs.json), summarises them (benchmarks/summary.py), adds the
verdicts (benchmarks/verdicts.py) and writes the three files; `smlp-bench --report` runs it alone.
"""
from __future__ import annotations

from pathlib import Path

from . import schedule as S
from .machine import machine_info
from .plots import plot
from .presets import models_from_plan
from .schedule import atomic_write_json
from .summary import probe_median, ratios, speeds, summarise
from .verdicts import analyse_curves, targets, verdict


def table(results: dict, rat: dict, peak: dict | None, machine: dict, plan: dict, complete: bool = True) -> str:
    s, t = plan["settings"], plan["settings"]["target"]
    seeds = sorted({seed for m in results.values() for seed in m["seeds"]})
    peak_s = f"dense matmul peak {peak['total'] / 1e9:.1f} GFLOP/s (sum over ranks); " if peak else ""
    tokens = plan["nproc"] * s["batch_size"] * t["seq_len"]
    lines = [f"Measured on {machine.get('cpu_model', machine.get('processor', '?'))}, {plan['nproc']} gloo ranks x 1 "
             f"thread, {peak_s}{plan['name']} preset, seeds {', '.join(map(str, seeds))}, {s['updates']} updates of "
             f"{plan['nproc']} x {s['batch_size']} x {t['seq_len']} = {tokens:,} tokens (D={t['d_model']}, "
             f"F={t['d_ffn']}, T={t['seq_len']})" + ("" if complete else " - PARTIAL: the benchmark has not finished")
             + ".", "",
             "| model | layers | GFLOPs/token (train) | words/s | sMLP-det speed-up [range] | valid ppl | MFU "
             "| MFU (executed) | routing + all2all | peak RSS / rank |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, m in results.items():
        rr = rat["smlp_det_wps_over_range"].get(key)
        b = m["breakdown"]
        comm = f"{(b['routing'] + b['all2all']):.1%}" if b else "-"
        wps = f"{m['wps']:,.0f} ± {m['wps_std']:,.0f}" if m["wps"] else "-"
        ppl = f"{m['valid_ppl']:.1f} ± {m['valid_ppl_std']:.1f}" if m["valid_ppl"] else "-"
        speed = f"{rr['ratio']:.2f}x [{rr['lo']:.2f}-{rr['hi']:.2f}]" if rr else "-"
        mfu = f"{m['mfu']:.1%}" if m["mfu"] else "-"
        mfu_executed = f"{m['mfu_executed']:.1%}" if m.get("mfu_executed") else "-"
        mem = f"{m['peak_mem_mb']:.0f} MB" if m["peak_mem_mb"] else "-"
        lines.append(f"| {m['name']} | {m['layers']} | {m['flops_per_token'] / 1e9:.4f} | {wps} | {speed} | {ppl} "
                     f"| {mfu} | {mfu_executed} | {comm} | {mem} |")
    return "\n".join(lines)


def perplexity_table(results: dict, plan: dict, complete: bool = True) -> str:
    """A perplexity-only table (the fair benchmark's stages, whose runs share the machine: no speed): each
    model's geometric mean over its seeds, the seeds, their spread (unknown from one seed), and the same on the
    positions sMLP-partial predicts."""
    import math
    import statistics

    s, t = plan["settings"], plan["settings"]["target"]

    def geo(vals):
        return math.exp(statistics.mean(math.log(v) for v in vals))

    def cell(vals):
        if not vals:
            return "-"
        return f"{geo(vals):.1f}" + (f" ({', '.join(f'{v:.1f}' for v in vals)})" if len(vals) > 1 else "")

    lines = [f"{plan['name']}: validation perplexity after {s['updates']} updates (D={t['d_model']}, F={t['d_ffn']}, "
             f"T={t['seq_len']}, {t.get('experts', plan['nproc'])} experts), {plan['nproc']} ranks"
             + ("" if complete else " - PARTIAL: the stage has not finished") + ".", "",
             "| model | layers | lr | valid ppl (seeds) | seed spread (sd of log ppl) | on sMLP-partial's positions |",
             "|---|---|---:|---:|---:|---:|"]
    for m in results.values():
        vals = m.get("valid_ppl_per_seed") or []
        spread = f"{statistics.stdev(math.log(v) for v in vals):.4f}" if len(vals) > 1 else \
            ("unknown (1 seed)" if vals else "-")
        lr = f"{m['lr']:g}" if m.get("lr") is not None else f"{s['lr']:g}"
        lines.append(f"| {m['name']} | {m['layers']} | {lr} | {cell(vals)} | {spread} | "
                     f"{cell(m.get('valid_suffix_ppl_per_seed'))} |")
    return "\n".join(lines)


def fmt(value) -> str:
    """A measured figure (a ratio, a share, a perplexity gap) as the tables show it; "-" when missing."""
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) >= 2 or value < 0 else f"{value:.3f}"


def report(store: S.RunStore, out_dir: Path, *, machine: dict | None = None, quiet: bool = False) -> dict:
    """results.json, table.md and the figure from the recorded runs (complete or not)."""
    plan = store.plan
    models = models_from_plan(plan)
    peaks = store.extra.get("peaks") or []
    # the highest of the peaks measured at each start: the least loaded one (MFU is only meaningful on a
    # quiet machine; under load a run's words/s and the peak are measured at different loads)
    peak = {"total": max(p["total"] for p in peaks), "measurements": peaks} if peaks else None
    machine = machine or store.extra.get("machine") or machine_info()
    results = summarise(store, models, peak)
    norms = speeds(store)
    complete = not store.pending() and (not plan["settings"].get("second_phase") or "phase2" in store.extra)
    rat = ratios(results, norms, plan["reference"])
    record = {"kind": "experiment" if plan.get("experiment") else "preset", "preset": plan["name"],
              "experiment": plan.get("experiment"), "complete": complete,
              "runs_recorded": len([s for s in store.finished() if s.kind == S.TRAIN]),
              "runs_scheduled": len([s for s in store.slots if s.kind == S.TRAIN]),
              "models": results, "ratios": rat, "normalized_speeds": norms, "probe_median_wps": probe_median(store),
              "schedule": [s.as_dict() for s in store.slots], "order_seed": plan["order_seed"],
              "phase2": store.extra.get("phase2"), "matching": store.extra.get("matching"), "machine": machine,
              "peak_flops": peak, "settings": plan["settings"], "target": plan["settings"]["target"],
              "nproc": plan["nproc"], "seconds": round(_elapsed(store), 1)}
    record["analysis"] = analyse_curves(results)
    if plan["name"].startswith("fair/"):
        # the fair benchmark's stages: perplexity only, and no verdict here (benchmarks/fair.py `verdicts`, one rule
        # in one place, decides every sentence it publishes)
        record["table_md"] = perplexity_table(results, plan, complete)
    else:
        record["table_md"] = table(results, rat, peak, machine, plan, complete)
        record["targets"] = targets(record)
        record["verdicts"] = {k: verdict(results, record["analysis"], k) for k in ("smlp_det", "smlp_partial")
                              if k in results}
    atomic_write_json(out_dir / "results.json", record)
    (out_dir / "table.md").write_text(record["table_md"] + "\n")
    if any(m["curves"] for m in results.values()):
        plot(results, out_dir / "figure5.png",
             f"{plan['name']}: FLOP-matched models on the demo corpus (in the manner of sMLP Figure 5)")
    if not quiet:
        print(record["table_md"])
    return record


def _elapsed(store: S.RunStore) -> float:
    return sum(r.get("seconds", 0.0) for r in store.records.values())
