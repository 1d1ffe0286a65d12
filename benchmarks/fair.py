"""The deciding benchmark: does sMLP beat Transformer-MoE at matched FLOPs, in a fair fight?

    smlp-bench --fair [--output-dir docs/benchmark/fair] [--work-dir DIR] [--resume] [--commit-store]
                      [--stages lr-sweep,deciding,experts[,width]] [--no-pin]

Every family FLOP-matched to sMLP-deterministic (9 dense + 3 sparse blocks, D=128, F=512, T=128) with
what MoE research uses and what makes a comparison fair:

- experts: 8 per sparse layer (4 local experts per rank on 2 ranks), not one per rank: at 2 experts
  GShard's top-2 sends every token to both and the sparse layers add nothing;
- attention heads of the paper's width (heads = D / 64);
- a learning rate per family, from a sweep (stage 1), and deciding runs on seeds the sweep never used,
  so the luck of the run a rate was chosen on does not carry into the result;
- evaluation routing: the balanced routers (Base Layers, the sMLP tMoE, sMLP-partial's sMoE) route each
  token by its score minus the expert prices averaged over training (`--balanced-eval-routing priced`,
  smlp/routing/prices.py): per token and causal like greedy routing, but as training assigns. Every run
  also logs greedy routing and the training-time assignment over the batch (not causal) as diagnostics;
- the same positions: every run also logs its perplexity on the positions sMLP-partial predicts
  (after its 20% routing prefix, `--valid-suffix-from`), and sMLP-partial is compared on those;
- one primary comparison with a Welch t interval (benchmarks/verdicts.py `t_compare`, each side its own
  seed spread): sMLP-det against the Transformer-MoE with the best perplexity in the sweep, on seeds fixed
  before any deciding run (2-5 for that pair, 2-3 for every other family); every other comparison is
  secondary. Speed is the speed benchmark's (smlp_bench.speed): these runs share the machine with
  whatever else runs, so no speed from them is published.

Stages, each its own interleaved, resumable run store (benchmarks/schedule.py) in OUTPUT_DIR/STAGE/
(runs.json and results.json, committed to the repository as runs finish with --commit-store; the
runs' logs go to --work-dir), planned from the stages before it:

1. lr-sweep   every family at 2e-3, 4e-3 and 8e-3, 200 updates (0.82M tokens), seed 1, no speed probes.
              A family whose best rate is at an edge gets the next rate beyond it (a factor 2, at most
              twice, within 1e-3..3.2e-2).
2. deciding   every family at its rate, seeds 2 and 3, 500 updates (2.05M tokens); seeds 4 and 5 for
              sMLP-det and the sweep's best Transformer-MoE (the primary pair), fixed in advance.
3. experts    sMLP-det and the best Transformer-MoE at 2 and 32 experts, seed 2: a trend, not a verdict.
4. width      (opt-in: --stages width) sMLP-det and the best Transformer-MoE at D=256 (F=1024), seed 2.

Pinned code (benchmarks/pinned.py): a stage runs the code of the commit it started at. Its models are
planned, its commands built and its trainings executed from a worktree of that commit (WORK_DIR/code/),
in the installed environment; a commit to this checkout never stops a stage nor leaks into its runs,
and every run records the commit it executed. `--no-pin` runs this checkout's code instead (trying out
uncommitted code): such a stage resumes only where the code that decides perplexity
(machine.PERPLEXITY_PATHS) is unchanged since it started.
"""
from __future__ import annotations

import functools
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from . import machine, pinned
from . import schedule as S
from .machine import code_identity, perplexity_changes
from .plan import probe_reference, run_schedule
from .plots import png_axes
from .presets import LONG_TARGET, MOE_BASELINES, NAMES, BenchError, Model, models_from_plan, plan_models, target_flags
from .report import report
from .schedule import atomic_write_json
from .verdicts import T_RULE, log_spread, t_compare

