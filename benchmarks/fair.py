"""The deciding comparisons, `smlp-bench fair [--corpus NAME]` (docs/benchmarks.md, "The deciding comparison"): each a
`Comparison` of stages, each stage a resumable run store in OUTPUT_DIR/STAGE/ planned from the stages before it. The
demo corpus's comparison (Shakespeare, 500 updates) is answered by benchmarks/fair_report.py; the kernel-docs one (a
corpus its runs read once, 1500 updates) by benchmarks/budget_report.py."""
from __future__ import annotations

import functools
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import budget_report, machine, pinned
from . import schedule as S
from .experiments import EXPERIMENTS
from .fair_report import analysed_stage, final_report, print_summary
from .machine import code_identity, perplexity_changes
from .presets import (
    LONG_TARGET,
    MOE_BASELINES,
    NAMES,
    BenchError,
    Model,
    models_from_plan,
    parse_names,
    plan_models,
    target_flags,
)
from .publish import FIGURE_DIR, PAGE, publish
from .report import report
from .store import RunStore, atomic_write_json, check_started
from .training import check_options, run_schedule

FAIR_TARGET = dict(LONG_TARGET, experts=8)


def at_width(width: int) -> dict:
    """The fair configuration at another width: d_model = width and d_ffn = 4 x width (D=128: FAIR_TARGET itself),
    its depth, sequence and 8 experts as they are."""
    return dict(FAIR_TARGET, d_model=width, d_ffn=4 * width)


WIDE_TARGET = at_width(256)
OUTPUT = Path("docs/benchmark/fair")  # --output-dir's default: the store is committed
FAMILIES = ("smlp_det", "smlp_partial", "gmlp", "transformer", *MOE_BASELINES)
RATES = (2e-3, 4e-3, 8e-3)
WIDEN = 2                      # at most this many rates added beyond an edge of the sweep
RATE_BOUNDS = (1e-3, 3.2e-2)   # never beyond these
EXPERT_SWEEP = (2, 32)
SWEEP_SEED, DECIDING_SEEDS = 1, (2, 3)
PRIMARY_SEEDS = (4, 5)  # more seeds for the primary pair (sMLP-det, the sweep's best MoE): fixed before any result
# issue 51, fixed before any of its results: dense gMLP's seeds 4-5 (the secondary at 4 and 4 seeds), then the expert
# trend's points (2 and 32 experts, the tie) at seeds 3-5 beside the experts stage's seed 2
SECONDARY_SEEDS, TREND_SEEDS = (4, 5), (3, 4, 5)
# then sMLP-det with the paper's channels per sMoE expert (D / 4 = 32 at D=128, as 1024 / 32 in Table 8), at 32 and 8
# tMoE experts, seeds 2-5; last, the rates at 32 experts: sMLP-det and the best MoE at half, once and twice their
# sweep's rate, seed 1 (the sweep's seed)
SMOE_EXPERTS, SMOE_TMOE_EXPERTS, SMOE_SEEDS = 4, (32, 8), (2, 3, 4, 5)
RATE_CHECK_EXPERTS, RATE_FACTORS = 32, (0.5, 1.0, 2.0)
COMMON = dict(batch_size=16, log_interval=10, validate_every=50, valid_steps=10, warmup=50, lr=2e-3)
STAGE_SETTINGS = {
    "lr-sweep": dict(COMMON, seeds=[SWEEP_SEED], updates=200, probe_updates=0, profile_steps=0),
    "deciding": dict(COMMON, seeds=list(DECIDING_SEEDS), updates=500, probe_updates=20, profile_steps=3),
    "experts": dict(COMMON, seeds=[DECIDING_SEEDS[0]], updates=500, probe_updates=0, profile_steps=0),
    "width": dict(COMMON, seeds=[DECIDING_SEEDS[0]], updates=500, probe_updates=0, profile_steps=0),
    # explicit rounds (stage_rounds): each model its own seeds
    "experts-seeds": dict(COMMON, seeds=[*SECONDARY_SEEDS, *TREND_SEEDS], updates=500, probe_updates=0,
                          profile_steps=0),
    "smoe-experts": dict(COMMON, seeds=[SWEEP_SEED, *SMOE_SEEDS], updates=500, probe_updates=0, profile_steps=0),
    "same-seed": dict(COMMON, seeds=[2, 3], updates=500, probe_updates=0, profile_steps=0),
}
STAGES = tuple(STAGE_SETTINGS)
# `width` and `same-seed` only when asked for (--stages width)
DEFAULT_STAGES = ("lr-sweep", "deciding", "experts", "experts-seeds", "smoe-experts")
# what the comparison is, for its record (benchmarks/fair_report.py final_report)
DESIGN = {"target": FAIR_TARGET, "wide_target": WIDE_TARGET, "settings": STAGE_SETTINGS,
          "experts_stages": ("experts", "experts-seeds", "smoe-experts"),
          "primary_seeds": {"seeds": [*DECIDING_SEEDS, *PRIMARY_SEEDS], "others": list(DECIDING_SEEDS),
                            "committed_in": "7dbbd46"}}  # the commit that fixed PRIMARY_SEEDS


