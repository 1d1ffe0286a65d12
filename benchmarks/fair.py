"""The deciding benchmark: does sMLP beat Transformer-MoE at matched FLOPs, in a fair fight? (issue 29)

    smlp-bench --fair [--output-dir results/fair] [--resume] [--stages lr-sweep,deciding,...]

Every family FLOP-matched to sMLP-deterministic (9 dense + 3 sparse blocks, D=128, F=512, T=128, the
long preset's shape) with what MoE research uses and what makes a comparison fair:

- experts: 8 per sparse layer (4 local experts per rank on 2 ranks, through the batched local
  experts), not one per rank: at 2 experts GShard's top-2 sends every token to both and the sparse
  layers add nothing (the E=2 records in docs/benchmark/long/ show Switch, GShard and Base Layers
  beside the dense Transformer);
- attention heads of the paper's width: head dimension 64 (heads = D / 64), as the paper's 16 heads
  at D=1024;
- a learning rate per family, from a sweep (stage 1);
- two seeds of every family, and one rule for every verdict (benchmarks/verdicts.py SEED_RULE: the
  difference of mean log perplexity against twice its standard error from the pooled seed spread);
- the same positions: every run also logs its validation perplexity on the positions sMLP-partial
  predicts (after its 20% routing prefix: `--valid-suffix-from`), and sMLP-partial is compared on those;
- evaluation routing: Base Layers and sMLP route greedily at evaluation (fairseq's BaseLayer does),
  while training assigns with exact balance; every run also logs its validation perplexity with the
  training-time assignment (`--valid-trained-routing`), and the verdicts are given both ways.

Stages, each its own interleaved, resumable run store (benchmarks/schedule.py) in OUTPUT_DIR/STAGE/,
planned from the stages before it (a stopped benchmark continues with --resume, run by run):

1. lr-sweep   every family at 1e-3, 2e-3 and 4e-3 (a factor 2 apart, the earlier benchmark's 2e-3 in the
              middle), 200 updates (0.82M tokens), one seed. A family whose best rate is at an edge of
              those tried gets the next rate beyond it, at most twice (`WIDEN`).
2. deciding   every family at its best rate, seeds 1 and 2, 500 updates (2.05M tokens).
3. width      sMLP-det, gMLP and the best Transformer-MoE of stage 2 at D=256 (F=1024; everything else
              as stage 2: T, tokens per update, tokens, warmup, their rates), seeds 1 and 2. With stage 2's
              D=128 runs: does sMLP's gap to the best Transformer-MoE hold, shrink or grow with width?
4. experts    sMLP-det and the best Transformer-MoE with 2 and 32 experts (8 in stage 2), one seed.
5. table7     the token-routed gMLP (sMLP Appendix A, Table 7) with 1, 8 and 32 experts, gMLP's rate.
6. figure4    Figure 4's dense models at gMLP's and the Transformer's rates: the Transformer with head
              dimension 128, 64, 32, 16 and 8 (1 to 16 heads at D=128), gMLP with 1, 4 and 16 SGU heads,
              and sMLP-det.

Why these token budgets. On the long record at E=2 (docs/benchmark/long/results.json, 15 validation
points to 3.07M tokens), every pair of models whose final perplexities differ by more than 2% is in its
final order from the first validation point (205k tokens) on, except the pairs with NiNformer, whose
curve flattens after a fast start and crosses five others between 1.2M and 2.3M tokens (`budget_check`
recomputes this from the record). The deciding runs stop at 2.05M tokens (500 updates): by then the three
best of the long record were in their final order (from 1.43M), and it leaves time for two seeds of
every family, a second width and the expert sweep (about 6 hours here in all). The sweep stops at 0.82M
tokens (200 updates), four validation points, where every clearly separated pair but NiNformer's was
already in its final order; a rate whose curve flattens like NiNformer's would be caught by the deciding
runs, whose rates the report shows beside their sweep. NiNformer is left out of the deciding families:
it is dense, its ranking needs the full budget, and the question is sMLP against Transformer-MoE.

The report (OUTPUT_DIR/results.json, lr_sweep.png, figure5.png, width.png, experts.png) holds, per
family, the chosen rate, the final perplexity with its seeds, both scorings, the verdicts with their rule,
the expert-count and width trends, and the claims it answers (`smlp-bench --publish` puts them in
docs/benchmarks.md and README).
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from . import schedule as S
from .plan import run_schedule
from .plots import png_axes
from .presets import LONG_TARGET, MOE_BASELINES, NAMES, BenchError, Model, plan_models, target_flags
from .report import report
from .schedule import atomic_write_json
from .verdicts import SEED_RULE, compare, describe, pooled_log_sd

FAIR_TARGET = dict(LONG_TARGET, experts=8)
WIDE_TARGET = dict(FAIR_TARGET, d_model=256, d_ffn=1024)
FAMILIES = ("smlp_det", "smlp_partial", "gmlp", "transformer", *MOE_BASELINES)
RATES = (1e-3, 2e-3, 4e-3)
WIDEN = 2                      # at most this many rates added beyond an edge of the sweep
RATE_BOUNDS = (1.25e-4, 3.2e-2)  # never beyond these
EXPERT_SWEEP = (2, 32)
COMMON = dict(batch_size=16, log_interval=10, validate_every=50, valid_steps=10, warmup=50, lr=2e-3,
              probe_updates=20)
STAGE_SETTINGS = {
    "lr-sweep": dict(COMMON, seeds=1, updates=200, profile_steps=0),
    "deciding": dict(COMMON, seeds=2, updates=500, profile_steps=3),
    "width": dict(COMMON, seeds=2, updates=500, profile_steps=0),
    "experts": dict(COMMON, seeds=1, updates=500, profile_steps=0),
    "table7": dict(COMMON, seeds=1, updates=150, validate_every=25, warmup=25, profile_steps=0),
    "figure4": dict(COMMON, seeds=1, updates=150, validate_every=25, warmup=25, profile_steps=0),
    "figure7": dict(COMMON, seeds=1, updates=150, validate_every=25, warmup=25, profile_steps=0),
}
STAGES = tuple(STAGE_SETTINGS)


@dataclass
class Context:
    """What a stage is planned from: the vocabulary, the ranks, and the finished stages' records."""

    vocab_size: int
    nproc: int
    records: dict  # stage name -> its results.json record

    def rate(self, family: str) -> float:
        return self.records["lr-sweep"]["fair"]["rates"][family]["chosen"]

    def best_moe(self) -> str:
        return self.records["deciding"]["fair"]["best_moe"]


