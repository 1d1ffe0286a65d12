"""A benchmark's report from its run store, complete or not (`smlp-bench report DIR`): results.json, table.md and
Figure 5 (what each figure means: docs/benchmarks.md, "smlp-bench: speed and quality at matched FLOPs"), and the
figures' plotting."""
from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

from smlp.files import write_figure
from smlp.profiling import routing_and_all2all

from . import schedule as S
from .machine import machine_info
from .presets import MOE_BASELINES, REFERENCE, Model, models_from_plan
from .store import RunStore, atomic_write_json, final_ppl, write_text
from .verdicts import analyse_curves, mean_curve, targets, verdict

# validation perplexities besides `ppl` that runs may log (fairseq_plugins/criterion.py): on the positions
# sMLP-partial scores, and with balanced routers assigning as in training or routing greedily
EXTRA_METRICS = ("suffix_ppl", "trained_routing_ppl", "greedy_routing_ppl")


def greedy_max_load(record: dict) -> float | None:
    """The busiest expert's load over the mean, the largest over a run's balanced layers, at its last validation
    with greedy routing (`load_greedy_<layer>`, --valid-greedy-routing); None when not logged."""
    last = record["valid"][-1] if record.get("valid") else {}
    return max((float(v) for k, v in last.items() if k.startswith("load_greedy_")), default=None)


def speeds(store: RunStore) -> dict:
    return S.normalized_speeds(store.slots, {rid: r["wps"] for rid, r in store.records.items() if r.get("wps")})


def probe_median(store: RunStore) -> float | None:
    w = [r["wps"] for r in store.records.values() if r["kind"] == S.PROBE and r.get("wps")]
    return statistics.median(w) if w else None


def summarise(store: RunStore, models: list[Model], peak: dict | None) -> dict:
    settings = store.plan["settings"]
    norms, meter, out = speeds(store), probe_median(store), {}
    for m in models:
        rs = [(s, store.records[s.run_id]) for s in store.slots
              if s.kind == S.TRAIN and s.key == m.key and s.run_id in store.records]
        if not rs:
            continue
        wps_seed = [r["wps"] for _, r in rs if r.get("wps")]
        ppl_seed = [final_ppl(r) for _, r in rs if final_ppl(r) is not None]
        wps = statistics.mean(wps_seed) if wps_seed else None
        prof = next((r["profile"] for _, r in rs if r.get("profile")), None)
        curves = []
        for s, r in rs:
            tpu = r.get("tokens_per_update") or store.plan["nproc"] * settings["batch_size"] * m.seq_len
            ups = [int(v["num_updates"]) for v in r["valid"]]
            tokens = [u * tpu for u in ups]
            nv = norms.get(s.run_id)
            speed = nv["norm"] * meter if nv and meter else r.get("wps")
            curve = {"seed": r["seed"], "updates": ups, "tokens": tokens, "wall": [v["wall"] for v in r["valid"]],
                     "time": [t / speed for t in tokens] if speed else [], "ppl": [v["ppl"] for v in r["valid"]]}
            for metric in EXTRA_METRICS:  # logged by the criterion where the benchmark asked for them
                if r["valid"] and all(metric in v for v in r["valid"]):
                    curve[metric] = [v[metric] for v in r["valid"]]
            curves.append(curve)
        greedy = [v for v in (greedy_max_load(r) for _, r in rs) if v is not None]
        extra = {"greedy_max_load": statistics.mean(greedy)} if greedy else {}
        if kept := [r["tokens_kept"] for _, r in rs if r.get("tokens_kept") is not None]:
            extra["tokens_kept"] = statistics.mean(kept)  # the share of routing slots its experts processed
        for metric in EXTRA_METRICS:
            if finals := [final_ppl(r, metric) for _, r in rs if final_ppl(r, metric) is not None]:
                extra.update({f"valid_{metric}": statistics.mean(finals), f"valid_{metric}_per_seed": finals})
        out[m.key] = {
            "name": m.title, "layers": m.layers, "fairseq_flags": " ".join(m.flags), "note": m.note,
            "wps": wps, "wps_std": statistics.stdev(wps_seed) if len(wps_seed) > 1 else 0.0,
            "wps_per_seed": wps_seed, "speed_vs_reference": S.model_speed(norms, m.key),
            "valid_ppl": statistics.mean(ppl_seed) if ppl_seed else None,
            "valid_ppl_std": statistics.stdev(ppl_seed) if len(ppl_seed) > 1 else 0.0,
            "valid_ppl_per_seed": ppl_seed, "seeds": [r["seed"] for _, r in rs],
            "flops_per_token": m.train_flops_per_token, "fwd_flops_per_seq": m.fwd_flops_per_seq,
            "mfu": wps * m.train_flops_per_token / peak["total"] if wps and peak else None,
            "executed_flops_per_token": m.executed_train_flops_per_token,
            "mfu_executed": wps * m.executed_train_flops_per_token / peak["total"] if wps and peak else None,
            "breakdown": prof["breakdown"] if prof else None,
            "profiled_seconds_per_step": prof["seconds_per_step"] if prof else None,
            "top_ops": prof["top_ops_rank0"] if prof else None,
            "peak_mem_mb": max((max(r["peak_rss_mb"]) for _, r in rs if r.get("peak_rss_mb")), default=None),
            "curves": curves, "seconds": [r["seconds"] for _, r in rs], **extra,
        }
        if m.lr is not None:
            out[m.key]["lr"] = m.lr
    return out


