"""The rules that turn measured figures into yes / no / tied, and the validation curves they read (docs/benchmarks.md);
the report and the docs (benchmarks/report.py, benchmarks/publish.py) only show what these decide."""
from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence

from smlp.profiling import routing_and_all2all

from .presets import MOE_BASELINES, NAMES, REFERENCE

# the perplexity target's name (docs/benchmarks.md replaces it with the long preset's, `long_ppl_target`)
PPL_TARGET_PREFIX = "sMLP-det valid ppl minus the best MoE baseline's"
# two validation perplexities within 1% of each other count as tied when deciding whether the ranking
# still changes (the long preset's second seeds differ by about that much)
RANK_TIE = 0.01


def pooled_log_sd(groups: Iterable[Sequence[float]]) -> dict | None:
    """The seed spread of a comparison: the standard deviation of log perplexity pooled over the models (groups of
    per-seed perplexities) with two seeds or more, and its degrees of freedom. None if no model has two seeds."""
    squares, df = 0.0, 0
    for logs in ([math.log(v) for v in g] for g in groups if len(g) >= 2):
        squares += sum((x - statistics.mean(logs)) ** 2 for x in logs)
        df += len(logs) - 1
    return {"sd": math.sqrt(squares / df), "df": df} if df else None


def compare(a: Sequence[float], b: Sequence[float], sd: float | None) -> dict:
    """Model a against model b from their per-seed perplexities: "better" (a lower) or "worse" when the difference
    of mean log perplexity exceeds twice its standard error, sd x sqrt(1/n_a + 1/n_b) with `sd` the seed spread
    pooled over the comparison's models (`pooled_log_sd`), else "tie"; "undecided" without a spread."""
    out = _means("compare", a, b, se=None, verdict="undecided")
    if sd is not None:
        se = out["se"] = sd * math.sqrt(1 / len(a) + 1 / len(b))
        out["verdict"] = "better" if out["log_diff"] < -2 * se else ("worse" if out["log_diff"] > 2 * se else "tie")
    return out


def _means(rule: str, a: Sequence[float], b: Sequence[float], **fields) -> dict:
    """Both sides' geometric mean perplexities, the difference of mean log perplexity and its ratio."""
    if not a or not b:
        raise ValueError(f"{rule} needs perplexities on both sides, got {len(a)} and {len(b)}")
    la, lb = statistics.mean(math.log(v) for v in a), statistics.mean(math.log(v) for v in b)
    return {"ppl_a": math.exp(la), "ppl_b": math.exp(lb), "log_diff": la - lb, "ratio": math.exp(la - lb),
            "seeds": [len(a), len(b)], **fields}


T_RULE = ("the difference of mean log perplexity with its 95% Welch interval, t(0.975, df) x sqrt(s_a^2/n_a + "
          "s_b^2/n_b), s_a and s_b each side's own seed-to-seed standard deviation of log perplexity (n - 1 in the "
          "denominator) and df from Welch-Satterthwaite, (s_a^2/n_a + s_b^2/n_b)^2 / ((s_a^2/n_a)^2/(n_a - 1) + "
          "(s_b^2/n_b)^2/(n_b - 1)); better or worse when the interval excludes zero, else a tie (no difference "
          "larger than the interval's farther bound); undecided when a side has one seed (its spread is unknown); "
          "a side whose best learning rate is at the edge of the sweep is never called worse; each comparison's "
          "seeds are fixed by a rule that reads no result (when each rule was committed: the page says)")


def log_spread(values: Sequence[float]) -> dict | None:
    """One model's seed spread: the sample standard deviation of log perplexity and its degrees of freedom
    (None with fewer than two seeds)."""
    if len(values) < 2:
        return None
    return {"sd": statistics.stdev(math.log(v) for v in values), "df": len(values) - 1}