def criterion_flags(target: dict, vocab_size: int, nproc: int) -> list[str]:
    """Every run also scores the positions sMLP-partial predicts and its balanced routers' training assignment."""
    from smlp_eval import flops as F

    flags = [*target_flags(target, nproc)[2:], "--smoe-routing", "partial"]
    start = F.parse_model("smlp_lm", flags, vocab_size=vocab_size).cfg.prediction_start
    return ["--valid-suffix-from", str(start), "--valid-trained-routing"]


def _matched(ctx: Context, target: dict, keys: Sequence[str]) -> dict[str, Model]:
    return dict(_plan(ctx.vocab_size, ctx.nproc, tuple(keys), json.dumps(target, sort_keys=True)))


@functools.lru_cache(maxsize=32)
def _plan(vocab_size: int, nproc: int, keys: tuple[str, ...], target: str) -> tuple[tuple[str, Model], ...]:
    """The FLOP-matched models of a target, planned once per process (every stage asks again; Models are
    only ever copied with `replace`)."""
    models, _ = plan_models(vocab_size, nproc, keys, json.loads(target))
    return tuple((m.key, m) for m in models)


def _at_rate(m: Model, lr: float, key: str | None = None, name: str | None = None) -> Model:
    return replace(m, key=key or m.key, lr=lr, name=name or m.title)


