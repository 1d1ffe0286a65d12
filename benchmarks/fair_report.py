"""The fair comparison's answers from its stages' records (benchmarks/fair.py runs them): the verdicts (one rule,
verdicts.T_RULE, decides every published sentence), the trends over width and experts, OUTPUT_DIR/results.json with
its figures, and the text of its sections of docs/benchmarks.md and README. No speed: the runs share the machine.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from .presets import MOE_BASELINES, NAMES
from .report import geo_cell, png_axes
from .store import atomic_write_json
from .verdicts import T_RULE, log_spread, t_compare

FAIR_START, FAIR_END = "<!-- smlp-bench-fair:start -->", "<!-- smlp-bench-fair:end -->"
README_FAIR_START, README_FAIR_END = "<!-- smlp-bench-readme-fair:start -->", "<!-- smlp-bench-readme-fair:end -->"
FAIR_FIGURES = ("lr_sweep.png", "width.png", "experts.png")
FAIR_PENDING = ("Not published yet: the deciding comparison (`smlp-bench --fair`: 8 experts per sparse layer, heads of "
                "dimension 64, a learning rate per family, deciding runs on seeds the sweep did not use) writes this "
                "answer; its runs are in progress, their store in docs/benchmark/fair/. The earlier runs "
                "with 2 experts per sparse layer and one learning rate for all families, in [benchmarks.md]({page}), "
                "cannot test the paper's claim: at 2 experts GShard's top-2 sends every token to both experts, and "
                "Switch, GShard and Base Layers ended beside the dense Transformer.")
SWEEP_DONE = ("Its learning-rate sweep has finished (each family's rates in [benchmarks.md]({page})); the deciding "
              "runs are under way.")
METRIC_WORDS = {"ppl": "all positions", "suffix_ppl": "the positions after sMLP-partial's routing prefix"}
ANSWER = {"better": "yes", "worse": "no", "undecided": "undecided"}
LOWER = {"better": "lower", "worse": "higher"}  # the first model's perplexity against the second's
SCALE_NOTE = ("Scale: about 2M non-expert parameters trained on about 2M tokens of one small corpus (Gutenberg plays, "
              "a 4k sentencepiece vocabulary, repeated after about 1.3 epochs), on CPU ranks. The answer says which "
              "family learns this corpus fastest per FLOP at this size and budget; it cannot say how the families "
              "rank at the paper's scale (hundreds of millions of parameters, billions of tokens), where larger "
              "experts, longer training and hardware speed change the trade-offs.")
BASE_NOTE = ("Base Layers here equals fairseq's `BaseLayer` with the same weights (outputs and gradients, "
             "tests/test_distributed.py); its greedy validation loads are in the diagnostic column: a property of "
             "the router at this scale, not a broken baseline.")


def _seeds(res: dict, key: str, metric: str = "ppl") -> list[float]:
    m = res.get(key) or {}
    return list(m.get("valid_ppl_per_seed" if metric == "ppl" else f"valid_{metric}_per_seed") or [])


def verdicts(deciding: dict, sweep: dict) -> dict:
    """The primary comparison (sMLP-det against the sweep's best Transformer-MoE, all positions, the balanced routers
    evaluating priced) and the secondary ones, each with its 95% Welch interval and both sides' rates; the greedy and
    training-time routings as diagnostics, never a verdict."""
    res, rates, best = deciding["models"], sweep.get("rates") or {}, sweep.get("best_moe")

    def comparison(a, b, metric, label):
        sa, sb = _seeds(res, a, metric), _seeds(res, b, metric)
        if not sa or not sb:
            return None
        c = t_compare(sa, sb)
        c["rates"] = {k: {"rate": (rates.get(k) or {}).get("chosen"), "bracketed": (rates.get(k) or {}).get(
            "bracketed")} for k in (a, b)}
        # a side whose best rate is at the edge of the sweep is never called worse (a rate beyond might do better)
        loser = b if c["verdict"] == "better" else (a if c["verdict"] == "worse" else None)
        if loser is not None and (rates.get(loser) or {}).get("bracketed") is False:
            c["verdict"] = "undecided"
            c["why_undecided"] = f"{NAMES.get(loser, loser)}'s best rate ({rates[loser]['chosen']:g}) is at the edge " \
                                 "of the sweep"
        return {"model": a, "against": b, "metric": metric, "scored": label, **c,
                "text": describe_t(c, NAMES.get(a, a), NAMES.get(b, b))}

    pairs = [("smlp_det", b, "ppl") for b in ("gmlp", "transformer", *MOE_BASELINES) if b != best]
    # sMLP-partial on the positions it predicts, sMLP-det on the same positions beside it
    pairs += [("smlp_partial", b, "suffix_ppl") for b in (best, "gmlp", "smlp_det") if b]
    return {"rule": T_RULE, "best_moe": best,
            "primary": comparison("smlp_det", best, "ppl", "all positions") if best is not None else None,
            "secondary": [c for a, b, metric in pairs if (c := comparison(
                a, b, metric, METRIC_WORDS[metric] if metric == "ppl" else "positions after the routing prefix"))],
            "diagnostics": {key: {metric: m.get(f"valid_{metric}") for metric in
                                  ("ppl", "greedy_routing_ppl", "trained_routing_ppl")} for key, m in res.items()}}


def describe_t(c: dict, a: str, b: str) -> str:
    """One comparison in words with its interval; a tie says how large a difference the interval rules out."""
    head = f"{a} {c['ppl_a']:.1f} vs {b} {c['ppl_b']:.1f}: {c['ratio'] - 1:+.1%}"
    if c.get("ci_pct") is None:
        return f"{head} ({c.get('why_undecided') or 'no seed spread known'}): undecided"
    (lo, hi), df = c["ci_pct"], "-" if c["df"] is None else f"{c['df']:.1f}"
    head += f" (95% CI {lo:+.1%} to {hi:+.1%}, {c['seeds'][0]} vs {c['seeds'][1]} seeds, Welch df {df})"
    if c["verdict"] == "tie":
        return f"{head}: no difference larger than {c['bound_pct']:.1%} at this budget"
    if c["verdict"] == "undecided":
        return f"{head}: undecided ({c.get('why_undecided', 'no seed spread')})"
    return f"{head}: {a} {'lower (better)' if c['verdict'] == 'better' else 'higher (worse)'}"


def _gap(res: dict, suffix: str, best: str, spreads: dict) -> dict | None:
    """sMLP-det's gap to `best` in a trend's record: one seed a side borrows the family's own spread at the deciding
    budget."""
    a, b = _seeds(res, f"smlp_det{suffix}"), _seeds(res, f"{best}{suffix}")
    return t_compare(a, b, spreads.get("smlp_det"), spreads.get(best)) if a and b else None


def width_trend(deciding: dict, width: dict, best: str) -> dict:
    """sMLP-det's gap to the best Transformer-MoE at the deciding width (its seeds) and the wider one (one seed each,
    each family's spread borrowed from its deciding seeds): a trend, not a verdict."""
    spreads = deciding["fair"]["seed_spread"]
    return {"points": [{"d_model": rec["target"]["d_model"], **c} for rec in (deciding, width)
                       if (c := _gap(rec["models"], "", best, spreads))], "best_moe": best,
            "label": "trend (one seed per model at D=256, spreads borrowed from the deciding seeds), not a verdict"}


