"""smlp-bench: FLOP-matched speed and quality of sMLP against its baselines (sMLP Table 4, Figure 5).

    smlp-bench [--quick] [--output-dir results/bench] [--seeds N] [--models smlp_det,gshard,...]

One question: at matched FLOPs on the same data, how fast does each model train (words/s, MFU)
and how low does its validation perplexity go (against updates and against wall time)?

1. data:     the demo corpus (Gutenberg plays, sentencepiece 4k, fairseq binary; built once);
2. peak:     dense fp32 matmul FLOP/s of W concurrent processes with one thread each, the MFU
             denominator, measured in this run on this machine;
3. matching: the target sMLP-deterministic (D=256, F=1024, T=256, 9 dense + 3 sparse blocks,
             one expert per rank) and every other family FLOP-matched to it by the FLOPs
             calculator (`smlp_eval.flops.match`) at run time;
4. training: every model runs the real fairseq-train through `smlp-launch --nproc W --cpu` (one
             gloo rank and one thread per core), same data, tokens, updates, optimizer and seeds.
             Anchors in the same run: fairseq's own `transformer_lm` (dense, and with
             --base-layers) at the sizes of our Transformer and Base Layers;
5. profile:  a window of steps near the end of the first seed's run is profiled inside
             fairseq-train (`SMLP_PROFILE_STEPS`, torch.profiler): routing, all2all, experts,
             token mixing and the rest of a step;
6. report:   results.json, Figure 5 (perplexity against updates and wall time), a Table 4 style
             table (table.md), and a summary on the console.

Words/s are tokens read per second over all ranks: fairseq's `wps` (tokens scored) times
bsz x seq_len / wpb, which only differs for partial prediction (its routing prefix is read, not
scored; see `input_tokens_per_target`), from log intervals that
contain neither a validation, the warm-up, nor the profiled window; the figure per model is the
median over those intervals, then the mean over seeds (spread: standard deviation).
MFU = words/s x training FLOPs per token / peak, with training FLOPs = 3 x the calculator's
forward FLOPs (the backward pass costs twice the forward), the paper's FLOPs convention (full
T x T spatial and attention products); "MFU (executed)" counts the causal products as they run,
without their zero triangle (`smlp_eval.flops.executed_macs`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

PROG = "smlp-bench"
BIN = Path(sys.executable).parent

TRAIN_LINE = re.compile(r"\| train_inner \| (.*)")
VALID_LINE = re.compile(r"\| valid on 'valid' subset \| (.*)")
FIELD = re.compile(r"(\w+)[= ]([-\d.eE+]+)")

# The target and its width (CPU scale that still means something: d_model >= 256, sequence >= 256).
TARGET = dict(d_model=256, d_ffn=1024, seq_len=256, dense=9, sparse=3)
MATCH_TOLERANCE = 0.03
OUR_FAMILIES = ("transformer", "gmlp", "hypermixer", "ninformer", "gshard", "switch", "base", "hash")
MODEL_ORDER = ("smlp_det", "smlp_partial", "gmlp", "hypermixer", "ninformer", "transformer", "gshard", "switch",
               "base", "hash", "fairseq_transformer_lm", "fairseq_base_layers")
NAMES = {"smlp_det": "sMLP-deterministic", "smlp_partial": "sMLP-partial", "gmlp": "gMLP",
         "transformer": "Transformer", "hypermixer": "HyperMixer (causal)",
         "ninformer": "NiNformer (causal)", "gshard": "GShard", "switch": "Switch", "base": "Base Layers",
         "hash": "HASH Layers", "fairseq_transformer_lm": "fairseq transformer_lm",
         "fairseq_base_layers": "fairseq transformer_lm --base-layers"}
MOE_BASELINES = ("gshard", "switch", "base", "hash")
# Causal HyperMixer keeps a d' x C state per position: at this size one block's training step takes
# ~12 s on one CPU thread against ~0.1 s for the SGU (elementwise-bound, see smlp/token_mixers.py), so
# a run would take hours. It is benchmarked only when asked for (--models ...,hypermixer).
DEFAULT_MODELS = tuple(k for k in MODEL_ORDER if k != "hypermixer")

PRESETS = {
    # quick: one seed, short runs (a smoke test of the comparison, under 10 minutes here)
    "quick": dict(seeds=1, updates=24, batch_size=4, log_interval=2, validate_every=8, valid_steps=8,
                  warmup=8, lr=2e-3, profile_steps=2),
    # full: three seeds, longer runs (about 50 minutes here for the 11 default models: ~95 s a run,
    # of which ~13 s validation; validating every 10 updates over 16 batches took it past an hour)
    "full": dict(seeds=3, updates=60, batch_size=4, log_interval=2, validate_every=15, valid_steps=8,
                 warmup=10, lr=2e-3, profile_steps=3),
}


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- machine and peak


def machine_info() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "processor": platform.processor()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for pkg in ("fairseq", "fvcore"):
        try:
            from importlib.metadata import version

            info[pkg] = version({"fairseq": "fairseq-fixed"}.get(pkg, pkg))
        except Exception:
            pass
    return info


def _matmul_worker(n: int, seconds: float, queue) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    queue.put(2 * n ** 3 * done / (time.perf_counter() - start))


def matmul_peak(nproc: int, n: int = 1024, seconds: float = 4.0) -> dict:
    """Dense fp32 matmul FLOP/s of `nproc` concurrent single-thread processes (as the training ranks run)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_matmul_worker, args=(n, seconds, queue)) for _ in range(nproc)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join()
    return {"per_rank": rates, "total": sum(rates), "n": n, "threads_per_rank": 1}