def _rate_key(family: str, lr: float) -> str:
    return f"{family}@lr{lr:g}"


# ---------------------------------------------------------------- the stages' models


def sweep_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, FAMILIES)
    return [_at_rate(base[f], lr, _rate_key(f, lr), f"{NAMES[f]}, lr {lr:g}") for f in FAMILIES for lr in RATES]


def deciding_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, FAMILIES)
    return [_at_rate(base[f], ctx.rate(f)) for f in FAMILIES]


def width_models(ctx: Context) -> list[Model]:
    keys = ("smlp_det", "gmlp", ctx.best_moe())
    base = _matched(ctx, WIDE_TARGET, keys)
    return [_at_rate(base[k], ctx.rate(k), name=f"{NAMES[k]}, D={WIDE_TARGET['d_model']}") for k in keys]


def expert_models(ctx: Context) -> list[Model]:
    out = []
    for experts in EXPERT_SWEEP:
        target = dict(FAIR_TARGET, experts=experts)
        for k in ("smlp_det", ctx.best_moe()):
            m = _matched(ctx, target, (k,))[k]
            out.append(_at_rate(m, ctx.rate(k), f"{k}_e{experts}", f"{NAMES[k]}, {experts} experts"))
    return out


def _experiment_models(name: str, families: dict[str, str]) -> Callable[[Context], list[Model]]:
    """An experiment of benchmarks/experiments.py with each model at its family's rate (families: key prefix ->
    family)."""
    def build(ctx: Context) -> list[Model]:
        from .experiments import get_experiment

        models, _ = get_experiment(name).plan_models(ctx.vocab_size, ctx.nproc, FAIR_TARGET)
        out = []
        for m in models:
            family = next(f for prefix, f in families.items() if m.key.startswith(prefix))
            out.append(_at_rate(m, ctx.rate(family)))
        return out
    return build


BUILDERS: dict[str, Callable[[Context], list[Model]]] = {
    "lr-sweep": sweep_models,
    "deciding": deciding_models,
    "width": width_models,
    "experts": expert_models,
    "table7": _experiment_models("table7-token-routed-gmlp", {"gmlp": "gmlp"}),
    "figure4": _experiment_models("figure4-dense", {"gmlp": "gmlp", "transformer": "transformer",
                                                    "smlp_det": "smlp_det"}),
    "figure7": _experiment_models("figure7-routing", {"smlp_det": "smlp_det", "smlp_partial": "smlp_partial",
                                                      "smlp_leaky": "smlp_det"}),
}
TARGETS = {"lr-sweep": FAIR_TARGET, "deciding": FAIR_TARGET, "width": WIDE_TARGET, "experts": FAIR_TARGET,
           "table7": FAIR_TARGET, "figure4": FAIR_TARGET, "figure7": FAIR_TARGET}
# the stages that are one of the paper's experiments (benchmarks/experiments.py), by their experiment name
EXPERIMENT_STAGES = {"table7": "table7-token-routed-gmlp", "figure4": "figure4-dense", "figure7": "figure7-routing"}


# ---------------------------------------------------------------- the sweep: choose, widen


def rates_tried(record: dict) -> dict[str, dict[float, float]]:
    """family -> {rate: final validation perplexity} of a sweep record."""
    out: dict[str, dict[float, float]] = {}
    for key, m in record["models"].items():
        family, _, _ = key.partition("@lr")
        if m.get("valid_ppl") is not None:
            out.setdefault(family, {})[m["lr"]] = m["valid_ppl"]
    return out