@dataclass
class Context:
    """What a stage is planned from: the vocabulary, the ranks, the finished stages' records and the comparison."""

    vocab_size: int
    nproc: int
    records: dict  # stage name -> its results.json record
    code: pinned.Checkout | None = None  # the stage's pinned commit (None: this checkout's code)
    comparison: Comparison | None = None  # None: the demo corpus's

    @property
    def sweep(self) -> str:
        return (self.comparison or DEMO).sweep

    def rate(self, family: str) -> float:
        return self.records[self.sweep]["fair"]["rates"][family]["chosen"]

    def best_moe(self) -> str:
        """The Transformer-MoE the primary comparison is made against: the best in the sweep (so that the deciding
        runs it is compared on did not choose it)."""
        return self.records[self.sweep]["fair"]["best_moe"]


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
    """The FLOP-matched models of a target by the stage's code, planned once per process (Models are only ever
    copied with `replace`)."""
    plan = code.plan_models if code is not None else plan_models
    models, _ = plan(vocab_size, nproc, keys, json.loads(target))
    return tuple((m.key, m) for m in models)


def _at_rate(m: Model, lr: float, key: str | None = None, name: str | None = None) -> Model:
    return replace(m, key=key or m.key, lr=lr, name=name or m.title)


def _swept(m: Model, lr: float) -> Model:
    """A model of the learning-rate sweep: its family at one rate, keyed and named by it."""
    return _at_rate(m, lr, f"{m.key}@lr{lr:g}", f"{NAMES[m.key]}, lr {lr:g}")


def sweep_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, FAMILIES)
    return [_swept(base[f], lr) for f in FAMILIES for lr in RATES]


def deciding_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, FAMILIES)
    return [_at_rate(base[f], ctx.rate(f)) for f in FAMILIES]


def width_models(ctx: Context) -> list[Model]:
    keys = ("smlp_det", ctx.best_moe())
    base = _matched(ctx, WIDE_TARGET, keys)
    return [_at_rate(base[k], ctx.rate(k), name=f"{NAMES[k]}, D={WIDE_TARGET['d_model']}") for k in keys]


def expert_models(ctx: Context) -> list[Model]:
    return [_at_rate(_matched(ctx, dict(FAIR_TARGET, experts=e), (k,))[k], ctx.rate(k), f"{k}_e{e}",
                     f"{NAMES[k]}, {e} experts") for e in EXPERT_SWEEP for k in ("smlp_det", ctx.best_moe())]


def seed_models(ctx: Context) -> list[Model]:
    """More seeds for points already run: dense gMLP as the deciding stage ran it, and the experts stage's models
    (planned by the same functions, so each key trains the same model in both stores: fair_report pools them)."""
    return [deciding_models(ctx)[FAMILIES.index("gmlp")], *expert_models(ctx)]


def seed_rounds_of(ctx: Context) -> list[list]:
    trend = [m.key for m in expert_models(ctx)]
    return [*([s, ["gmlp"]] for s in SECONDARY_SEEDS), *([s, trend] for s in TREND_SEEDS)]


def smoe_key(tmoe_experts: int, smoe_experts: int = SMOE_EXPERTS) -> str:
    """sMLP-det with its sMoE's experts counted apart: smlp_det_s4_e32 (4 sMoE, 32 tMoE experts)."""
    return f"smlp_det_s{smoe_experts}_e{tmoe_experts}"


