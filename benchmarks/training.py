"""The run step: one fairseq-train run through `smlp-launch --nproc W --cpu` (`run_training`), and `execute`, which runs
a store's pending slots, recording each at once; words/s as docs/benchmarks.md defines them."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from smlp_launch.fairseq_log import as_floats, train_fields, valid_fields
from smlp_launch.memory import peak_rss, process_tree

from . import machine
from . import schedule as S
from .presets import REFERENCE, TARGET, BenchError, Model, models_from_plan
from .store import RunStore, final_ppl, write_text

BIN = Path(sys.executable).parent
PROBE_SKIP_UPDATES = 4  # a probe's words/s: from the intervals after this many updates (start-up, allocations)
# the fields of fairseq's training log intervals a record keeps (the per-layer routing figures stay in the log; an
# interval of a model with experts also keeps their `tokens_kept`, from its layers' drops)
INTERVAL_FIELDS = ("num_updates", "loss", "nll_loss", "ppl", "wps", "ups", "wpb", "bsz", "lr", "gnorm", "clip",
                   "train_wall", "wall", "aux_loss")


@dataclass
class Run:
    key: str
    seed: int
    intervals: list[dict] = field(default_factory=list)   # train_inner fields
    valid: list[dict] = field(default_factory=list)       # valid fields (+ wall from the last train line)
    peak_rss_mb: list[float] = field(default_factory=list)
    seconds: float = 0.0
    profile: dict | None = None
    log: str = ""
    started: float = 0.0
    finished: float = 0.0
    steal: float | None = None  # share of the machine's CPU time the hypervisor took during the run (machine.py)


def _poll_peaks(pid: int, peaks: dict, stop: threading.Event) -> None:
    """Highest resident set (VmHWM, MiB) of every process under a launcher, polled until `stop` is set."""
    while not stop.wait(0.5):
        for kid, hwm in peak_rss(process_tree(pid)[1:]).items():
            peaks[kid] = max(peaks.get(kid, 0.0), hwm / 2 ** 20)


def train_command(model: Model, data: Path, settings: dict, nproc: int, seed: int, logdir: Path, *,
                  updates: int | None = None, validate: bool = True, log_interval: int | None = None) -> list[str]:
    p = settings
    ours = ["--user-dir", str(_plugins_dir()), "--criterion", "smlp_lm_loss", *p.get("criterion_flags", ())] \
        if model.ours else ["--criterion", "cross_entropy"]
    validate_every = p["validate_every"] if validate else 10 ** 9
    return [
        str(BIN / "smlp-launch"), "--nproc", str(nproc), "--cpu", "--threads", "1", "--log-dir", str(logdir),
        "--", str(data), *ours, *model.flags, "--task", "language_modeling", "--sample-break-mode", "none",
        "--batch-size", str(p["batch_size"]), "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--lr", str(model.lr or p["lr"]), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(p["warmup"]),
        "--warmup-init-lr", "1e-7", "--clip-norm", "1.0", "--dropout", "0", "--max-update",
        str(updates or p["updates"]), "--validate-interval-updates", str(validate_every), "--max-valid-steps",
        str(p["valid_steps"]), "--log-format", "simple", "--log-interval", str(log_interval or p["log_interval"]),
        "--no-progress-bar", "--no-save", "--num-workers", "0", "--seed", str(seed),
        "--validate-interval", "1000",  # no end-of-epoch validation
        *(["--disable-validation"] if not validate else []),
    ]


def _plugins_dir() -> Path:
    import importlib.util

    if (spec := importlib.util.find_spec("fairseq_plugins")) is None or not spec.submodule_search_locations:
        raise BenchError("the fairseq_plugins package is not installed: run `make install` first")
    return Path(spec.submodule_search_locations[0]).resolve()


def check_data(data: Path | None) -> None:
    """--data, when given, must be a fairseq data-bin."""
    if data and not (Path(data).expanduser() / "dict.txt").is_file():
        raise BenchError(f"--data {data} is not a fairseq data-bin (no dict.txt); build one with smlp-prepare-data")


def check_options(args, least_nproc: int = 1) -> None:
    """The options of every program that trains through the harness (`cli.add_training`): --data, --nproc."""
    check_data(args.data)
    if args.nproc < least_nproc:
        raise BenchError(f"--nproc {args.nproc}: " + ("expert parallelism needs at least 2 ranks" if least_nproc == 2
                                                      else f"give at least {least_nproc}"))


def prepare(data: Path | None, folder: Path, corpus: str | None = None) -> Path:
    """The data-bin runs train on: `data`, or the demo corpus built once into `folder`/data-bin (a packaged corpus:
    into `folder`/data-CORPUS), with 4000 pieces."""
    if data:
        check_data(data)
        return data.expanduser().absolute()
    from smlp_launch.data import DataPrepError, prepare_data

    try:
        return prepare_data(folder / (f"data-{corpus}" if corpus else "data-bin"), demo=corpus is None, corpus=corpus,
                            vocab_size=4000, seed=1, log=lambda msg: print(f"   {msg}", flush=True))[0]
    except DataPrepError as exc:
        raise BenchError(f"data preparation failed: {exc}") from exc


def vocab_size(data: Path) -> int:
    """The size of the dictionary fairseq builds for this data-bin (its specials included)."""
    from fairseq.data import Dictionary

    return len(Dictionary.load(str(data / "dict.txt")))


def profile_window(preset: dict) -> tuple[int, int]:
    """0-based training steps profiled: near the end, after the last validation before it."""
    return preset["updates"] - preset["profile_steps"] - 2, preset["profile_steps"]


def run_training(model: Model, data: Path, settings: dict, nproc: int, seed: int, out: Path, *,
                 profile: bool = False, updates: int | None = None, validate: bool = True,
                 log_interval: int | None = None, code=None) -> Run:
    """One fairseq-train run through smlp-launch; its log goes to out/train.log."""
    if out.exists():  # an interrupted run starts again from scratch
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build = code.train_command if code is not None else train_command
    cmd = build(model, data, settings, nproc, seed, out, updates=updates, validate=validate, log_interval=log_interval)
    env = {**(code.env if code is not None else os.environ), "PYTHONUNBUFFERED": "1"}
    if profile:
        start, count = profile_window(settings)
        env["SMLP_PROFILE_STEPS"] = f"{start}:{count}:{out / 'profile'}"
    write_text(out / "train.cmd", " ".join(cmd) + "\n")
    run = Run(model.key, seed, log=str(out / "train.log"), started=time.time())
    t0, ticks = time.perf_counter(), machine.cpu_ticks()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                cwd=code.root if code is not None else None)
        peaks, stop = {}, threading.Event()
        memory = threading.Thread(target=_poll_peaks, args=(proc.pid, peaks, stop), daemon=True)
        memory.start()
        last_wall = 0.0
        try:
            for line in proc.stdout:
                log.write(line)
                if (logged := train_fields(line)) is not None:
                    run.intervals.append(f := as_floats(logged))
                    last_wall = f.get("wall", last_wall)
                elif (logged := valid_fields(line)) is not None:
                    run.valid.append({**as_floats(logged), "wall": last_wall})
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: stop the launcher (it stops its workers)
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            stop.set()
            memory.join(timeout=5)
    run.seconds, run.finished = time.perf_counter() - t0, time.time()
    run.steal = machine.steal_share(ticks, machine.cpu_ticks())
    run.peak_rss_mb = sorted(peaks.values(), reverse=True)[:nproc]
    if rc != 0:
        tail = "".join((out / "train.log").read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise BenchError(f"{model.key} (seed {seed}) failed with exit code {rc}; log: {out / 'train.log'}\n{tail}")
    if profile:
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("profile.rank*.json"))]
        if len(ranks) != nproc:
            raise BenchError(f"{model.key}: expected {nproc} profile files in {out}, found {len(ranks)}")
        # the mean over ranks of each category's share of the step, the slowest rank's step time
        run.profile = {"breakdown": {c: statistics.mean(r["breakdown"][c] for r in ranks)
                                     for c in ranks[0]["breakdown"]},
                       "seconds_per_step": max(r["seconds_per_step"] for r in ranks),
                       "top_ops_rank0": ranks[0]["top_ops"][:10]}
    return run


def clean_intervals(run: Run, preset: dict) -> list[dict]:
    """The log intervals that hold no warm-up, no validation and no profiled step (and log words/s)."""
    L, V = preset["log_interval"], preset["validate_every"]
    start, count = profile_window(preset)
    profiled = set(range(start + 1, start + count + 2))  # 1-based updates, + the step that writes the profile
    out = []
    for f in run.intervals:
        end = int(f.get("num_updates", 0))
        first = end - L + 1
        if first > L and (first - 1) % V and not profiled & set(range(first, end + 1)) and "wps" in f:
            out.append(f)
    return out


def clean_wps(run: Run, preset: dict) -> list[float]:
    """wps of the clean intervals, in tokens read (input_tokens_per_target)."""
    seq_len = preset.get("target", TARGET)["seq_len"]
    return [f["wps"] * input_tokens_per_target(f, seq_len) for f in clean_intervals(run, preset)]


def tokens_kept(interval: dict) -> float | None:
    """The share of routing slots (token, choice) an interval's experts processed: 1 - the mean over the MoE layers
    of the share each dropped past capacity (`drop_<layer>`: Switch, GShard; fairseq_plugins/criterion.py); 1.0
    where the layers log their loads and no drop (Base Layers, HASH, sMLP's routers keep every token); None for a
    model without experts."""
    if drops := [v for k, v in interval.items() if k.startswith("drop_")]:
        return 1.0 - statistics.mean(drops)
    return 1.0 if any(k.startswith("load_") for k in interval) else None


def input_tokens_per_target(interval: dict, seq_len: int = TARGET["seq_len"]) -> float:
    """Tokens read per token scored: bsz x seq_len / wpb (fairseq's wps counts targets; a partial-prediction model
    reads its routing prefix without scoring it, so its wps alone would understate its speed by 20%)."""
    return interval["bsz"] * seq_len / interval["wpb"] if "bsz" in interval and interval.get("wpb") else 1.0


def run_record(slot: S.Slot, run: Run, settings: dict, nproc: int, code=None) -> dict:
    """The record runs.json keeps of a finished run (a probe's words/s, or a training run's clean median), with the
    code it ran (the pinned commit's, else this checkout's)."""
    seq_len = settings["target"]["seq_len"]
    rec = {"key": run.key, "seed": run.seed, "kind": slot.kind, "seconds": round(run.seconds, 2),
           "started": run.started, "finished": run.finished, "peak_rss_mb": run.peak_rss_mb,
           "intervals": [{**{k: f[k] for k in INTERVAL_FIELDS if k in f},
                          **({"tokens_kept": kept} if (kept := tokens_kept(f)) is not None else {})}
                         for f in run.intervals], "valid": run.valid,
           "profile": run.profile, "log": run.log, "cpu_steal": run.steal,
           "code": code.identity() if code is not None else machine.code_identity()}
    if slot.kind == S.PROBE:
        w = [f["wps"] * input_tokens_per_target(f, seq_len) for f in run.intervals
             if f.get("num_updates", 0) > PROBE_SKIP_UPDATES and "wps" in f]
    else:
        w = clean_wps(run, settings)
        rec["tokens_per_update"] = nproc * settings["batch_size"] * seq_len
        # over the intervals its words/s come from: a speed that comes from dropped tokens reads as such
        kept = [k for f in clean_intervals(run, settings) if (k := tokens_kept(f)) is not None]
        rec["tokens_kept"] = statistics.mean(kept) if kept else None
    rec["wps"] = statistics.median(w) if w else None
    return rec


def _stolen(run: Run) -> str:
    """A warning for a run whose machine was not its own: the hypervisor took more than 2% of the CPU time."""
    return f"; the hypervisor took {run.steal:.0%} of the CPU time: words/s disturbed" if (run.steal or 0) > 0.02 \
        else ""


def second_phase(store: RunStore) -> bool:
    """After phase 1, append phase 2 once: the models with the lowest final validation perplexity of seed 1 (in
    phase-1 order) with the plan's other seeds. True if appended."""
    spec = store.plan["settings"].get("second_phase")
    if not spec or "phase2" in store.extra or store.pending():
        return False
    finals = {s.key: final_ppl(store.records[s.run_id]) for s in store.slots
              if s.kind == S.TRAIN and s.phase == 1 and s.seed == 1}
    best = set(sorted((k for k, v in finals.items() if v is not None), key=lambda k: finals[k])[:spec["top"]])
    keys = [m["key"] for m in store.plan["models"] if m["key"] in best]
    rounds = S.seed_rounds(keys, spec["seeds"], store.plan["order_seed"], phase=2,
                           first_round=len(S.plan_seeds(store.plan["settings"])))
    store.slots = S.extend_schedule(store.slots, rounds, S.probe_reference(store.plan))
    store.extra["phase2"] = {"models": keys, "rule": f"the {spec['top']} lowest final validation perplexities "
                                                     f"of phase 1", "seeds": spec["seeds"]}
    store.save()
    return True


def execute(store: RunStore, models: dict[str, Model], data: Path, *, log_dir: Path, on_recorded=None,
            code=None) -> None:
    """Run every pending slot in order (then phase 2, if the plan has one), recording each at once; the runs' logs go
    under log_dir (the store keeps each run's figures, not its log)."""
    settings, nproc = store.plan["settings"], store.plan["nproc"]
    pin = {"code": code} if code is not None else {}
    for rid in store.prepare_resume():
        print(f"   resuming: measuring the probe before the next run again ({rid})", flush=True)
    while True:
        todo = store.pending()
        if not todo:
            if not second_phase(store):
                return
            print(f"   phase 2: second seed for {', '.join(store.extra['phase2']['models'])} "
                  f"({store.extra['phase2']['rule']})", flush=True)
            continue
        slot, done, model = todo[0], len(store.finished()), models[todo[0].key]
        first_seed = min((s.seed for s in store.slots if s.kind == S.TRAIN and s.key == slot.key), default=0)
        kw = dict(updates=settings["probe_updates"], validate=False, log_interval=2) if slot.kind == S.PROBE else \
            dict(profile=bool(settings.get("profile_steps")) and model.ours and slot.seed == first_seed)
        run = run_training(model, data, settings, nproc, slot.seed,
                           log_dir / ("probes" if slot.kind == S.PROBE else "runs") / slot.run_id, **kw, **pin)
        rec = run_record(slot, run, settings, nproc, code)
        if slot.kind == S.PROBE:
            print(f"   [{done + 1}/{len(store.slots)}] probe {slot.run_id}: {rec['wps'] or float('nan'):,.0f} "
                  f"words/s ({run.seconds:.0f} s)", flush=True)
        else:
            ppl = final_ppl(rec)
            print(f"   [{done + 1}/{len(store.slots)}] {slot.run_id:<28} {rec['wps'] or float('nan'):>8,.0f} words/s, "
                  f"valid ppl {ppl if ppl is not None else float('nan'):.1f}, {run.seconds:.0f} s "
                  f"(phase {slot.phase}, round {slot.round}){_stolen(run)}", flush=True)
        with contextlib.suppress(ValueError):  # a store committed to the repository names no machine's paths
            rec["log"] = str(Path(rec["log"]).resolve().relative_to(Path(log_dir).resolve()))
        store.record(slot, rec)
        if left := store.pending():
            took = {k: [store.records[s.run_id]["seconds"] for s in store.finished() if s.kind == k]
                    for k in (S.TRAIN, S.PROBE)}
            est = sum(statistics.mean(took[s.kind]) if took[s.kind] else run.seconds for s in left)
            print(f"   {len(left)} runs left, about {est / 60:.0f} min", flush=True)
        if on_recorded is not None and slot.kind == S.TRAIN:
            try:  # a partial results.json after every training run; never stop the benchmark for it
                on_recorded()
            except Exception as exc:  # noqa: BLE001
                print(f"   (partial report failed: {type(exc).__name__}: {exc})", flush=True)


def run_schedule(name: str, settings: dict, models: Sequence[Model], matching: dict, data: Path, nproc: int,
                 out_dir: Path, *, resume: bool, order_seed: int = 1, reference: str | None = None,
                 experiment: str | None = None, log_dir: Path | None = None, after_run=None,
                 extra: dict | None = None, code=None, before_runs=None) -> RunStore:
    """Plan, open (or resume) the run store in out_dir, measure the matmul peak and train every pending run (logs
    under log_dir, default out_dir; `before_runs(store)` once the store is open, `after_run()` after each recorded
    training run and its partial report; `code`: the pinned commit every run executes, benchmarks/pinned.py)."""
    from .report import report

    keys = [m.key for m in models]
    plan = S.make_plan(name, settings, models, nproc, order_seed,
                       reference or (REFERENCE if REFERENCE in keys else keys[0]), experiment=experiment)
    if not (store := RunStore.open(out_dir / "runs.json", plan, resume=resume)).slots:
        store.slots, store.extra["matching"] = S.initial_schedule(plan), matching
    for k, v in (extra or {}).items():  # facts of the store's start (kept on resume)
        store.extra.setdefault(k, v)
    if before_runs is not None:
        before_runs(store)
    store.extra["machine"] = machine.machine_info()
    if store.pending() or not store.extra.get("peaks"):
        print(f"   dense matmul peak ({nproc} processes x 1 thread) ...", flush=True)
        peak = machine.matmul_peak(nproc)
        store.extra.setdefault("peaks", []).append({"total": peak["total"], "at": time.time()})
        store.save()
        print(f"   {peak['total'] / 1e9:.1f} GFLOP/s in total", flush=True)
    else:  # a finished store reported again: a peak of another hour would move its MFU
        print("   every run is recorded: the matmul peaks of its runs' hours are kept, none measured now", flush=True)
    print(f"   training: {len(store.pending())} of {len(store.slots)} runs to go "
          f"({len([s for s in store.slots if s.kind == S.PROBE])} of them probes)", flush=True)

    def recorded():
        report(store, out_dir, quiet=True)
        if after_run is not None:
            after_run()

    execute(store, {m.key: m for m in models_from_plan(store.plan)}, data, log_dir=log_dir or out_dir,
            on_recorded=recorded, code=code)
    return store