def choose_rates(tried: dict[str, dict[float, float]], widened: dict[str, int]) -> dict[str, dict]:
    """Per family the best rate, and the next rate to try when the best is at an edge of those tried
    (beyond it by a factor 2; not past RATE_BOUNDS, not more than WIDEN times)."""
    out = {}
    for family, by_rate in tried.items():
        rates = sorted(by_rate)
        best = min(rates, key=lambda r: by_rate[r])
        nxt = None
        if widened.get(family, 0) < WIDEN and len(rates) >= 2:
            if best == rates[0] and rates[0] / 2 >= RATE_BOUNDS[0]:
                nxt = rates[0] / 2
            elif best == rates[-1] and rates[-1] * 2 <= RATE_BOUNDS[1]:
                nxt = rates[-1] * 2
        at_edge = best in (rates[0], rates[-1])
        out[family] = {"tried": {f"{r:g}": by_rate[r] for r in rates}, "chosen": best, "next": nxt,
                       "bracketed": not at_edge, "widened": widened.get(family, 0)}
    return out


def widen_sweep(store: S.RunStore, ctx: Context, record: dict) -> list[Model]:
    """Append the sweep's next rates (one new phase) to the store; returns the models added."""
    widened = store.extra.setdefault("widened", {})
    choice = choose_rates(rates_tried(record), widened)
    base = _matched(ctx, FAIR_TARGET, FAMILIES)
    added = []
    for family, c in choice.items():
        if c["next"] is not None:
            added.append(_at_rate(base[family], c["next"], _rate_key(family, c["next"]),
                                  f"{NAMES[family]}, lr {c['next']:g}"))
            widened[family] = widened.get(family, 0) + 1
    if added:
        phase = max(s.phase for s in store.slots) + 1
        first_round = max(s.round for s in store.slots) + 1
        rounds = S.seed_rounds([m.key for m in added], [1], store.plan["order_seed"], phase=phase,
                               first_round=first_round)
        store.slots = S.extend_schedule(store.slots, rounds, store.plan["reference"])
        store.plan["models"].extend(m.as_dict() for m in added)
        store.extra.setdefault("added_models", []).extend(m.key for m in added)
        store.save()
    return added


# ---------------------------------------------------------------- running the stages


def run_stage(stage: str, ctx: Context, data: Path, out_dir: Path, *, order_seed: int = 1) -> dict:
    """Train one stage (resuming where it stopped) and return its report record with the stage's analysis."""
    models = BUILDERS[stage](ctx)
    settings = dict(STAGE_SETTINGS[stage], target=TARGETS[stage],
                    criterion_flags=criterion_flags(TARGETS[stage], ctx.vocab_size, ctx.nproc))
    settings["models"] = tuple(m.key for m in models)
    reference = models[0].key
    out_dir.mkdir(parents=True, exist_ok=True)
    resume = (out_dir / "runs.json").exists()  # main() asked for --resume before continuing a started benchmark
    while True:
        store = run_schedule(f"fair/{stage}", settings, models, {"stage": stage}, data, ctx.nproc, out_dir,
                             resume=resume, order_seed=order_seed, reference=reference)
        record = report(store, out_dir, quiet=True)
        added = widen_sweep(store, ctx, record) if stage == "lr-sweep" else []
        if not added:
            break
        print(f"   widening the sweep: {', '.join(m.key for m in added)}", flush=True)
        resume = True
    record["fair"] = analyse_stage(stage, record, store)
    if stage in EXPERIMENT_STAGES:
        from .experiments import get_experiment

        record["plan_experiment"] = EXPERIMENT_STAGES[stage]
        return get_experiment(EXPERIMENT_STAGES[stage]).finish(
            record, out_dir, seed_spread=ctx.records["deciding"]["fair"]["seed_spread"])
    atomic_write_json(out_dir / "results.json", record)
    return record


def analyse_stage(stage: str, record: dict, store: S.RunStore) -> dict:
    res = record["models"]
    if stage == "lr-sweep":
        choice = choose_rates(rates_tried(record), store.extra.get("widened", {}))
        return {"rates": choice}
    groups = [m["valid_ppl_per_seed"] for m in res.values()]
    spread = pooled_log_sd(groups)
    out = {"seed_spread": spread, "rule": SEED_RULE}
    if stage == "deciding":
        moe = [k for k in MOE_BASELINES if k in res and res[k]["valid_ppl"]]
        if moe:
            out["best_moe"] = min(moe, key=lambda k: res[k]["valid_ppl"])
    return out