# the stages whose runs of one model key pool into one set of seeds (each run its seed once), in this order
POOLED_STAGES = ("deciding", "experts", "experts-seeds", "smoe-experts")
PER_SEED = ("valid_ppl_per_seed", "valid_suffix_ppl_per_seed", "valid_greedy_routing_ppl_per_seed",
            "valid_trained_routing_ppl_per_seed")
EXPERT_COUNTS = (2, 8, 32)
SMOE_NOTE = ("sMLP-det's sMoE routes deterministically: every token passes through every sMoE expert, each a spatial "
             "gating unit over D/E channels, so with --num-experts alone more experts split the same channels finer "
             "(16 channels per sMoE expert at 8 experts, 4 at 32) rather than adding parameters per token as the "
             "tMoE's experts do; `--smoe-experts 4` keeps 32 channels per sMoE expert, the paper's width (1024 / 32, "
             "Table 8), whatever the tMoE's count. The paper reports no expert sweep for sMLP (its Table 7 is "
             "token-routed gMLP).")


def pooled_models(records: dict) -> tuple[dict, list[str]]:
    """{model key: its results pooled over the stages that ran it} and the problems found: a key is one model
    (the same fairseq flags and learning rate in every stage) and each seed counts once; a stage whose model of
    the same key differs is left out of the pool, and said."""
    out, problems = {}, []
    for stage in POOLED_STAGES:
        for key, m in ((records.get(stage) or {}).get("models") or {}).items():
            if key not in out:
                out[key] = {**m, "stages": [stage], **{f: list(m.get(f) or []) for f in (*PER_SEED, "seeds")}}
                continue
            have = out[key]
            if (m.get("fairseq_flags"), m.get("lr")) != (have.get("fairseq_flags"), have.get("lr")):
                problems.append(f"{key}: stage {stage} trained another model under this key (flags or rate differ); "
                                f"its seeds are not pooled")
                continue
            if twice := sorted(set(m.get("seeds") or []) & set(have["seeds"])):
                problems.append(f"{key}: seed(s) {twice} ran in stage {stage} again; its seeds are not pooled")
                continue
            have["stages"].append(stage)
            for f in (*PER_SEED, "seeds"):
                have[f] += list(m.get(f) or [])
    for m in out.values():
        if m["valid_ppl_per_seed"]:
            m["valid_ppl"] = statistics.mean(m["valid_ppl_per_seed"])
    return out, problems