def t_compare(a: Sequence[float], b: Sequence[float], spread_a: dict | None = None, spread_b: dict | None = None,
              level: float = 0.95) -> dict:
    """Model a against model b from their per-seed perplexities by T_RULE (Welch: each side its own spread).
    A side with one seed borrows `spread_a` / `spread_b` ({"sd", "df"}, e.g. the same family's spread at the
    deciding budget: a trend's interval, said by `borrowed`); without one the verdict is "undecided". Returns
    the means, the log difference, its standard error and Welch degrees of freedom, the interval (in log and
    as percent changes of perplexity), the bound a tie rules out, and the verdict: "better" (a lower), "worse",
    "tie" or "undecided"."""
    from scipy.stats import t as student_t

    out = _means("t_compare", a, b, sd=None, se=None, df=None, t_crit=None, ci_log=None, ci_pct=None, bound_pct=None,
                 level=level, borrowed=[], verdict="undecided")
    diff = out["log_diff"]
    sides = []
    for name, values, fallback in (("a", a, spread_a), ("b", b, spread_b)):
        own = log_spread(values)
        if own is None and fallback:
            own = {"sd": fallback["sd"], "df": fallback["df"]}
            out["borrowed"].append(name)
        if own is None:
            out["why_undecided"] = "one seed: its spread is unknown"
            return out
        sides.append((own["sd"] ** 2 / len(values), own["df"]))
    var = sides[0][0] + sides[1][0]
    df = var ** 2 / sum(v * v / d for v, d in sides) if var > 0 else float(sides[0][1] + sides[1][1])
    se = math.sqrt(var)
    t_crit = float(student_t.ppf(0.5 + level / 2, df))
    lo, hi = diff - t_crit * se, diff + t_crit * se
    out.update(sd=[math.sqrt(v * n) for (v, _), n in zip(sides, (len(a), len(b)))], se=se, df=df, t_crit=t_crit,
               ci_log=[lo, hi], ci_pct=[math.expm1(lo), math.expm1(hi)],
               bound_pct=max(abs(math.expm1(lo)), abs(math.expm1(hi))),
               verdict="better" if hi < 0 else ("worse" if lo > 0 else "tie"))
    return out


# Validation curves: validation perplexity at increasing x (tokens read, or seconds), compared in log perplexity,
# linearly interpolated between validation points; two curves cross where their difference changes sign inside the x
# range both cover.
def mean_curve(curves: Sequence[dict], xkey: str) -> tuple[list[float], list[float]]:
    """Mean x and geometric-mean perplexity over seeds, point by point (as many points as the shortest curve)."""
    curves = [c for c in curves if c.get("ppl") and c.get(xkey)]  # no time axis without a measured speed
    if not curves:
        return [], []
    n = min(min(len(c["ppl"]), len(c[xkey])) for c in curves)
    return ([statistics.mean(c[xkey][i] for c in curves) for i in range(n)],
            [math.exp(statistics.mean(math.log(c["ppl"][i]) for c in curves)) for i in range(n)])


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation of log y at x (xs increasing, x inside [xs[0], xs[-1]])."""
    if (i := bisect.bisect_left(xs, x)) < len(xs) and xs[i] == x:
        return math.log(ys[i])
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return (1 - t) * math.log(ys[i - 1]) + t * math.log(ys[i])


def crossings(xa: Sequence[float], ya: Sequence[float], xb: Sequence[float], yb: Sequence[float]) -> list[dict]:
    """Where curve a and curve b cross: [{x, ppl, lower_after: 'a' | 'b'}], in increasing x: a sign change of log
    ppl_a - log ppl_b between two neighbouring x of the union of their points (a touch is no crossing)."""
    if len(xa) < 2 or len(xb) < 2:
        return []
    lo, hi = max(xa[0], xb[0]), min(xa[-1], xb[-1])
    grid = sorted({x for x in (*xa, *xb) if lo <= x <= hi})
    out, prev = [], None
    for x in grid if len(grid) >= 2 else []:
        d = _interp(xa, ya, x) - _interp(xb, yb, x)
        if d == 0:
            continue
        if prev is not None and (prev[0] < 0) != (d < 0):
            d0, x0 = prev
            xc = x0 + (x - x0) * d0 / (d0 - d)
            out.append({"x": xc, "ppl": math.exp(_interp(xa, ya, xc)), "lower_after": "b" if d > 0 else "a"})
        prev = (d, x)
    return out


def ranking_history(curves: dict[str, tuple[Sequence[float], Sequence[float]]]) -> list[dict]:
    """The ranking (lowest perplexity first) at every validation point all curves share (by index), with each
    model's perplexity there."""
    n = min((len(ys) for _, ys in curves.values()), default=0)
    return [{"x": statistics.mean(curves[k][0][i] for k in curves),
             "ranking": sorted(curves, key=lambda k: curves[k][1][i]), "ppl": {k: curves[k][1][i] for k in curves}}
            for i in range(n)]