def budget_check(long_record: dict, band: float = 0.02) -> dict:
    """On the long record: from which validation point on is every pair of models whose final perplexities
    differ by more than `band` in its final order (all pairs, and all pairs without NiNformer)?"""
    curves = long_record["analysis"]["mean_curves"]["tokens"]
    keys = list(curves)
    xs = curves[keys[0]]["x"]
    final = {k: curves[k]["ppl"][-1] for k in keys}
    pairs = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if abs(math.log(final[a] / final[b])) > band]

    def wrong_at(i, subset):
        return [(a, b) for a, b in subset if (curves[a]["ppl"][i] - curves[b]["ppl"][i]) * (final[a] - final[b]) <= 0]

    def settled(subset):
        first = len(xs) - 1
        for i in range(len(xs) - 1, -1, -1):
            if wrong_at(i, subset):
                break
            first = i
        return xs[first]

    without = [(a, b) for a, b in pairs if "ninformer" not in (a, b)]
    return {"band": band, "pairs": len(pairs), "tokens": xs, "settled_all": settled(pairs),
            "settled_without_ninformer": settled(without),
            "wrong_at_first_point": [list(p) for p in wrong_at(0, pairs)]}


# ---------------------------------------------------------------- the comparison's answers


def _seeds(res: dict, key: str, metric: str = "ppl") -> list[float]:
    m = res.get(key) or {}
    return list(m.get("valid_ppl_per_seed" if metric == "ppl" else f"valid_{metric}_per_seed") or [])


def verdicts(deciding: dict) -> dict:
    """sMLP-det and sMLP-partial against the best Transformer-MoE and against gMLP, by the one rule, on all
    positions and on sMLP-partial's positions, with greedy and with training-time routing at evaluation."""
    res = deciding["models"]
    out = {"rule": SEED_RULE, "comparisons": []}
    for metric, label in (("ppl", "all positions"), ("suffix_ppl", "positions after the routing prefix"),
                          ("trained_routing_ppl", "balanced routers with their training-time assignment")):
        groups = [_seeds(res, k, metric) for k in res]
        spread = pooled_log_sd(g for g in groups if g)
        moe = [k for k in MOE_BASELINES if _seeds(res, k, metric)]
        if not moe:
            continue
        best = min(moe, key=lambda k: statistics.mean(_seeds(res, k, metric)))
        for key in ("smlp_det", "smlp_partial"):
            if key == "smlp_partial" and metric != "suffix_ppl":
                continue  # partial prediction scores only the positions after its prefix
            for other in (best, "gmlp"):
                a, b = _seeds(res, key, metric), _seeds(res, other, metric)
                if not a or not b:
                    continue
                c = compare(a, b, spread["sd"] if spread else None)
                out["comparisons"].append({"model": key, "against": other, "metric": metric, "scored": label,
                                           "best_moe": best, **c, "seed_spread": spread,
                                           "text": describe(c, NAMES[key], NAMES[other])})
    out["equal_time"] = equal_time(deciding)
    return out


def equal_time(record: dict) -> list[dict]:
    """sMLP-det against each Transformer-MoE at equal load-corrected training time, each seed on its own time
    axis; undecided unless both sides have two seeds (the seeds' times carry the load correction's noise)."""
    from .verdicts import ppl_at

    res = record["models"]
    out = []
    for other in MOE_BASELINES:
        if "smlp_det" not in res or other not in res:
            continue
        curves = [c for k in ("smlp_det", other) for c in res[k]["curves"] if c.get("time")]
        if not curves:
            continue
        t = min(c["time"][-1] for c in curves)
        a = [ppl_at(c["time"], c["ppl"], t) for c in res["smlp_det"]["curves"] if c.get("time")]
        b = [ppl_at(c["time"], c["ppl"], t) for c in res[other]["curves"] if c.get("time")]
        a, b = [v for v in a if v], [v for v in b if v]
        if len(a) < 2 or len(b) < 2:
            out.append({"against": other, "seconds": t, "verdict": "undecided",
                        "text": f"at equal time ({t / 60:.1f} min): undecided (fewer than two seeds on a side)"})
            continue
        spread = pooled_log_sd([a, b])
        c = compare(a, b, spread["sd"] if spread else None)
        out.append({"against": other, "seconds": t, **c,
                    "text": f"at equal time ({t / 60:.1f} min at the median load): "
                            + describe(c, NAMES["smlp_det"], NAMES[other])})
    return out