# ---------------------------------------------------------------- the models


@dataclass
class Model:
    key: str
    flags: list[str]                  # fairseq-train model flags
    fwd_flops_per_seq: int            # calculator, one sequence of seq_len tokens
    layers: str
    ours: bool = True
    note: str = ""
    executed_fwd_flops_per_seq: int | None = None  # without the causal zero triangles (None: as counted)

    @property
    def train_flops_per_token(self) -> float:
        return 3.0 * self.fwd_flops_per_seq / TARGET["seq_len"]

    @property
    def executed_train_flops_per_token(self) -> float:
        return 3.0 * (self.executed_fwd_flops_per_seq or self.fwd_flops_per_seq) / TARGET["seq_len"]


def plan_models(vocab_size: int, nproc: int, keys: Sequence[str]) -> tuple[list[Model], dict]:
    """The target and its FLOP matches, from the calculator (`smlp_eval.flops`)."""
    from smlp_eval import flops as F

    t = TARGET
    width = ["--decoder-embed-dim", str(t["d_model"]), "--decoder-ffn-embed-dim", str(t["d_ffn"]),
             "--tokens-per-sample", str(t["seq_len"])]
    target_flags = ["--arch", "smlp_lm", *width, "--decoder-layers", str(t["dense"]),
                    "--sparse-layers", str(t["sparse"]), "--num-experts", str(nproc)]
    spec = F.parse_model("smlp_lm", target_flags[2:], vocab_size=vocab_size)
    target = F.count_spec(spec)
    rows = {r.family: r for r in F.match(target, tolerance=MATCH_TOLERANCE, families=OUR_FAMILIES)}
    partial = F.count_spec(F.parse_model("smlp_lm", [*target_flags[2:], "--smoe-routing", "partial"],
                                         vocab_size=vocab_size))
    models = [Model("smlp_det", target_flags, target.flops, f"{t['dense']}+{t['sparse']}",
                    executed_fwd_flops_per_seq=2 * F.executed_macs(target)),
              Model("smlp_partial", [*target_flags, "--smoe-routing", "partial"], partial.flops,
                    f"{t['dense']}+{t['sparse']}", executed_fwd_flops_per_seq=2 * F.executed_macs(partial))]
    for family in OUR_FAMILIES:
        r = rows[family]
        c = r.count.cfg
        flags = F.fairseq_flags(c).split()
        layers = f"{c.dense_layers}+{c.sparse_layers}" if c.sparse_layers else str(c.dense_layers)
        models.append(Model(family, flags, r.count.flops, layers,
                            note="" if r.within_tolerance else f"nearest FLOPs match: {r.rel:+.1%}",
                            executed_fwd_flops_per_seq=2 * F.executed_macs(r.count)))
    # fairseq's own transformer_lm at the sizes of our Transformer and Base Layers
    tr, base = rows["transformer"].count.cfg, rows["base"].count.cfg
    # transformer_lm's --decoder-input-dim / --decoder-output-dim default to 512 whatever the model width
    # (a 512-wide embedding with projections in and out): set them to D for the same model as ours.
    fairseq_common = ["--arch", "transformer_lm", *width, "--decoder-attention-heads", str(tr.heads),
                      "--decoder-input-dim", str(t["d_model"]), "--decoder-output-dim", str(t["d_model"]),
                      "--decoder-normalize-before", "--share-decoder-input-output-embed", "--activation-fn", "gelu",
                      "--attention-dropout", "0"]
    models.append(Model("fairseq_transformer_lm", [*fairseq_common, "--decoder-layers", str(tr.dense_layers)],
                        rows["transformer"].count.flops, str(tr.dense_layers), ours=False))
    base_flops = _fairseq_base_layers_flops(rows, base)
    models.append(Model("fairseq_base_layers", [*fairseq_common, "--decoder-layers", str(base.dense_layers),
                                                "--base-layers", str(base.sparse_layers), "--base-sublayers", "1",
                                                "--base-shuffle", "1"],
                        base_flops, f"{base.dense_layers}+{base.sparse_layers}", ours=False,
                        note="fairseq's BaseLayer has no attention: fewer FLOPs than our Base Layers"))
    by_key = {m.key: m for m in models}
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise BenchError(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODEL_ORDER)}")
    matching = {"target": {"arch": "smlp_lm", **TARGET, "experts": nproc, "flops": target.flops},
                "tolerance": MATCH_TOLERANCE, "matches": [r.as_dict() for r in rows.values()]}
    return [by_key[k] for k in keys], matching