FAIR_TARGET = dict(LONG_TARGET, experts=8)
WIDE_TARGET = dict(FAIR_TARGET, d_model=256, d_ffn=1024)
FAMILIES = ("smlp_det", "smlp_partial", "gmlp", "transformer", *MOE_BASELINES)
RATES = (2e-3, 4e-3, 8e-3)
WIDEN = 2                      # at most this many rates added beyond an edge of the sweep
RATE_BOUNDS = (1e-3, 3.2e-2)   # never beyond these
EXPERT_SWEEP = (2, 32)
SWEEP_SEED, DECIDING_SEEDS = 1, (2, 3)
PRIMARY_SEEDS = (4, 5)  # more seeds for the primary pair (sMLP-det, the sweep's best MoE): fixed before any result
COMMON = dict(batch_size=16, log_interval=10, validate_every=50, valid_steps=10, warmup=50, lr=2e-3)
STAGE_SETTINGS = {
    "lr-sweep": dict(COMMON, seeds=[SWEEP_SEED], updates=200, probe_updates=0, profile_steps=0),
    "deciding": dict(COMMON, seeds=list(DECIDING_SEEDS), updates=500, probe_updates=20, profile_steps=3),
    "experts": dict(COMMON, seeds=[DECIDING_SEEDS[0]], updates=500, probe_updates=0, profile_steps=0),
    "width": dict(COMMON, seeds=[DECIDING_SEEDS[0]], updates=500, probe_updates=0, profile_steps=0),
}
STAGES = tuple(STAGE_SETTINGS)
DEFAULT_STAGES = ("lr-sweep", "deciding", "experts")  # `width` only when asked for (--stages width)


@dataclass
class Context:
    """What a stage is planned from: the vocabulary, the ranks, and the finished stages' records."""

    vocab_size: int
    nproc: int
    records: dict  # stage name -> its results.json record
    code: pinned.Checkout | None = None  # the stage's pinned commit (None: this checkout's code)

    def rate(self, family: str) -> float:
        return self.records["lr-sweep"]["fair"]["rates"][family]["chosen"]

    def best_moe(self) -> str:
        """The Transformer-MoE the primary comparison is made against: the best in the sweep, so that the
        deciding runs it is then compared on did not choose it."""
        return self.records["lr-sweep"]["fair"]["best_moe"]


def criterion_flags(target: dict, vocab_size: int, nproc: int, code: pinned.Checkout | None = None) -> list[str]:
    """Every run also scores the positions sMLP-partial predicts and its balanced routers' training assignment."""
    flags = [*target_flags(target, nproc)[2:], "--smoe-routing", "partial"]
    if code is not None:
        start = code.ask("prediction_start", flags=flags, vocab_size=vocab_size)["start"]
    else:
        from smlp_eval import flops as F

        start = F.parse_model("smlp_lm", flags, vocab_size=vocab_size).cfg.prediction_start
    return ["--valid-suffix-from", str(start), "--valid-trained-routing", "--valid-greedy-routing"]


def _matched(ctx: Context, target: dict, keys: Sequence[str]) -> dict[str, Model]:
    return dict(_plan(ctx.code, ctx.vocab_size, ctx.nproc, tuple(keys), json.dumps(target, sort_keys=True)))


@functools.lru_cache(maxsize=32)
def _plan(code: pinned.Checkout | None, vocab_size: int, nproc: int, keys: tuple[str, ...],
          target: str) -> tuple[tuple[str, Model], ...]:
    """The FLOP-matched models of a target by the stage's code, planned once per process (every stage asks
    again; Models are only ever copied with `replace`)."""
    if code is not None:
        plan = code.ask("plan", vocab_size=vocab_size, nproc=nproc, keys=list(keys), target=json.loads(target))
        models = models_from_plan(plan)
    else:
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
    keys = ("smlp_det", ctx.best_moe())
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