def smoe_models(ctx: Context) -> list[Model]:
    """sMLP-det with SMOE_EXPERTS sMoE experts at each tMoE count, then the rate check's models at
    RATE_CHECK_EXPERTS experts (sMLP-det and the best MoE at each factor of their sweep's rate, keyed by rate)."""
    out = []
    for e in SMOE_TMOE_EXPERTS:
        target = dict(FAIR_TARGET, experts=e, smoe_experts=SMOE_EXPERTS)
        out.append(_at_rate(_matched(ctx, target, ("smlp_det",))["smlp_det"], ctx.rate("smlp_det"), smoe_key(e),
                            f"{NAMES['smlp_det']}, {SMOE_EXPERTS} sMoE + {e} tMoE experts"))
    e = RATE_CHECK_EXPERTS
    for k in ("smlp_det", ctx.best_moe()):
        base = _matched(ctx, dict(FAIR_TARGET, experts=e), (k,))[k]
        for f in RATE_FACTORS:
            lr = ctx.rate(k) * f
            out.append(_at_rate(base, lr, f"{k}_e{e}@lr{lr:g}", f"{NAMES[k]}, {e} experts, lr {lr:g}"))
    return out


def smoe_rounds_of(ctx: Context) -> list[list]:
    rate_keys = [m.key for m in smoe_models(ctx) if "@lr" in m.key]
    return [*([s, [smoe_key(e)]] for e in SMOE_TMOE_EXPERTS for s in SMOE_SEEDS), [SWEEP_SEED, rate_keys]]


# Same-seed reruns of the points whose seeds came from two commits (the experts trend's seed 2 ran at the experts
# stage's commit, its seeds 3-5 and gMLP's 4-5 at experts-seeds'; gMLP's 2-3 at the deciding stage's): each rerun
# executes experts-seeds' commit (STAGE_PINS), so that every seed of a pooled point is one code's.
RERUN_ROUNDS = ((2, ("smlp_det_e2", "hash_e2", "smlp_det_e32", "hash_e32", "gmlp")), (3, ("gmlp",)))


def rerun_rounds_of(ctx: Context) -> list[list]:
    return [[seed, list(keys)] for seed, keys in RERUN_ROUNDS]


BUILDERS: dict[str, Callable[[Context], list[Model]]] = {
    "lr-sweep": sweep_models, "deciding": deciding_models, "experts": expert_models, "width": width_models,
    "experts-seeds": seed_models, "smoe-experts": smoe_models, "same-seed": seed_models}
# the stages whose models run different seeds: their rounds ([seed, [keys]], in order)
ROUNDS: dict[str, Callable[[Context], list[list]]] = {"experts-seeds": seed_rounds_of, "smoe-experts": smoe_rounds_of,
                                                      "same-seed": rerun_rounds_of}
TARGETS = {"lr-sweep": FAIR_TARGET, "deciding": FAIR_TARGET, "experts": FAIR_TARGET, "width": WIDE_TARGET,
           "experts-seeds": FAIR_TARGET, "smoe-experts": FAIR_TARGET, "same-seed": FAIR_TARGET}
NEEDS = {"lr-sweep": (), "deciding": ("lr-sweep",), "experts": ("lr-sweep",), "width": ("lr-sweep",),
         "experts-seeds": ("lr-sweep",), "smoe-experts": ("lr-sweep",), "same-seed": ("lr-sweep", "experts-seeds")}
# a stage that executes another stage's commit rather than the checkout's (stage -> that stage)
STAGE_PINS = {"same-seed": "experts-seeds"}


def rates_tried(record: dict) -> dict[str, dict[float, float]]:
    """family -> {rate: final validation perplexity} of a sweep record."""
    out: dict[str, dict[float, float]] = {}
    for key, m in record["models"].items():
        if m.get("valid_ppl") is not None:
            out.setdefault(key.partition("@lr")[0], {})[m["lr"]] = m["valid_ppl"]
    return out