def _fairseq_base_layers_flops(rows, base_cfg) -> int:
    """fairseq's --base-layers stack = our Base Layers stack minus the attention of its sparse blocks.

    Our sparse block is attention + routed FFN; fairseq's BaseLayer is the routed FFN alone (with its
    own LayerNorm), so its FLOPs are ours minus N2 attention sublayers. The attention sublayer's
    cost is the dense Transformer block's minus its FFN (2 D F multiply-adds per token)."""
    c = rows["base"].count
    T, D, Fw = TARGET["seq_len"], TARGET["d_model"], TARGET["d_ffn"]
    attention_macs = c.dense.macs - 2 * D * Fw * T - 5 * T * D  # minus the FFN and its LayerNorm
    return c.flops - 2 * base_cfg.sparse_layers * attention_macs


# ---------------------------------------------------------------- one training run


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


def _fields(text: str) -> dict:
    return {k: float(v) for k, v in FIELD.findall(text)}


def _vmhwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class _PeakMemory(threading.Thread):
    """Highest resident set (VmHWM) of every worker process of a launcher, polled until it exits."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peaks, self.stop = pid, {}, threading.Event()

    def run(self) -> None:
        import psutil

        try:
            parent = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stop.wait(0.5):
            try:
                kids = parent.children(recursive=True)
            except psutil.Error:
                return
            for kid in kids:
                hwm = _vmhwm_mb(kid.pid)
                if hwm is not None:
                    self.peaks[kid.pid] = max(self.peaks.get(kid.pid, 0.0), hwm)


def train_command(model: Model, data: Path, args, seed: int, logdir: Path) -> list[str]:
    p = args.preset
    ours = ["--user-dir", str(_plugins_dir()), "--criterion", "smlp_lm_loss"] if model.ours else \
        ["--criterion", "cross_entropy"]
    return [
        str(BIN / "smlp-launch"), "--nproc", str(args.nproc), "--cpu", "--threads", "1", "--log-dir", str(logdir),
        "--", str(data), *ours, *model.flags, "--task", "language_modeling", "--sample-break-mode", "none",
        "--batch-size", str(p["batch_size"]), "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--lr", str(p["lr"]), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(p["warmup"]),
        "--warmup-init-lr", "1e-7", "--clip-norm", "1.0", "--dropout", "0", "--max-update", str(p["updates"]),
        "--validate-interval-updates", str(p["validate_every"]), "--max-valid-steps", str(p["valid_steps"]),
        "--log-format", "simple", "--log-interval", str(p["log_interval"]), "--no-progress-bar", "--no-save",
        "--num-workers", "0", "--seed", str(seed), "--validate-interval", "1000",  # no end-of-epoch validation
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


def run_model(model: Model, data: Path, args, seed: int, profile: bool, on_line=None) -> Run:
    out = args.output_dir / "runs" / f"{model.key}.seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = train_command(model, data, args, seed, out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prof_path = out / "profile"
    for old in out.glob("profile.rank*.json"):
        old.unlink()
    if profile:
        start, count = profile_window(args.preset)
        env["SMLP_PROFILE_STEPS"] = f"{start}:{count}:{prof_path}"
    (out / "train.cmd").write_text(" ".join(cmd) + "\n")
    run = Run(model.key, seed)
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        memory = _PeakMemory(proc.pid)
        memory.start()
        last_wall = 0.0
        for line in proc.stdout:
            log.write(line)
            if m := TRAIN_LINE.search(line):
                f = _fields(m.group(1))
                run.intervals.append(f)
                last_wall = f.get("wall", last_wall)
                if on_line:
                    on_line("train", f)
            elif m := VALID_LINE.search(line):
                f = _fields(m.group(1))
                f["wall"] = last_wall
                run.valid.append(f)
                if on_line:
                    on_line("valid", f)
        code = proc.wait()
        memory.stop.set()
        memory.join(timeout=5)
    run.seconds = time.perf_counter() - t0
    run.peak_rss_mb = sorted(memory.peaks.values(), reverse=True)[:args.nproc]
    if code != 0:
        tail = "".join((out / "train.log").read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise BenchError(f"{model.key} (seed {seed}) failed with exit code {code}; log: {out / 'train.log'}\n{tail}")
    if profile:
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("profile.rank*.json"))]
        if len(ranks) != args.nproc:
            raise BenchError(f"{model.key}: expected {args.nproc} profile files in {out}, found {len(ranks)}")
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
    out = []
    for f in run.intervals:
        end = int(f.get("num_updates", 0))
        first = end - L + 1
        if first <= L or (first - 1) % V == 0 or profiled & set(range(first, end + 1)):
            continue
        if "wps" in f:
            out.append(f["wps"] * input_tokens_per_target(f))
    return out


def input_tokens_per_target(interval: dict) -> float:
    """Tokens the model read per token it was scored on. fairseq's wps counts targets (the
    criterion's ntokens); a partial-prediction model reads its routing prefix without scoring it, so
    its wps alone would understate its speed by the prefix share (20%). With bsz sequences of
    seq_len tokens per update and wpb targets: bsz x seq_len / wpb (1 for every other model)."""
    if "bsz" in interval and interval.get("wpb"):
        return interval["bsz"] * TARGET["seq_len"] / interval["wpb"]
    return 1.0


# ---------------------------------------------------------------- summary


def summarise(models: list[Model], runs: dict[str, list[Run]], peak: dict, args) -> dict:
    out = {}
    for m in models:
        rs = runs[m.key]
        wps_seed = [statistics.median(clean_wps(r, args.preset)) for r in rs if clean_wps(r, args.preset)]
        ppl_seed = [r.valid[-1]["ppl"] for r in rs if r.valid]
        wps = statistics.mean(wps_seed) if wps_seed else None
        prof = next((r.profile for r in rs if r.profile), None)
        out[m.key] = {
            "name": NAMES[m.key], "layers": m.layers, "fairseq_flags": " ".join(m.flags), "note": m.note,
            "wps": wps, "wps_std": statistics.stdev(wps_seed) if len(wps_seed) > 1 else 0.0,
            "wps_per_seed": wps_seed,
            "valid_ppl": statistics.mean(ppl_seed) if ppl_seed else None,
            "valid_ppl_std": statistics.stdev(ppl_seed) if len(ppl_seed) > 1 else 0.0,
            "valid_ppl_per_seed": ppl_seed,
            "flops_per_token": m.train_flops_per_token, "fwd_flops_per_seq": m.fwd_flops_per_seq,
            "mfu": wps * m.train_flops_per_token / peak["total"] if wps else None,
            "executed_flops_per_token": m.executed_train_flops_per_token,
            "mfu_executed": wps * m.executed_train_flops_per_token / peak["total"] if wps else None,
            "breakdown": prof["breakdown"] if prof else None,
            "profiled_seconds_per_step": prof["seconds_per_step"] if prof else None,
            "top_ops": prof["top_ops_rank0"] if prof else None,
            "peak_mem_mb": max((max(r.peak_rss_mb) for r in rs if r.peak_rss_mb), default=None),
            "curves": [{"seed": r.seed, "updates": [int(v["num_updates"]) for v in r.valid],
                        "wall": [v["wall"] for v in r.valid], "ppl": [v["ppl"] for v in r.valid]} for r in rs],
            "seconds": [round(r.seconds, 1) for r in rs],
        }
    return out


def ratios(results: dict) -> dict:
    """The comparisons the paper makes (Table 4) and the anchors' checks."""
    def r(a, b):
        return results[a]["wps"] / results[b]["wps"] if a in results and b in results and results[b]["wps"] \
            and results[a]["wps"] else None

    out = {"smlp_det_wps_over": {k: r("smlp_det", k) for k in results if k != "smlp_det"}}
    moe = [k for k in MOE_BASELINES if k in results and results[k]["wps"]]
    if moe and "smlp_det" in results:
        fastest = max(moe, key=lambda k: results[k]["wps"])
        best = min(moe, key=lambda k: results[k]["valid_ppl"] or float("inf"))
        out["fastest_moe_baseline"] = fastest
        out["smlp_det_over_fastest_moe"] = r("smlp_det", fastest)
        out["best_moe_baseline_ppl"] = best
        out["smlp_det_ppl_minus_best_moe"] = (results["smlp_det"]["valid_ppl"] or 0) - (results[best]["valid_ppl"] or 0)
    out["transformer_over_fairseq"] = r("transformer", "fairseq_transformer_lm")
    out["base_over_fairseq_base_layers"] = r("base", "fairseq_base_layers")
    if "base" in results and "fairseq_base_layers" in results and out["base_over_fairseq_base_layers"]:
        out["base_over_fairseq_base_layers_flop_rate"] = out["base_over_fairseq_base_layers"] * \
            results["base"]["flops_per_token"] / results["fairseq_base_layers"]["flops_per_token"]
    return out