BUILDERS: dict[str, Callable[[Context], list[Model]]] = {
    "lr-sweep": sweep_models,
    "deciding": deciding_models,
    "experts": expert_models,
    "width": width_models,
}
TARGETS = {"lr-sweep": FAIR_TARGET, "deciding": FAIR_TARGET, "experts": FAIR_TARGET, "width": WIDE_TARGET}
# what each stage is planned from
NEEDS = {"lr-sweep": (), "deciding": ("lr-sweep",), "experts": ("lr-sweep",), "width": ("lr-sweep",)}


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
            if best == rates[0] and rates[0] / 2 >= RATE_BOUNDS[0] * (1 - 1e-9):
                nxt = rates[0] / 2
            elif best == rates[-1] and rates[-1] * 2 <= RATE_BOUNDS[1] * (1 + 1e-9):
                nxt = rates[-1] * 2
        at_edge = best in (rates[0], rates[-1])
        out[family] = {"tried": {f"{r:g}": by_rate[r] for r in rates}, "chosen": best, "next": nxt,
                       "bracketed": not at_edge, "widened": widened.get(family, 0)}
    return out


def best_moe_of_sweep(rates: dict[str, dict]) -> str | None:
    """The Transformer-MoE whose best sweep perplexity is lowest: the primary comparison's opponent."""
    moe = [k for k in MOE_BASELINES if k in rates]
    return min(moe, key=lambda k: rates[k]["tried"][f"{rates[k]['chosen']:g}"]) if moe else None


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
        _append_round(store, [m.key for m in added], [SWEEP_SEED])
        store.plan["models"].extend(m.as_dict() for m in added)
        store.extra.setdefault("added_models", []).extend(m.key for m in added)
        store.save()
    return added


def _append_round(store: S.RunStore, keys: list[str], seeds: list[int]) -> None:
    phase = max(s.phase for s in store.slots) + 1
    first_round = max(s.round for s in store.slots) + 1
    rounds = S.seed_rounds(keys, seeds, store.plan["order_seed"], phase=phase, first_round=first_round)
    store.slots = S.extend_schedule(store.slots, rounds, probe_reference(store.plan))


def primary_seeds(store: S.RunStore, ctx: Context) -> list[str]:
    """The deciding stage's extra seeds (PRIMARY_SEEDS) for sMLP-det and the sweep's best Transformer-MoE,
    appended once, whatever the results so far: the number of seeds is fixed before the data are seen (no
    seed added because an interval held zero). Returns the models given them (none when already appended)."""
    if "primary_seeds" in store.extra:
        return []
    keys = ["smlp_det", ctx.best_moe()]
    _append_round(store, keys, list(PRIMARY_SEEDS))
    store.extra["primary_seeds"] = {"models": keys, "seeds": list(PRIMARY_SEEDS),
                                    "rule": "fixed in advance: the primary pair runs seeds 2-5, every other family "
                                            "seeds 2-3"}
    store.save()
    return keys


# ---------------------------------------------------------------- running the stages


def check_code(store_path: Path, stage: str) -> dict:
    """The code identity to record for a stage; refuses to resume a stage whose runs came from other code
    that decides perplexity (machine.PERPLEXITY_PATHS) than the code running now."""
    now = code_identity()
    if now["dirty"]:
        raise BenchError(f"stage {stage}: the code that decides perplexity has uncommitted changes "
                         f"(git status -- {' '.join(('smlp/', 'fairseq_plugins/', 'launch/'))}): commit them, or run "
                         f"the benchmark from a clean checkout, so that every run records the code it ran")
    if not store_path.exists():
        return now
    started = (S.RunStore.load(store_path).extra.get("code") or {}).get("commit")
    if started is None or now["commit"] is None:
        return now
    changed = perplexity_changes(started, now["commit"])
    if changed is None:
        raise BenchError(f"stage {stage} started at commit {started[:10]}, which this checkout does not know: "
                         f"resume from a checkout that has it (git fetch), or restart the stage (remove "
                         f"{store_path.parent})")
    if changed:
        raise BenchError(f"stage {stage} started at commit {started[:10]}; since then {len(changed)} file(s) that "
                         f"decide perplexity changed ({', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''}): "
                         f"resume from a checkout of {started[:10]} (git worktree add ../fair-code {started[:10]}), "
                         f"or restart the stage (remove {store_path.parent})")
    return {**now, "stage_commit": started}