def choose_rates(tried: dict[str, dict[float, float]], widened: dict[str, int], widen: int | None = None,
                 bounds: tuple[float, float] | None = None) -> dict[str, dict]:
    """Per family the best rate, and the next rate to try when the best is at an edge of those tried (beyond it by a
    factor 2; not past `bounds`, not more than `widen` times; by default RATE_BOUNDS and WIDEN)."""
    widen = WIDEN if widen is None else widen
    lo, hi = RATE_BOUNDS if bounds is None else bounds
    out = {}
    for family, by_rate in tried.items():
        rates = sorted(by_rate)
        best = min(rates, key=lambda r: by_rate[r])
        nxt = None
        if widened.get(family, 0) < widen and len(rates) >= 2:
            if best == rates[0] and rates[0] / 2 >= lo * (1 - 1e-9):
                nxt = rates[0] / 2
            elif best == rates[-1] and rates[-1] * 2 <= hi * (1 + 1e-9):
                nxt = rates[-1] * 2
        out[family] = {"tried": {f"{r:g}": by_rate[r] for r in rates}, "chosen": best, "next": nxt,
                       "bracketed": best not in (rates[0], rates[-1]), "widened": widened.get(family, 0)}
    return out


def _append_round(store: RunStore, keys: list[str], seeds: list[int]) -> None:
    rounds = S.seed_rounds(keys, seeds, store.plan["order_seed"], phase=max(s.phase for s in store.slots) + 1,
                           first_round=max(s.round for s in store.slots) + 1)
    store.slots = S.extend_schedule(store.slots, rounds, S.probe_reference(store.plan))


def widen_sweep(store: RunStore, ctx: Context, record: dict, comparison: Comparison) -> list[Model]:
    """Append the sweep's next rates (one new phase) to the store; returns the models added."""
    widened = store.extra.setdefault("widened", {})
    base = _matched(ctx, FAIR_TARGET, comparison.swept())
    added = []
    for family, c in comparison.choose(rates_tried(record), widened).items():
        if c["next"] is not None:
            added.append(_swept(base[family], c["next"]))
            widened[family] = widened.get(family, 0) + 1
    if added:
        _append_round(store, [m.key for m in added], [SWEEP_SEED])
        store.plan["models"].extend(m.as_dict() for m in added)
        store.extra.setdefault("added_models", []).extend(m.key for m in added)
        store.save()
    return added


def primary_seeds(store: RunStore, ctx: Context) -> list[str]:
    """The deciding stage's extra seeds for the primary pair, appended once whatever the results so far (no seed
    added because an interval held zero). Returns the models given them (none when already appended)."""
    if "primary_seeds" in store.extra:
        return []
    keys = ["smlp_det", ctx.best_moe()]
    _append_round(store, keys, list(PRIMARY_SEEDS))
    store.extra["primary_seeds"] = {"models": keys, "seeds": list(PRIMARY_SEEDS),
                                    "rule": "fixed in advance: the primary pair runs seeds 2-5, every other family "
                                            "seeds 2-3"}
    store.save()
    return keys


def check_code(store_path: Path, stage: str) -> dict:
    """The code identity to record for an unpinned stage; refuses to resume one whose runs came from other code that
    decides perplexity (machine.PERPLEXITY_PATHS)."""
    now = code_identity()
    if now["dirty"]:
        raise BenchError(f"stage {stage}: the code that decides perplexity has uncommitted changes "
                         f"(git status -- smlp/ fairseq_plugins/ launch/): commit them, or run the benchmark from a "
                         f"clean checkout, so that every run records the code it ran")
    started = (RunStore.load(store_path).extra.get("code") or {}).get("commit") if store_path.exists() else None
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