def table(results: dict, rat: dict, peak: dict, machine: dict, args) -> str:
    lines = [f"Measured on {machine.get('cpu_model', machine['processor'])}, {args.nproc} gloo ranks x 1 thread, "
             f"dense matmul peak {peak['total'] / 1e9:.1f} GFLOP/s (sum over ranks); {args.preset_name} preset, "
             f"{args.preset['seeds']} seed(s), {args.preset['updates']} updates of {args.preset['batch_size']} x "
             f"{TARGET['seq_len']} tokens per rank.", "",
             "| model | layers | GFLOPs/token (train) | words/s | sMLP-det speed-up | valid ppl | MFU | MFU (executed) "
             "| routing + all2all | peak RSS / rank |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, m in results.items():
        speed = rat["smlp_det_wps_over"].get(key)
        b = m["breakdown"]
        comm = f"{(b['routing'] + b['all2all']):.1%}" if b else "-"
        wps = f"{m['wps']:,.0f} ± {m['wps_std']:,.0f}" if m["wps"] else "-"
        ppl = f"{m['valid_ppl']:.1f} ± {m['valid_ppl_std']:.1f}" if m["valid_ppl"] else "-"
        speed = f"{speed:.2f}x" if speed else "-"
        mfu = f"{m['mfu']:.1%}" if m["mfu"] else "-"
        mfu_executed = f"{m['mfu_executed']:.1%}" if m.get("mfu_executed") else "-"
        mem = f"{m['peak_mem_mb']:.0f} MB" if m["peak_mem_mb"] else "-"
        lines.append(f"| {m['name']} | {m['layers']} | {m['flops_per_token'] / 1e9:.4f} | {wps} | {speed} | {ppl} "
                     f"| {mfu} | {mfu_executed} | {comm} | {mem} |")
    return "\n".join(lines)


def targets(record: dict) -> list[dict]:
    """The issue's targets, each with the measured figure and whether it is met."""
    results, rat = record["models"], record["ratios"]
    out = []

    def add(name, value, goal, met):
        out.append({"target": name, "measured": value, "goal": goal, "met": bool(met) if value is not None else None})

    v = rat.get("smlp_det_over_fastest_moe")
    add(f"sMLP-det words/s over the fastest MoE baseline ({rat.get('fastest_moe_baseline')})",
        v, ">= 1.10x", v is not None and v >= 1.10)
    d = rat.get("smlp_det_ppl_minus_best_moe")
    add(f"sMLP-det valid ppl minus the best MoE baseline's ({rat.get('best_moe_baseline_ppl')}), equal updates",
        d, "<= 0", d is not None and d <= 0)
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
            v = b["routing"] + b["all2all"]
            add(f"{NAMES[key]} routing + all2all share of a step", v, "<= 15%", v <= 0.15)
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) >= 2 or value < 0 else f"{value:.3f}"