def _point_key(row: str, experts: int, best: str, base: int) -> str:
    """The model key of a row of the expert figure at `experts` tMoE experts (the deciding stage's at `base`)."""
    if row == "smoe4":
        return f"smlp_det_s4_e{experts}"
    return row.replace("best", best) + ("" if experts == base else f"_e{experts}")


def _mean_interval(values: list[float], level: float = 0.95) -> list[float] | None:
    """The `level` t-interval of a model's geometric mean perplexity over its seeds (None below two seeds)."""
    from scipy.stats import t as student_t

    if len(values) < 2:
        return None
    logs = [math.log(v) for v in values]
    half = student_t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return [math.exp(statistics.mean(logs) - half), math.exp(statistics.mean(logs) + half)]


def expert_scaling(pooled: dict, best: str, base: int, spreads: dict) -> dict:
    """Validation perplexity against the tMoE's expert count (2, 8, 32) for sMLP-det (the sMoE's experts tied to
    them, as --num-experts alone), sMLP-det with 4 sMoE experts (--smoe-experts 4) and the best Transformer-MoE,
    every seed of every stage pooled; at each count each comparison by T_RULE (a side with one seed borrows its
    family's spread at `base` experts, labelled: a trend's interval, not a verdict)."""
    rows = []
    for row, name in (("smlp_det", NAMES["smlp_det"]), ("smoe4", f"{NAMES['smlp_det']}, 4 sMoE experts"),
                      ("best", NAMES.get(best, best))):
        points = {}
        for e in EXPERT_COUNTS:
            vals = _seeds(pooled, _point_key(row, e, best, base))
            if vals:
                points[str(e)] = {"ppl": math.exp(statistics.mean(math.log(v) for v in vals)), "per_seed": vals,
                                  "seeds": (pooled[_point_key(row, e, best, base)]["seeds"]),
                                  "interval": _mean_interval(vals)}
        if points:
            rows.append({"row": row, "model": "smlp_det" if row != "best" else best, "name": name, "points": points})
    comparisons = []
    pairs = (("smlp_det", "best", "sMLP-det against {best}"), ("smoe4", "best", "sMLP-det, 4 sMoE experts, against "
             "{best}"), ("smoe4", "smlp_det", "sMLP-det with 4 sMoE experts against the tie"))
    for e in EXPERT_COUNTS:
        for a_row, b_row, label in pairs:
            a, b = (_point_key(r, e, best, base) for r in (a_row, b_row))
            sa, sb = _seeds(pooled, a), _seeds(pooled, b)
            if not sa or not sb:
                continue
            fam = {r: "smlp_det" if r != "best" else best for r in (a_row, b_row)}
            c = t_compare(sa, sb, spreads.get(fam[a_row]), spreads.get(fam[b_row]))
            names = {"smlp_det": f"sMLP-det, {e} experts", "smoe4": f"sMLP-det, 4 sMoE + {e} tMoE experts",
                     "best": f"{NAMES.get(best, best)}, {e} experts"}
            comparisons.append({"experts": e, "model": a, "against": b, "label": label.format(
                best=NAMES.get(best, best)), **c, "text": describe_t(c, names[a_row], names[b_row])})
    return {"rows": rows, "comparisons": comparisons, "best_moe": best, "base_experts": base, "rule": T_RULE,
            "note": SMOE_NOTE}


def rate_check(pooled: dict, rates: dict, experts: int = 32) -> list[dict]:
    """At `experts` experts, each family's final perplexity at half, once and twice its sweep's rate (seed 1, the
    sweep's seed): is the sweep's rate still the best of the three, or would a rate beyond it do better?"""
    out = []
    for family in sorted({k.partition("_e")[0] for k in pooled if re.fullmatch(rf"[a-z_]+_e{experts}@lr.+", k)}):
        tried = {}
        for key, m in pooled.items():
            if key.startswith(f"{family}_e{experts}@lr") and m.get("valid_ppl_per_seed"):
                tried[float(key.split("@lr")[1])] = m["valid_ppl_per_seed"][0]
        chosen = (rates.get(family) or {}).get("chosen")
        if not tried or chosen is None:
            continue
        best = min(tried, key=tried.get)
        at_edge = best in (min(tried), max(tried)) and best != chosen
        # how much the best rate gains over the sweep's, against the family's seed spread at this count (log sd)
        gain = tried[best] / tried[chosen] - 1 if chosen in tried else None
        spread = log_spread(_seeds(pooled, f"{family}_e{experts}"))
        out.append({"family": family, "name": NAMES.get(family, family), "experts": experts, "chosen": chosen,
                    "tried": {f"{r:g}": tried[r] for r in sorted(tried)}, "best": best,
                    "chosen_is_best": math.isclose(best, chosen), "best_at_edge": at_edge,
                    "gain": gain, "seed_sd": spread["sd"] if spread else None, "complete": len(tried) == 3})
    return out


