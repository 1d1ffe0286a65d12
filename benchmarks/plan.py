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

from . import schedule as S
from . import training
from .presets import REFERENCE, Model
from .training import final_ppl, run_record


def make_plan(name: str, settings: dict, models: Sequence[Model], nproc: int, order_seed: int,
              reference: str = REFERENCE, experiment: str | None = None) -> dict:
    """Everything that decides the runs; --resume refuses a record planned differently."""
    s = {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items() if k not in ("models",)}
    return {"name": name, "experiment": experiment, "settings": json.loads(json.dumps(s)),
            "models": [m.as_dict() for m in models], "nproc": nproc, "order_seed": order_seed,
            "reference": reference}


def initial_schedule(plan: dict) -> list[S.Slot]:
    keys = [m["key"] for m in plan["models"]]
    seeds = list(range(1, plan["settings"]["seeds"] + 1))
    return S.extend_schedule([], S.seed_rounds(keys, seeds, plan["order_seed"]), plan["reference"])


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
    first_round = store.plan["settings"]["seeds"]
    rounds = S.seed_rounds(keys, spec["seeds"], store.plan["order_seed"], phase=2, first_round=first_round)
    store.slots = S.extend_schedule(store.slots, rounds, store.plan["reference"])
    store.extra["phase2"] = {"models": keys, "rule": f"the {spec['top']} lowest final validation perplexities "
                                                     f"of phase 1", "seeds": spec["seeds"]}
    store.save()
    return True


def execute(store: S.RunStore, models: dict[str, Model], data: Path, args, *, out_dir: Path,
            on_recorded=None) -> None:
    """Run every pending slot in order (then phase 2, if the plan has one), recording each at once."""
    settings, nproc = store.plan["settings"], store.plan["nproc"]
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
            run = training.run_training(model, data, settings, nproc, slot.seed, out_dir / "probes" / slot.run_id,
                                        updates=settings["probe_updates"], validate=False, log_interval=2)
            rec = run_record(slot, run, settings, nproc)
            print(f"   [{done + 1}/{len(store.slots)}] probe {slot.run_id}: {rec['wps'] or float('nan'):,.0f} "
                  f"words/s ({run.seconds:.0f} s)", flush=True)
        else:
            first_seed = min(s.seed for s in store.slots if s.kind == S.TRAIN and s.key == slot.key)
            profile = bool(settings.get("profile_steps")) and model.ours and slot.seed == first_seed
            run = training.run_training(model, data, settings, nproc, slot.seed, out_dir / "runs" / slot.run_id,
                                        profile=profile)
            rec = run_record(slot, run, settings, nproc)
            ppl = final_ppl(rec)
            print(f"   [{done + 1}/{len(store.slots)}] {slot.run_id:<28} {rec['wps'] or float('nan'):>8,.0f} words/s, "
                  f"valid ppl {ppl if ppl is not None else float('nan'):.1f}, {run.seconds:.0f} s "
                  f"(phase {slot.phase}, round {slot.round})", flush=True)
        store.record(slot, rec)
        _print_eta(store, time.time() - t_run)
        if on_recorded is not None and slot.kind == S.TRAIN:
            try:  # partial results.json after every training run; never stop the benchmark for it
                on_recorded()
            except Exception as exc:  # noqa: BLE001
                print(f"   (partial report failed: {type(exc).__name__}: {exc})", flush=True)


def _print_eta(store: S.RunStore, last: float) -> None:
    recs = [store.records[s.run_id] for s in store.finished()]
    by_kind = {k: [r["seconds"] for r in recs if r["kind"] == k] for k in (S.TRAIN, S.PROBE)}
    left = store.pending()
    if not left:
        return
    est = sum(statistics.mean(by_kind[s.kind]) if by_kind[s.kind] else last for s in left)
    print(f"   {len(left)} runs left, about {est / 60:.0f} min", flush=True)