def ratios(results: dict, norms: dict, reference: str = REFERENCE) -> dict:
    """The comparisons the paper makes (Table 4) and the anchors' checks, each from runs adjacent in time
    (speed_ratio: median, range lo..hi, pairs); `*_unpaired` are the plain ratios of mean words/s."""
    def r(a, b):
        v = S.speed_ratio(norms, a, b) if a in results and b in results else None
        return v["ratio"] if v else None

    def plain(a, b):
        wa, wb = results.get(a, {}).get("wps"), results.get(b, {}).get("wps")
        return wa / wb if wa and wb else None

    others = [k for k in results if k != reference]
    out = {"reference": reference, "smlp_det_wps_over": {k: r(reference, k) for k in others},
           "smlp_det_wps_over_range": {k: S.speed_ratio(norms, reference, k) for k in others},
           "smlp_det_wps_over_unpaired": {k: plain(reference, k) for k in others}}
    moe = [k for k in MOE_BASELINES if k in results and results[k]["wps"]]
    if moe and reference in results:
        fastest = max(moe, key=lambda k: results[k].get("speed_vs_reference") or results[k]["wps"])
        best = min(moe, key=lambda k: results[k]["valid_ppl"] or float("inf"))
        out.update(fastest_moe_baseline=fastest, smlp_det_over_fastest_moe=r(reference, fastest),
                   smlp_det_over_fastest_moe_range=S.speed_ratio(norms, reference, fastest),
                   best_moe_baseline_ppl=best, smlp_det_ppl_minus_best_moe=(results[reference]["valid_ppl"] or 0)
                   - (results[best]["valid_ppl"] or 0))
    out["transformer_over_fairseq"] = r("transformer", "fairseq_transformer_lm")
    out["base_over_fairseq_base_layers"] = r("base", "fairseq_base_layers")
    if "base" in results and "fairseq_base_layers" in results and out["base_over_fairseq_base_layers"]:
        out["base_over_fairseq_base_layers_flop_rate"] = out["base_over_fairseq_base_layers"] * \
            results["base"]["flops_per_token"] / results["fairseq_base_layers"]["flops_per_token"]
    return out


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
        rr, b = rat["smlp_det_wps_over_range"].get(key), m["breakdown"]
        comm, wps, ppl, speed, mfu, mfu_executed, mem = (
            f"{routing_and_all2all(b):.1%}" if b else "-",
            f"{m['wps']:,.0f} ± {m['wps_std']:,.0f}" if m["wps"] else "-",
            f"{m['valid_ppl']:.1f} ± {m['valid_ppl_std']:.1f}" if m["valid_ppl"] else "-",
            f"{rr['ratio']:.2f}x [{rr['lo']:.2f}-{rr['hi']:.2f}]" if rr else "-",
            f"{m['mfu']:.1%}" if m["mfu"] else "-", f"{m['mfu_executed']:.1%}" if m.get("mfu_executed") else "-",
            f"{m['peak_mem_mb']:.0f} MB" if m["peak_mem_mb"] else "-")
        lines.append(f"| {m['name']} | {m['layers']} | {m['flops_per_token'] / 1e9:.4f} | {wps} | {speed} | {ppl} "
                     f"| {mfu} | {mfu_executed} | {comm} | {mem} |")
    return "\n".join(lines)


def geo_cell(vals) -> str:
    """Per-seed perplexities as a table shows them: their geometric mean, then the seeds when there are several."""
    if not vals:
        return "-"
    return f"{math.exp(statistics.mean(math.log(v) for v in vals)):.1f}" + (
        f" ({', '.join(f'{v:.1f}' for v in vals)})" if len(vals) > 1 else "")


