"""The kernel-docs comparison's answer (benchmarks/fair.py KERNEL_DOCS runs it): each pair's verdict by the published
rule (verdicts.T_RULE, each side its own seed spread) at every budget, the relative gap against tokens with its
interval, each seed's perplexity and the rates tried; OUTPUT_DIR/results.json, its figures and its page section."""
from __future__ import annotations

from pathlib import Path

from .fair_report import plot_sweep
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
    return {k: m for stage in ("deciding", "experts") for k, m in ((records.get(stage) or {}).get("models")
                                                                   or {}).items()}


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


def sentence(c: dict, a: str, b: str) -> str:
    """One verdict in words: the means, the change, its interval and the seeds."""
    head = f"{_name(a)} {c['ppl_a']:.1f} against {_name(b)} {c['ppl_b']:.1f}, {c['ratio'] - 1:+.1%}"
    if c.get("ci_pct") is None:
        return f"{head}: undecided ({c.get('why_undecided', 'one seed a side')})"
    lo, hi = c["ci_pct"]
    tail = f"(95% CI {lo:+.1%} to {hi:+.1%}, {c['seeds'][0]} and {c['seeds'][1]} seeds)"
    word = {"better": "lower", "worse": "higher", "tie": f"a tie, no difference above {c['bound_pct']:.1%}",
            "undecided": f"undecided ({c.get('why_undecided', '')})"}[c["verdict"]]
    return f"{head} {tail}: {word}"


def final_report(records: dict, out_dir: Path, design: dict) -> dict:
    """OUTPUT_DIR/results.json and its figures from the stages finished so far (`design`: fair.KERNEL_DOCS's)."""
    rates = ((records.get("rate") or {}).get("fair") or {}).get("rates") or {}
    models = pooled_models(records)
    rec = {"kind": "fair-budget", "rule": T_RULE, "budgets": list(BUDGETS), "design": design,
           "stages": {k: f"{k}/results.json" for k in records},
           "stages_complete": {k: bool((records.get(k) or {}).get("complete")) for k in design["settings"]},
           "complete": all((records.get(k) or {}).get("complete") for k in design["settings"]),
           "rates": rates, "pairs": [], "per_seed": {}}
    for key, m in models.items():
        rec["per_seed"][key] = {"name": m.get("name") or _name(key), "lr": m.get("lr"),
                                "ppl": {str(u): {str(s): p for s, p in per_seed(m, u).items()} for u in BUDGETS}}
    for a, b, what in PAIRS:
        at = {str(u): p for u in BUDGETS if (p := pair_at(models, a, b, u, rates))}
        if at:
            rec["pairs"].append({"a": a, "b": b, "what": what, "at": at, "gap": gap_curve(models, a, b, rates),
                                 "text": {u: sentence(c, a, b) for u, c in at.items()}})
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
        print(f"   {NAMES.get(family, family):<28} lr {c['chosen']:g}{'' if c['bracketed'] else ' (edge)'} ({tried})")
    for p in rec.get("pairs") or []:
        for u, text in p["text"].items():
            print(f"   @{u:>5} {text}")