def commit_store(path: Path, message: str, attempts: int = 5) -> bool:
    """Commit the files under `path` (a stage's store and report) and nothing else to the repository holding
    it; retried while another git process holds the index. False (said, not raised) when it cannot."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=60)

    for attempt in range(attempts):
        add = git("add", "--", ".")
        res = git("commit", "-q", "-m", message, "--only", "--", ".") if add.returncode == 0 else add
        if res.returncode == 0 or "nothing to commit" in (res.stdout + res.stderr):
            return True
        time.sleep(2 + 3 * attempt)
    print(f"   (could not commit {path}: {(res.stderr or res.stdout).strip()[:300]})", flush=True)
    return False


def stage_code(store_path: Path, stage: str, work_dir: Path) -> pinned.Checkout:
    """The pinned code of a stage: the commit it started at (recorded in its store), or this checkout's commit
    for a stage not started yet; its worktree made under work_dir/code/."""
    repo = machine.CODE_ROOT
    started = (S.RunStore.load(store_path).extra.get("code") or {}).get("commit") if store_path.exists() else None
    now = code_identity()
    commit = started or now["commit"]
    if commit is None:
        raise BenchError(f"stage {stage}: {repo} is not a git checkout, so no commit can be pinned for its runs: "
                         f"run the benchmark from a clone, or pass --no-pin to run this folder's code")
    if started is None and now["dirty"]:
        print(f"   stage {stage} pins commit {commit[:10]}: uncommitted changes under "
              f"{', '.join(machine.PERPLEXITY_PATHS)} are not part of its runs", flush=True)
    code = pinned.checkout(commit, work_dir, repo)
    if now["commit"] and now["commit"] != code.commit and pinned.environment_changes(repo, code.commit, now["commit"]):
        print(f"   note: pyproject.toml changed since {code.commit[:10]}; the pinned code runs in the environment "
              f"installed now", flush=True)
    print(f"   stage {stage}: its runs execute commit {code.commit[:10]} ({code.root})", flush=True)
    return code


def _recorded_models(store_path: Path) -> tuple[list[Model], dict] | None:
    """A started stage's models and settings as its store recorded them (the models it added itself while it
    ran excluded): a pinned stage resumes its own plan, whatever this checkout would plan now."""
    if not store_path.exists():
        return None
    store = S.RunStore.load(store_path)
    added = set(store.extra.get("added_models", ()))
    return [m for m in models_from_plan(store.plan) if m.key not in added], dict(store.plan["settings"])


def run_stage(stage: str, ctx: Context, data: Path, out_dir: Path, *, order_seed: int = 1,
              log_dir: Path | None = None, commit: bool = False, pin: bool = True) -> dict:
    """Train one stage (resuming where it stopped) and return its report record with the stage's analysis.
    Pinned (the default) its runs execute the stage's commit (`stage_code`); else this checkout's code."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store_path = out_dir / "runs.json"
    resume = store_path.exists()  # main() asked for --resume before continuing a started benchmark
    if pin:
        ctx = replace(ctx, code=stage_code(store_path, stage, log_dir or Path("results/fair-work").absolute()))
        code = {"commit": ctx.code.commit}
    else:
        code = check_code(store_path, stage)
    recorded = _recorded_models(store_path) if pin else None
    if recorded is not None:
        models, settings = recorded
    else:
        models = BUILDERS[stage](ctx)
        settings = dict(STAGE_SETTINGS[stage], target=TARGETS[stage],
                        criterion_flags=criterion_flags(TARGETS[stage], ctx.vocab_size, ctx.nproc, ctx.code))
    settings["models"] = tuple(m.key for m in models)
    reference = models[0].key

    def after_run():
        if commit:
            commit_store(out_dir, f"fair benchmark, stage {stage}: a run finished")

    def before_runs(store: S.RunStore):
        if stage == "deciding" and (keys := primary_seeds(store, ctx)):
            print(f"   seeds {', '.join(map(str, PRIMARY_SEEDS))} for the primary pair: {', '.join(keys)}", flush=True)

    while True:
        store = run_schedule(f"fair/{stage}", settings, models, {"stage": stage}, data, ctx.nproc, out_dir,
                             resume=resume, order_seed=order_seed, reference=reference,
                             log_dir=(log_dir / stage) if log_dir else None, after_run=after_run,
                             extra={"code": {"commit": code["commit"], "checked": "machine.PERPLEXITY_PATHS"}},
                             code=ctx.code, before_runs=before_runs)
        record = report(store, out_dir, quiet=True)
        added = [m.key for m in widen_sweep(store, ctx, record)] if stage == "lr-sweep" else []
        if not added:
            break
        print(f"   widening the sweep: {', '.join(added)}", flush=True)
        resume = True
    record["fair"] = analyse_stage(stage, record, store)
    atomic_write_json(out_dir / "results.json", record)
    if commit:
        commit_store(out_dir, f"fair benchmark, stage {stage}: finished")
    return record