def settled_from(history: Sequence[dict], top: int | None = None, tol: float = 0.0) -> dict | None:
    """The first validation point from which the ranking (its first `top` places) no longer changes, two models
    within `tol` (relative perplexity) of each other counting as tied: {x, index, points_unchanged, fraction,
    tolerance}, fraction = x / the last x; None for no history."""
    if not history:
        return None
    final = history[-1]["ranking"]
    top = top or len(final)

    def agrees(point: dict) -> bool:  # keeps the final ranking's first `top` places, each above everyone after it
        return all(point["ppl"][a] <= point["ppl"][b] * (1 + tol) for i, a in enumerate(final[:top])
                   for b in final[i + 1:])

    i = len(history) - 1
    while i > 0 and agrees(history[i - 1]):
        i -= 1
    return {"x": history[i]["x"], "index": i, "points_unchanged": len(history) - i,
            "fraction": history[i]["x"] / history[-1]["x"] if history[-1]["x"] else None, "tolerance": tol}


def analyse_curves(results: dict, keys: Sequence[str] | None = None) -> dict:
    """Mean curves against tokens and time, where every two of them cross, and the ranking's history."""
    keys = [k for k in (keys or results) if k in results and results[k]["curves"]]
    mean = {x: {k: mean_curve(results[k]["curves"], x) for k in keys} for x in ("tokens", "time")}
    cross = {x: [] for x in mean}
    for x, by in mean.items():
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                for c in crossings(*by[a], *by[b]):
                    cross[x].append({"a": a, "b": b, **c, "lower_after": a if c["lower_after"] == "a" else b})
    history = ranking_history(mean["tokens"])
    return {"mean_curves": {x: {k: {"x": xs, "ppl": ys} for k, (xs, ys) in by.items()} for x, by in mean.items()},
            "crossings": cross, "ranking_history": history,
            "ranking_settled_from": settled_from(history, tol=RANK_TIE),
            "top3_settled_from": settled_from(history, 3, tol=RANK_TIE), "ranking_tie_tolerance": RANK_TIE}


