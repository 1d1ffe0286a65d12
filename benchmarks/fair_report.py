"""The fair comparison's answers from its stages' records (benchmarks/fair.py runs them): the verdicts (one rule,
verdicts.T_RULE, decides every published sentence), the trends over width and experts, OUTPUT_DIR/results.json with
its figures, and the text of its sections of docs/benchmarks.md and README. No speed: the runs share the machine.
"""
from __future__ import annotations

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


def expert_trend(deciding: dict, experts: dict, best: str) -> dict:
    """Final perplexity against the expert count for sMLP-det and the best Transformer-MoE (the deciding count: its
    seeds; the others: one seed, borrowing the family's spread at the deciding count), and sMLP-det's gap at each."""
    spreads, base = deciding["fair"]["seed_spread"], deciding["target"]["experts"]
    swept = sorted({int(m.group(1)) for k in experts["models"] if (m := re.search(r"_e(\d+)$", k))})
    source = {e: (deciding["models"], "") if e == base else (experts["models"], f"_e{e}") for e in {base, *swept}}
    rows = []
    for k in ("smlp_det", best):
        by_e = {e: _seeds(res, f"{k}{suffix}") for e, (res, suffix) in source.items()}
        es = sorted(e for e in by_e if by_e[e])
        rows.append({"model": k, "name": NAMES[k], "ppl": {e: statistics.mean(by_e[e]) for e in es},
                     "seeds": {e: len(by_e[e]) for e in es}})
    return {"rows": rows, "gaps": {e: c for e, (res, suffix) in sorted(source.items())
                                   if (c := _gap(res, suffix, best, spreads))},
            "best_moe": best, "seed_spread": {k: spreads.get(k) for k in ("smlp_det", best)},
            "label": "trend (one seed at 2 and 32 experts, spreads borrowed from the deciding seeds), not a verdict",
            "note": "sMLP-det's sMoE routes deterministically: every token passes through every sMoE expert (each a "
                    "spatial gating unit over D/E channels), so more experts split the same channels finer rather "
                    "than adding parameters per token as the tMoE's experts do."}


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
           "eval_routing": "priced (--balanced-eval-routing, smlp/routing/prices.py)"}
    sweep = (records.get("lr-sweep") or {}).get("fair") or {}
    if "lr-sweep" in records:
        rec["rates"], rec["best_moe"] = sweep["rates"], sweep.get("best_moe")
        plot_sweep(rec["rates"], out_dir / "lr_sweep.png")
    if d := records.get("deciding"):
        spreads = analysed_stage(d, {})["seed_spread"]
        keep = ("valid_suffix_ppl_per_seed", "valid_greedy_routing_ppl_per_seed", "valid_trained_routing_ppl_per_seed")
        rec["families"] = {k: {"name": m["name"], "layers": m["layers"], "lr": m.get("lr"),
                               "bracketed": (sweep.get("rates", {}).get(k) or {}).get("bracketed"),
                               "valid_ppl": m["valid_ppl"], "valid_ppl_per_seed": m["valid_ppl_per_seed"],
                               "seeds": m["seeds"], "log_spread": spreads[k], **{f: m.get(f) for f in keep},
                               "greedy_max_load": m.get("greedy_max_load")} for k, m in d["models"].items()}
        rec["seed_spread"], rec["verdicts"] = spreads, verdicts(d, sweep)
    for stage, trend, plot in (("width", width_trend, plot_width), ("experts", expert_trend, plot_experts)):
        if "deciding" in records and stage in records and rec.get("best_moe"):
            rec[stage] = trend(_analysed(records["deciding"]), records[stage], rec["best_moe"])
            plot(rec[stage], out_dir / f"{stage}.png")
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
    with png_axes(path, "more experts: sMLP-det and the best Transformer-MoE (a trend)", "experts per sparse layer",
                  "validation perplexity (± 2 seed SD of the family at 8 experts)", log2x=True) as ax:
        for row in experts["rows"]:
            sd = ((experts.get("seed_spread") or {}).get(row["model"]) or {}).get("sd", 0.0)
            ppl = {int(e): v for e, v in row["ppl"].items()}  # int keys in memory, str in the JSON
            ys = [ppl[e] for e in sorted(ppl)]
            ax.errorbar(sorted(ppl), ys, yerr=[2 * sd * y for y in ys], marker="o", capsize=4, label=row["name"])


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
    borrowed = ", one seed a side: spread borrowed from the deciding seeds" if c.get("borrowed") else ""
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
    if e := record.get("experts"):
        gaps = ", ".join(f"{x} experts {g['ratio'] - 1:+.1%}"
                         for x, g in sorted(e["gaps"].items(), key=lambda kv: int(kv[0])))
        note = e.get("note", "").rstrip(".")  # records written before it ended with a period lack one
        lines.append(f"- Experts (a trend, one seed at 2 and 32): sMLP-det's difference to "
                     f"{names.get(e['best_moe'], e['best_moe'])}: {gaps}." + (f" {note}." if note else ""))
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
        es = sorted({int(x) for r in e["rows"] for x in r["ppl"]})
        lines += ["", "| model | " + " | ".join(f"{x} experts" for x in es) + " |", "|---|" + "---:|" * len(es)]
        for r in e["rows"]:
            lines.append(f"| {r['name']} | " + " | ".join(
                f"{r['ppl'][str(x)] if str(x) in r['ppl'] else r['ppl'].get(x, float('nan')):.1f}" for x in es) + " |")
        if "experts.png" in figures:
            lines += ["", f"![perplexity against the number of experts]({figures['experts.png']})"]
    lines += ["", BASE_NOTE, "", SCALE_NOTE, "",
              "Generated by `smlp-bench --fair` from `docs/benchmark/fair/results.json` and its stages' records "
              "(`docs/benchmark/fair/<stage>/runs.json`, `results.json`)."]
    return "\n".join(lines)


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
        text += f" Against dense gMLP (secondary): {_answer(g)} ({g['ppl_a']:.1f} against {g['ppl_b']:.1f}, {_ci(g)})."
    text += (" This is the answer at this small scale only; the paper's claim is at hundreds of millions of "
             "parameters and billions of tokens.") + ("" if record.get("complete") else
                                                       " **PARTIAL: the benchmark has not finished.**")
    lines = [text] + (["", f"![validation perplexity against tokens and against time, the deciding runs]({figure})"]
                      if figure else [])
    return "\n".join([*lines, "", f"Every family's perplexity per seed, the secondary comparisons, the rule and the "
                                  f"expert-count trend: [{Path(page).name}]({page}). Generated by "
                                  f"`smlp-bench --publish`."])