def analyse_stage(stage: str, record: dict, store: S.RunStore) -> dict:
    res = record["models"]
    if stage == "lr-sweep":
        choice = choose_rates(rates_tried(record), store.extra.get("widened", {}))
        return {"rates": choice, "best_moe": best_moe_of_sweep(choice),
                "best_moe_rule": "the Transformer-MoE with the lowest perplexity at its best rate in the sweep"}
    return {"seed_spread": {k: log_spread(m["valid_ppl_per_seed"]) for k, m in res.items()}, "rule": T_RULE,
            "code": store.extra.get("code"), "primary_seeds": store.extra.get("primary_seeds")}


# ---------------------------------------------------------------- the comparison's answers


def _seeds(res: dict, key: str, metric: str = "ppl") -> list[float]:
    m = res.get(key) or {}
    return list(m.get("valid_ppl_per_seed" if metric == "ppl" else f"valid_{metric}_per_seed") or [])


def _bracketing(rates: dict, family: str) -> dict:
    c = rates.get(family) or {}
    return {"rate": c.get("chosen"), "bracketed": c.get("bracketed")}


def _judged(c: dict, a: str, b: str, rates: dict) -> dict:
    """A comparison with both sides' rates beside it: a side whose best rate is at the edge of the sweep
    cannot be called worse (a rate beyond the edge might have done better)."""
    ra, rb = _bracketing(rates, a), _bracketing(rates, b)
    out = {**c, "rates": {a: ra, b: rb}}
    loser = b if c["verdict"] == "better" else (a if c["verdict"] == "worse" else None)
    if loser is not None and (rates.get(loser) or {}).get("bracketed") is False:
        out["verdict"] = "undecided"
        out["why_undecided"] = (f"{NAMES.get(loser, loser)}'s best rate ({rates[loser]['chosen']:g}) is at the "
                                f"edge of the sweep")
    return out


def verdicts(deciding: dict, sweep: dict) -> dict:
    """The primary comparison (sMLP-det against the sweep's best Transformer-MoE, all positions, the balanced
    routers evaluating priced) and the secondary ones, each with its 95% Welch interval (T_RULE: each side its
    own seed spread) and both sides' rates; the greedy and training-time routings as diagnostic columns, never a
    verdict. The one place that decides the published sentences."""
    res = deciding["models"]
    rates, best = sweep.get("rates") or {}, sweep.get("best_moe")
    out = {"rule": T_RULE, "best_moe": best, "primary": None, "secondary": [], "diagnostics": {}}

    def comparison(a, b, metric, label):
        sa, sb = _seeds(res, a, metric), _seeds(res, b, metric)
        if not sa or not sb:
            return None
        c = _judged(t_compare(sa, sb), a, b, rates)
        return {"model": a, "against": b, "metric": metric, "scored": label, **c,
                "text": describe_t(c, NAMES.get(a, a), NAMES.get(b, b))}

    if best is not None:
        out["primary"] = comparison("smlp_det", best, "ppl", "all positions")
    for b in (k for k in ("gmlp", "transformer", *MOE_BASELINES) if k != best):
        if c := comparison("smlp_det", b, "ppl", "all positions"):
            out["secondary"].append(c)
    for b in (best, "gmlp"):  # sMLP-partial on the positions it predicts, sMLP-det on the same positions beside it
        c = comparison("smlp_partial", b, "suffix_ppl", "positions after the routing prefix") if b else None
        if c:
            out["secondary"].append(c)
    if c := comparison("smlp_partial", "smlp_det", "suffix_ppl", "positions after the routing prefix"):
        out["secondary"].append(c)
    for key, m in res.items():
        out["diagnostics"][key] = {metric: m.get(f"valid_{metric}") for metric in
                                   ("ppl", "greedy_routing_ppl", "trained_routing_ppl")}
    return out