def analysed_stage(record: dict, extra: dict) -> dict:
    """A finished stage's analysis (not the sweep's): each family's seed spread, the rule, its code and seeds."""
    return {"seed_spread": {k: log_spread(m["valid_ppl_per_seed"]) for k, m in record["models"].items()},
            "rule": T_RULE, "code": extra.get("code"), "primary_seeds": extra.get("primary_seeds")}


def _analysed(record: dict) -> dict:
    """A stage record with its seed spreads per family (also a partial one, or one written before they were)."""
    fair = dict(record.get("fair") or {})
    if not isinstance(fair.get("seed_spread"), dict) or "sd" in fair["seed_spread"]:
        fair["seed_spread"] = analysed_stage(record, {})["seed_spread"]
    return {**record, "fair": fair}


def final_report(records: dict, out_dir: Path, design: dict) -> dict:
    """OUTPUT_DIR/results.json and its figures from the stages finished so far (`design`: the comparison's target,
    stages, settings and seeds, benchmarks/fair.py)."""
    rec = {"kind": "fair", "stages": {k: f"{k}/results.json" for k in records}, "rule": T_RULE,
           "complete": all(k in records and records[k].get("complete") for k in ("lr-sweep", "deciding")),
           "stages_complete": {k: bool(records.get(k, {}).get("complete")) for k in design["settings"]},
           "target": design["target"], "wide_target": design["wide_target"], "settings": design["settings"],
           "primary_seeds": design["primary_seeds"],
           "experts_complete": all(records.get(k, {}).get("complete") for k in design.get("experts_stages", ())),
           "eval_routing": "priced (--balanced-eval-routing, smlp/routing/prices.py)"}
    sweep = (records.get("lr-sweep") or {}).get("fair") or {}
    if "lr-sweep" in records:
        rec["rates"], rec["best_moe"] = sweep["rates"], sweep.get("best_moe")
        plot_sweep(rec["rates"], out_dir / "lr_sweep.png")
    pooled, problems = pooled_models(records)
    spreads = {}
    if d := records.get("deciding"):  # its families with every seed any stage ran of them (gMLP's 4-5: issue 51)
        d = {**d, "models": {k: pooled.get(k, m) for k, m in d["models"].items()}}
        d["fair"] = {**(d.get("fair") or {}), "seed_spread": analysed_stage(d, {})["seed_spread"]}
        spreads = d["fair"]["seed_spread"]
        keep = ("valid_suffix_ppl_per_seed", "valid_greedy_routing_ppl_per_seed", "valid_trained_routing_ppl_per_seed")
        rec["families"] = {k: {"name": m["name"], "layers": m["layers"], "lr": m.get("lr"),
                               "bracketed": (sweep.get("rates", {}).get(k) or {}).get("bracketed"),
                               "valid_ppl": m["valid_ppl"], "valid_ppl_per_seed": m["valid_ppl_per_seed"],
                               "seeds": m["seeds"], "log_spread": spreads[k], **{f: m.get(f) for f in keep},
                               "greedy_max_load": m.get("greedy_max_load")} for k, m in d["models"].items()}
        rec["seed_spread"], rec["verdicts"] = spreads, verdicts(d, sweep)
    if "deciding" in records and "width" in records and rec.get("best_moe"):
        rec["width"] = width_trend(_analysed(records["deciding"]), records["width"], rec["best_moe"])
        plot_width(rec["width"], out_dir / "width.png")
    if "deciding" in records and "experts" in records and rec.get("best_moe"):
        rec["experts"] = expert_scaling(pooled, rec["best_moe"], records["deciding"]["target"]["experts"], spreads)
        plot_experts(rec["experts"], out_dir / "experts.png")
    if check := rate_check(pooled, rec.get("rates") or {}):
        rec["rate_check"] = check
    if problems:
        rec["pooling_problems"] = problems
    atomic_write_json(out_dir / "results.json", rec)
    return rec


def plot_sweep(rates: dict, path: Path) -> None:
    with png_axes(path, "learning-rate sweep per family (star: chosen)", "peak learning rate (inverse-sqrt schedule)",
                  "validation perplexity after the sweep's budget", figsize=(7, 4.5), log2x=True, logy=True,
                  legend_size=7) as ax:
        for family, c in rates.items():
            xs = sorted(float(r) for r in c["tried"])
            line, = ax.plot(xs, [c["tried"][f"{x:g}"] for x in xs], marker="o", label=NAMES.get(family, family))
            ax.plot([c["chosen"]], [c["tried"][f"{c['chosen']:g}"]], "*", ms=12, color=line.get_color())


