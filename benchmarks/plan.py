"""The benchmark's plan and its execution: which runs, in which order, and running them one by one.

The plan (`make_plan`) holds everything that decides the runs; the interleaved schedule of
benchmarks/schedule.py turns it into slots: one round per seed, the order rotated from round to
round (reversed, then shuffled with the recorded --order-seed), and a short probe run of the
reference model (sMLP-det) before, between and after the training runs. `execute` runs every
pending slot in order and writes each finished run to OUTPUT_DIR/runs.json at once (temporary file,
fsync, rename), so `--resume` continues a stopped benchmark: finished runs are skipped, an
interrupted one starts again. A preset with a second phase (the long one) gets it appended once
phase 1 is done: the best models of phase 1 again with other seeds.
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from . import machine, training
from . import schedule as S
from .presets import REFERENCE, Model, models_from_plan
from .report import report
from .training import final_ppl, run_record


def make_plan(name: str, settings: dict, models: Sequence[Model], nproc: int, order_seed: int,
              reference: str = REFERENCE, experiment: str | None = None) -> dict:
    """Everything that decides the runs; --resume refuses a record planned differently."""
    s = {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items() if k not in ("models",)}
    return {"name": name, "experiment": experiment, "settings": json.loads(json.dumps(s)),
            "models": [m.as_dict() for m in models], "nproc": nproc, "order_seed": order_seed,
            "reference": reference}


def plan_seeds(settings: dict) -> list[int]:
    """The seeds of a plan: `seeds` is a count (1..N) or the list itself."""
    seeds = settings["seeds"]
    return list(seeds) if isinstance(seeds, (list, tuple)) else list(range(1, seeds + 1))


def probe_reference(plan: dict) -> str | None:
    """The model the probes run, or None when the plan measures no speed (probe_updates 0)."""
    return plan["reference"] if plan["settings"].get("probe_updates") else None


def initial_schedule(plan: dict) -> list[S.Slot]:
    keys = [m["key"] for m in plan["models"]]
    return S.extend_schedule([], S.seed_rounds(keys, plan_seeds(plan["settings"]), plan["order_seed"]),
                             probe_reference(plan))


def choose_second_phase(store: S.RunStore) -> list[str]:
    """The models with the lowest final validation perplexity in phase 1 (seed 1), in phase-1 order."""
    spec = store.plan["settings"].get("second_phase")
    phase1 = [s for s in store.slots if s.kind == S.TRAIN and s.phase == 1]
    finals = {s.key: final_ppl(store.records[s.run_id]) for s in phase1 if s.seed == 1}
    ranked = sorted((k for k, v in finals.items() if v is not None), key=lambda k: finals[k])
    best = set(ranked[:spec["top"]])
    return [m["key"] for m in store.plan["models"] if m["key"] in best]


def maybe_schedule_second_phase(store: S.RunStore) -> bool:
    """After phase 1, append phase 2 (second seeds of the best models) once; True if appended."""
    spec = store.plan["settings"].get("second_phase")
    if not spec or "phase2" in store.extra or store.pending():
        return False
    keys = choose_second_phase(store)
    first_round = len(plan_seeds(store.plan["settings"]))
    rounds = S.seed_rounds(keys, spec["seeds"], store.plan["order_seed"], phase=2, first_round=first_round)
    store.slots = S.extend_schedule(store.slots, rounds, probe_reference(store.plan))
    store.extra["phase2"] = {"models": keys, "rule": f"the {spec['top']} lowest final validation perplexities "
                                                     f"of phase 1", "seeds": spec["seeds"]}
    store.save()
    return True


def execute(store: S.RunStore, models: dict[str, Model], data: Path, args, *, out_dir: Path,
            on_recorded=None, log_dir: Path | None = None, code=None) -> None:
    """Run every pending slot in order (then phase 2, if the plan has one), recording each at once. The runs'
    logs go under log_dir (default out_dir): the store keeps each run's figures, not its log. With `code` (a
    benchmarks.pinned.Checkout) every run executes that commit's code."""
    log_dir = log_dir or out_dir
    settings, nproc = store.plan["settings"], store.plan["nproc"]
    pin = {"code": code} if code is not None else {}
    dropped = store.prepare_resume()
    if dropped:
        print(f"   resuming: measuring the probe before the next run again ({', '.join(dropped)})", flush=True)
    while True:
        todo = store.pending()
        if not todo:
            if maybe_schedule_second_phase(store):
                print(f"   phase 2: second seed for {', '.join(store.extra['phase2']['models'])} "
                      f"({store.extra['phase2']['rule']})", flush=True)
                continue
            return
        slot = todo[0]
        done = len(store.finished())
        model = models[slot.key]
        t_run = time.time()
        if slot.kind == S.PROBE:
            run = training.run_training(model, data, settings, nproc, slot.seed, log_dir / "probes" / slot.run_id,
                                        updates=settings["probe_updates"], validate=False, log_interval=2, **pin)
            rec = run_record(slot, run, settings, nproc, code)
            print(f"   [{done + 1}/{len(store.slots)}] probe {slot.run_id}: {rec['wps'] or float('nan'):,.0f} "
                  f"words/s ({run.seconds:.0f} s)", flush=True)
        else:
            first_seed = min(s.seed for s in store.slots if s.kind == S.TRAIN and s.key == slot.key)
            profile = bool(settings.get("profile_steps")) and model.ours and slot.seed == first_seed
            run = training.run_training(model, data, settings, nproc, slot.seed, log_dir / "runs" / slot.run_id,
                                        profile=profile, **pin)
            rec = run_record(slot, run, settings, nproc, code)
            ppl = final_ppl(rec)
            print(f"   [{done + 1}/{len(store.slots)}] {slot.run_id:<28} {rec['wps'] or float('nan'):>8,.0f} words/s, "
                  f"valid ppl {ppl if ppl is not None else float('nan'):.1f}, {run.seconds:.0f} s "
                  f"(phase {slot.phase}, round {slot.round})", flush=True)
        store.record(slot, {**rec, "log": _under(rec.get("log"), log_dir)})
        _print_eta(store, time.time() - t_run)
        if on_recorded is not None and slot.kind == S.TRAIN:
            try:  # partial results.json after every training run; never stop the benchmark for it
                on_recorded()
            except Exception as exc:  # noqa: BLE001
                print(f"   (partial report failed: {type(exc).__name__}: {exc})", flush=True)


