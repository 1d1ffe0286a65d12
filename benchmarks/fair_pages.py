"""The demo corpus's deciding comparison in words (benchmarks/fair_report.py writes its record): the section "Does
sMLP beat Transformer-MoE at matched FLOPs here?" of docs/benchmarks.md and README's answer paragraph. Every sentence
reads a verdict of the record (verdicts.T_RULE); nothing in them is typed."""
from __future__ import annotations

import math
from pathlib import Path

from .fair_report import EXPERT_COUNTS, METRIC_WORDS, SMOE_NOTE
from .presets import NAMES
from .report import geo_cell

FAIR_START, FAIR_END = "<!-- smlp-bench-fair:start -->", "<!-- smlp-bench-fair:end -->"
README_FAIR_START, README_FAIR_END = "<!-- smlp-bench-readme-fair:start -->", "<!-- smlp-bench-readme-fair:end -->"
FAIR_PENDING = ("Not published yet: the deciding comparison (`smlp-bench --fair`: 8 experts per sparse layer, heads of "
                "dimension 64, a learning rate per family, deciding runs on seeds the sweep did not use) writes this "
                "answer; its runs are in progress, their store in docs/benchmark/fair/. The earlier runs "
                "with 2 experts per sparse layer and one learning rate for all families, in [benchmarks.md]({page}), "
                "cannot test the paper's claim: at 2 experts GShard's top-2 sends every token to both experts, and "
                "Switch, GShard and Base Layers ended beside the dense Transformer.")
SWEEP_DONE = ("Its learning-rate sweep has finished (each family's rates in [benchmarks.md]({page})); the deciding "
              "runs are under way.")
ANSWER = {"better": "yes", "worse": "no", "undecided": "undecided"}
LOWER = {"better": "lower", "worse": "higher"}  # the first model's perplexity against the second's
SCALE_NOTE = ("Scale: about 2M non-expert parameters trained on about 2M tokens of one small corpus (Gutenberg plays, "
              "a 4k sentencepiece vocabulary; its training split is about 1.45M tokens, so a 500-update run reads it "
              "1.4 times and re-reads it from update ~360), on CPU ranks. The answer says which "
              "family learns this corpus fastest per FLOP at this size and budget; it cannot say how the families "
              "rank at the paper's scale (hundreds of millions of parameters, billions of tokens), where larger "
              "experts, longer training and hardware speed change the trade-offs.")
BASE_NOTE = ("Base Layers here equals fairseq's `BaseLayer` with the same weights (outputs and gradients, "
             "tests/test_distributed.py); its greedy validation loads are in the diagnostic column: a property of "
             "the router at this scale, not a broken baseline.")


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
        return f"a tie, no difference larger than {c['bound_pct']:.1%} at this budget"
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
                         f"experts are added, at 500 updates? {gaps}. The table below has every point and comparison.")
        lines += own_trend(record)
    lines += [f"- {snapshot_sentence(record)}"] if record.get("snapshots") else []
    lines += [f"- {text}" for text in (seed_rule_sentence(record), same_seed_sentence(record)) if text]
    lines.append(f"- Rule: {v.get('rule', record.get('rule'))}.")
    if not record.get("complete"):
        lines.append("- **PARTIAL: the benchmark has not finished; the answers may change.**")
    return lines


def _pct(c: dict) -> str:
    return f"{c['ratio'] - 1:+.1%}"


def snapshot_sentence(record: dict) -> str:
    """The pairs' gaps along training: the published order is a 500-update snapshot, and which way it was moving."""
    parts = []
    for snap in record.get("snapshots") or []:
        pts = snap["points"]
        ups = " / ".join(pts)
        moving = ""
        if snap.get("last_100") is not None:
            moving = (f", {100 * snap['last_100']:+.1f} points over the last 100 updates ({snap['seeds_moving_down']} "
                      f"of {snap['seeds_paired']} seeds lower relative to the other at 500 than at 400)")
        parts.append(f"{_pair_name(snap['a'], snap['b'])} at {ups} updates: "
                     f"{' / '.join(_pct(c) for c in pts.values())}{moving}")
    return ("**The order is a 500-update snapshot on a corpus read 1.4 times, not a settled one.** " + "; ".join(parts)
            + ". Where the gap still moves points per 100 updates, a longer run can change the order (the kernel-docs "
              "comparison below runs three times the tokens on a corpus read once).")


def _pair_name(a: str, b: str) -> str:
    def name(k):
        base, _, e = k.partition("_e")
        return f"{NAMES.get(base, base)}{f' ({e} experts)' if e else ''}"
    return f"{name(a)} against {name(b)}"


def own_trend(record: dict) -> list[str]:
    """sMLP-det's own perplexity against its expert count, and its 2-expert point against dense gMLP."""
    rows = {r["row"]: r for r in (record.get("experts") or {}).get("rows", [])}
    pts = (rows.get("smlp_det") or {}).get("points") or {}
    if len(pts) < 2:
        return []
    es = sorted(pts, key=int)
    ys = [pts[e]["ppl"] for e in es]
    way = "worse" if ys == sorted(ys) else ("better" if ys == sorted(ys, reverse=True) else "not monotone")
    text = (f"- sMLP-det itself at this budget: {' / '.join(f'{y:.1f}' for y in ys)} at {' / '.join(es)} experts "
            f"({way} as experts are added).")
    if d := record.get("dense_at_2"):
        text += (f" At 2 experts against dense gMLP: {d['ppl_a']:.1f} against {d['ppl_b']:.1f}, "
                 f"{_answer(d) if d['verdict'] == 'tie' else LOWER.get(d['verdict'], _answer(d))} ({_ci(d)}).")
    return [text]


