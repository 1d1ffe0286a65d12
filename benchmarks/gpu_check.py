"""The GPU check: the project's training and decoding paths on one CUDA device, against the CPU (docs/gpu.md).

    make gpu-check [GPU_CHECK_ARGS="--output-dir DIR"]     (python -m smlp_bench.gpu_check, smlp-bench gpu-check)

For a machine with one CUDA GPU and only torch and numpy (the core and this program import nothing else; `make
gpu-check` runs it from the checkout). Checks: auction (balanced assignment on the device equals the CPU's, at most
one host read an auction phase), fp32 (every family's training forward and backward against the same weights on
the CPU, within tests/tolerance.py's rounding bound; routing that depends on other rows or random draws made on the
CPU and replayed), autocast (bf16 and fp16 steps finite, router logits fp32), cached-decoding (equals the full
forward), causality (smlp/causality.py; the leaky router must fail), host-syncs (torch.cuda.set_sync_debug_mode
against tests/test_hot_path.py's budget and the CPU counter), speed (words/s, MFU against the bf16 matmul rate of
the same run, peak memory; the fair configuration and a GPU-sized one), fairseq (the plugin's step, where fairseq
imports). --dry-run runs them on the CPU at tiny sizes with the accelerator's paths forced (tests/test_gpu_check.py).
Writes OUTPUT_DIR/gpu_check.json and gpu_check.md; exits 1 if a check failed, 2 without a GPU and --dry-run.
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
from datetime import UTC, datetime
from pathlib import Path

import torch

from smlp.causality import earlier_outputs_unchanged, randomized
from smlp.dispatch import synchronize
from smlp.lm import LanguageModel, LMConfig
from smlp.routing import assignment
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS

from .gpu_support import (
    DRY_RUN_FAMILIES,
    DRY_RUN_SIZES,
    FAMILIES,
    Outcome,
    Run,
    SameRouting,
    Sizes,
    SyncCount,
    check_fairseq,
    check_speed,
    device_info,
    device_paths,
    family_config,
    grads_finite,
    guarded,
    lm_loss,
    max_difference,
    perturbed,
    rounding_bound,
    router_logit_dtypes,
    tokens_for,
)
from .micro.host_syncs import torch_assignment_path
from .store import atomic_write_json, environment, write_text

CHECKS = ("auction", "fp32", "autocast", "cached-decoding", "causality", "host-syncs", "speed", "fairseq")
RECORD, TABLE = "gpu_check.json", "gpu_check.md"


def check_auction(run: Run) -> Outcome:
    """Balanced assignment on the device against the CPU's numpy path with the device's completion checks (the same
    integer algorithm: the same experts and prices), and the device's host reads per call."""
    out = Outcome()
    # E = 2 is exact; 8192 x 8 runs step 4 (a dry run's shapes: tests/test_hot_path.py checks step 4's reads)
    for S, E in [(80, 4), (64, 2), (512, 8)] if run.dry_run else [(80, 4), (512, 2), (2048, 8), (1024, 32), (8192, 8)]:
        key = f"{S}x{E}"
        with guarded(out, key):
            scores = torch.randn(S, E, generator=torch.Generator().manual_seed(S + E))
            expert_ref, price_ref = assignment.balanced_assignment(scores, with_prices=True,
                                                                   check_every=assignment.ACCELERATOR_CHECKS)
            every_round = assignment.balanced_assignment(scores, check_every=1)
            on_device, times = scores.to(run.device), []
            with torch_assignment_path() if run.device.type == "cpu" else contextlib.nullcontext():
                assignment.balanced_assignment(on_device, with_prices=True)  # warm-up: cached constants
                with SyncCount(run.device) as syncs:
                    expert_dev, price_dev = assignment.balanced_assignment(on_device, with_prices=True)
                for _ in range(1 if run.dry_run else 5):
                    t0 = time.perf_counter()
                    assignment.balanced_assignment(on_device)
                    synchronize(run.device)
                    times.append(time.perf_counter() - t0)
            keys = S * (1 << max(1, (E - 1).bit_length()))
            step4 = E > 2 and keys >= assignment._MIN_TAIL_KEYS and 2 * max(S // 16, assignment._MIN_WORKING_ROWS) <= S
            allowed = 0 if E == 2 else (2 if step4 else 1)
            same, price_err = torch.equal(expert_dev.cpu(), expert_ref), max_difference(price_dev, price_ref)
            out.figures[key] = {"same_experts": same, "as_every_round_checks": torch.equal(expert_ref, every_round),
                                "price_max_difference": price_err, "host_reads": syncs.count,
                                "host_reads_allowed": allowed, "median_ms": 1000 * statistics.median(times),
                                "step4": step4}
            out.expect(same, f"{key}: the device's experts differ from the CPU's")
            out.expect(price_err <= 1e-6 * max(1.0, float(price_ref.abs().max())),
                       f"{key}: prices differ by {price_err:.3g}")
            out.expect(syncs.count <= allowed,
                       f"{key}: {syncs.count} host reads, {allowed} allowed ({dict(syncs.sites)})")
            run.log(f"  auction {key}: same={same} reads={syncs.count} {1000 * statistics.median(times):.2f} ms")
    return out


def check_fp32(run: Run) -> Outcome:
    """Every family's training forward and backward on the device against the CPU, fp32, same weights."""
    out, s = Outcome(), run.sizes
    prev, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False  # fp32 in fp32
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
                x, routing = tokens_for(cfg, s.batch, seed=1), SameRouting()
                with routing.recording():
                    loss_ref, logits_ref = lm_loss(ref, x)
                loss_ref.backward()
                with routing.replaying(), device_paths(run.device):
                    loss_dev, logits_dev = lm_loss(dev, x.to(run.device))
                    loss_dev.backward()
                depth, widths = len(ref.layers) + 1, max(s.d_model, s.d_ffn, s.seq_len)
                grads_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
                grads_dev = torch.cat([p.grad.reshape(-1).cpu() for p in dev.parameters() if p.grad is not None])
                logits_bound = rounding_bound(logits_ref, widths, depth)
                checks = {"logits": (logits_dev, logits_ref, logits_bound),  # the loss: twice the logits' error
                          "loss": (loss_dev, loss_ref, 2 * logits_bound + rounding_bound(  # and its own sums
                              loss_ref, s.vocab_size + s.batch * s.seq_len, 1)),
                          # a weight gradient sums the whole batch; the backward pass doubles the depth
                          "gradients": (grads_dev, grads_ref,
                                        rounding_bound(grads_ref, max(widths, s.batch * s.seq_len), 2 * depth))}
                figures = {}
                for what, (got, want, bound) in checks.items():
                    figures[what] = {"max_difference": (err := max_difference(got, want)), "bound": bound}
                    out.expect(err <= bound, f"{name}: {what} differ by {err:.3g}, bound {bound:.3g}")
                out.figures[name] = {**figures, "routing_replayed": len(routing.assignments)}
                run.log(f"  fp32 {name}: logits {figures['logits']['max_difference']:.2g} (bound {logits_bound:.2g}), "
                        f"gradients {figures['gradients']['max_difference']:.2g} "
                        f"(bound {figures['gradients']['bound']:.2g})")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def check_autocast(run: Run) -> Outcome:
    """bf16 and fp16 autocast: two SGD steps of every family, loss and gradients finite, the output in the autocast
    dtype, every router's logits fp32."""
    out = Outcome()
    for dtype in (torch.bfloat16, torch.float16):
        label = str(dtype).removeprefix("torch.")
        for name in run.families:
            with guarded(out, f"{name} {label}"):
                cfg = family_config(name, run.sizes)
                torch.manual_seed(0)
                model = perturbed(LanguageModel(cfg)).to(run.device).train()
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                x = tokens_for(cfg, run.sizes.batch, seed=2).to(run.device)
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
                out.figures[f"{name} {label}"] = {"losses": losses, "logits_dtype": str(logits.dtype),
                                                  "router_logits": sorted({str(d) for d in router_dtypes})}
                out.expect(all(math.isfinite(v) for v in losses), f"{name} {label}: loss not finite {losses}")
                out.expect(finite, f"{name} {label}: gradients not finite")
                out.expect(logits.dtype == dtype, f"{name} {label}: logits are {logits.dtype}: autocast did not apply")
                learned = cfg.token_routed_experts or (cfg.sparse_layers and (
                    cfg.family == "smlp" or TOKEN_ROUTERS[cfg.moe_router].learned_scores))
                if learned:
                    out.expect({torch.float32} == set(router_dtypes),
                               f"{name} {label}: router logits {sorted(map(str, set(router_dtypes)))}, want fp32")
        run.log(f"  autocast {label}: {len(run.families)} families")
    return out


def check_cached_decoding(run: Run) -> Outcome:
    """Cached decoding on the device (prefill, single steps, multi-position steps) equals the full forward."""
    out, s, T = Outcome(), run.sizes, run.sizes.seq_len
    for name in run.families:
        with guarded(out, name):
            cfg = family_config(name, s)
            torch.manual_seed(0)
            model = perturbed(LanguageModel(cfg)).to(run.device).eval()
            if not model.supports_cached_decoding:
                out.figures[name] = {"skipped": model.no_cached_decoding}
                continue
            x, worst = tokens_for(cfg, 3, seed=3).to(run.device), 0.0
            with torch.no_grad(), device_paths(run.device):
                full = model(x)
                bound = rounding_bound(full, max(s.d_model, s.d_ffn, T), len(model.layers) + 1)
                for schedule in ([3, 1, 2, 1, T - 7], [T // 4] + [1] * (T // 4) + [T - T // 2], [T]):
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
    """Changing the tokens after position t leaves the outputs up to t bit-identical on the device (eval mode); the
    leaky router (Appendix B) must fail. Where outputs change, the record gives the difference against the rounding
    bound: a kernel whose rounding depends on the other rows stays near it, a leak goes far beyond."""
    out, s, T = Outcome(), run.sizes, run.sizes.seq_len
    cases = [(name, family_config(name, s), True) for name in run.families]
    cases.append(("sMLP leaky router", family_config("sMLP-partial", s, smoe_routing="leaky-full-sequence"), False))
    for name, cfg, causal in cases:
        with guarded(out, name):
            torch.manual_seed(0)
            model = randomized(LanguageModel(cfg), 1).to(run.device).eval()
            start, x, kept, moved = cfg.prediction_start, tokens_for(cfg, 3, seed=4).to(run.device), {}, {}
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
    """The forward's budget of host reads (tests/test_hot_path.py): one split-size read per dispatch that reads
    counts, and up to 3 auction completion checks per sparse layer with a balanced router (None: the token-routed
    gMLP, no budget)."""
    if cfg.token_routed_experts:
        return None
    if not cfg.sparse_layers:
        return 0
    deterministic_smoe = cfg.family == "smlp" and not SMOE_ROUTINGS[cfg.smoe_routing].balanced
    dispatches = len(model.moe_modules()) - (cfg.sparse_layers if deterministic_smoe else 0)
    return dispatches + (3 * cfg.sparse_layers if model.has_balanced_routers else 0)


def _counted_step(model, opt, x, device) -> dict:
    """One warm-up training step, then one counted by part: forward with the loss, backward and, on CUDA, the
    optimizer step (on the CPU the counter would count the host's own reads of a CPU optimizer)."""
    def step(count: bool) -> dict:
        counted = lambda on=True: SyncCount(device) if count and on else contextlib.nullcontext()  # noqa: E731
        opt.zero_grad(set_to_none=True)
        with counted() as fwd:
            loss, _ = lm_loss(model, x)
        with counted() as bwd:
            loss.backward()
        with counted(device.type == "cuda") as optimizer:
            opt.step()
        return {"forward": fwd, "backward": bwd, "optimizer": optimizer}

    with device_paths(device):
        step(False)
    return step(True)


def check_host_syncs(run: Run) -> Outcome:
    """Synchronizing calls of a training step of every family on the device, against the budget and against the CPU
    counter's count of the same step (a sync it does not see is a gap in the counter the test suite relies on)."""
    out = Outcome()
    with SyncCount(run.device) as control:  # the counting method sees a sync, and nothing else
        (torch.ones(4, device=run.device) * 2).sum().item()
    out.figures["control"] = {"method": control.method, "count": control.count}
    if not out.expect(control.count == 1, f"the counting method saw {control.count} syncs in a block with one"):
        return out
    for name in run.families:
        with guarded(out, name):
            cfg = family_config(name, run.sizes)
            x_cpu, counted = tokens_for(cfg, run.sizes.batch, seed=5), {}
            for device in (torch.device("cpu"), run.device) if run.device.type != "cpu" else (run.device,):
                torch.manual_seed(0)
                model = perturbed(LanguageModel(cfg)).to(device).train()
                counted[device.type] = _counted_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                                     x_cpu.to(device), device)
            dev, cpu = counted[run.device.type], counted["cpu"]  # a dry run's device count is the CPU counter's
            limit = _sync_limit(cfg, model)
            fig = {part: {"count": dev[part].count, "cpu_counter": cpu[part].count,
                          "sites": dict(dev[part].sites.most_common(8))} for part in ("forward", "backward")}
            fig["optimizer"] = None if dev["optimizer"] is None else {"count": dev["optimizer"].count,
                                                                      "sites": dict(dev["optimizer"].sites)}
            fig["forward"]["limit"], fig["method"] = limit, dev["forward"].method
            out.figures[name] = fig
            for part in ("forward", "backward"):
                out.expect(dev[part].count <= cpu[part].count, f"{name}: {part} made {dev[part].count} host syncs, "
                                                               f"the CPU counter counts {cpu[part].count} "
                                                               f"({dict(dev[part].sites)})")
            if limit is not None:
                out.expect(dev["forward"].count <= limit, f"{name}: forward made {dev['forward'].count} host syncs, "
                                                          f"budget {limit} ({dict(dev['forward'].sites)})")
            out.expect(dev["backward"].count == 0, f"{name}: backward made {dev['backward'].count} host syncs "
                                                   f"({dict(dev['backward'].sites)})")
            optimizer = "" if dev["optimizer"] is None else f", optimizer step {dev['optimizer'].count}"
            run.log(f"  host syncs {name}: forward {dev['forward'].count} (CPU counter {cpu['forward'].count}, "
                    f"budget {limit}), backward {dev['backward'].count}{optimizer}")
    return out


RUNNERS: dict[str, Callable[[Run], Outcome]] = {
    "auction": check_auction, "fp32": check_fp32, "autocast": check_autocast, "cached-decoding": check_cached_decoding,
    "causality": check_causality, "host-syncs": check_host_syncs, "speed": check_speed, "fairseq": check_fairseq}


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="run on the CPU at tiny sizes (no GPU needed)")
    p.add_argument("--output-dir", type=Path, default=Path("results/gpu-check"),
                   help=f"where {RECORD} and {TABLE} go (default results/gpu-check)")
    p.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(CHECKS)})")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    p.add_argument("--families", default="", help=f"comma-separated families of the correctness checks (default all; "
                                                  f"a dry run's: {', '.join(DRY_RUN_FAMILIES)}); valid: "
                                                  f"{', '.join(FAMILIES)}")
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
    started = time.monotonic()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run on a CPU-only machine", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    threads = torch.get_num_threads()
    if args.dry_run:  # tiny models: the kernels of a few rows only wait for each other on more threads
        torch.set_num_threads(1)
    try:
        return _checks(args, device, started)
    finally:
        torch.set_num_threads(threads)


