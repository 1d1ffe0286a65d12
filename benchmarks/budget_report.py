"""The kernel-docs comparison's answer (benchmarks/fair.py KERNEL_DOCS runs it): each pair's verdict by the published
rule (verdicts.T_RULE, each side its own seed spread) at every budget, the relative gap against tokens with its
interval, each seed's perplexity and the rates tried; OUTPUT_DIR/results.json, its figures and its page section."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from .fair_report import plot_sweep, snapshot, stage_commits
from .machine import PERPLEXITY_PATHS, perplexity_changes
from .presets import NAMES
from .report import png_axes
from .store import atomic_write_json
from .verdicts import T_RULE, t_compare

BUDGETS = (500, 1000, 1500)  # updates at which every pair's verdict is given
# (model, against, what the pair asks): keys of the deciding and experts stages
PAIRS = (("smlp_det", "hash", "sMLP-det against HASH Layers, 8 experts (primary)"),
         ("smlp_det", "gmlp", "sMLP-det against dense gMLP, 8 experts"),
         ("smlp_det_e32", "hash_e32", "sMLP-det against HASH Layers, 32 experts"),
         ("smlp_det_e32", "smlp_det", "sMLP-det, 32 experts against 8"),
         ("hash_e32", "hash", "HASH Layers, 32 experts against 8"))
GAP_FIGURE = "gap.png"
POOLED = ("deciding", "experts")  # the stages whose models PAIRS compare


def _name(key: str) -> str:
    base, _, experts = key.partition("_e")
    return f"{NAMES.get(base, base)}{f', {experts} experts' if experts else ''}"


def per_seed(model: dict, updates: int) -> dict[int, float]:
    """seed -> validation perplexity at `updates` (seeds whose run validated there)."""
    out = {}
    for c in model.get("curves") or []:
        if updates in (c.get("updates") or []):
            out[c["seed"]] = c["ppl"][c["updates"].index(updates)]
    return out


def pooled_models(records: dict) -> dict[str, dict]:
    """Every model of the deciding and experts stages by key (the two stages' keys differ)."""
    return {k: m for stage in POOLED for k, m in ((records.get(stage) or {}).get("models") or {}).items()}


def crossed_stages(records: dict) -> list[tuple[str, str]]:
    """The (earlier, later) stages that a pair of PAIRS compares across (32 experts against 8), of those recorded."""
    stage_of = {k: stage for stage in POOLED for k in ((records.get(stage) or {}).get("models") or {})}
    return sorted({tuple(sorted((stage_of[a], stage_of[b]), key=POOLED.index)) for a, b, _ in PAIRS
                   if a in stage_of and b in stage_of and stage_of[a] != stage_of[b]})


def rates_so_far(record: dict) -> dict:
    """A rate stage still running: each family's rates tried so far and its best among them (not yet chosen)."""
    out: dict[str, dict] = {}
    for key, m in (record.get("models") or {}).items():
        family, _, rate = key.partition("@lr")
        if rate and m.get("valid_ppl") is not None:
            out.setdefault(family, {"tried": {}})["tried"][rate] = m["valid_ppl"]
    for c in out.values():
        c.update(chosen=float(min(c["tried"], key=c["tried"].get)), bracketed=None, partial=True)
    return out


def pair_at(models: dict, a: str, b: str, updates: int, rates: dict) -> dict | None:
    """The pair's comparison at one budget (None until both sides have a seed there); a side whose rate is at the
    edge of the rates tried is never called worse."""
    sa, sb = per_seed(models.get(a) or {}, updates), per_seed(models.get(b) or {}, updates)
    if not sa or not sb:
        return None
    c = t_compare(list(sa.values()), list(sb.values()))
    loser = b if c["verdict"] == "better" else (a if c["verdict"] == "worse" else None)
    family = loser and loser.partition("_e")[0]
    if loser is not None and (rates.get(family) or {}).get("bracketed") is False:
        c["verdict"], c["why_undecided"] = "undecided", f"{NAMES[family]}'s best rate is at the edge of those tried"
    return {"updates": updates, "seeds_a": sa, "seeds_b": sb, **c}


def gap_curve(models: dict, a: str, b: str, rates: dict) -> list[dict]:
    """The pair's relative gap and interval at every validation both sides share."""
    ups = sorted({u for k in (a, b) for c in (models.get(k) or {}).get("curves") or [] for u in c["updates"]})
    return [{"tokens": _tokens(models[a], u), **p} for u in ups if (p := pair_at(models, a, b, u, rates))]


def _tokens(model: dict, updates: int) -> int:
    c = next(c for c in model["curves"] if updates in c["updates"])
    return c["tokens"][c["updates"].index(updates)]


def motion(models: dict, a: str, b: str, last: int) -> dict | None:
    """How the pair's gap moved over the 100 updates before `last` (fair_report.snapshot's reading: the change of the
    relative gap of the geometric means, and how many seeds, paired by number, moved the same way), whether toward
    zero, and in how many more updates that pace would close it (two significant digits; a straight line, not a
    measurement)."""
    snap = snapshot(models, a, b, at=(last - 100, last))
    if not snap or snap.get("last_100") is None:
        return None
    move, gap = snap["last_100"], snap["points"][str(last)]["ratio"] - 1
    down, paired = snap["seeds_moving_down"], snap["seeds_paired"]
    direction = ("unchanged" if round(100 * move, 1) == 0  # at the printed precision, 0.1 points
                 else "toward zero" if move * gap < 0 else "away from zero")
    return {"updates": last, "last_100": move, "seeds_paired": paired,
            "seeds_same_way": down if move < 0 else paired - down, "direction": direction,
            "updates_to_zero": int(float(f"{100 * abs(gap / move):.2g}")) if direction == "toward zero" else None}


def motion_words(m: dict) -> str:
    """A gap's motion at the last budget, in words."""
    head = (f"{100 * m['last_100']:+.1f} points over the last 100 updates ({m['seeds_same_way']} of "
            f"{m['seeds_paired']} seeds the same way), ")
    if m["direction"] != "toward zero":
        return head + m["direction"]
    return head + (f"toward zero: at that pace it closes in about {m['updates_to_zero']} more updates (a straight "
                   f"line through the last two validations, not a measurement)")


def sentence(c: dict, a: str, b: str) -> str:
    """One verdict in words: the means, the change, its interval and the seeds."""
    head = f"{_name(a)} {c['ppl_a']:.1f} against {_name(b)} {c['ppl_b']:.1f}, {c['ratio'] - 1:+.1%}"
    if c.get("ci_pct") is None:
        return f"{head}: undecided ({c.get('why_undecided', 'a side with one seed')})"
    lo, hi = c["ci_pct"]
    tail = f"(95% CI {lo:+.1%} to {hi:+.1%}, {c['seeds'][0]} and {c['seeds'][1]} seeds)"
    word = {"better": "lower", "worse": "higher", "tie": f"a tie, no difference above {c['bound_pct']:.1%}",
            "undecided": f"undecided ({c.get('why_undecided', '')})"}[c["verdict"]]
    return f"{head} {tail}: {word}"


def final_report(records: dict, out_dir: Path, design: dict) -> dict:
    """OUTPUT_DIR/results.json and its figures from the stages finished so far (`design`: fair.KERNEL_DOCS's)."""
    rates = ((records.get("rate") or {}).get("fair") or {}).get("rates") or rates_so_far(records.get("rate") or {})
    models = pooled_models(records)
    rec = {"kind": "fair-budget", "rule": T_RULE, "budgets": list(BUDGETS), "design": design,
           "stages": {k: f"{k}/results.json" for k in records},
           "stages_complete": {k: bool((records.get(k) or {}).get("complete")) for k in design["settings"]},
           "complete": all((records.get(k) or {}).get("complete") for k in design["settings"]),
           "progress": {k: [(r := records.get(k) or {}).get("runs_recorded", 0), r.get("runs_scheduled")]
                        for k in design["settings"]},
           "rates": rates, "pairs": [], "per_seed": {},
           "data": max((r["settings"]["data"] for r in records.values() if r.get("settings", {}).get("data")),
                       key=len, default=None)}  # the fullest identity (a stage planned later records more of it)
    for key, m in models.items():
        rec["per_seed"][key] = {"name": m.get("name") or _name(key), "lr": m.get("lr"),
                                "ppl": {str(u): {str(s): p for s, p in per_seed(m, u).items()} for u in BUDGETS}}
    for a, b, what in PAIRS:
        at = {str(u): p for u in BUDGETS if (p := pair_at(models, a, b, u, rates))}
        if at:
            rec["pairs"].append({"a": a, "b": b, "what": what, "at": at, "gap": gap_curve(models, a, b, rates),
                                 "text": {u: sentence(c, a, b) for u, c in at.items()},
                                 "motion": motion(models, a, b, BUDGETS[-1])})
    found = stage_commits(out_dir)
    rec["stage_commits"] = commits = {k: found[k] for k in design["settings"] if k in found}
    rec["code_between"] = {f"{a}..{b}": perplexity_changes(commits[a], commits[b])
                           for a, b in crossed_stages(records) if a in commits and b in commits}
    if rates:
        plot_sweep(rates, out_dir / "rates.png")
    if rec["pairs"]:
        plot_gaps(rec["pairs"], out_dir / GAP_FIGURE)
    atomic_write_json(out_dir / "results.json", rec)
    return rec


def plot_gaps(pairs: list[dict], path: Path) -> None:
    with png_axes(path, "the relative gap against tokens read (below 0: the first model lower)", "tokens read",
                  "perplexity difference (%), 95% Welch interval", figsize=(7.5, 4.5), legend_size=7) as ax:
        for p in pairs:
            pts = [g for g in p["gap"] if g.get("ci_pct")]
            xs = [g["tokens"] for g in p["gap"]]
            line, = ax.plot(xs, [100 * (g["ratio"] - 1) for g in p["gap"]], marker="o", ms=3, label=p["what"])
            if pts:
                ax.fill_between([g["tokens"] for g in pts], [100 * g["ci_pct"][0] for g in pts],
                                [100 * g["ci_pct"][1] for g in pts], color=line.get_color(), alpha=0.15)
        ax.axhline(0, color="grey", lw=0.8)


def print_summary(rec: dict) -> None:
    for family, c in (rec.get("rates") or {}).items():
        tried = ", ".join(f"{r}: {p:.1f}" for r, p in c["tried"].items())
        edge = " (so far)" if c.get("partial") else "" if c["bracketed"] else " (edge)"
        print(f"   {NAMES.get(family, family):<28} lr {c['chosen']:g}{edge} ({tried})")
    for p in rec.get("pairs") or []:
        for u, text in p["text"].items():
            print(f"   @{u:>5} {text}")
        if p.get("motion"):
            print(f"          the gap at {p['motion']['updates']}: {motion_words(p['motion'])}")



DOCS_START, DOCS_END = "<!-- smlp-bench-fair-docs:start -->", "<!-- smlp-bench-fair-docs:end -->"
DOCS_FIGURES = ("gap.png", "rates.png")
WORDS = {"better": "lower", "worse": "higher", "tie": "tie", "undecided": "undecided"}


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if c.get("ci_pct") is None:
        return f"{c['ratio'] - 1:+.1%} (undecided: a side with one seed)"
    lo, hi = c["ci_pct"]
    return f"{c['ratio'] - 1:+.1%} [{lo:+.1%}, {hi:+.1%}]: {WORDS[c['verdict']]}"


def _geo(values: list[float]) -> str:
    return f"{math.exp(statistics.mean(math.log(v) for v in values)):.1f}" if values else "-"


def progress(record: dict) -> str:
    """How far each stage has come, for a partial record."""
    done, runs = record.get("stages_complete") or {}, record.get("progress") or {}
    return ", ".join(f"{k} " + ("done" if v else f"{runs[k][0]} of {runs[k][1]} runs" if runs.get(k, [0])[0]
                                else "to come") for k, v in done.items())


def render_docs(record: dict, figures: dict[str, str]) -> str:
    """docs/benchmarks.md's section on the kernel-docs comparison: the verdicts at each budget, the gap figure, every
    seed's perplexity and the rates tried (figures: name -> link)."""
    d, budgets = record["design"], record["budgets"]
    t = d["target"]
    s = d["settings"]["deciding"]
    tokens = s["updates"] * s["batch_size"] * t["seq_len"] * 2
    data = record.get("data") or {}
    corpus = (f"{data['source']}, kept in launch/corpora/{data['corpus']}/; {data['train_tokens'] / 1e6:.2f}M "
              f"training tokens at 4000 pieces, of which a run reads {tokens / data['train_tokens']:.0%}"
              if data.get("train_tokens") else "launch/corpora/kernel-docs/")
    lines = [f"The same question on a corpus the runs read once: the kernel's English documentation ({corpus}). "
             f"gMLP, sMLP-det and HASH Layers FLOP-matched at D={t['d_model']}, F={t['d_ffn']}, T={t['seq_len']}, "
             f"{t['dense']}+{t['sparse']} blocks, 2 CPU ranks, {s['updates']} updates ({tokens / 1e6:.1f}M tokens), "
             f"validated every {s['validate_every']} updates; seeds {', '.join(map(str, d['seeds']))} for every "
             f"model, fixed in the plan before any run.", ""]
    if not record.get("complete"):
        lines += [f"**PARTIAL: {progress(record)}; every figure below may change.**", ""]
    if record["pairs"]:
        lines += ["Each pair at each budget: the relative perplexity difference of the first model, its 95% Welch "
                  "interval and the verdict (the rule below):", "",
                  "| pair | " + " | ".join(f"{u} updates" for u in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for p in record["pairs"]:
            lines.append(f"| {p['what']} | " + " | ".join(_cell(p["at"].get(str(u))) for u in budgets) + " |")
        if "gap.png" in figures:
            lines += ["", f"![the relative gap against tokens with its interval]({figures['gap.png']})"]
        if moving := [p for p in record["pairs"] if p.get("motion")]:
            last = moving[0]["motion"]["updates"]
            lines += ["", f"Still moving at {last} updates? Each gap's change over the last 100 updates (a gap's "
                          f"relative difference, in percent points; seeds paired by number). Each verdict is the "
                          f"answer at its budget: where a gap still closes, a longer run can change it.", ""]
            lines += [f"- {p['what']}: {motion_words(p['motion'])}" for p in moving]
    if per := record.get("per_seed"):
        lines += ["", "Validation perplexity per seed (geometric mean first) at each budget:", "",
                  "| model | lr | " + " | ".join(f"{u} updates" for u in budgets) + " |",
                  "|---|---:|" + "---|" * len(budgets)]
        for m in per.values():
            cells = []
            for u in budgets:
                seeds = m["ppl"].get(str(u)) or {}
                cells.append(f"{_geo(list(seeds.values()))} ({', '.join(f'{v:.1f}' for v in seeds.values())})"
                             if seeds else "-")
            lines.append(f"| {m['name']} | {m['lr']:g} | " + " | ".join(cells) + " |")
    if rates := record.get("rates"):
        lines += ["", f"Rates: each family at the demo sweep's rate, half and twice (seed 1, "
                      f"{d['settings']['rate']['updates']} updates; one more rate past an edge), final validation "
                      f"perplexity:", "", "| model | rates tried: ppl | chosen | inside the rates tried |",
                  "|---|---|---:|---|"]
        for key, c in rates.items():
            tried = ", ".join(f"{r}: {v:.1f}" for r, v in sorted(c["tried"].items(), key=lambda kv: float(kv[0])))
            inside = "so far" if c.get("partial") else "yes" if c["bracketed"] else "no"
            best = f"{c['chosen']:g}" + (" (best so far)" if c.get("partial") else "")
            lines.append(f"| {NAMES.get(key, key)} | {tried} | {best} | {inside} |")
        if "rates.png" in figures:
            lines += ["", f"![final perplexity against learning rate]({figures['rates.png']})"]
    if code := code_sentence(record):
        lines += ["", code]
    lines += ["", f"Rule: {record['rule']}.", "", "Generated by `smlp-bench fair --corpus kernel-docs` from "
              "`docs/benchmark/fair-docs/results.json` and its stages' stores."]
    return "\n".join(lines)


def code_sentence(record: dict) -> str | None:
    """Which commit each stage's runs executed, and for the pairs compared across two stages, the files that decide
    perplexity (machine.PERPLEXITY_PATHS) that differ between their commits."""
    commits = record.get("stage_commits") or {}
    if not commits:
        return None
    text = "Code: each stage's runs executed one commit (" + ", ".join(f"{k} {c}" for k, c in commits.items()) + ")."
    for span, files in (record.get("code_between") or {}).items():
        a, b = span.split("..")
        differ = ("git could not tell which" if files is None else "none differ" if not files
                  else ", ".join(f"`{f}`" for f in files))
        text += (f" The pairs across the {a} and {b} stages compare {commits[a]} with {commits[b]}; the files on the "
                 f"perplexity path ({', '.join(PERPLEXITY_PATHS)}) that differ between them: {differ}.")
    return text


def render_docs_summary(record: dict, page: str) -> str | None:
    """README's answer on the corpus read once, from the primary pair at the last budget (None until its deciding
    stage has finished)."""
    if not (record.get("stages_complete") or {}).get("deciding") or not record.get("pairs"):
        return None
    by = {(p["a"], p["b"]): p for p in record["pairs"]}
    last = str(record["budgets"][-1])
    p = by.get(("smlp_det", "hash"))
    if p is None or last not in p["at"]:
        return None
    c = p["at"][last]
    answer = {"better": "yes", "worse": "no", "tie": "a tie", "undecided": "undecided"}[c["verdict"]]
    text = (f"**On a corpus read once (the kernel's documentation, 6.1M tokens): does sMLP-deterministic beat the "
            f"best Transformer-MoE at matched FLOPs? {answer}.** {p['text'][last]}. Along the way: "
            + "; ".join(f"{u} updates {_cell(p['at'][str(u)])}" for u in record["budgets"][:-1] if str(u) in p["at"]))
    if m := p.get("motion"):
        state = {"toward zero": "still shrinking", "away from zero": "still growing"}.get(m["direction"], "steady")
        text += (f". At {last} updates the gap was {state}: {motion_words(m)}"
                 + (", so this is the answer at this budget, not a settled order" if state != "steady" else ""))
    if (g := by.get(("smlp_det", "gmlp"))) and last in g["at"]:
        text += f". Against dense gMLP: {g['text'][last]}"
    if (e := by.get(("smlp_det_e32", "hash_e32"))) and last in e["at"]:
        done, planned = (record.get("progress") or {}).get("experts") or [None, None]
        so_far = "" if (record.get("stages_complete") or {}).get("experts") else (
            f" (so far: the experts stage has run {done} of {planned} runs)")
        text += f". At 32 experts{so_far}: {e['text'][last]}"
    return text + f" ([{Path(page).name}]({page}#the-answer-on-a-corpus-read-once))."
