"""The demo corpus's deciding comparison from its stages' records (benchmarks/fair.py runs them): the verdicts (one
rule, verdicts.T_RULE, decides every published sentence), the trends over width and experts, OUTPUT_DIR/results.json
with its figures; benchmarks/fair_pages.py writes them in words. No speed: the runs share the machine.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
from pathlib import Path

from .presets import MOE_BASELINES, NAMES
from .report import png_axes
from .store import atomic_write_json
from .verdicts import T_RULE, log_spread, t_compare

FAIR_FIGURES = ("lr_sweep.png", "width.png", "experts.png")
METRIC_WORDS = {"ppl": "all positions", "suffix_ppl": "the positions after sMLP-partial's routing prefix"}


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
POOLED = ("seeds", "curves")  # pooled beside the per-seed figures, in the same order
EXPERT_COUNTS = (2, 8, 32)
SMOE_NOTE = ("sMLP-det's sMoE routes deterministically: every token passes through every sMoE expert, each a spatial "
             "gating unit over D/E channels, so with --num-experts alone more experts split the same channels finer "
             "(16 channels per sMoE expert at 8 experts, 4 at 32) rather than adding parameters per token as the "
             "tMoE's experts do; `--smoe-experts 4` keeps 32 channels per sMoE expert, the paper's width (1024 / 32, "
             "Table 8), whatever the tMoE's count. The paper reports no expert sweep for sMLP (its Table 7 is "
             "token-routed gMLP).")


RERUN_STAGE = "same-seed"  # its runs replace the pooled runs of the same key and seed (benchmarks/fair.py)


def pooled_models(records: dict) -> tuple[dict, list[str]]:
    """{model key: its results pooled over the stages that ran it} and the problems found: a key is one model
    (the same fairseq flags and learning rate in every stage) and each seed counts once; a stage whose model of
    the same key differs is left out of the pool, and said. A same-seed rerun (RERUN_STAGE) replaces the seed it
    reran, so that a point's seeds are one commit's."""
    out, problems = {}, []
    for stage in POOLED_STAGES:
        for key, m in ((records.get(stage) or {}).get("models") or {}).items():
            if key not in out:
                out[key] = {**m, "stages": [stage], **{f: list(m.get(f) or []) for f in (*PER_SEED, *POOLED)}}
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
            for f in (*PER_SEED, *POOLED):
                have[f] += list(m.get(f) or [])
    for key, m in ((records.get(RERUN_STAGE) or {}).get("models") or {}).items():
        have = out.get(key)
        if have is None or (m.get("fairseq_flags"), m.get("lr")) != (have.get("fairseq_flags"), have.get("lr")):
            problems.append(f"{key}: the same-seed rerun trained another model under this key; not used")
            continue
        for j, seed in enumerate(m["seeds"]):
            i = have["seeds"].index(seed)
            for f in PER_SEED:
                if m.get(f) and have.get(f):
                    have[f][i] = m[f][j]
            have["curves"] = [c for c in have["curves"] if c["seed"] != seed] + [
                c for c in m.get("curves") or [] if c["seed"] == seed]
            have.setdefault("rerun_seeds", []).append(seed)
    for m in out.values():
        if m["valid_ppl_per_seed"]:
            m["valid_ppl"] = statistics.mean(m["valid_ppl_per_seed"])
    return out, problems


def at_update(model: dict, updates: int) -> dict[int, float]:
    """seed -> validation perplexity at `updates` (the seeds whose curve has that point)."""
    return {c["seed"]: c["ppl"][c["updates"].index(updates)] for c in model.get("curves") or []
            if updates in c.get("updates", [])}


SNAPSHOT_AT = (100, 250, 350, 500)  # updates at which a pair's gap is shown (the deciding budget last)


def snapshot(pooled: dict, a: str, b: str, at: tuple[int, ...] = SNAPSHOT_AT) -> dict | None:
    """Model a's gap to model b along training (the Welch comparison at each of `at`) and how it moved over the last
    100 updates: in percent points, and how many seeds (paired by seed number) moved the same way."""
    ma, mb = pooled.get(a), pooled.get(b)
    if not ma or not mb:
        return None
    points = {}
    for u in at:
        sa, sb = at_update(ma, u), at_update(mb, u)
        if sa and sb:
            points[str(u)] = t_compare(list(sa.values()), list(sb.values()))
    last, before = at[-1], at[-1] - 100
    ga = {s: math.log(v) for s, v in at_update(ma, last).items()}
    gb = {s: math.log(v) for s, v in at_update(mb, last).items()}
    pa, pb = at_update(ma, before), at_update(mb, before)
    paired = [s for s in ga if s in gb and s in pa and s in pb]
    moves = [(ga[s] - gb[s]) - (math.log(pa[s]) - math.log(pb[s])) for s in paired]
    if str(last) not in points or not (sa := at_update(ma, before)) or not (sb := at_update(mb, before)):
        return {"a": a, "b": b, "points": points}
    then = t_compare(list(sa.values()), list(sb.values()))
    return {"a": a, "b": b, "points": points, "last_100": points[str(last)]["ratio"] - then["ratio"],
            "seeds_paired": len(paired), "seeds_moving_down": sum(m < 0 for m in moves)}


def same_seed_checks(records: dict, commits: dict[str, str]) -> list[dict]:
    """Each same-seed rerun against the value it reran: the stage and commit of each, and whether they agree at the
    printed precision (0.1 perplexity)."""
    rerun = (records.get(RERUN_STAGE) or {}).get("models") or {}
    out = []
    for key, m in rerun.items():
        for j, seed in enumerate(m.get("seeds") or []):
            stored = next(((st, r["models"][key]) for st in POOLED_STAGES if (r := records.get(st))
                           and key in r.get("models", {}) and seed in r["models"][key]["seeds"]), None)
            if stored is None:
                continue
            st, sm = stored
            old, new = sm["valid_ppl_per_seed"][sm["seeds"].index(seed)], m["valid_ppl_per_seed"][j]
            out.append({"key": key, "seed": seed, "stage": st, "commit": commits.get(st), "ppl": old,
                        "rerun_commit": commits.get(RERUN_STAGE), "rerun_ppl": new,
                        "equal": f"{old:.1f}" == f"{new:.1f}"})
    return out


def stage_commits(out_dir: Path) -> dict[str, str]:
    """stage -> the commit its runs executed (its store's record), for the stages under OUTPUT_DIR."""
    out = {}
    for store in sorted(Path(out_dir).glob("*/runs.json")):
        if commit := ((json.loads(store.read_text()).get("extra") or {}).get("code") or {}).get("commit"):
            out[store.parent.name] = commit[:7]
    return out


def seed_rule_history(out_dir: Path, commit: str) -> dict | None:
    """Which deciding runs had finished when the primary pair's extra seeds were fixed (`commit`, its time from git):
    the published rule says exactly that."""
    res = subprocess.run(["git", "-C", str(out_dir), "log", "-1", "--format=%ct", commit], capture_output=True,
                         text=True)
    store = Path(out_dir) / "deciding" / "runs.json"
    if res.returncode != 0 or not res.stdout.strip() or not store.exists():
        return None
    at = int(res.stdout.strip())
    runs = [r for r in json.loads(store.read_text())["records"].values() if r.get("kind") == "train"]
    return {"commit": commit, "time": at, "finished_before": sorted(
        f"{r['key']} seed {r['seed']}" for r in runs if r["finished"] < at), "runs": len(runs)}


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
    if (best := rec.get("best_moe")) and "deciding" in records:
        pairs = [("smlp_det", best), ("smlp_det", "gmlp"), *((f"smlp_det_e{e}", f"{best}_e{e}") for e in (2, 32))]
        rec["snapshots"] = [snap for a, b in pairs if (snap := snapshot(pooled, a, b))]
        if (g := _seeds(pooled, "gmlp")) and (d2 := _seeds(pooled, "smlp_det_e2")):
            rec["dense_at_2"] = {**t_compare(d2, g), "model": "smlp_det_e2", "against": "gmlp"}
    commits = stage_commits(out_dir)
    if checks := same_seed_checks(records, commits):
        rec["same_seed"] = checks
    rec["stage_commits"] = commits
    if design.get("primary_seeds", {}).get("committed_in") and (
            h := seed_rule_history(out_dir, design["primary_seeds"]["committed_in"])):
        rec["seed_rule"] = h
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