def commit_store(path: Path, message: str, attempts: int = 5, files: Sequence[str] = (".",)) -> bool:
    """Commit the files under `path` (a stage's store and report; or `files`, relative to it) and nothing else to
    the repository holding it; retried while another git process holds the index. False (said, not raised) when it
    cannot."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=60)

    for attempt in range(attempts):
        add = git("add", "--", *files)
        res = git("commit", "-q", "-m", message, "--only", "--", *files) if add.returncode == 0 else add
        if res.returncode == 0 or "nothing to commit" in (res.stdout + res.stderr):
            return True
        time.sleep(2 + 3 * attempt)
    print(f"   (could not commit {path}: {(res.stderr or res.stdout).strip()[:300]})", flush=True)
    return False


def stage_code(store_path: Path, stage: str, work_dir: Path, commit: str | None = None) -> pinned.Checkout:
    """The pinned code of a stage: the commit it started at (recorded in its store), else `commit` (another stage's,
    STAGE_PINS), else this checkout's commit; its worktree made under work_dir/code/."""
    repo = machine.CODE_ROOT
    started = (RunStore.load(store_path).extra.get("code") or {}).get("commit") if store_path.exists() else None
    now = code_identity()
    commit = started or commit or now["commit"]
    if commit is None:
        raise BenchError(f"stage {stage}: {repo} is not a git checkout, so no commit can be pinned for its runs: "
                         f"run the benchmark from a clone, or pass --no-pin to run this folder's code")
    if started is None and commit == now["commit"] and now["dirty"]:
        print(f"   stage {stage} pins commit {commit[:10]}: uncommitted changes under "
              f"{', '.join(machine.PERPLEXITY_PATHS)} are not part of its runs", flush=True)
    code = pinned.checkout(commit, work_dir, repo)
    if now["commit"] and now["commit"] != code.commit and pinned.environment_changes(repo, code.commit, now["commit"]):
        print(f"   note: pyproject.toml changed since {code.commit[:10]}; the pinned code runs in the environment "
              f"installed now", flush=True)
    print(f"   stage {stage}: its runs execute commit {code.commit[:10]} ({code.root})", flush=True)
    return code


# The kernel-docs comparison (docs/benchmarks.md, "The answer on a corpus read once"): the three families that
# decide the published answer, each at its demo sweep's rate, half and twice, then seeds 2-5 at 8 and 32 experts.
DOCS_FAMILIES = ("gmlp", "smlp_det", "hash")
DOCS_RATES = {"gmlp": 1.6e-2, "smlp_det": 8e-3, "hash": 4e-3}  # the demo corpus's lr-sweep chose these
DOCS_FACTORS, DOCS_SEEDS, DOCS_EXPERTS = (0.5, 1.0, 2.0), (2, 3, 4, 5), 32
DOCS_COMMON = dict(COMMON, validate_every=100, valid_steps=20, probe_updates=0, profile_steps=0)
DOCS_SETTINGS = {
    "rate": dict(DOCS_COMMON, seeds=[SWEEP_SEED], updates=1000),
    "deciding": dict(DOCS_COMMON, seeds=list(DOCS_SEEDS), updates=1500),
    "experts": dict(DOCS_COMMON, seeds=list(DOCS_SEEDS), updates=1500),
}


def docs_rate_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, DOCS_FAMILIES)
    return [_swept(base[f], DOCS_RATES[f] * k) for f in DOCS_FAMILIES for k in DOCS_FACTORS]


def docs_deciding_models(ctx: Context) -> list[Model]:
    base = _matched(ctx, FAIR_TARGET, DOCS_FAMILIES)
    return [_at_rate(base[f], ctx.rate(f)) for f in DOCS_FAMILIES]


def docs_expert_models(ctx: Context) -> list[Model]:
    e = DOCS_EXPERTS
    return [_at_rate(_matched(ctx, dict(FAIR_TARGET, experts=e), (k,))[k], ctx.rate(k), f"{k}_e{e}",
                     f"{NAMES[k]}, {e} experts") for k in ("smlp_det", "hash")]


@dataclass(frozen=True)
class Comparison:
    """One deciding comparison: the corpus its runs read, its stages (settings, models, targets, what each is planned
    from), the stage whose record holds each family's rate, where its stores go and how its answer is written."""

    name: str                      # `smlp-bench fair --corpus NAME`
    corpus: str | None             # a packaged corpus (smlp_launch.packaged_corpus); None: the demo corpus
    output: Path
    settings: dict[str, dict]
    default_stages: tuple[str, ...]
    builders: dict[str, Callable[[Context], list[Model]]]
    targets: dict[str, dict]
    needs: dict[str, tuple[str, ...]]
    design: dict
    report: Callable[[dict, Path, dict], dict]   # (stage records, OUTPUT_DIR, design) -> results.json's record
    summary: Callable[[dict], None]
    rounds: dict[str, Callable[[Context], list[list]]] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)  # STAGE_PINS
    sweep: str = "lr-sweep"
    families: tuple[str, ...] | None = None       # the swept families (None: FAMILIES)
    widen: int | None = None                      # None: WIDEN
    rate_bounds: tuple[float, float] | None = None  # None: RATE_BOUNDS
    vocab_size: int = 4000

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self.settings)

    def swept(self) -> tuple[str, ...]:
        return FAMILIES if self.families is None else self.families

    def choose(self, tried: dict, widened: dict) -> dict:
        return choose_rates(tried, widened, self.widen, self.rate_bounds)