def width_trend(deciding: dict, width: dict) -> dict:
    """sMLP-det's gap (log perplexity) to the best Transformer-MoE and to gMLP at D=128 and D=256, with its
    standard error from the seed spread pooled over both widths."""
    best = deciding["fair"]["best_moe"]
    points = []
    for d_model, rec in ((FAIR_TARGET["d_model"], deciding), (WIDE_TARGET["d_model"], width)):
        res = rec["models"]
        spread = pooled_log_sd(m["valid_ppl_per_seed"] for m in res.values())
        row = {"d_model": d_model}
        for other in (best, "gmlp"):
            a, b = _seeds(res, "smlp_det"), _seeds(res, other)
            if a and b:
                row[other] = compare(a, b, spread["sd"] if spread else None)
        points.append(row)
    trend = None
    if all(best in p for p in points):
        d0, d1 = points[0][best], points[1][best]
        change = d1["log_diff"] - d0["log_diff"]
        se = math.hypot(d0["se"] or 0.0, d1["se"] or 0.0) if d0["se"] and d1["se"] else None
        if se is None:
            trend = "undecided"
        elif abs(change) <= 2 * se:
            trend = "holds"
        else:  # a gap that moves towards 0 shrinks, one that moves away grows
            trend = "shrinks" if abs(d1["log_diff"]) < abs(d0["log_diff"]) else "grows"
        trend = {"change": change, "se": se, "answer": trend, "against": best}
    return {"points": points, "trend": trend, "best_moe": best}


def expert_trend(deciding: dict, experts: dict) -> dict:
    """Final perplexity against the expert count for sMLP-det and the best Transformer-MoE, and sMLP-det's gap."""
    best = deciding["fair"]["best_moe"]
    spread = deciding["fair"]["seed_spread"]
    sd = spread["sd"] if spread else None
    rows = []
    for k in ("smlp_det", best):
        by_e = {FAIR_TARGET["experts"]: _seeds(deciding["models"], k)}
        for e in EXPERT_SWEEP:
            by_e[e] = _seeds(experts["models"], f"{k}_e{e}")
        es = sorted(e for e in by_e if by_e[e])
        steps = [{"from": a, "to": b, **compare(by_e[b], by_e[a], sd)} for a, b in zip(es, es[1:])]
        rows.append({"model": k, "name": NAMES[k], "ppl": {e: statistics.mean(by_e[e]) for e in es},
                     "steps": steps,
                     "better_with_experts": all(s["verdict"] == "better" for s in steps) if steps else None})
    gaps = {}
    for e in sorted({*EXPERT_SWEEP, FAIR_TARGET["experts"]}):
        src = deciding["models"] if e == FAIR_TARGET["experts"] else experts["models"]
        suffix = "" if e == FAIR_TARGET["experts"] else f"_e{e}"
        a, b = _seeds(src, f"smlp_det{suffix}"), _seeds(src, f"{best}{suffix}")
        if a and b:
            gaps[e] = compare(a, b, sd)
    return {"rows": rows, "gaps": gaps, "best_moe": best, "seed_spread": spread}


# ---------------------------------------------------------------- the report