def plot_width(width: dict, path: Path) -> None:
    with png_axes(path, "the gap against width, a trend (below 0: sMLP-det lower)", "model width D",
                  "sMLP-det's perplexity difference (%), 95% interval", log2x=True) as ax:
        pts = width["points"]
        ys = [100 * (p["ratio"] - 1) for p in pts]
        lo = [y - 100 * p["ci_pct"][0] if p.get("ci_pct") else 0 for y, p in zip(ys, pts)]
        hi = [100 * p["ci_pct"][1] - y if p.get("ci_pct") else 0 for y, p in zip(ys, pts)]
        ax.errorbar([p["d_model"] for p in pts], ys, yerr=[lo, hi], marker="o", capsize=4,
                    label=f"sMLP-det vs {NAMES.get(width['best_moe'], width['best_moe'])}")
        ax.axhline(0, color="grey", lw=0.8)


def plot_experts(experts: dict, path: Path) -> None:
    with png_axes(path, "validation perplexity against the tMoE's experts", "tMoE experts per sparse layer",
                  "validation perplexity (95% interval of the mean over seeds)") as ax:
        ax.set_xscale("log", base=2)
        for row in experts["rows"]:
            es = sorted(int(e) for e in row["points"])
            pts = [row["points"][str(e)] for e in es]
            ys = [p["ppl"] for p in pts]
            lo = [y - p["interval"][0] if p["interval"] else 0 for y, p in zip(ys, pts)]
            hi = [p["interval"][1] - y if p["interval"] else 0 for y, p in zip(ys, pts)]
            seeds = "/".join(str(len(p["per_seed"])) for p in pts)
            ax.errorbar(es, ys, yerr=[lo, hi], marker="o", capsize=4, label=f"{row['name']} (seeds {seeds})")
        ax.set_xticks(list(EXPERT_COUNTS), [str(e) for e in EXPERT_COUNTS])


def print_summary(rec: dict) -> None:
    for family, c in (rec.get("rates") or {}).items():
        tried = ", ".join(f"{r}: {p:.1f}" for r, p in c["tried"].items())
        edge = "" if c["bracketed"] else " (at the sweep's edge)"
        print(f"   {NAMES.get(family, family):<28} lr {c['chosen']:g}{edge} ({tried})")
    v = rec.get("verdicts") or {}
    for label, c in ([("PRIMARY", v["primary"])] if v.get("primary") else []) + \
            [("secondary", c) for c in v.get("secondary", [])]:
        print(f"   {label} [{c['scored']}] {c['text']}")


def _ci(c: dict) -> str:
    if c.get("ci_pct") is None:
        return f"{c['ratio'] - 1:+.1%}, no seed spread known"
    lo, hi = c["ci_pct"]
    borrowed = {2: ", one seed a side: spread borrowed from the deciding seeds",
                1: ", one seed on one side: its spread borrowed from the deciding seeds"}.get(len(c.get("borrowed") or
                                                                                             []), "")
    return f"{c['ratio'] - 1:+.1%}, 95% CI {lo:+.1%} to {hi:+.1%}, Welch df {c['df']:.1f}{borrowed}"


def _answer(c: dict) -> str:
    if c["verdict"] == "tie":
        return f"no difference larger than {c['bound_pct']:.1%} at this budget"
    if c["verdict"] == "undecided" and c.get("why_undecided"):
        return f"undecided ({c['why_undecided']})"
    return ANSWER[c["verdict"]]


def fair_verdicts(record: dict) -> list[str]:
    """The answers, one bullet each (docs/benchmarks.md): the primary comparison first, the secondary ones labelled."""
    names = {k: f["name"] for k, f in (record.get("families") or {}).items()}
    v, lines = record.get("verdicts") or {}, []
    if p := v.get("primary"):
        best = names.get(p["against"], p["against"])
        rates = "; ".join(f"{names.get(k, k)} at lr {r['rate']:g}" + ("" if r.get("bracketed") else
                                                                        " (at the sweep's edge)")
                          for k, r in (p.get("rates") or {}).items() if r.get("rate") is not None)
        lines.append(f"- **Does sMLP-deterministic beat the best Transformer-MoE ({best}) at matched FLOPs? "
                     f"{_answer(p)}.** The primary comparison: validation perplexity on all positions "
                     f"{p['ppl_a']:.1f} against {p['ppl_b']:.1f} ({_ci(p)}; {p['seeds'][0]} and {p['seeds'][1]} "
                     f"seeds, none used to choose a rate; {rates}). {best} is the Transformer-MoE "
                     f"with the best perplexity in the learning-rate sweep.")
    for c in v.get("secondary", []):
        lines.append(f"- Secondary, {names.get(c['model'], c['model'])} against {names.get(c['against'], c['against'])}"
                     f" on {METRIC_WORDS[c['metric']]}: {_answer(c)} ({c['ppl_a']:.1f} against {c['ppl_b']:.1f}, "
                     f"{_ci(c)}).")
    lines.append("- Evaluation routing: the balanced routers (Base Layers, sMLP's tMoE, sMLP-partial's sMoE) route "
                 "each token by its score minus the expert prices averaged over training (causal, per token); greedy "
                 "routing and the training-time assignment over the batch (not causal) are diagnostic columns, "
                 "never a verdict.")
    if (w := record.get("width")) and len(w.get("points", [])) == 2:
        a, b = w["points"]
        lines.append(f"- Width (a trend, one seed per model at D={b['d_model']}): sMLP-det's difference to "
                     f"{names.get(w['best_moe'], w['best_moe'])} is {a['ratio'] - 1:+.1%} at D={a['d_model']} and "
                     f"{b['ratio'] - 1:+.1%} at D={b['d_model']}.")
    if (e := record.get("experts")) and "comparisons" in e:
        if gaps := "; ".join(f"{c['experts']} experts: {_answer(c)} ({_ci(c)}; {c['seeds'][0]} and {c['seeds'][1]} "
                             f"seeds)" for c in e["comparisons"] if c["model"].startswith("smlp_det_e")
                             or c["model"] == "smlp_det"):
            lines.append(f"- Experts: does sMLP-det's lead over {names.get(e['best_moe'], e['best_moe'])} hold as "
                         f"experts are added? {gaps}. The table below has every point and comparison.")
    lines.append(f"- Rule: {v.get('rule', record.get('rule'))}.")
    if not record.get("complete"):
        lines.append("- **PARTIAL: the benchmark has not finished; the answers may change.**")
    return lines