def _checks(args, device: torch.device, started: float) -> int:
    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    families = tuple(args.families) or (DRY_RUN_FAMILIES if args.dry_run else tuple(FAMILIES))
    run = Run(device=device, dry_run=args.dry_run, sizes=DRY_RUN_SIZES if args.dry_run else Sizes(), families=families,
              plant_fault=args.plant_fault, deadline=started + args.time_budget, log=log)
    chosen = [c for c in CHECKS if (not args.only or c in args.only) and c not in args.skip]
    info, results = device_info(device), {}
    log(f"gpu check on {info['name']}, torch {torch.__version__}, checks: {', '.join(chosen)}")
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
        try:
            summary = summary_line(name, outcome)
        except Exception as e:  # a summary is a convenience: the figures are in the record
            summary = f"(no summary: {type(e).__name__})"
        results[name] = {"status": outcome.status, "seconds": time.monotonic() - t0, "failures": outcome.failures,
                         "skipped": outcome.skipped, "summary": summary, "figures": outcome.figures}
        log(f"{name}: {outcome.status}" + "".join(f"\n    {f}" for f in outcome.failures[:10]))
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    try:
        import numpy
    except ImportError:
        numpy = None
    record = {"question": "do the project's GPU paths run on one CUDA device as on the CPU, and how fast?",
              "dry_run": args.dry_run, "device": info, **environment(versions={"numpy": numpy and numpy.__version__}),
              "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "modules": {m: str(Path(sys.modules[m].__file__).parent) for m in ("smlp", "smlp_bench", "smlp_eval")},
              "seconds": time.monotonic() - started, "sizes": vars(run.sizes) | {"families": list(run.families)},
              "checks": results, "failed": failed, "passed": not failed}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output_dir / RECORD, record)
    text = "\n".join(["| check | status | seconds | figures |", "|---|---|---|---|"] + [
        f"| {name} | {r['status']} | {r['seconds']:.1f} | {r['summary']}"
        + (f" FAILED: {r['failures'][0]}" if r["failures"] else "") + " |" for name, r in results.items()])
    write_text(args.output_dir / TABLE, f"GPU check on {info['name']} (torch {torch.__version__}, "
                                        f"{record['seconds']:.0f} s){' [dry run]' if args.dry_run else ''}\n\n{text}\n")
    print(text)
    log(f"wrote {args.output_dir / RECORD}; {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