def final_report(records: dict, out_dir: Path, long_record: dict | None) -> dict:
    """OUTPUT_DIR/results.json and its figures from the stages finished so far."""
    rec = {"kind": "fair", "stages": {k: f"{k}/results.json" for k in records}, "rule": SEED_RULE,
           "complete": all(k in records and records[k].get("complete") for k in STAGES),
           "target": FAIR_TARGET, "wide_target": WIDE_TARGET, "settings": STAGE_SETTINGS}
    if long_record is not None:
        rec["budget_check"] = budget_check(long_record)
    if "lr-sweep" in records:
        rec["rates"] = records["lr-sweep"]["fair"]["rates"]
        plot_sweep(rec["rates"], out_dir / "lr_sweep.png")
    if "deciding" in records:
        d = records["deciding"]
        rec["families"] = {k: {"name": m["name"], "layers": m["layers"], "lr": m.get("lr"),
                               "valid_ppl": m["valid_ppl"], "valid_ppl_per_seed": m["valid_ppl_per_seed"],
                               "valid_suffix_ppl_per_seed": m.get("valid_suffix_ppl_per_seed"),
                               "valid_trained_routing_ppl_per_seed": m.get("valid_trained_routing_ppl_per_seed"),
                               "wps": m["wps"], "speed_vs_reference": m.get("speed_vs_reference")}
                           for k, m in d["models"].items()}
        rec["best_moe"] = d["fair"].get("best_moe")
        rec["seed_spread"] = d["fair"]["seed_spread"]
        rec["verdicts"] = verdicts(d)
        rec["ratios"] = d["ratios"]
    if "deciding" in records:
        rec["table4"] = rec["stages"]["table4"] = table4_stage(records["deciding"], out_dir / "table4")
    if "deciding" in records and "width" in records:
        rec["width"] = width_trend(records["deciding"], records["width"])
        plot_width(rec["width"], out_dir / "width.png")
    if "deciding" in records and "experts" in records:
        rec["experts"] = expert_trend(records["deciding"], records["experts"])
        plot_experts(rec["experts"], out_dir / "experts.png")
    atomic_write_json(out_dir / "results.json", rec)
    return rec


def table4_stage(deciding: dict, out_dir: Path) -> str:
    """Table 4 from the deciding comparison's speeds (runs adjacent in time) and the step-time model:
    OUTPUT_DIR/table4/results.json, an experiment record (`table4-speed`) of the claims table."""
    from .experiments import EXPERIMENTS, plot_table4, table4_claims, table4_markdown, table4_record

    t4 = table4_record(deciding, _paper_step_rows())
    record = {"kind": "experiment", "experiment": "table4-speed", "title": EXPERIMENTS["table4-speed"].title,
              "complete": bool(deciding.get("complete")), "source": "the deciding comparison (smlp-bench --fair)",
              "table4": t4, "models": {}, "settings": deciding.get("settings"), "nproc": deciding.get("nproc")}
    record["claims"] = table4_claims(record)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "results.json", record)
    (out_dir / "table.md").write_text(table4_markdown(t4) + "\n")
    plot_table4(t4, out_dir / "figure.png")
    return "table4/results.json"


@functools.cache
def _paper_step_rows() -> list[dict] | None:
    """The step-time model's Table 4 (top) on the paper's 32 V100s (computed once: it does not depend on the runs)."""
    try:
        from smlp_eval.flops import table4
        from smlp_eval.flops.steptime import CLUSTERS

        return table4("top", CLUSTERS["v100-dgx1"])
    except Exception as exc:  # noqa: BLE001  the CPU ratios stand without the model
        print(f"   step-time model unavailable: {exc}")
        return None


def plot_sweep(rates: dict, path: Path) -> None:
    with png_axes(path, "learning-rate sweep per family (star: chosen)", "peak learning rate (inverse-sqrt schedule)",
                  "validation perplexity after the sweep's budget", figsize=(7, 4.5), log2x=True, logy=True,
                  legend_size=7) as ax:
        for family, c in rates.items():
            xs = sorted(float(r) for r in c["tried"])
            line, = ax.plot(xs, [c["tried"][f"{x:g}"] for x in xs], marker="o", label=NAMES.get(family, family))
            ax.plot([c["chosen"]], [c["tried"][f"{c['chosen']:g}"]], "*", ms=12, color=line.get_color())