def _df(df: float | None) -> str:
    return "-" if df is None else f"{df:.1f}"


def describe_t(c: dict, a: str, b: str) -> str:
    """One comparison in words, with its interval: "sMLP-det 88.1 vs HASH 92.3: -4.6% (95% CI -7.1% to -2.0%,
    4 vs 4 seeds, Welch df 5.8): lower (better)"; a tie says how large a difference the interval rules out."""
    if c.get("ci_pct") is None:
        why = c.get("why_undecided") or "no seed spread known"
        return f"{a} {c['ppl_a']:.1f} vs {b} {c['ppl_b']:.1f}: {c['ratio'] - 1:+.1%} ({why}): undecided"
    lo, hi = c["ci_pct"]
    head = (f"{a} {c['ppl_a']:.1f} vs {b} {c['ppl_b']:.1f}: {c['ratio'] - 1:+.1%} (95% CI {lo:+.1%} to {hi:+.1%}, "
            f"{c['seeds'][0]} vs {c['seeds'][1]} seeds, Welch df {_df(c['df'])})")
    if c["verdict"] == "tie":
        return f"{head}: no difference larger than {c['bound_pct']:.1%} at this budget"
    if c["verdict"] == "undecided":
        return f"{head}: undecided ({c.get('why_undecided', 'no seed spread')})"
    return f"{head}: {a} {'lower (better)' if c['verdict'] == 'better' else 'higher (worse)'}"


def _trend_gap(a: list[float], b: list[float], spreads: dict, ka: str, kb: str) -> dict | None:
    """A trend point's gap: one seed a side borrows the family's own spread at the deciding budget."""
    return t_compare(a, b, spreads.get(ka), spreads.get(kb)) if a and b else None


def width_trend(deciding: dict, width: dict, best: str) -> dict:
    """sMLP-det's gap (log perplexity) to the best Transformer-MoE at D=128 (the deciding seeds) and D=256 (one
    seed each, each family's spread borrowed from its deciding seeds): a trend, not a verdict."""
    spreads = deciding["fair"]["seed_spread"]
    points = []
    for d_model, res in ((FAIR_TARGET["d_model"], deciding["models"]), (WIDE_TARGET["d_model"], width["models"])):
        if c := _trend_gap(_seeds(res, "smlp_det"), _seeds(res, best), spreads, "smlp_det", best):
            points.append({"d_model": d_model, **c})
    return {"points": points, "best_moe": best,
            "label": "trend (one seed per model at D=256, spreads borrowed from the deciding seeds), not a verdict"}