def render_fair(record: dict, figures: dict[str, str]) -> str:
    """docs/benchmarks.md section 'Does sMLP beat Transformer-MoE at matched FLOPs here?' (figures: name -> link)."""
    fam, t = record.get("families") or {}, record["target"]
    lines = [*fair_verdicts(record), "",
             f"Every family FLOP-matched to sMLP-det ({t['dense']}+{t['sparse']} blocks, D={t['d_model']}, "
             f"F={t['d_ffn']}, T={t['seq_len']}), {t['experts']} experts per sparse layer on 2 CPU ranks, Transformers "
             f"with heads of dimension 64, each family at its own learning rate"
             + (":" if fam else ". The deciding runs (seeds the sweep did not use) have not finished: no family's "
                                "perplexity is published yet.")]
    if fam:
        lines += ["", "| model | layers | lr | valid ppl (seeds) | seed spread (sd of log ppl) | on sMLP-partial's "
                  "positions | diagnostic: greedy routing (busiest expert / mean) | diagnostic: training-time "
                  "assignment |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for key in sorted(fam, key=lambda k: fam[k]["valid_ppl"] or float("inf")):
            f, sp = fam[key], fam[key].get("log_spread")
            load = f" ({f['greedy_max_load']:.1f}x)" if f.get("greedy_max_load") else ""
            lr = f"{f['lr']:g}" + ("" if f.get("bracketed") is not False else " (edge)")
            spread = f"{sp['sd']:.4f}" if sp else ("unknown (1 seed)" if f["valid_ppl_per_seed"] else "-")
            lines.append(f"| {f['name']} | {f['layers']} | {lr} | {geo_cell(f['valid_ppl_per_seed'])} | {spread} | "
                         f"{geo_cell(f.get('valid_suffix_ppl_per_seed'))} | "
                         f"{geo_cell(f.get('valid_greedy_routing_ppl_per_seed'))}{load} | "
                         f"{geo_cell(f.get('valid_trained_routing_ppl_per_seed'))} |")
        lines += ["", "Speed is not measured here: these runs share the machine with other work. Words/s at "
                      "matched FLOPs are the speed benchmark's (`python -m smlp_bench.speed`, section \"Where "
                      "sMLP-det's step goes\")."]
        if "figure5.png" in figures:
            lines += ["", f"![validation perplexity against tokens and against time, the deciding runs]"
                          f"({figures['figure5.png']})"]
    if rates := record.get("rates") or {}:
        lines += ["", "Learning rates (inverse-sqrt schedule, the same warmup), chosen by a sweep of one seed (seed 1, "
                      "which no deciding run uses) at a shorter budget; final validation perplexity per rate:", "",
                  "| model | rates tried: ppl | chosen | inside the rates tried |", "|---|---|---:|---|"]
        for key, c in rates.items():
            tried = ", ".join(f"{r}: {p:.1f}" for r, p in sorted(c["tried"].items(), key=lambda kv: float(kv[0])))
            lines.append(f"| {fam.get(key, {}).get('name', key)} | {tried} | {c['chosen']:g} | "
                         f"{'yes' if c['bracketed'] else 'no (at the edge after widening)'} |")
        if "lr_sweep.png" in figures:
            lines += ["", f"![final perplexity against learning rate per family]({figures['lr_sweep.png']})"]
    if w := record.get("width"):
        lines += ["", f"| width (trend) | sMLP-det vs {fam.get(w['best_moe'], {}).get('name', w['best_moe'])} |",
                  "|---|---:|", *(f"| D={pt['d_model']} | {_ci(pt)} |" for pt in w["points"])]
        if "width.png" in figures:
            lines += ["", f"![sMLP-det's gap against width]({figures['width.png']})"]
    if e := record.get("experts"):
        lines += ["", *render_experts(e, record.get("rate_check") or [], figures.get("experts.png"),
                                      complete=record.get("experts_complete", True))]
    lines += ["", BASE_NOTE, "", SCALE_NOTE, "",
              "Generated by `smlp-bench --fair` from `docs/benchmark/fair/results.json` and its stages' records "
              "(`docs/benchmark/fair/<stage>/runs.json`, `results.json`)."]
    return "\n".join(lines)


def _point(p: dict | None) -> str:
    if p is None:
        return "-"
    iv = f", {p['interval'][0]:.1f}-{p['interval'][1]:.1f}" if p.get("interval") else ""
    return f"{p['ppl']:.1f} ({len(p['per_seed'])} seed{'s' if len(p['per_seed']) > 1 else ''}{iv})"


def render_experts(e: dict, rate_rows: list[dict], figure: str | None, complete: bool = True) -> list[str]:
    """The experts part of the fair section: perplexity per tMoE expert count and row (every seed pooled), the
    verdict of each comparison at each count, the figure, the rate check at 32 experts and what the paper reports."""
    best = NAMES.get(e["best_moe"], e["best_moe"])
    if "comparisons" not in e:  # a record written before issue 51: one seed at 2 and 32 experts
        es = sorted({int(x) for r in e["rows"] for x in r["ppl"]})
        return ["| model | " + " | ".join(f"{x} experts" for x in es) + " |", "|---|" + "---:|" * len(es),
                *(f"| {r['name']} | " + " | ".join(f"{r['ppl'][str(x)]:.1f}" for x in es) + " |" for r in e["rows"])]
    rows = {r["row"]: r for r in e["rows"]}
    head = [("smlp_det", "sMLP-det, sMoE experts = tMoE experts (the tie)"),
            ("smoe4", "sMLP-det, 4 sMoE experts (32 channels each)"), ("best", best)]
    lines = ["How the answer moves with experts (tMoE experts per sparse layer; validation perplexity, the geometric "
             "mean over seeds with its 95% interval; every seed of every stage pooled, each fixed before its runs):",
             "", "| tMoE experts | " + " | ".join(h for _, h in head) + " |", "|---:|" + "---:|" * len(head)]
    for x in EXPERT_COUNTS:
        lines.append(f"| {x} | " + " | ".join(_point((rows.get(r) or {}).get("points", {}).get(str(x)))
                                             for r, _ in head) + " |")
    lines += ["", "| comparison | " + " | ".join(f"{x} experts" for x in EXPERT_COUNTS) + " |",
              "|---|" + "---|" * len(EXPERT_COUNTS)]
    for label in dict.fromkeys(c["label"] for c in e["comparisons"]):
        cells = {c["experts"]: c for c in e["comparisons"] if c["label"] == label}
        lines.append(f"| {label} | " + " | ".join(
            f"{LOWER[cells[x]['verdict']] if cells[x]['verdict'] in LOWER else _answer(cells[x])}: {_ci(cells[x])}"
            if x in cells else "-" for x in EXPERT_COUNTS) + " |")
    if figure:
        lines += ["", f"![validation perplexity against the tMoE's experts]({figure})"]
    lines += ["", e.get("note") or SMOE_NOTE]
    if rate_rows:
        lines += ["", "Is the sweep's rate still right at 32 experts? Each family at half, once and twice its sweep's "
                      "rate on seed 1 (the sweep's seed), final validation perplexity:", "",
                  "| model | rates: ppl | sweep's rate | best here |", "|---|---|---:|---|"]
        for r in rate_rows:
            tried = ", ".join(f"{k}: {v:.1f}" for k, v in r["tried"].items())
            verdict = ("the sweep's rate" if r["chosen_is_best"] else
                       f"{r['best']:g}" + (" (at the edge of the three)" if r["best_at_edge"] else ""))
            lines.append(f"| {r['name']} | {tried} | {r['chosen']:g} | {verdict}"
                         f"{'' if r['complete'] else ' (partial)'} |")
        for sentence in filter(None, map(rate_sentence, rate_rows)):
            lines += ["", sentence]
    if not complete:
        lines += ["", "**PARTIAL: the experts runs (issue 51) have not all finished; every figure above may change.**"]
    return lines


def rate_sentence(r: dict) -> str:
    """What a rate-check row means for the 32-expert points, where the sweep's rate was not the best of the three:
    the gain of the best rate against the family's seed spread there, and whether a rate beyond it is untried."""
    if r["chosen_is_best"] or r.get("gain") is None:
        return ""
    at_best, at_chosen = r["tried"][f"{r['best']:g}"], r["tried"][f"{r['chosen']:g}"]
    side = "higher" if r["best"] > r["chosen"] else "lower"
    beyond = f"; a {side} rate than {r['best']:g} was not tried" if r["best_at_edge"] else ""
    text = (f"{r['name']} does best at {r['best']:g}: {at_best:.1f} against {at_chosen:.1f} at its sweep's rate "
            f"({r['gain']:+.1%}, seed 1 alone{beyond}).")
    if r.get("seed_sd") is None:
        return text
    spread = f" Its seeds at {r['experts']} experts spread {r['seed_sd']:.1%} (sd of log perplexity): the gain "
    if abs(math.log1p(r["gain"])) <= r["seed_sd"]:
        return text + spread + (f"is within that spread, though its points at this count may be about "
                                f"{abs(r['gain']):.1%} pessimistic.")
    return text + spread + ("exceeds that spread, so its points at this count are pessimistic and the comparisons "
                            "there lean against it.")


def trend_sentences(record: dict) -> str:
    """README's sentences on the experts: the lead at each expert count with its interval, and which sMoE setting
    to train (from the verdict of 4 sMoE experts against the tie)."""
    e = record.get("experts") or {}
    best = NAMES.get(e.get("best_moe"), e.get("best_moe"))
    tied = [c for c in e.get("comparisons", []) if c["label"].startswith("sMLP-det against")]
    if len(tied) < 2:
        return ""
    text = (f" As experts are added, sMLP-det against {best}: " + "; ".join(
        f"{c['experts']} experts {c['ratio'] - 1:+.1%} ({_ci_short(c)}, {c['seeds'][0]}+{c['seeds'][1]} seeds)"
        for c in tied) + ".")
    apart = {c["experts"]: c for c in e.get("comparisons", []) if c["label"].endswith("against the tie")}
    if apart:
        x = max(apart)
        c = apart[x]
        if c["verdict"] == "better":
            advice = "train with `--smoe-experts` set to D / 32 (32 channels per sMoE expert)"
        elif c["verdict"] == "worse":
            advice = "keep the sMoE's experts tied to the tMoE's"
        else:
            advice = "the sMoE's expert count is not what decides, at this scale"
        text += (f" With 4 sMoE experts (32 channels each) at {x} tMoE experts sMLP-det reaches {c['ppl_a']:.1f} "
                 f"against {c['ppl_b']:.1f} tied ({_ci_short(c)}): {advice}.")
    return text


def _ci_short(c: dict) -> str:
    if c.get("ci_pct") is None:
        return "no interval"
    lo, hi = c["ci_pct"]
    return f"95% CI {lo:+.1%} to {hi:+.1%}" + (", spread borrowed" if c.get("borrowed") else "")


def render_fair_summary(record: dict, figure: str | None, page: str) -> str:
    """README's answer in one paragraph (the primary verdict with its interval, sMLP-det against dense gMLP as the
    secondary, the scale), the curves, and the page for the rest."""
    names = {k: f["name"] for k, f in (record.get("families") or {}).items()}
    v, t = record.get("verdicts") or {}, record["target"]
    if (p := v.get("primary")) is None:
        return FAIR_PENDING.format(page=page)
    text = (f"**Does sMLP-deterministic beat the best Transformer-MoE at matched FLOPs? {_answer(p)}.** "
            f"At {t['d_model']}-wide models with {t['experts']} experts per sparse layer, trained for about 2M tokens "
            f"on 2 CPU ranks (about 2M non-expert parameters, each family at its own learning rate), sMLP-det "
            f"reaches validation perplexity {p['ppl_a']:.1f} against {p['ppl_b']:.1f} for "
            f"{names.get(p['against'], p['against'])}, the Transformer-MoE with the best perplexity in the "
            f"learning-rate sweep ({_ci(p)}; {p['seeds'][0]} and {p['seeds'][1]} seeds, fixed in advance).")
    if g := next((c for c in v.get("secondary", []) if c["against"] == "gmlp" and c["model"] == "smlp_det"), None):
        text += (f" Against dense gMLP (secondary): {_answer(g)} ({g['ppl_a']:.1f} against {g['ppl_b']:.1f}, {_ci(g)}; "
                 f"{g['seeds'][0]} and {g['seeds'][1]} seeds).")
    text += trend_sentences(record)
    text += (" This is the answer at this small scale only; the paper's claim is at hundreds of millions of "
             "parameters and billions of tokens.") + ("" if record.get("complete") else
                                                       " **PARTIAL: the benchmark has not finished.**")
    lines = [text] + (["", f"![validation perplexity against tokens and against time, the deciding runs]({figure})"]
                      if figure else [])
    return "\n".join([*lines, "", f"Every family's perplexity per seed, the secondary comparisons, the rule and the "
                                  f"expert-count trend: [{Path(page).name}]({page}). Generated by "
                                  f"`smlp-bench --publish`."])