def render_markdown(record: dict, figure: str) -> str:
    """The README section: generated from results.json, never typed by hand."""
    lines = [record["table_md"], "", f"![validation perplexity against updates and wall time]({figure})", "",
             "| target | measured | goal | met |", "|---|---:|---|---|"]
    for t in record["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['target']} | {_fmt(t['measured'])} | {t['goal']} | {met} |")
    lines += ["", f"Generated by `smlp-bench` ({record['preset']} preset, {record['seconds'] / 60:.0f} min) from "
                  f"`results.json`; machine: {record['machine'].get('cpu_model', '?')}, {record['machine']['cpus']} "
                  f"cores, torch {record['machine']['torch']}."]
    return "\n".join(lines)


README_START, README_END = "<!-- smlp-bench:start -->", "<!-- smlp-bench:end -->"


def publish(results_json: Path, readme: Path, figure_dir: Path) -> None:
    """Copy the figure and JSON next to the README and rewrite its benchmark section."""
    import shutil

    record = json.loads(results_json.read_text())
    figure_dir.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "figure5.png", "table.md"):
        src = results_json.parent / name
        if src.exists() and src.resolve() != (figure_dir / name).resolve():
            shutil.copy2(src, figure_dir / name)
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise BenchError(f"{readme} has no {README_START} ... {README_END} section to rewrite")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    figure = (figure_dir / "figure5.png").relative_to(readme.parent.resolve()).as_posix()
    readme.write_text(head + README_START + "\n" + render_markdown(record, figure) + "\n" + README_END + tail)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, m in results.items():
        style = "-" if key.startswith("smlp") else ("--" if key.startswith("fairseq") else "-.")
        for ax, xkey in zip(axes, ("updates", "wall")):
            curves = [c for c in m["curves"] if c["ppl"]]
            if not curves:
                continue
            n = min(len(c["ppl"]) for c in curves)
            xs = [statistics.mean(c[xkey][i] for c in curves) for i in range(n)]
            ys = [statistics.mean(c["ppl"][i] for c in curves) for i in range(n)]
            line, = ax.plot(xs, ys, style, marker="o", ms=3, label=m["name"], lw=2 if key == "smlp_det" else 1)
            if len(curves) > 1:
                lo = [min(c["ppl"][i] for c in curves) for i in range(n)]
                hi = [max(c["ppl"][i] for c in curves) for i in range(n)]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("updates")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("FLOP-matched models on the demo corpus (in the manner of sMLP Figure 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one seed, short runs (under 10 minutes here)")
    p.add_argument("--output-dir", type=Path, default=Path("results/bench"), help="where results go (results/bench)")
    p.add_argument("--data", type=Path, default=None,
                   help="a fairseq data-bin (default: the demo corpus, built into OUTPUT_DIR/data-bin once)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated subset of {','.join(MODEL_ORDER)} (default: all but hypermixer)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per model (quick: 1, full: 3)")
    p.add_argument("--updates", type=int, default=None, help="training updates per run (quick: 24, full: 60)")
    p.add_argument("--nproc", type=int, default=2, help="expert-parallel CPU ranks = experts (2)")
    p.add_argument("--publish", type=Path, default=None, metavar="RESULTS_JSON",
                   help="do not train: copy RESULTS_JSON's figures to docs/benchmark/ and rewrite README.md's "
                        "benchmark section from it")
    return p