def seed_rule_sentence(record: dict) -> str:
    """When each set of seeds was fixed, exactly (the primary pair's 4-5 by a rule committed during the deciding
    stage)."""
    h, ps = record.get("seed_rule"), record.get("primary_seeds") or {}
    if not h:
        return ""
    before = ", ".join(_run_name(r) for r in h["finished_before"]) or "none"
    return (f"Seeds: seeds {'-'.join(map(str, ps.get('others') or [2, 3]))} of every family were fixed before the "
            f"deciding runs; the primary pair's seeds 4-5 by a rule committed in {h['commit']}, when "
            f"{len(h['finished_before'])} of the deciding stage's {h['runs']} runs had finished ({before}), and "
            f"applied whatever they showed (no seed added or dropped on a result); gMLP's seeds 4-5 and the experts "
            f"trend's seeds 3-5 were fixed before their runs.")


def _run_name(run: str) -> str:
    key, _, seed = run.partition(" seed ")
    return f"{NAMES.get(key, key)} seed {seed}"


def same_seed_sentence(record: dict) -> str:
    """The points whose seeds came from two commits, and what the same-seed reruns showed."""
    c = record.get("stage_commits") or {}
    checks = record.get("same_seed") or []
    if not checks:
        return (f"Pooled across commits: the 2- and 32-expert points pool seed 2 (commit {c.get('experts')}) with "
                f"seeds 3-5 ({c.get('experts-seeds')}), and gMLP seeds 2-3 ({c.get('deciding')}) with 4-5 "
                f"({c.get('experts-seeds')}); files on the perplexity path changed between them, and the same-seed "
                f"reruns at {c.get('experts-seeds')} (`smlp-bench fair --stages same-seed`) have not finished.")
    equal = sum(x["equal"] for x in checks)
    return (f"Pooled across commits, re-run at one: each seed a pooled point first ran at an older commit was run "
            f"again at {checks[0]['rerun_commit']}, the commit of its other seeds; {equal} of {len(checks)} reruns "
            f"equal the stored value at the printed precision (table below), and every figure on this page uses the "
            f"reruns, so each point's seeds are one commit's.")


def render_same_seed(record: dict) -> list[str]:
    checks = record.get("same_seed") or []
    if not checks:
        return []
    return ["", "| model | seed | stored (stage, commit) | rerun (commit) | equal at 0.1 |", "|---|---:|---|---|---|",
            *(f"| {_pair_name(x['key'], 'x').split(' against')[0]} | {x['seed']} | {x['ppl']:.2f} ({x['stage']}, "
              f"{x['commit']}) | {x['rerun_ppl']:.2f} ({x['rerun_commit']}) | {'yes' if x['equal'] else 'no'} |"
              for x in checks)]


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
    lines += render_same_seed(record)
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
    text = (f" As experts are added, sMLP-det against {best} at 500 updates: " + "; ".join(
        f"{c['experts']} experts {c['ratio'] - 1:+.1%} ({_ci_short(c)}, {c['seeds'][0]}+{c['seeds'][1]} seeds"
        f"{', a tie' if c['verdict'] == 'tie' else ''})" for c in tied) + ".")
    apart = {c["experts"]: c for c in e.get("comparisons", []) if c["label"].endswith("against the tie")}
    if apart:
        x = max(apart)
        c = apart[x]
        if c["verdict"] == "better":
            advice = "train with `--smoe-experts` set to D / 32 (32 channels per sMoE expert)"
        elif c["verdict"] == "worse":
            advice = "keep the sMoE's experts tied to the tMoE's"
        else:
            advice = "a tie, neither setting shown better at this scale"
        text += (f" With 4 sMoE experts (32 channels each) at {x} tMoE experts sMLP-det reaches {c['ppl_a']:.1f} "
                 f"against {c['ppl_b']:.1f} with the sMoE's experts tied to the tMoE's ({_ci_short(c)}): {advice}.")
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
            f"learning-rate sweep ({_ci(p)}; {p['seeds'][0]} and {p['seeds'][1]} seeds).")
    if g := next((c for c in v.get("secondary", []) if c["against"] == "gmlp" and c["model"] == "smlp_det"), None):
        text += (f" Against dense gMLP (secondary): {_answer(g)} ({g['ppl_a']:.1f} against {g['ppl_b']:.1f}, {_ci(g)}; "
                 f"{g['seeds'][0]} and {g['seeds'][1]} seeds).")
    text += trend_sentences(record)
    if snaps := [x for x in record.get("snapshots") or [] if x.get("last_100") is not None]:
        text += (" These are 500-update snapshots on a corpus read 1.4 times: the gaps to HASH Layers were still "
                 "moving (" + "; ".join(f"{_pair_name(x['a'], x['b']).split(' against')[0]} "
                                        f"{100 * x['last_100']:+.1f} points over the last 100 updates" for x in snaps
                                        if x['b'] != "gmlp") + ").")
    text += (" This is the answer at this small scale only; the paper's claim is at hundreds of millions of "
             "parameters and billions of tokens.") + ("" if record.get("complete") else
                                                       " **PARTIAL: the benchmark has not finished.**")
    lines = [text] + (["", f"![validation perplexity against tokens and against time, the deciding runs]({figure})"]
                      if figure else [])
    return "\n".join([*lines, "", f"Every family's perplexity per seed, the secondary comparisons, the rule and the "
                                  f"expert-count trend: [{Path(page).name}]({page}). Generated by "
                                  f"`smlp-bench --publish`."])
