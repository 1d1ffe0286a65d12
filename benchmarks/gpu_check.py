"""The GPU check: the project's training and decoding paths on one CUDA device, against the CPU.

    make gpu-check [GPU_CHECK_ARGS="--output-dir DIR"]        (python -m smlp_bench.gpu_check [...])

One program for one CUDA GPU with only torch and numpy installed (the core and this program import
nothing else; `make gpu-check` runs it from the checkout, without installing the project). Checks:

    auction          balanced assignment on the device equals the CPU's numpy path bit for bit (experts and
                     prices), with at most one host read per auction phase
    fp32             every family's training forward and backward on the device in fp32 against the same
                     weights on the CPU, within the rounding bound of tests/tolerance.py; routing decisions
                     that depend on other rows or on random draws are made on the CPU and replayed
    autocast         bf16 and fp16 autocast training steps: loss and gradients finite, router logits fp32
    cached-decoding  cached decoding on the device equals the full forward on the device
    causality        smlp/causality.py on the device (eval mode); the leaky router must fail it
    host-syncs       synchronizing calls of a training step of each family (torch.cuda.set_sync_debug_mode),
                     against the budget the CPU counter enforces (tests/test_hot_path.py) and against what the
                     CPU counter (smlp_bench.micro.host_syncs) counts for the same step
    speed            training words/s, MFU against the bf16 matmul rate measured in the same run, and peak
                     memory: the fair configuration (benchmarks/fair.py FAIR_TARGET, fp32) and a GPU-sized one
                     (D=1024, T=512, 8 experts, bf16 autocast), FLOP-matched from the core (analytic counts),
                     one process with every expert local, timed in turns
    fairseq          a training step through the fairseq plugin, where fairseq imports; skipped otherwise

--dry-run runs the same checks on the CPU at tiny sizes (the device-side paths forced where the CPU
would take others: smlp_bench.micro.host_syncs.accelerator_paths), so that the test suite keeps the
program working (tests/test_gpu_check.py). Writes OUTPUT_DIR/gpu_check.json (atomically) and
OUTPUT_DIR/gpu_check.md (the summary table); exits 1 if a check failed. docs/gpu.md has more.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from smlp.causality import earlier_outputs_unchanged, randomized
from smlp.dispatch import synchronize
from smlp.lm import LanguageModel, LMConfig
from smlp.routing import assignment
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS
from smlp_eval.flops.counting import count as count_flops
from smlp_eval.flops.matching import match

from .gpu_support import (
    DRY_RUN_FAMILIES,
    DRY_RUN_SIZES,
    FAMILIES,
    SPEED_NAMES,
    SameRouting,
    Sizes,
    SpeedConfig,
    SyncCount,
    _numpy_version,
    device_info,
    device_paths,
    family_config,
    grads_finite,
    lm_loss,
    matmul_rate,
    max_difference,
    perturbed,
    rounding_bound,
    router_logit_dtypes,
    speed_configs,
    time_in_turns,
    tokens_for,
)
from .micro.host_syncs import torch_assignment_path
from .presets import MATCH_TOLERANCE
from .store import atomic_write_json, environment, write_text

CHECKS = ("auction", "fp32", "autocast", "cached-decoding", "causality", "host-syncs", "speed", "fairseq")
RECORD, TABLE = "gpu_check.json", "gpu_check.md"

# ---------------------------------------------------------------- the checks


@contextlib.contextmanager
def guarded(out: Outcome, what: str):
    """An error in one case is that case's failure (with its traceback in the figures): the others still run."""
    try:
        yield
    except Exception as e:
        out.failures.append(f"{what}: error: {type(e).__name__}: {e}")
        out.figures.setdefault("errors", {})[what] = traceback.format_exc().splitlines()[-12:]


@dataclass
class Outcome:
    """What a check found: its figures, its failures (empty: passed) or why it was skipped."""

    figures: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None

    def expect(self, ok: bool, failure: str) -> bool:
        if not ok:
            self.failures.append(failure)
        return ok

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("failed" if self.failures else "passed")