def _demo_report(records: dict, out: Path, design: dict) -> dict:
    return final_report(records, out, design)


DEMO = Comparison(
    name="demo", corpus=None, output=OUTPUT, settings=STAGE_SETTINGS, default_stages=DEFAULT_STAGES,
    builders=BUILDERS, targets=TARGETS, needs=NEEDS, design=DESIGN, report=_demo_report, summary=print_summary,
    rounds=ROUNDS, pins=STAGE_PINS)
KERNEL_DOCS = Comparison(
    name="kernel-docs", corpus="kernel-docs", output=Path("docs/benchmark/fair-docs"), settings=DOCS_SETTINGS,
    default_stages=tuple(DOCS_SETTINGS),
    builders={"rate": docs_rate_models, "deciding": docs_deciding_models, "experts": docs_expert_models},
    targets={"rate": FAIR_TARGET, "deciding": FAIR_TARGET, "experts": dict(FAIR_TARGET, experts=DOCS_EXPERTS)},
    needs={"rate": (), "deciding": ("rate",), "experts": ("rate",)},
    design={"target": FAIR_TARGET, "settings": DOCS_SETTINGS, "families": DOCS_FAMILIES, "centre_rates": DOCS_RATES,
            "factors": DOCS_FACTORS, "seeds": list(DOCS_SEEDS), "experts": [FAIR_TARGET["experts"], DOCS_EXPERTS]},
    report=budget_report.final_report, summary=budget_report.print_summary,
    sweep="rate", families=DOCS_FAMILIES, widen=1, rate_bounds=(5e-4, 6.4e-2))
COMPARISONS = {c.name: c for c in (DEMO, KERNEL_DOCS)}


def data_identity(data: Path) -> dict:
    """What a stage records of its data folder: smlp-prepare-data's fingerprint and the corpus it names."""
    from smlp_launch.data_dir import read_manifest

    manifest = read_manifest(data) or {}
    pin = manifest.get("corpus") or {}
    return {"fingerprint": manifest.get("fingerprint"), "corpus": (manifest.get("params") or {}).get("corpus")
            or ("demo" if manifest.get("demo_package") else None),
            "source": f"{pin['package']} {pin['version']}" if pin else manifest.get("demo_package"),
            "train_tokens": ((manifest.get("splits") or {}).get("train") or {}).get("fairseq_tokens")}


def check_data(store_path: Path, stage: str, data: Path) -> dict | None:
    """The data identity to plan a stage with; refuses, in one line, a data folder other than the one its store was
    planned on. None for a store planned before stages recorded their data (nothing to check against)."""
    now = data_identity(data)
    if not store_path.exists():
        return now
    planned = RunStore.load(store_path).plan["settings"].get("data")
    if planned is not None and planned.get("fingerprint") != now["fingerprint"]:
        raise BenchError(f"stage {stage} was planned on data fingerprint {str(planned.get('fingerprint'))[:12]} "
                         f"(corpus {planned.get('corpus')}), but {data} has {str(now['fingerprint'])[:12]} (corpus "
                         f"{now['corpus']}): pass the data folder it was planned on (--data), or rebuild it with "
                         f"smlp-prepare-data as the stage's plan records")
    return planned


def _logs(work_dir: Path | None, comp: Comparison, stage: str) -> Path | None:
    """Where a stage's run logs go: WORK_DIR/STAGE (the demo corpus's), WORK_DIR/CORPUS/STAGE (another's)."""
    return None if work_dir is None else work_dir / stage if comp is DEMO else work_dir / comp.name / stage


