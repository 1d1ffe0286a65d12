"""One training run of the benchmark: the fairseq-train command, running it, and the figures of its log.

`run_training` runs the real fairseq-train through `smlp-launch --nproc W --cpu` (one gloo rank and
one thread per core), reads its log as it goes, polls every worker's peak resident memory, and with
`profile=True` profiles a window of steps near the end inside fairseq-train (`SMLP_PROFILE_STEPS`,
torch.profiler: routing, all2all, experts, token mixing and the rest of a step). `run_record` turns
a run into the JSON record `runs.json` keeps.

Words/s are tokens read per second over all ranks: fairseq's `wps` (tokens scored) times
bsz x seq_len / wpb, which only differs for partial prediction (its routing prefix is read, not
scored; see `input_tokens_per_target`), from log intervals that contain neither a validation, the
warm-up, nor the profiled window (`clean_wps`); the figure per run is the median over those
intervals.
"""
from __future__ import annotations

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

from . import schedule as S
from .presets import TARGET, BenchError, Model

BIN = Path(sys.executable).parent
# probes: words/s from the intervals after this many updates (process start, first allocations)
PROBE_SKIP_UPDATES = 4


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


class _PeakMemory(threading.Thread):
    """Highest resident set (VmHWM, MiB) of every process under a launcher, polled until `stop` is set."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peaks, self.stop = pid, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for kid, hwm in peak_rss(process_tree(self.pid)[1:]).items():
                self.peaks[kid] = max(self.peaks.get(kid, 0.0), hwm / 2 ** 20)


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
        "--warmup-init-lr", "1e-7", "--clip-norm", "1.0", "--dropout", "0",
        "--max-update", str(updates or p["updates"]),
        "--validate-interval-updates", str(validate_every), "--max-valid-steps", str(p["valid_steps"]),
        "--log-format", "simple", "--log-interval", str(log_interval or p["log_interval"]), "--no-progress-bar",
        "--no-save", "--num-workers", "0", "--seed", str(seed),
        "--validate-interval", "1000",  # no end-of-epoch validation
        *(["--disable-validation"] if not validate else []),
    ]


def _plugins_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("fairseq_plugins")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the fairseq_plugins package is not installed: run `make install` first")
    return Path(spec.submodule_search_locations[0]).resolve()


def profile_window(preset: dict) -> tuple[int, int]:
    """0-based training steps profiled: near the end, after the last validation before it."""
    count = preset["profile_steps"]
    return preset["updates"] - count - 2, count


def run_training(model: Model, data: Path, settings: dict, nproc: int, seed: int, out: Path, *,
                 profile: bool = False, updates: int | None = None, validate: bool = True,
                 log_interval: int | None = None, on_line=None, code=None) -> Run:
    """One fairseq-train run through smlp-launch; its log goes to out/train.log. With `code` (a
    benchmarks.pinned.Checkout) the command is that commit's and every process of the run executes its code."""
    if out.exists():  # an interrupted run starts again from scratch
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build = code.train_command if code is not None else train_command
    cmd = build(model, data, settings, nproc, seed, out, updates=updates, validate=validate, log_interval=log_interval)
    env = {**(code.env if code is not None else os.environ), "PYTHONUNBUFFERED": "1"}
    if profile:
        start, count = profile_window(settings)
        env["SMLP_PROFILE_STEPS"] = f"{start}:{count}:{out / 'profile'}"
    (out / "train.cmd").write_text(" ".join(cmd) + "\n")
    run = Run(model.key, seed, log=str(out / "train.log"), started=time.time())
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                cwd=code.root if code is not None else None)
        memory = _PeakMemory(proc.pid)
        memory.start()
        last_wall = 0.0
        try:
            for line in proc.stdout:
                log.write(line)
                if (logged := train_fields(line)) is not None:
                    f = as_floats(logged)
                    run.intervals.append(f)
                    last_wall = f.get("wall", last_wall)
                    if on_line:
                        on_line("train", f)
                elif (logged := valid_fields(line)) is not None:
                    f = as_floats(logged)
                    f["wall"] = last_wall
                    run.valid.append(f)
                    if on_line:
                        on_line("valid", f)
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: stop the launcher (it stops its workers)
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            memory.stop.set()
            memory.join(timeout=5)
    run.seconds = time.perf_counter() - t0
    run.finished = time.time()
    run.peak_rss_mb = sorted(memory.peaks.values(), reverse=True)[:nproc]
    if code != 0:
        tail = "".join((out / "train.log").read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise BenchError(f"{model.key} (seed {seed}) failed with exit code {code}; log: {out / 'train.log'}\n{tail}")
    if profile:
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("profile.rank*.json"))]
        if len(ranks) != nproc:
            raise BenchError(f"{model.key}: expected {nproc} profile files in {out}, found {len(ranks)}")
        run.profile = _merge_profiles(ranks)
    return run