@dataclass
class Run:
    device: torch.device
    dry_run: bool
    sizes: Sizes
    families: tuple[str, ...]
    plant_fault: bool
    deadline: float
    log: Callable[[str], None]

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def check_auction(run: Run) -> Outcome:
    """Balanced assignment on the device against the CPU's numpy path with the device's completion checks
    (the same integer algorithm: the same experts and prices), and the device's host reads per call."""
    out = Outcome()
    shapes = [(80, 4), (512, 2), (2048, 8), (1024, 32), (8192, 8)]  # E = 2 exact; 8192 x 8 runs step 4
    if run.dry_run:  # step 4's reads: tests/test_hot_path.py
        shapes = [(80, 4), (64, 2), (512, 8)]
    for S, E in shapes:
        with guarded(out, f"{S}x{E}"):
            scores = torch.randn(S, E, generator=torch.Generator().manual_seed(S + E))
            expert_ref, price_ref = assignment.balanced_assignment(scores, with_prices=True,
                                                                   check_every=assignment.ACCELERATOR_CHECKS)
            every_round = assignment.balanced_assignment(scores, check_every=1)
            on_device = scores.to(run.device)
            with torch_assignment_path() if run.device.type == "cpu" else contextlib.nullcontext():
                assignment.balanced_assignment(on_device, with_prices=True)  # warm-up: cached constants
                with SyncCount(run.device) as syncs:
                    expert_dev, price_dev = assignment.balanced_assignment(on_device, with_prices=True)
                times = []
                for _ in range(1 if run.dry_run else 5):
                    t0 = time.perf_counter()
                    assignment.balanced_assignment(on_device)
                    synchronize(run.device)
                    times.append(time.perf_counter() - t0)
            keys = S * (1 << max(1, (E - 1).bit_length()))
            work_rows = max(S // 16, assignment._MIN_WORKING_ROWS)
            step4 = E > 2 and keys >= assignment._MIN_TAIL_KEYS and 2 * work_rows <= S
            reads_allowed = 0 if E == 2 else (2 if step4 else 1)
            key = f"{S}x{E}"
            same = torch.equal(expert_dev.cpu(), expert_ref)
            price_err = max_difference(price_dev, price_ref)
            out.figures[key] = {"same_experts": same, "as_every_round_checks": torch.equal(expert_ref, every_round),
                                "price_max_difference": price_err, "host_reads": syncs.count,
                                "host_reads_allowed": reads_allowed, "median_ms": 1000 * statistics.median(times),
                                "step4": step4}
            out.expect(same, f"{key}: the device's experts differ from the CPU's")
            price_bound = 1e-6 * max(1.0, float(price_ref.abs().max()))
            out.expect(price_err <= price_bound, f"{key}: prices differ by {price_err:.3g}")
            out.expect(syncs.count <= reads_allowed, f"{key}: {syncs.count} host reads, {reads_allowed} allowed "
                                                     f"({dict(syncs.sites)})")
            run.log(f"  auction {key}: same={same} reads={syncs.count} {1000 * statistics.median(times):.2f} ms")
    return out


def check_fp32(run: Run) -> Outcome:
    """Every family's training forward and backward on the device against the CPU, fp32, same weights."""
    out = Outcome()
    s = run.sizes
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32 (also torch's default)
    try:
        for name in run.families:
            with guarded(out, name):
                cfg = family_config(name, s)
                torch.manual_seed(0)
                ref = perturbed(LanguageModel(cfg)).train()
                dev = copy.deepcopy(ref).to(run.device)
                if run.plant_fault:  # the check's own test: a weight off by 1e-3 of itself must fail it
                    with torch.no_grad():
                        next(p for p in dev.layers[0].parameters() if p.dim() >= 2).mul_(1 + 1e-3)
                x = tokens_for(cfg, s.batch, seed=1)
                routing = SameRouting()
                with routing.recording():
                    loss_ref, logits_ref = lm_loss(ref, x)
                loss_ref.backward()
                with routing.replaying(), device_paths(run.device):
                    loss_dev, logits_dev = lm_loss(dev, x.to(run.device))
                    loss_dev.backward()
                depth = len(ref.layers) + 1
                grads_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
                grads_dev = torch.cat([p.grad.reshape(-1).cpu() for p in dev.parameters() if p.grad is not None])
                widths = max(s.d_model, s.d_ffn, s.seq_len)
                logits_bound = rounding_bound(logits_ref, widths, depth)
                # the loss moves by at most twice the logits' error, plus its own sums (vocabulary, rows)
                loss_bound = 2 * logits_bound + rounding_bound(loss_ref, s.vocab_size + s.batch * s.seq_len, 1)
                # rows summed into a weight gradient: the whole batch; the backward pass doubles the depth
                grads_bound = rounding_bound(grads_ref, max(widths, s.batch * s.seq_len), 2 * depth)
                checks = {"logits": (logits_dev, logits_ref, logits_bound), "loss": (loss_dev, loss_ref, loss_bound),
                          "gradients": (grads_dev, grads_ref, grads_bound)}
                figures = {}
                for what, (got, want, bound) in checks.items():
                    err = max_difference(got, want)
                    figures[what] = {"max_difference": err, "bound": bound}
                    out.expect(err <= bound, f"{name}: {what} differ by {err:.3g}, bound {bound:.3g}")
                figures["routing_replayed"] = len(routing.assignments)
                out.figures[name] = figures
                logits, grads = figures["logits"], figures["gradients"]
                run.log(f"  fp32 {name}: logits {logits['max_difference']:.2g} (bound {logits['bound']:.2g}), "
                        f"gradients {grads['max_difference']:.2g} (bound {grads['bound']:.2g})")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out


def _learned_router(cfg: LMConfig) -> bool:
    if cfg.token_routed_experts:
        return True
    if not cfg.sparse_layers:
        return False
    return cfg.family == "smlp" or TOKEN_ROUTERS[cfg.moe_router].learned_scores


def check_autocast(run: Run) -> Outcome:
    """bf16 and fp16 autocast training steps of every family: two optimizer steps, loss and gradients finite,
    the output in the autocast dtype, every router's logits fp32."""
    out = Outcome()
    s = run.sizes
    for dtype in (torch.bfloat16, torch.float16):
        label = str(dtype).removeprefix("torch.")
        for name in run.families:
            with guarded(out, f"{name} {label}"):
                cfg = family_config(name, s)
                torch.manual_seed(0)
                model = perturbed(LanguageModel(cfg)).to(run.device).train()
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                x = tokens_for(cfg, s.batch, seed=2).to(run.device)
                router_dtypes, losses, finite = [], [], True
                with device_paths(run.device):
                    for _ in range(2):
                        opt.zero_grad(set_to_none=True)
                        with torch.autocast(run.device.type, dtype=dtype), router_logit_dtypes(router_dtypes):
                            loss, logits = lm_loss(model, x)
                        loss.backward()
                        finite = finite and grads_finite(model)
                        opt.step()
                        losses.append(float(loss.detach()))
                fp32 = {torch.float32} == set(router_dtypes)
                out.figures[f"{name} {label}"] = {"losses": losses, "logits_dtype": str(logits.dtype),
                                                  "router_logits": sorted({str(d) for d in router_dtypes})}
                out.expect(all(math.isfinite(v) for v in losses), f"{name} {label}: loss not finite {losses}")
                out.expect(finite, f"{name} {label}: gradients not finite")
                out.expect(logits.dtype == dtype, f"{name} {label}: logits are {logits.dtype}: autocast did not apply")
                if _learned_router(cfg):
                    out.expect(fp32, f"{name} {label}: router logits {sorted(map(str, set(router_dtypes)))}, want fp32")
        run.log(f"  autocast {label}: {len(run.families)} families")
    return out


def check_cached_decoding(run: Run) -> Outcome:
    """Cached decoding on the device (prefill, single steps, multi-position steps) equals the full forward."""
    out = Outcome()
    s = run.sizes
    T = s.seq_len
    schedules = ([3, 1, 2, 1, T - 7], [T // 4] + [1] * (T // 4) + [T - T // 2], [T])
    for name in run.families:
        with guarded(out, name):
            cfg = family_config(name, s)
            torch.manual_seed(0)
            model = perturbed(LanguageModel(cfg)).to(run.device).eval()
            if not model.supports_cached_decoding:
                out.figures[name] = {"skipped": model.no_cached_decoding}
                continue
            x = tokens_for(cfg, 3, seed=3).to(run.device)
            worst, bound = 0.0, 0.0
            with torch.no_grad(), device_paths(run.device):
                full = model(x)
                bound = rounding_bound(full, max(s.d_model, s.d_ffn, T), len(model.layers) + 1)
                for schedule in schedules:
                    cache, parts, pos = model.new_cache(), [], 0
                    for k in schedule:
                        parts.append(model(x[:, pos:pos + k], cache=cache))
                        pos += k
                    worst = max(worst, max_difference(torch.cat(parts, 1), full))
            out.figures[name] = {"max_difference": worst, "bound": bound}
            out.expect(worst <= bound, f"{name}: cached logits differ from the full forward by {worst:.3g}, "
                                       f"bound {bound:.3g}")
    run.log(f"  cached decoding: {sum('bound' in f for f in out.figures.values())} families")
    return out


def check_causality(run: Run) -> Outcome:
    """Changing the tokens after position t leaves the outputs at positions <= t bit-identical, on the
    device, in eval mode; the leaky router (Appendix B) must fail the same check. Where outputs change,
    the record says by how much against the rounding bound: a kernel whose rounding depends on the other
    rows of its product (a leak moves outputs far more)."""
    out = Outcome()
    s = run.sizes
    T = s.seq_len
    cases = [(name, family_config(name, s), True) for name in run.families]
    cases.append(("sMLP leaky router", family_config("sMLP-partial", s, smoe_routing="leaky-full-sequence"), False))
    for name, cfg, causal in cases:
        with guarded(out, name):
            torch.manual_seed(0)
            model = randomized(LanguageModel(cfg), 1).to(run.device).eval()
            start = cfg.prediction_start
            x = tokens_for(cfg, 3, seed=4).to(run.device)
            kept, moved = {}, {}
            with torch.no_grad(), device_paths(run.device):
                for t in sorted({start, (start + T) // 2, T - 2}):
                    outputs = []

                    def recorded(tokens, model=model, outputs=outputs):
                        outputs.append(model(tokens))
                        return outputs[-1]

                    kept[str(t)] = earlier_outputs_unchanged(recorded, x, t, first_checked=start)
                    y1, y2 = (y[:, start:t + 1] for y in outputs)
                    moved[str(t)] = {"max_difference": max_difference(y1, y2),
                                     "bound": rounding_bound(y1, max(s.d_model, s.d_ffn, T), len(model.layers) + 1)}
            out.figures[name] = {"unchanged_up_to": kept, "changed_by": moved, "should_be_causal": causal}
            if causal:
                out.expect(all(kept.values()), f"{name}: outputs changed when later tokens changed: {moved}")
            else:
                out.expect(not all(kept.values()), f"{name}: the leaky router passed the causality check")
    return out


def _sync_limit(cfg: LMConfig, model: LanguageModel) -> int | None:
    """The forward's budget of host reads (tests/test_hot_path.py): one split-size read per dispatch that
    reads counts, and up to 3 auction completion checks per sparse layer with a balanced router; None
    where no budget is set (the token-routed gMLP: as many as the CPU counter counts)."""
    if cfg.token_routed_experts:
        return None
    if not cfg.sparse_layers:
        return 0
    deterministic_smoe = cfg.family == "smlp" and not SMOE_ROUTINGS[cfg.smoe_routing].balanced
    dispatches = len(model.moe_modules()) - (cfg.sparse_layers if deterministic_smoe else 0)
    return dispatches + (3 * cfg.sparse_layers if model.has_balanced_routers else 0)


def _counted_step(model, opt, x, device) -> dict:
    """One warm-up training step, then one counted: forward with the loss, backward, and on CUDA the
    optimizer step (the CPU counter counts the host's own reads of a CPU optimizer: nothing a GPU waits on)."""
    def step(count: bool) -> dict:
        counts = {}
        opt.zero_grad(set_to_none=True)
        with SyncCount(device) if count else contextlib.nullcontext() as c:
            loss, _ = lm_loss(model, x)
        counts["forward"] = c
        with SyncCount(device) if count else contextlib.nullcontext() as c:
            loss.backward()
        counts["backward"] = c
        with SyncCount(device) if count and device.type == "cuda" else contextlib.nullcontext() as c:
            opt.step()
        counts["optimizer"] = c
        return counts

    with device_paths(device):
        step(False)
    return step(True)


def check_host_syncs(run: Run) -> Outcome:
    """Synchronizing calls per training step of every family on the device, against the budget and against
    the CPU counter's count of the same step on the CPU (a sync it does not see is a gap in the counter the
    test suite relies on)."""
    out = Outcome()
    s = run.sizes
    with SyncCount(run.device) as control:  # the counting method sees a sync, and nothing else
        probe = torch.ones(4, device=run.device)
        (probe * 2).sum().item()
    out.figures["control"] = {"method": control.method, "count": control.count}
    if not out.expect(control.count == 1, f"the counting method saw {control.count} syncs in a block with one"):
        return out
    for name in run.families:
        with guarded(out, name):
            cfg = family_config(name, s)
            x_cpu = tokens_for(cfg, s.batch, seed=5)
            counted = {}
            for where in ("cpu", "device") if run.device.type != "cpu" else ("device",):
                device = torch.device("cpu") if where == "cpu" else run.device
                torch.manual_seed(0)
                model = perturbed(LanguageModel(cfg)).to(device).train()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                counted[where] = _counted_step(model, opt, x_cpu.to(device), device)
            expected = counted.get("cpu", counted["device"])  # the CPU counter's count (a dry run's device count)
            limit = _sync_limit(cfg, model)
            dev = counted["device"]
            fig = {part: {"count": dev[part].count, "cpu_counter": expected[part].count,
                          "sites": dict(dev[part].sites.most_common(8))} for part in ("forward", "backward")}
            fig["optimizer"] = None if dev["optimizer"] is None else {"count": dev["optimizer"].count,
                                                                      "sites": dict(dev["optimizer"].sites)}
            fig["forward"]["limit"] = limit
            fig["method"] = dev["forward"].method
            out.figures[name] = fig
            for part in ("forward", "backward"):
                n, cpu_n = dev[part].count, expected[part].count
                out.expect(n <= cpu_n, f"{name}: {part} made {n} host syncs, the CPU counter counts {cpu_n} "
                                       f"({dict(dev[part].sites)})")
            if limit is not None:
                out.expect(dev["forward"].count <= limit, f"{name}: forward made {dev['forward'].count} host syncs, "
                                                          f"budget {limit} ({dict(dev['forward'].sites)})")
            out.expect(dev["backward"].count == 0, f"{name}: backward made {dev['backward'].count} host syncs "
                                                   f"({dict(dev['backward'].sites)})")
            optimizer = "" if dev["optimizer"] is None else f", optimizer step {dev['optimizer'].count}"
            run.log(f"  host syncs {name}: forward {dev['forward'].count} (CPU counter {expected['forward'].count}, "
                    f"budget {limit}), backward {dev['backward'].count}{optimizer}")
    return out


def speed_models(c: SpeedConfig) -> dict[str, LMConfig]:
    """sMLP-det at the configuration and its FLOP matches (smlp_eval's analytic counts: no fairseq)."""
    target = LMConfig(family="smlp", vocab_size=c.vocab_size, d_model=c.d_model, d_ffn=c.d_ffn, seq_len=c.seq_len,
                      dense_layers=c.dense, sparse_layers=c.sparse, num_experts=c.experts)
    rows = match(count_flops(target, method="analytic"), tolerance=MATCH_TOLERANCE, method="analytic",
                 families=c.families)
    return {"sMLP-det": target, **{SPEED_NAMES[r.family]: r.count.cfg for r in rows}}


def _speed_of(run: Run, c: SpeedConfig, peak_bf16: float, budget_s: float) -> Outcome:
    out = Outcome()
    device = run.device
    configs = speed_models(c)
    steps, models, memory = {}, {}, {}
    for name, cfg in configs.items():
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        torch.manual_seed(0)
        model = LanguageModel(cfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = [tokens_for(cfg, c.batch, seed=i).to(device) for i in range(2)]
        state = {"i": 0, "loss": None}

        def step(model=model, opt=opt, batches=batches, state=state):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=c.dtype, enabled=c.dtype is not None):
                loss, _ = lm_loss(model, batches[state["i"] % 2])
            loss.backward()
            opt.step()
            state["i"] += 1
            state["loss"] = loss.detach()
            synchronize(device)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(1 if run.dry_run else 3):  # warm-up: caches, kernels, the optimizer's state
            step()
        # the step's peak above what the models built before this one hold
        memory[name] = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else None
        steps[name], models[name] = step, (model, cfg, state)
        run.log(f"  speed {c.name} {name}: {cfg.dense_layers}+{cfg.sparse_layers} layers built and warm")
    per_model = budget_s / max(1, len(steps))
    times = time_in_turns(steps, iters=2 if run.dry_run else 5, min_seconds=0.0 if run.dry_run else per_model,
                          max_iters=3 if run.dry_run else 200)
    tokens_per_step = c.batch * c.seq_len
    for name, (model, cfg, state) in models.items():
        wall = times[name]
        wps = tokens_per_step / statistics.median(wall)
        flops = count_flops(cfg, method="analytic")
        train_flops_per_token = 3 * flops.flops / cfg.seq_len
        final = float(state["loss"])
        out.figures[name] = {"layers": f"{cfg.dense_layers}+{cfg.sparse_layers}", "heads": cfg.heads,
                             "words_per_s": wps, "median_step_ms": 1000 * statistics.median(wall),
                             "steps_timed": len(wall), "train_flops_per_token": train_flops_per_token,
                             "fwd_flops_per_seq": flops.flops, "mfu": train_flops_per_token * wps / peak_bf16,
                             "peak_memory_gib": None if memory[name] is None else memory[name] / 2 ** 30,
                             "params": sum(p.numel() for p in model.parameters()), "final_loss": final}
        out.expect(math.isfinite(final), f"{c.name} {name}: loss not finite ({final})")
    out.figures["_config"] = {"d_model": c.d_model, "d_ffn": c.d_ffn, "seq_len": c.seq_len, "target": f"{c.dense}+"
                              f"{c.sparse}", "experts": c.experts, "vocab_size": c.vocab_size, "batch": c.batch,
                              "tokens_per_step": tokens_per_step, "dtype": str(c.dtype or torch.float32),
                              "match_tolerance": MATCH_TOLERANCE}
    del steps, models
    return out


def check_speed(run: Run) -> Outcome:
    """Training words/s, MFU and peak memory of sMLP-det and its FLOP matches, per configuration."""
    out = Outcome()
    n, seconds = (128, 0.05) if run.dry_run else (8192, 1.0)
    peak_bf16 = matmul_rate(run.device, torch.bfloat16, n, seconds)
    out.figures["matmul_flops_per_s"] = {"bf16": peak_bf16, "fp32": matmul_rate(run.device, torch.float32,
                                                                                n // 2, seconds), "n": n}
    run.log(f"  matmul bf16 {peak_bf16 / 1e12:.1f} TFLOP/s")
    configs = speed_configs(run.dry_run)
    for i, c in enumerate(configs):
        with guarded(out, c.name):
            budget = 0.0 if run.dry_run else max(10.0, min(60.0, 0.4 * run.seconds_left() / (len(configs) - i)))
            part = _speed_of(run, c, peak_bf16, budget)
            out.figures[c.name] = part.figures
            out.failures += part.failures
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def check_fairseq(run: Run) -> Outcome:
    """A training step through the fairseq plugin (wrapper and criterion) on the device, where fairseq imports."""
    out = Outcome()
    try:
        import fairseq  # noqa: F401

        from .micro.host_syncs import _Replay, criterion, fairseq_model, lm_sample
    except ImportError as e:
        out.skipped, out.figures["import_error"] = "fairseq not installed", f"{type(e).__name__}: {e}"
        return out
    for name in ("sMLP-det", "Switch"):
        with guarded(out, name):
            cfg = family_config(name, run.sizes)
            torch.manual_seed(0)
            core = LanguageModel(cfg).to(run.device).train()
            model, dictionary = fairseq_model(core)
            sample = lm_sample(tokens_for(cfg, run.sizes.batch, seed=6), dictionary.pad())
            sample = {k: ({kk: vv.to(run.device) for kk, vv in v.items()} if isinstance(v, dict) else
                          v.to(run.device) if torch.is_tensor(v) else v) for k, v in sample.items()}
            with device_paths(run.device):
                net_output = model(**sample["net_input"])
                with SyncCount(run.device) as syncs:
                    loss, _, _ = criterion(dictionary)(_Replay(model, net_output), sample)
                loss.backward()
            finite = math.isfinite(float(loss.detach())) and grads_finite(model)
            out.figures[name] = {"loss": float(loss.detach()), "criterion_host_syncs": syncs.count}
            out.expect(finite, f"{name}: the plugin's training step is not finite")
            out.expect(syncs.count == 0, f"{name}: the criterion made {syncs.count} host syncs ({dict(syncs.sites)})")
    return out


RUNNERS: dict[str, Callable[[Run], Outcome]] = {
    "auction": check_auction, "fp32": check_fp32, "autocast": check_autocast,
    "cached-decoding": check_cached_decoding, "causality": check_causality, "host-syncs": check_host_syncs,
    "speed": check_speed, "fairseq": check_fairseq,
}


# ---------------------------------------------------------------- the record


def summary_line(name: str, o: Outcome) -> str:
    """The table's figures column: the one or two numbers that say most about the check."""
    if o.skipped:
        return o.skipped
    f = {k: v for k, v in o.figures.items() if k != "errors" and isinstance(v, dict)}
    if name == "speed":
        parts = []
        for config, models in f.items():
            if "sMLP-det" in models:
                ws = {k: v["words_per_s"] for k, v in models.items() if not k.startswith("_")}
                parts.append(f"{config}: sMLP-det {ws['sMLP-det']:,.0f} w/s (MFU {models['sMLP-det']['mfu']:.1%}), "
                             f"fastest {max(ws, key=ws.get)}")
        return "; ".join(parts)
    if name == "host-syncs":
        return "forward syncs " + ", ".join(f"{k} {v['forward']['count']}" for k, v in f.items() if "forward" in v)
    if name == "fp32":
        ratios = [v["logits"]["max_difference"] / v["logits"]["bound"] for v in f.values() if "logits" in v]
        return f"worst logits difference {max(ratios, default=0.0):.2g} of its bound"
    if name == "auction":
        return ", ".join(f"{k}: {v['host_reads']} reads" for k, v in f.items() if "host_reads" in v)
    return f"{len(f)} cases"


def table(results: dict[str, dict]) -> str:
    lines = ["| check | status | seconds | figures |", "|---|---|---|---|"]
    for name, r in results.items():
        first_failure = f" FAILED: {r['failures'][0]}" if r["failures"] else ""
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.1f} | {r['summary']}{first_failure} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="run on the CPU at tiny sizes (no GPU needed)")
    p.add_argument("--output-dir", type=Path, default=Path("results/gpu-check"),
                   help=f"where {RECORD} and {TABLE} go (default results/gpu-check)")
    p.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(CHECKS)})")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    p.add_argument("--families", default="",
                   help=f"comma-separated families of the correctness checks (default all; a dry run's: "
                        f"{', '.join(DRY_RUN_FAMILIES)}); valid: {', '.join(FAMILIES)}")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds the whole check may take (420); the speed check fits itself into what is left, "
                        "checks that would start after it are skipped")
    p.add_argument("--plant-fault", action="store_true",
                   help="the check's own test: one weight of every device model off by 1e-3 of itself in the fp32 "
                        "comparison, which must then fail")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_bench.gpu_check", description=__doc__.split("\n")[0],
                                epilog="make gpu-check GPU_CHECK_ARGS='...' passes these options.")
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    for opt, valid in (("only", CHECKS), ("skip", CHECKS), ("families", FAMILIES)):
        names = [n for n in getattr(args, opt).split(",") if n]
        if unknown := [n for n in names if n not in valid]:
            raise SystemExit(f"gpu_check: error: --{opt}: unknown {unknown}; valid: {', '.join(valid)}")
        setattr(args, opt, names)
    args.families = tuple(args.families) or (DRY_RUN_FAMILIES if args.dry_run else tuple(FAMILIES))
    started = time.monotonic()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run on a CPU-only machine", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    threads = torch.get_num_threads()
    if args.dry_run:  # tiny models: the kernels of a few rows only wait for each other on more threads
        torch.set_num_threads(1)
    try:
        return _main(args, device, started)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, device: torch.device, started: float) -> int:

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    run = Run(device=device, dry_run=args.dry_run, sizes=DRY_RUN_SIZES if args.dry_run else Sizes(),
              families=args.families, plant_fault=args.plant_fault, deadline=started + args.time_budget, log=log)
    chosen = [c for c in CHECKS if (not args.only or c in args.only) and c not in args.skip]
    info = device_info(device)
    log(f"gpu check on {info['name']}, torch {torch.__version__}, checks: {', '.join(chosen)}")
    results: dict[str, dict] = {}
    for name in chosen:
        t0 = time.monotonic()
        if run.seconds_left() <= 0:
            outcome = Outcome(skipped=f"out of time (--time-budget {args.time_budget:g} s)")
        else:
            log(f"{name} ...")
            try:
                outcome = RUNNERS[name](run)
            except Exception as e:  # one broken check must not hide the others' findings
                outcome = Outcome(failures=[f"error: {type(e).__name__}: {e}"],
                                  figures={"traceback": traceback.format_exc().splitlines()[-12:]})
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.empty_cache()
        results[name] = {"status": outcome.status, "seconds": time.monotonic() - t0, "failures": outcome.failures,
                         "skipped": outcome.skipped, "summary": "", "figures": outcome.figures}
        try:
            results[name]["summary"] = summary_line(name, outcome)
        except Exception as e:  # a summary is a convenience: the figures are in the record
            results[name]["summary"] = f"(no summary: {type(e).__name__})"
        log(f"{name}: {outcome.status}" + "".join(f"\n    {f}" for f in outcome.failures[:10]))
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    record = {"question": "do the project's GPU paths run on one CUDA device as on the CPU, and how fast?",
              "dry_run": args.dry_run, "device": info, **environment(versions={"numpy": _numpy_version()}),
              "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "modules": {m: str(Path(sys.modules[m].__file__).parent) for m in ("smlp", "smlp_bench", "smlp_eval")},
              "seconds": time.monotonic() - started, "sizes": vars(run.sizes) | {"families": list(run.families)},
              "checks": results, "failed": failed, "passed": not failed}
    text = table(results)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output_dir / RECORD, record)
    write_text(args.output_dir / TABLE, f"GPU check on {info['name']} (torch {torch.__version__}, "
                                        f"{record['seconds']:.0f} s){' [dry run]' if args.dry_run else ''}\n\n"
                                        f"{text}\n")
    print(text)
    log(f"wrote {args.output_dir / RECORD}; {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