def expert_trend(deciding: dict, experts: dict, best: str) -> dict:
    """Final perplexity against the expert count for sMLP-det and the best Transformer-MoE (8: the deciding
    seeds; 2 and 32: one seed), and sMLP-det's gap at each (one seed a side borrows its family's spread at 8
    experts from the deciding seeds)."""
    spreads = deciding["fair"]["seed_spread"]
    rows = []
    for k in ("smlp_det", best):
        by_e = {FAIR_TARGET["experts"]: _seeds(deciding["models"], k)}
        for e in EXPERT_SWEEP:
            by_e[e] = _seeds(experts["models"], f"{k}_e{e}")
        es = sorted(e for e in by_e if by_e[e])
        rows.append({"model": k, "name": NAMES[k], "ppl": {e: statistics.mean(by_e[e]) for e in es},
                     "seeds": {e: len(by_e[e]) for e in es}})
    gaps = {}
    for e in sorted({*EXPERT_SWEEP, FAIR_TARGET["experts"]}):
        src = deciding["models"] if e == FAIR_TARGET["experts"] else experts["models"]
        suffix = "" if e == FAIR_TARGET["experts"] else f"_e{e}"
        if c := _trend_gap(_seeds(src, f"smlp_det{suffix}"), _seeds(src, f"{best}{suffix}"), spreads, "smlp_det",
                           best):
            gaps[e] = c
    return {"rows": rows, "gaps": gaps, "best_moe": best,
            "seed_spread": {k: spreads.get(k) for k in ("smlp_det", best)},
            "label": "trend (one seed at 2 and 32 experts, spreads borrowed from the deciding seeds), not a verdict",
            "note": "sMLP-det's sMoE routes deterministically: every token passes through every sMoE expert (each a "
                    "spatial gating unit over D/E channels), so more experts split the same channels finer rather "
                    "than adding parameters per token as the tMoE's experts do"}


# ---------------------------------------------------------------- the report


def final_report(records: dict, out_dir: Path) -> dict:
    """OUTPUT_DIR/results.json and its figures from the stages finished so far: perplexities and the answers
    (`verdicts`, the one rule); no speed (the runs share the machine: speed is the speed benchmark's)."""
    rec = {"kind": "fair", "stages": {k: f"{k}/results.json" for k in records}, "rule": T_RULE,
           "complete": all(k in records and records[k].get("complete") for k in ("lr-sweep", "deciding")),
           "stages_complete": {k: bool(records.get(k, {}).get("complete")) for k in STAGES},
           "target": FAIR_TARGET, "wide_target": WIDE_TARGET, "settings": STAGE_SETTINGS,
           "primary_seeds": {"seeds": [*DECIDING_SEEDS, *PRIMARY_SEEDS], "others": list(DECIDING_SEEDS)},
           "eval_routing": "priced (--balanced-eval-routing, smlp/routing/prices.py)"}
    sweep = (records.get("lr-sweep") or {}).get("fair") or {}
    if "lr-sweep" in records:
        rec["rates"] = sweep["rates"]
        rec["best_moe"] = sweep.get("best_moe")
        plot_sweep(rec["rates"], out_dir / "lr_sweep.png")
    if "deciding" in records:
        d = records["deciding"]
        spreads = {k: log_spread(m["valid_ppl_per_seed"]) for k, m in d["models"].items()}
        rec["families"] = {k: {"name": m["name"], "layers": m["layers"], "lr": m.get("lr"),
                               "bracketed": (sweep.get("rates", {}).get(k) or {}).get("bracketed"),
                               "valid_ppl": m["valid_ppl"], "valid_ppl_per_seed": m["valid_ppl_per_seed"],
                               "seeds": m["seeds"], "log_spread": spreads[k],
                               "valid_suffix_ppl_per_seed": m.get("valid_suffix_ppl_per_seed"),
                               "valid_greedy_routing_ppl_per_seed": m.get("valid_greedy_routing_ppl_per_seed"),
                               "valid_trained_routing_ppl_per_seed": m.get("valid_trained_routing_ppl_per_seed"),
                               "greedy_max_load": m.get("greedy_max_load")}
                           for k, m in d["models"].items()}
        rec["seed_spread"] = spreads
        rec["verdicts"] = verdicts(d, sweep)
    best = rec.get("best_moe")
    if "deciding" in records and "width" in records and best:
        rec["width"] = width_trend(_analysed(records["deciding"]), records["width"], best)
        plot_width(rec["width"], out_dir / "width.png")
    if "deciding" in records and "experts" in records and best:
        rec["experts"] = expert_trend(_analysed(records["deciding"]), records["experts"], best)
        plot_experts(rec["experts"], out_dir / "experts.png")
    atomic_write_json(out_dir / "results.json", rec)
    return rec