def prepare(args) -> Path:
    if args.data:
        if not (args.data / "dict.txt").is_file():
            raise BenchError(f"--data {args.data} is not a fairseq data-bin (no dict.txt); build one with "
                             f"smlp-prepare-data")
        return args.data
    from smlp_launch.data import DataPrepError, prepare_data

    try:
        out, _ = prepare_data(args.output_dir / "data-bin", demo=True, vocab_size=4000, seed=1,
                              log=lambda msg: print(f"   {msg}", flush=True))
    except DataPrepError as exc:
        raise BenchError(f"data preparation failed: {exc}") from exc
    return out


def vocab_size(data: Path) -> int:
    """The size of the dictionary fairseq builds for this data-bin (its specials included)."""
    from fairseq.data import Dictionary

    return len(Dictionary.load(str(data / "dict.txt")))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.preset_name = "quick" if args.quick else "full"
    args.preset = dict(PRESETS[args.preset_name])
    if args.seeds is not None:
        args.preset["seeds"] = args.seeds
    if args.updates is not None:
        args.preset["updates"] = args.updates
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    if args.publish:
        try:
            root = Path.cwd()
            publish(args.publish, root / "README.md", root / "docs" / "benchmark")
        except (BenchError, OSError, KeyError, json.JSONDecodeError) as exc:
            print(f"{PROG}: error: cannot publish {args.publish}: {exc}", file=sys.stderr)
            return 1
        print(f"   README.md's benchmark section now shows {args.publish}")
        return 0
    try:
        if args.nproc < 2:
            raise BenchError(f"--nproc {args.nproc}: expert parallelism needs at least 2 ranks")
        if args.preset["seeds"] < 1 or args.preset["updates"] < 4 * args.preset["validate_every"] // 2:
            raise BenchError(f"--seeds must be >= 1 and --updates >= {2 * args.preset['validate_every']}")
        args.output_dir = args.output_dir.expanduser().absolute()
        args.output_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        print(f"== {PROG} ({args.preset_name}): {len(keys)} models x {args.preset['seeds']} seed(s), "
              f"{args.preset['updates']} updates each, {args.nproc} ranks", flush=True)
        print("== 1/5 data", flush=True)
        data = prepare(args)
        print(f"== 2/5 dense matmul peak ({args.nproc} processes x 1 thread)", flush=True)
        peak = matmul_peak(args.nproc)
        print(f"   {peak['total'] / 1e9:.1f} GFLOP/s in total", flush=True)
        print("== 3/5 FLOP matching (smlp_eval.flops.match)", flush=True)
        models, matching = plan_models(vocab_size(data), args.nproc, keys)
        for m in models:
            print(f"   {NAMES[m.key]:<40} {m.layers:>6}  {m.fwd_flops_per_seq / 1e9:.3f} GFLOPs/seq  {m.note}")
        print("== 4/5 training", flush=True)
        runs = train_all(models, data, args)
        print("== 5/5 report", flush=True)
        machine = machine_info()
        results = summarise(models, runs, peak, args)
        rat = ratios(results)
        md = table(results, rat, peak, machine, args)
        record = {"models": results, "ratios": rat, "matching": matching, "machine": machine, "peak_flops": peak,
                  "preset": args.preset_name, "settings": args.preset, "target": TARGET, "nproc": args.nproc,
                  "seconds": round(time.time() - t0, 1), "table_md": md}
        record["targets"] = targets(record)
        write_json(args.output_dir / "results.json", record)
        (args.output_dir / "table.md").write_text(md + "\n")
        plot(results, args.output_dir / "figure5.png")
        print(md)
        print()
        for t in record["targets"]:
            met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
            print(f"   {met:>6}  {t['target']}: {_fmt(t['measured'])} (goal {t['goal']})")
        print(f"\n   sMLP-det words/s over the fastest MoE baseline ({rat.get('fastest_moe_baseline')}): "
              f"{rat.get('smlp_det_over_fastest_moe') or float('nan'):.2f}x;  our Transformer / fairseq: "
              f"{rat.get('transformer_over_fairseq') or float('nan'):.2f}x;  our Base Layers / fairseq's: "
              f"{rat.get('base_over_fairseq_base_layers') or float('nan'):.2f}x")
        print(f"   results: {args.output_dir / 'results.json'}, {args.output_dir / 'table.md'}, "
              f"{args.output_dir / 'figure5.png'}  ({(time.time() - t0) / 60:.1f} min)")
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