def plot_width(width: dict, path: Path) -> None:
    with png_axes(path, "the gap against width (below 0: sMLP-det lower)", "model width D",
                  "sMLP-det's perplexity difference (%), ± 2 SE", log2x=True) as ax:
        for other, marker in ((width["best_moe"], "o"), ("gmlp", "s")):
            pts = [p for p in width["points"] if other in p]
            ax.errorbar([p["d_model"] for p in pts], [100 * (p[other]["ratio"] - 1) for p in pts],
                        yerr=[200 * (p[other]["se"] or 0) for p in pts], marker=marker, capsize=4,
                        label=f"sMLP-det vs {NAMES.get(other, other)}")
        ax.axhline(0, color="grey", lw=0.8)


def plot_experts(experts: dict, path: Path) -> None:
    sd = (experts["seed_spread"] or {}).get("sd", 0.0)
    with png_axes(path, "more experts: sMLP-det and the best Transformer-MoE", "experts per sparse layer",
                  "validation perplexity (± 2 seed SD)", log2x=True) as ax:
        for row in experts["rows"]:
            ppl = {int(e): v for e, v in row["ppl"].items()}  # int keys in memory, str in the JSON
            es = sorted(ppl)
            ys = [ppl[e] for e in es]
            ax.errorbar(es, ys, yerr=[2 * sd * y for y in ys], marker="o", capsize=4, label=row["name"])


def main(args, data: Path, vocab_size: int) -> int:
    """`smlp-bench --fair`: every stage in order (or those of --stages), each resumed where it stopped."""
    stages = list(STAGES) if not args.stages else [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise BenchError(f"--stages: unknown {', '.join(unknown)}; valid: {', '.join(STAGES)}")
    out = args.output_dir
    started = sorted(str(p.relative_to(out)) for p in out.glob("*/runs.json"))
    if started and not args.resume:
        raise BenchError(f"{out} holds a started benchmark ({', '.join(started)}); pass --resume to continue it, "
                         f"or choose another --output-dir")
    records = {}
    for name in STAGES:
        path = out / name / "results.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    long_path = Path("docs/benchmark/long/results.json")
    long_record = json.loads(long_path.read_text()) if long_path.exists() else None
    t0 = time.time()
    for i, name in enumerate(stages, 1):
        needs = [] if name == "lr-sweep" else (["lr-sweep"] if name == "deciding" else ["lr-sweep", "deciding"])
        missing = [n for n in needs if not (n in records and records[n].get("complete"))]
        if missing:
            raise BenchError(f"stage {name} is planned from {', '.join(missing)}, which has not finished: "
                             f"run it first (--stages {','.join(missing)})")
        if records.get(name, {}).get("complete"):
            print(f"== fair {i}/{len(stages)} {name}: done", flush=True)
            continue
        print(f"== fair {i}/{len(stages)} {name}", flush=True)
        ctx = Context(vocab_size, args.nproc, records)
        records[name] = run_stage(name, ctx, data, out / name, order_seed=args.order_seed)
        final_report(records, out, long_record)
    rec = final_report(records, out, long_record)
    print_summary(rec)
    print(f"   results: {out / 'results.json'} ({(time.time() - t0) / 60:.0f} min)")
    return 0


def print_summary(rec: dict) -> None:
    for family, c in (rec.get("rates") or {}).items():
        tried = ", ".join(f"{r}: {p:.1f}" for r, p in c["tried"].items())
        print(f"   {NAMES.get(family, family):<28} lr {c['chosen']:g} ({tried})")
    for c in (rec.get("verdicts") or {}).get("comparisons", []):
        print(f"   [{c['scored']}] {c['text']}")