def run_stage(stage: str, ctx: Context, data: Path, out_dir: Path, *, order_seed: int = 1,
              log_dir: Path | None = None, commit: bool = False, pin: bool = True) -> dict:
    """Train one stage (resuming where it stopped) and return its report record with the stage's analysis."""
    comp = ctx.comparison or DEMO
    out_dir.mkdir(parents=True, exist_ok=True)
    store_path = out_dir / "runs.json"
    resume = store_path.exists()  # main() asked for --resume before continuing a started benchmark
    data_id = check_data(store_path, stage, data)
    if pin:
        of = comp.pins.get(stage)
        commit_of = (RunStore.load(out_dir.parent / of / "runs.json").extra.get("code") or {}).get("commit") \
            if of else None
        ctx = replace(ctx, code=stage_code(store_path, stage, log_dir or Path("results/fair-work").absolute(),
                                           commit_of))
        code = {"commit": ctx.code.commit}
    else:
        code = check_code(store_path, stage)
    if pin and resume:  # a pinned stage resumes its own plan, whatever this checkout would plan now
        store = RunStore.load(store_path)
        added = set(store.extra.get("added_models", ()))
        models = [m for m in models_from_plan(store.plan) if m.key not in added]
        settings = dict(store.plan["settings"])
    else:
        models = comp.builders[stage](ctx)
        target = comp.targets[stage]
        settings = dict(comp.settings[stage], target=target,
                        criterion_flags=criterion_flags(target, ctx.vocab_size, ctx.nproc, ctx.code))
        if data_id is not None:
            settings["data"] = data_id
        if stage in comp.rounds:
            settings["rounds"] = comp.rounds[stage](ctx)
    settings["models"] = tuple(m.key for m in models)

    def after_run():
        if commit:
            commit_store(out_dir, f"fair benchmark, stage {stage}: a run finished")

    def before_runs(store: RunStore):
        if comp is DEMO and stage == "deciding" and (keys := primary_seeds(store, ctx)):
            print(f"   seeds {', '.join(map(str, PRIMARY_SEEDS))} for the primary pair: {', '.join(keys)}", flush=True)

    while True:
        store = run_schedule(f"fair/{stage}" if comp is DEMO else f"fair-{comp.name}/{stage}", settings, models,
                             {"stage": stage}, data, ctx.nproc, out_dir, resume=resume, order_seed=order_seed,
                             reference=models[0].key, log_dir=_logs(log_dir, comp, stage),
                             after_run=after_run,
                             extra={"code": {"commit": code["commit"], "checked": "machine.PERPLEXITY_PATHS"}},
                             code=ctx.code, before_runs=before_runs)
        record = report(store, out_dir, quiet=True)
        added = [m.key for m in widen_sweep(store, ctx, record, comp)] if stage == comp.sweep else []
        if not added:
            break
        print(f"   widening the sweep: {', '.join(added)}", flush=True)
        report(store, out_dir, quiet=True)  # the stage's record says its new runs are to come (a resume runs them)
        resume = True
    if stage == comp.sweep:
        choice = comp.choose(rates_tried(record), store.extra.get("widened", {}))
        moe = [k for k in MOE_BASELINES if k in choice]
        record["fair"] = {"rates": choice, "best_moe": min(moe, key=lambda k: choice[k]["tried"][
            f"{choice[k]['chosen']:g}"]) if moe else None,
            "best_moe_rule": "the Transformer-MoE with the lowest perplexity at its best rate in the sweep"}
    else:
        record["fair"] = analysed_stage(record, store.extra)
    atomic_write_json(out_dir / "results.json", record)
    if commit:
        commit_store(out_dir, f"fair benchmark, stage {stage}: finished")
    return record


def stage_records(out: Path, comparison: Comparison = None) -> dict:
    """stage name -> its results.json record, for every stage that has one (finished or partial)."""
    return {name: json.loads((out / name / "results.json").read_text()) for name in (comparison or DEMO).stages
            if (out / name / "results.json").exists()}


def comparison_of(args) -> Comparison:
    return COMPARISONS[getattr(args, "corpus", None) or DEMO.name]


def report_only(out: Path, comparison: Comparison = None) -> int:
    """`smlp-bench fair --report-only`: OUTPUT_DIR/results.json from the stages' records, nothing trained."""
    comp = comparison or DEMO
    if not (records := stage_records(out, comp)):
        raise BenchError(f"{out} holds no stage's results.json: run the benchmark first (smlp-bench fair)")
    rec = comp.report(records, out, comp.design)
    comp.summary(rec)
    print(f"   results: {out / 'results.json'} (stages: {', '.join(records)}); publish with "
          f"`smlp-bench --publish {out / 'results.json'}`")
    return 0