def train_all(models: list[Model], data: Path, args) -> dict[str, list[Run]]:
    from tqdm import tqdm

    seeds = list(range(1, args.preset["seeds"] + 1))
    total = len(models) * len(seeds) * args.preset["updates"]
    bar = tqdm(total=total, unit="upd", desc="   training", dynamic_ncols=True, file=sys.stdout,
               disable=None)
    runs: dict[str, list[Run]] = {m.key: [] for m in models}
    done = 0
    for seed in seeds:
        for m in models:
            bar.set_description(f"   {m.key} seed {seed}")

            def on_line(kind, f, base=done):
                if kind == "train":
                    bar.n = base + int(f.get("num_updates", 0))
                    bar.refresh()

            # fairseq's own models carry none of our profiler ranges: only ours are profiled
            run = run_model(m, data, args, seed, profile=(seed == seeds[0] and m.ours), on_line=on_line)
            runs[m.key].append(run)
            done += args.preset["updates"]
            bar.n = done
            wps = clean_wps(run, args.preset)
            bar.write(f"   {m.key:<24} seed {seed}: {statistics.median(wps) if wps else float('nan'):>8,.0f} words/s, "
                      f"valid ppl {run.valid[-1]['ppl'] if run.valid else float('nan'):.1f}, {run.seconds:.0f} s")
    bar.close()
    return runs


if __name__ == "__main__":
    sys.exit(main())