def _merge_profiles(ranks: list[dict]) -> dict:
    """Mean over ranks of each category's share of the step, plus the slowest rank's step time."""
    cats = ranks[0]["breakdown"].keys()
    return {"breakdown": {c: statistics.mean(r["breakdown"][c] for r in ranks) for c in cats},
            "seconds_per_step": max(r["seconds_per_step"] for r in ranks),
            "top_ops_rank0": ranks[0]["top_ops"][:10]}


def clean_wps(run: Run, preset: dict) -> list[float]:
    """wps of the intervals that hold no warm-up, no validation and no profiled step."""
    L, V = preset["log_interval"], preset["validate_every"]
    start, count = profile_window(preset)
    profiled = set(range(start + 1, start + count + 2))  # 1-based updates, + the step that writes the profile
    seq_len = preset.get("target", TARGET)["seq_len"]
    out = []
    for f in run.intervals:
        end = int(f.get("num_updates", 0))
        first = end - L + 1
        if first <= L or (first - 1) % V == 0 or profiled & set(range(first, end + 1)):
            continue
        if "wps" in f:
            out.append(f["wps"] * input_tokens_per_target(f, seq_len))
    return out


def probe_wps(intervals: Sequence[dict], seq_len: int) -> float | None:
    """A probe's words/s: the median of its intervals after the first PROBE_SKIP_UPDATES updates."""
    w = [f["wps"] * input_tokens_per_target(f, seq_len) for f in intervals
         if f.get("num_updates", 0) > PROBE_SKIP_UPDATES and "wps" in f]
    return statistics.median(w) if w else None


def input_tokens_per_target(interval: dict, seq_len: int = TARGET["seq_len"]) -> float:
    """Tokens the model read per token it was scored on. fairseq's wps counts targets (the
    criterion's ntokens); a partial-prediction model reads its routing prefix without scoring it, so
    its wps alone would understate its speed by the prefix share (20%). With bsz sequences of
    seq_len tokens per update and wpb targets: bsz x seq_len / wpb (1 for every other model)."""
    if "bsz" in interval and interval.get("wpb"):
        return interval["bsz"] * seq_len / interval["wpb"]
    return 1.0


def final_ppl(record: dict, metric: str = "ppl") -> float | None:
    """The last validation perplexity of a run record (None: it never validated, or did not log
    `metric`: `suffix_ppl` the positions sMLP-partial scores, `trained_routing_ppl` balanced routers
    with their training-time assignment; fairseq_plugins/criterion.py)."""
    return record["valid"][-1].get(metric) if record.get("valid") else None


# the fields of fairseq's training log intervals a record keeps (the per-layer routing figures stay in the log)
INTERVAL_FIELDS = ("num_updates", "loss", "nll_loss", "ppl", "wps", "ups", "wpb", "bsz", "lr", "gnorm", "clip",
                   "train_wall", "wall", "aux_loss")


def run_record(slot: S.Slot, run: Run, settings: dict, nproc: int, code=None) -> dict:
    """The JSON record runs.json keeps of a finished run (a probe's words/s, or a training run's clean median),
    with the code it ran (the pinned commit's `code.identity()`, else machine.code_identity)."""
    from .machine import code_identity

    seq_len = settings["target"]["seq_len"]
    intervals = [{k: f[k] for k in INTERVAL_FIELDS if k in f} for f in run.intervals]
    rec = {"key": run.key, "seed": run.seed, "kind": slot.kind, "seconds": round(run.seconds, 2),
           "started": run.started, "finished": run.finished, "peak_rss_mb": run.peak_rss_mb,
           "intervals": intervals, "valid": run.valid, "profile": run.profile, "log": run.log,
           "code": code.identity() if code is not None else code_identity()}
    if slot.kind == S.PROBE:
        rec["wps"] = probe_wps(run.intervals, seq_len)
    else:
        w = clean_wps(run, settings)
        rec["wps"] = statistics.median(w) if w else None
        rec["tokens_per_update"] = nproc * settings["batch_size"] * seq_len
    return rec