def ppl_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """A curve's perplexity at x, interpolated in log perplexity (None outside the points it has)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    return math.exp(_interp(xs, ys, x))


def verdict(results: dict, analysis: dict, key: str = REFERENCE) -> dict | None:
    """Does `key` (an sMLP) beat the best Transformer-MoE at matched FLOPs: at equal tokens (the end of
    training), at equal time, and is a lead only early? Plain sentences with the figures."""
    moe = [k for k in MOE_BASELINES if k in results and results[k]["valid_ppl"]]
    if key not in results or not moe or not results[key]["valid_ppl"]:
        return None
    best = min(moe, key=lambda k: results[k]["valid_ppl"])
    mine, theirs = results[key], results[best]
    gap = mine["valid_ppl"] - theirs["valid_ppl"]
    noise = max(mine["valid_ppl_std"], theirs["valid_ppl_std"])
    if len(mine["valid_ppl_per_seed"]) < 2 and len(theirs["valid_ppl_per_seed"]) < 2:
        # neither has a second seed: the seed-to-seed spread of the models that have one stands in
        spreads = [m["valid_ppl_std"] for m in results.values() if len(m.get("valid_ppl_per_seed", [])) > 1]
        noise = statistics.median(spreads) if spreads else 0.0
    tok = analysis["mean_curves"]["tokens"]
    xs, ys = tok[key]["x"], tok[key]["ppl"]
    # the best MoE baseline at each validation point (lowest of the four there)
    best_at = [min(tok[k]["ppl"][i] for k in moe if i < len(tok[k]["ppl"])) for i in range(len(ys))]
    lead = [y < b for y, b in zip(ys, best_at)]
    last_lead = max((xs[i] for i, v in enumerate(lead) if v), default=None)
    tim = analysis["mean_curves"]["time"]
    t_end = min(tim[key]["x"][-1], tim[best]["x"][-1]) if tim[key]["x"] and tim[best]["x"] else None
    at_time = None
    if t_end:
        a, b = ppl_at(tim[key]["x"], tim[key]["ppl"], t_end), ppl_at(tim[best]["x"], tim[best]["ppl"], t_end)
        at_time = {"seconds": t_end, "ppl": a, "best_moe_ppl": b, "gap": a - b if a and b else None}
    name, bname = mine["name"], theirs["name"]
    end_tokens = xs[-1] if xs else 0
    if gap < -noise and all(lead[-3:]):
        answer = "yes"
        text = (f"After {end_tokens / 1e6:.2f}M tokens {name} reaches validation perplexity "
                f"{mine['valid_ppl']:.1f} against {theirs['valid_ppl']:.1f} for the best Transformer-MoE ({bname}), "
                f"{-gap:.1f} lower.")
    elif last_lead is not None and gap > noise:
        answer = "only early"
        text = (f"{name} leads the best Transformer-MoE until about {last_lead / 1e6:.2f}M tokens, then "
                f"falls behind; after {end_tokens / 1e6:.2f}M tokens it is at {mine['valid_ppl']:.1f} against "
                f"{theirs['valid_ppl']:.1f} for {bname} ({gap:+.1f}).")
    elif abs(gap) <= noise:
        answer = "tied"
        text = (f"Not distinguishable: after {end_tokens / 1e6:.2f}M tokens {name} is at "
                f"{mine['valid_ppl']:.1f} and {bname} at {theirs['valid_ppl']:.1f}, within the seeds' spread "
                f"(±{noise:.1f}).")
    else:
        answer = "no"
        text = (f"After {end_tokens / 1e6:.2f}M tokens {name} is at {mine['valid_ppl']:.1f} against "
                f"{theirs['valid_ppl']:.1f} for {bname} ({gap:+.1f}), and it does not lead at any validation point.")
    if at_time and at_time["gap"] is not None:
        text += (f" At equal training time ({at_time['seconds'] / 60:.1f} min at the median load) the gap is "
                 f"{at_time['gap']:+.1f}.")
    return {"model": key, "best_moe": best, "answer": answer, "text": text, "ppl": mine["valid_ppl"],
            "best_moe_ppl": theirs["valid_ppl"], "gap": gap, "seed_spread": noise, "last_lead_tokens": last_lead,
            "at_equal_time": at_time, "tokens": end_tokens}


def targets(record: dict) -> list[dict]:
    """The issue's targets, each with the measured figure and whether it is met."""
    results, rat = record["models"], record["ratios"]
    out = []

    def add(name, value, goal, met):
        out.append({"target": name, "measured": value, "goal": goal, "met": bool(met) if value is not None else None})

    v = rat.get("smlp_det_over_fastest_moe")
    add(f"sMLP-det words/s over the fastest MoE baseline ({rat.get('fastest_moe_baseline')}), runs adjacent in time",
        v, ">= 1.10x", v is not None and v >= 1.10)
    d = rat.get("smlp_det_ppl_minus_best_moe")
    add(f"{PPL_TARGET_PREFIX} ({rat.get('best_moe_baseline_ppl')}), after "
        f"{record['settings']['updates']} updates", d, "<= 0", d is not None and d <= 0)
    v = rat.get("transformer_over_fairseq")
    add("our Transformer words/s / fairseq's transformer_lm (same layers, same FLOPs)", v, ">= 0.95x",
        v is not None and v >= 0.95)
    # fairseq's --base-layers inserts attention-free base sublayers, ours (the paper's FLOP count,
    # Table 5) keep attention in the sparse layers: the same layer counts are not the same work, so
    # the like-for-like figure is the training FLOP rate (words/s x training FLOPs per token)
    v = rat.get("base_over_fairseq_base_layers_flop_rate")
    add("our Base Layers FLOP/s / fairseq's --base-layers (its base sublayers skip attention)", v, ">= 0.95x",
        v is not None and v >= 0.95)
    for key in ("smlp_det", "smlp_partial"):
        if key in results and results[key]["mfu"] is not None:
            v = results[key]["mfu"]
            add(f"{NAMES[key]} MFU (of the measured matmul peak)", v, ">= 50%", v >= 0.5)
    for key in ("smlp_det", "smlp_partial", *MOE_BASELINES):
        b = results.get(key, {}).get("breakdown")
        if b:
            v = routing_and_all2all(b)
            add(f"{NAMES[key]} routing + all2all share of a step", v, "<= 15%", v <= 0.15)
    return out


def long_ppl_target(long_record: dict) -> dict | None:
    """The perplexity target at the end of the long preset (replaces the one at the full preset's 60 updates)."""
    v = (long_record.get("verdicts") or {}).get("smlp_det")
    if not v:
        return None
    tokens = v["tokens"]
    state = "" if long_record.get("complete") else ", PARTIAL"
    return {"target": f"{PPL_TARGET_PREFIX} ({v['best_moe']}), at the end of the long preset "
                      f"({tokens / 1e6:.2f}M tokens{state})",
            "measured": v["gap"], "goal": "<= 0", "met": v["gap"] <= 0}