def _analysed(record: dict) -> dict:
    """A stage record with its seed spreads per family (as analyse_stage writes them; also for a record written
    before they were)."""
    fair = dict(record.get("fair") or {})
    if not isinstance(fair.get("seed_spread"), dict) or "sd" in fair.get("seed_spread", {}):
        fair["seed_spread"] = {k: log_spread(m["valid_ppl_per_seed"]) for k, m in record["models"].items()}
    return {**record, "fair": fair}


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
        xs = [p["d_model"] for p in pts]
        ys = [100 * (p["ratio"] - 1) for p in pts]
        lo = [100 * (p["ratio"] - 1) - 100 * (p["ci_pct"] or (0, 0))[0] if p.get("ci_pct") else 0 for p in pts]
        hi = [100 * (p["ci_pct"] or (0, 0))[1] - 100 * (p["ratio"] - 1) if p.get("ci_pct") else 0 for p in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4,
                    label=f"sMLP-det vs {NAMES.get(width['best_moe'], width['best_moe'])}")
        ax.axhline(0, color="grey", lw=0.8)


def plot_experts(experts: dict, path: Path) -> None:
    with png_axes(path, "more experts: sMLP-det and the best Transformer-MoE (a trend)", "experts per sparse layer",
                  "validation perplexity (± 2 seed SD of the family at 8 experts)", log2x=True) as ax:
        for row in experts["rows"]:
            sd = ((experts.get("seed_spread") or {}).get(row["model"]) or {}).get("sd", 0.0)
            ppl = {int(e): v for e, v in row["ppl"].items()}  # int keys in memory, str in the JSON
            es = sorted(ppl)
            ys = [ppl[e] for e in es]
            ax.errorbar(es, ys, yerr=[2 * sd * y for y in ys], marker="o", capsize=4, label=row["name"])


def main(args, data: Path, vocab_size: int) -> int:
    """`smlp-bench --fair`: the default stages in order (or those of --stages), each resumed where it stopped."""
    stages = list(DEFAULT_STAGES) if not args.stages else [s.strip() for s in args.stages.split(",") if s.strip()]
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
    commit = bool(getattr(args, "commit_store", False))
    log_dir = getattr(args, "work_dir", None)
    t0 = time.time()
    for i, name in enumerate(stages, 1):
        missing = [n for n in NEEDS[name] if not (n in records and records[n].get("complete"))]
        if missing:
            raise BenchError(f"stage {name} is planned from {', '.join(missing)}, which has not finished: "
                             f"run it first (--stages {','.join(missing)})")
        if records.get(name, {}).get("complete"):
            print(f"== fair {i}/{len(stages)} {name}: done", flush=True)
            continue
        print(f"== fair {i}/{len(stages)} {name}", flush=True)
        ctx = Context(vocab_size, args.nproc, records)
        records[name] = run_stage(name, ctx, data, out / name, order_seed=args.order_seed, log_dir=log_dir,
                                  commit=commit, pin=not getattr(args, "no_pin", False))
        final_report(records, out)
        if commit:
            commit_store(out, f"fair benchmark: report after stage {name}")
    rec = final_report(records, out)
    print_summary(rec)
    print(f"   results: {out / 'results.json'} ({(time.time() - t0) / 60:.0f} min)")
    return 0


def print_summary(rec: dict) -> None:
    for family, c in (rec.get("rates") or {}).items():
        tried = ", ".join(f"{r}: {p:.1f}" for r, p in c["tried"].items())
        edge = "" if c["bracketed"] else " (at the sweep's edge)"
        print(f"   {NAMES.get(family, family):<28} lr {c['chosen']:g}{edge} ({tried})")
    v = rec.get("verdicts") or {}
    if v.get("primary"):
        print(f"   PRIMARY [{v['primary']['scored']}] {v['primary']['text']}")
    for c in v.get("secondary", []):
        print(f"   secondary [{c['scored']}] {c['text']}")