def chosen_stages(args) -> list[str]:
    comp = comparison_of(args)
    return list(comp.default_stages) if args.stages is None else parse_names(args.stages, comp.stages, "--stages")


def check_args(args) -> None:
    """`smlp-bench fair`'s arguments, before any work: the stages, the training options, and no started benchmark
    in OUTPUT_DIR unless --resume continues it."""
    if args.report_only:
        return
    chosen_stages(args)
    check_options(args)
    out = Path(args.output_dir or comparison_of(args).output).expanduser()
    check_started(out, sorted(str(p.relative_to(out)) for p in out.glob("*/runs.json")), args.resume)


def _final(comp: Comparison, records: dict, out: Path) -> dict | None:
    """The comparison's report of the stages so far; a failure is said, never stops the runs (--report-only
    writes it again)."""
    try:
        return comp.report(records, out, comp.design)
    except Exception as exc:  # noqa: BLE001
        print(f"   (the report failed: {type(exc).__name__}: {exc}; `smlp-bench fair --report-only` writes it)",
              flush=True)
        return None


def republish(out: Path, stage: str, root: Path = machine.CODE_ROOT) -> bool:
    """After a stage's report is committed: when `out` is a committed record under the repository's docs/benchmark/,
    rewrite what README.md and docs/benchmarks.md publish of it and commit the two files, so the committed pages
    never lag the committed record (a checkout whose pages said 'rate 9 of 10 runs' beside a record saying 'rate
    done' failed the suite's page-is-the-record test). Left to the user, and said, when either file has uncommitted
    changes: the commit must hold only what publishing wrote."""
    record, files = out.resolve() / "results.json", ["README.md", str(PAGE)]
    if not record.is_relative_to((root / FIGURE_DIR).resolve()) or not record.exists():
        return False
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *files],
                           capture_output=True, text=True, timeout=60)
    if dirty.returncode != 0 or dirty.stdout.strip():
        print(f"   ({' or '.join(files)} has uncommitted changes: after committing them, publish with "
              f"`smlp-bench --publish {record.relative_to(root.resolve())}`)", flush=True)
        return False
    try:
        publish([record], root / PAGE, root / FIGURE_DIR, experiment_order=list(EXPERIMENTS), readme=root / "README.md")
    except (BenchError, OSError, KeyError, ValueError) as exc:
        print(f"   (publishing {record} failed: {type(exc).__name__}: {exc}; `smlp-bench --publish` it)", flush=True)
        return False
    return commit_store(root, f"fair benchmark: published after stage {stage}", files=files)


def main(args, data: Path, vocab_size: int) -> int:
    """The default stages in order (or those of --stages), each resumed where it stopped (arguments checked by
    `check_args`)."""
    comp = comparison_of(args)
    stages, out = chosen_stages(args), args.output_dir
    records = stage_records(out, comp)
    t0 = time.time()
    for i, name in enumerate(stages, 1):
        if missing := [n for n in comp.needs[name] if not (n in records and records[n].get("complete"))]:
            raise BenchError(f"stage {name} is planned from {', '.join(missing)}, which has not finished: "
                             f"run it first (--stages {','.join(missing)})")
        if records.get(name, {}).get("complete"):
            print(f"== fair {i}/{len(stages)} {name}: done", flush=True)
            continue
        print(f"== fair {i}/{len(stages)} {name}", flush=True)
        records[name] = run_stage(name, Context(vocab_size, args.nproc, records, comparison=comp), data, out / name,
                                  order_seed=args.order_seed, log_dir=args.work_dir, commit=args.commit_store,
                                  pin=not args.no_pin)
        _final(comp, records, out)
        if args.commit_store:
            commit_store(out, f"fair benchmark: report after stage {name}")
            republish(out, name)
    if (rec := _final(comp, records, out)) is not None:
        comp.summary(rec)
    print(f"   results: {out / 'results.json'} ({(time.time() - t0) / 60:.0f} min)")
    return 0