def perplexity_table(results: dict, plan: dict, complete: bool = True) -> str:
    """A perplexity-only table (the fair comparison's stages, whose runs share the machine: no speed): per model the
    geometric mean over its seeds, the seeds, their spread, and the same on the positions sMLP-partial predicts."""
    s, t = plan["settings"], plan["settings"]["target"]
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
        lines.append(f"| {m['name']} | {m['layers']} | {lr} | {geo_cell(vals)} | {spread} | "
                     f"{geo_cell(m.get('valid_suffix_ppl_per_seed'))} |")
    return "\n".join(lines)


def fmt(value) -> str:
    """A measured figure (a ratio, a share, a perplexity gap) as the tables show it; "-" when missing."""
    return "-" if value is None else f"{value:.2f}" if abs(value) >= 2 or value < 0 else f"{value:.3f}"


def report(store: RunStore, out_dir: Path, *, machine: dict | None = None, quiet: bool = False) -> dict:
    """results.json, table.md and the figure from the recorded runs (complete or not)."""
    plan = store.plan
    peaks = store.extra.get("peaks") or []
    # the highest of the peaks measured at each start: the least loaded one
    peak = {"total": max(p["total"] for p in peaks), "measurements": peaks} if peaks else None
    machine = machine or store.extra.get("machine") or machine_info()
    results = summarise(store, models_from_plan(plan), peak)
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
              "nproc": plan["nproc"], "seconds": round(sum(r.get("seconds", 0.0) for r in store.records.values()), 1)}
    record["analysis"] = analyse_curves(results)
    if plan["name"].startswith("fair/"):  # perplexity only; benchmarks/fair_report.py decides what it says
        record["table_md"] = perplexity_table(results, plan, complete)
    else:
        record["table_md"] = table(results, rat, peak, machine, plan, complete)
        record["targets"] = targets(record)
        record["verdicts"] = {k: verdict(results, record["analysis"], k) for k in ("smlp_det", "smlp_partial")
                              if k in results}
    atomic_write_json(out_dir / "results.json", record)
    write_text(out_dir / "table.md", record["table_md"] + "\n")
    if any(m["curves"] for m in results.values()):
        plot(results, out_dir / "figure5.png",
             f"{plan['name']}: FLOP-matched models on the demo corpus (in the manner of sMLP Figure 5)")
    if not quiet:
        print(record["table_md"])
    return record


LABELS = {"updates": "updates", "tokens": "tokens read", "time": "training time at the median load (s)",
          "wall": "wall time (s)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict, path: Path, title: str, xkeys=("tokens", "time")) -> Path:
    """One panel per x axis (`xkeys`: tokens, time, updates or wall) of the models in `results`; PNG at `path`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(xkeys), figsize=(6 * len(xkeys), 4.5))
    axes = list(axes) if len(xkeys) > 1 else [axes]
    for i, (key, m) in enumerate(results.items()):
        style = "-" if key.startswith("smlp") else ("--" if key.startswith("fairseq") else "-.")
        for ax, xkey in zip(axes, xkeys):
            curves = [c for c in m["curves"] if c["ppl"] and c.get(xkey)]
            if not curves:
                continue
            xs, ys = mean_curve(curves, xkey)
            line, = ax.plot(xs, ys, style, marker="o", ms=2.5, label=m["name"], color=plt.get_cmap("tab10")(i % 10),
                            lw=2.2 if key == REFERENCE else 1.2)
            if len(curves) > 1:
                ax.fill_between(xs, [min(c["ppl"][j] for c in curves) for j in range(len(xs))],
                                [max(c["ppl"][j] for c in curves) for j in range(len(xs))], color=line.get_color(),
                                alpha=0.15)
    for ax, xkey in zip(axes, xkeys):
        ax.set(xlabel=LABELS[xkey], ylabel="validation perplexity", yscale="log")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    write_figure(path, fig, dpi=80)
    plt.close(fig)
    return path


@contextlib.contextmanager
def png_axes(path: Path, title: str, xlabel: str, ylabel: str, *, figsize=(6, 4.5), log2x: bool = False,
             logy: bool = False, legend_size: int = 8) -> Iterator:
    """One set of axes that is labelled, gridded, given its legend and written to `path` (PNG) after the block."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        if log2x:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
        fig.tight_layout()
        write_figure(path, fig, dpi=80)
    finally:
        plt.close(fig)