def _under(path: str | None, folder: Path) -> str | None:
    """A run's log path as recorded in the store: relative to the logs' folder (a store committed to the
    repository names no machine's paths); as is when it lies elsewhere."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path(folder).resolve()))
    except ValueError:
        return path


def _print_eta(store: S.RunStore, last: float) -> None:
    recs = [store.records[s.run_id] for s in store.finished()]
    by_kind = {k: [r["seconds"] for r in recs if r["kind"] == k] for k in (S.TRAIN, S.PROBE)}
    left = store.pending()
    if not left:
        return
    est = sum(statistics.mean(by_kind[s.kind]) if by_kind[s.kind] else last for s in left)
    print(f"   {len(left)} runs left, about {est / 60:.0f} min", flush=True)


def open_store(plan: dict, path: Path, *, resume: bool) -> S.RunStore:
    """The run store of `plan`: new, or with resume the recorded one. Models a stage appended to its own
    plan while it ran (store.extra["added_models"], the learning-rate sweep's widening) are not part of
    the plan it was started with, so they do not count as a different plan."""
    if resume and path.exists():
        store = S.RunStore.load(path)
        added = set(store.extra.get("added_models", ()))
        started = {**store.plan, "models": [m for m in store.plan["models"] if m["key"] not in added]}
        diff = S.plan_differences(started, plan)
        if diff:
            raise S.ScheduleError(f"--resume: the recorded benchmark in {path.parent} was planned differently "
                                  f"({'; '.join(diff)}); rerun with its settings, or choose another --output-dir")
        return store
    return S.RunStore.open(path, plan, resume=resume)


def run_schedule(name: str, settings: dict, models: Sequence[Model], matching: dict, data: Path, nproc: int,
                 out_dir: Path, *, resume: bool, order_seed: int = 1, reference: str | None = None,
                 experiment: str | None = None, log_dir: Path | None = None, after_run=None,
                 extra: dict | None = None, code=None, before_runs=None) -> S.RunStore:
    """Plan, open (or resume) the run store in out_dir, measure the matmul peak and train every pending run
    (logs under log_dir, default out_dir; `before_runs(store)` once the store is open, `after_run()` after each
    recorded training run and its report; `code`: the pinned commit every run executes, benchmarks/pinned.py)."""
    by_key = {m.key: m for m in models}
    reference = reference or (REFERENCE if REFERENCE in by_key else models[0].key)
    plan = make_plan(name, settings, models, nproc, order_seed, reference, experiment=experiment)
    store = open_store(plan, out_dir / "runs.json", resume=resume)
    if not store.slots:
        store.slots = initial_schedule(plan)
        store.extra["matching"] = matching
    for k, v in (extra or {}).items():  # facts of the store's start (kept on resume)
        store.extra.setdefault(k, v)
    if before_runs is not None:
        before_runs(store)
    store.extra["machine"] = machine.machine_info()
    print(f"   dense matmul peak ({nproc} processes x 1 thread) ...", flush=True)
    peak = machine.matmul_peak(nproc)
    store.extra.setdefault("peaks", []).append({"total": peak["total"], "at": time.time()})
    store.save()
    print(f"   {peak['total'] / 1e9:.1f} GFLOP/s in total", flush=True)
    for rid in store.prepare_resume():
        print(f"   resuming: the probe before the next run is measured again ({rid})", flush=True)
    print(f"   training: {len(store.pending())} of {len(store.slots)} runs to go "
          f"({len([s for s in store.slots if s.kind == S.PROBE])} of them probes)", flush=True)
    def recorded():
        report(store, out_dir, quiet=True)
        if after_run is not None:
            after_run()

    execute(store, {m.key: m for m in models_from_plan(store.plan)}, data, None, out_dir=out_dir,
            on_recorded=recorded, log_dir=log_dir, code=code)
    return store
