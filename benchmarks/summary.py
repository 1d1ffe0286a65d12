"""Per-model figures from the recorded runs: words/s, perplexity, curves, MFU, and the paired speed ratios.

Time axis: a run's load-corrected training time = tokens / (its words/s over its adjacent probes'
x the median probe words/s of the benchmark): the time it would have taken at the benchmark's
median load, without validation. fairseq's own wall time is kept in the JSON too.

Words/s: the figure per run is the median over its clean log intervals (benchmarks/training.py), the
figure per model the mean over seeds (spread: standard deviation).

MFU = words/s x training FLOPs per token / peak, with training FLOPs = 3 x the calculator's
forward FLOPs (the backward pass costs twice the forward), the paper's FLOPs convention (full
T x T spatial and attention products); "MFU (executed)" counts the causal products as they run,
without their zero triangle (`smlp_eval.flops.executed_macs`).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from . import schedule as S
from .presets import MOE_BASELINES, REFERENCE, Model
from .training import final_ppl

# validation perplexities besides `ppl` that runs may log (fairseq_plugins/criterion.py): on the positions
# sMLP-partial scores, and with balanced routers assigning as in training
EXTRA_METRICS = ("suffix_ppl", "trained_routing_ppl", "greedy_routing_ppl")


def greedy_max_load(record: dict) -> float | None:
    """The busiest expert's load over the mean, the largest over a run's balanced layers, at its last validation
    with greedy routing (`load_greedy_<layer>`, --valid-greedy-routing); None when not logged."""
    last = record["valid"][-1] if record.get("valid") else {}
    loads = [float(v) for k, v in last.items() if k.startswith("load_greedy_")]
    return max(loads) if loads else None


def _runs_of(store: S.RunStore, key: str) -> list[tuple[S.Slot, dict]]:
    return [(s, store.records[s.run_id]) for s in store.slots
            if s.kind == S.TRAIN and s.key == key and s.run_id in store.records]


def speeds(store: S.RunStore) -> dict:
    """Normalized speeds of every recorded training run (benchmarks/schedule.py)."""
    wps = {rid: r["wps"] for rid, r in store.records.items() if r.get("wps")}
    return S.normalized_speeds(store.slots, wps)


def probe_median(store: S.RunStore) -> float | None:
    w = [r["wps"] for r in store.records.values() if r["kind"] == S.PROBE and r.get("wps")]
    return statistics.median(w) if w else None


def summarise(store: S.RunStore, models: Sequence[Model], peak: dict | None) -> dict:
    settings = store.plan["settings"]
    norms = speeds(store)
    meter = probe_median(store)
    out = {}
    for m in models:
        rs = _runs_of(store, m.key)
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
        extra = {}
        greedy = [v for v in (greedy_max_load(r) for _, r in rs) if v is not None]
        if greedy:
            extra["greedy_max_load"] = statistics.mean(greedy)
        for metric in EXTRA_METRICS:
            finals = [final_ppl(r, metric) for _, r in rs if final_ppl(r, metric) is not None]
            if finals:
                extra[f"valid_{metric}"] = statistics.mean(finals)
                extra[f"valid_{metric}_per_seed"] = finals
        out[m.key] = {
            "name": m.title, "layers": m.layers, "fairseq_flags": " ".join(m.flags), "note": m.note,
            "wps": wps, "wps_std": statistics.stdev(wps_seed) if len(wps_seed) > 1 else 0.0,
            "wps_per_seed": wps_seed,
            "speed_vs_reference": S.model_speed(norms, m.key),
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
    """The comparisons the paper makes (Table 4) and the anchors' checks, each from runs adjacent in
    time (speed_ratio: median, range lo..hi, pairs); `*_unpaired` are the plain ratios of mean words/s."""
    def r(a, b):
        v = S.speed_ratio(norms, a, b) if a in results and b in results else None
        return v["ratio"] if v else None

    def plain(a, b):
        return results[a]["wps"] / results[b]["wps"] if a in results and b in results and results[b]["wps"] \
            and results[a]["wps"] else None

    out = {"reference": reference,
           "smlp_det_wps_over": {k: r(reference, k) for k in results if k != reference},
           "smlp_det_wps_over_range": {k: S.speed_ratio(norms, reference, k) for k in results if k != reference},
           "smlp_det_wps_over_unpaired": {k: plain(reference, k) for k in results if k != reference}}
    moe = [k for k in MOE_BASELINES if k in results and results[k]["wps"]]
    if moe and reference in results:
        fastest = max(moe, key=lambda k: results[k].get("speed_vs_reference") or results[k]["wps"])
        best = min(moe, key=lambda k: results[k]["valid_ppl"] or float("inf"))
        out["fastest_moe_baseline"] = fastest
        out["smlp_det_over_fastest_moe"] = r(reference, fastest)
        out["smlp_det_over_fastest_moe_range"] = S.speed_ratio(norms, reference, fastest)
        out["best_moe_baseline_ppl"] = best
        out["smlp_det_ppl_minus_best_moe"] = (results[reference]["valid_ppl"] or 0) - (results[best]["valid_ppl"] or 0)
    out["transformer_over_fairseq"] = r("transformer", "fairseq_transformer_lm")
    out["base_over_fairseq_base_layers"] = r("base", "fairseq_base_layers")
    if "base" in results and "fairseq_base_layers" in results and out["base_over_fairseq_base_layers"]:
        out["base_over_fairseq_base_layers_flop_rate"] = out["base_over_fairseq_base_layers"] * \
            results["base"]["flops_per_token"] / results["fairseq_base_layers"]["flops_per_token"]
    return out
