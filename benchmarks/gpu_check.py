"""The GPU check (docs/gpu.md): the project's training paths on one CUDA device against the CPU, and their speed.
For a machine with one CUDA GPU and only torch and numpy installed."""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import torch

from smlp.dispatch import synchronize
from smlp.lm import LanguageModel
from smlp.routing import assignment
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS

from . import gpu_support as G
from .gpu_support import DRY_RUN_FAMILIES, FAMILIES, Outcome, SyncCount
from .micro.host_syncs import torch_assignment_path
from .presets import BenchError, check_names, parse_checked
from .store import atomic_write_json, environment, write_text

CHECKS = ("fp32", "autocast", "host-syncs", "speed")
RECORD, TABLE = "gpu_check.json", "gpu_check.md"


def check_fp32(run) -> Outcome:
    """Every family's training forward and backward on the device against the CPU, fp32, same weights, within the
    rounding bound; routing that depends on other rows or random draws made on the CPU and replayed."""
    out, s = Outcome(), run.sizes
    prev, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False  # fp32 in fp32
    try:
        for name in run.families:
            with out.case(name):
                cfg = G.family_config(name, s)
                torch.manual_seed(0)
                ref = G.perturbed(LanguageModel(cfg)).train()
                dev = copy.deepcopy(ref).to(run.device)
                if run.plant_fault:  # the check's own test: a weight off by 1e-3 of itself must fail it
                    with torch.no_grad():
                        next(p for p in dev.layers[0].parameters() if p.dim() >= 2).mul_(1 + 1e-3)
                x, routing = G.tokens_for(cfg, s.batch, seed=1), []
                with G.same_routing(routing, replay=False):
                    loss_ref, logits_ref = G.lm_loss(ref, x)
                loss_ref.backward()
                with G.same_routing(routing, replay=True), G.device_paths(run.device):
                    loss_dev, logits_dev = G.lm_loss(dev, x.to(run.device))
                    loss_dev.backward()
                depth, widths = len(ref.layers) + 1, max(s.d_model, s.d_ffn, s.seq_len)
                grads_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
                grads_dev = torch.cat([p.grad.reshape(-1).cpu() for p in dev.parameters() if p.grad is not None])
                bound = G.rounding_bound(logits_ref, widths, depth)
                checks = {"logits": (logits_dev, logits_ref, bound),  # the loss: twice the logits' error
                          "loss": (loss_dev, loss_ref, 2 * bound + G.rounding_bound(  # and its own sums
                              loss_ref, s.vocab_size + s.batch * s.seq_len, 1)),
                          # a weight gradient sums the whole batch; the backward pass doubles the depth
                          "gradients": (grads_dev, grads_ref,
                                        G.rounding_bound(grads_ref, max(widths, s.batch * s.seq_len), 2 * depth))}
                f = out.figures[name] = {}
                for what, (got, want, limit) in checks.items():
                    f[what] = {"max_difference": (err := G.max_difference(got, want)), "bound": limit}
                    out.expect(err <= limit, f"{name}: {what} differ by {err:.3g}, bound {limit:.3g}")
                f["routing_replayed"] = len(routing)
                run.log(f"  fp32 {name}: logits {f['logits']['max_difference']:.2g} (bound {bound:.2g}), gradients "
                        f"{f['gradients']['max_difference']:.2g} (bound {f['gradients']['bound']:.2g})")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def check_autocast(run) -> Outcome:
    """bf16 and fp16 autocast: two SGD steps of every family, loss and gradients finite, the output in the autocast
    dtype, every router's logits fp32."""
    out = Outcome()
    for dtype in (torch.bfloat16, torch.float16):
        label = str(dtype).removeprefix("torch.")
        for name in run.families:
            with out.case(case := f"{name} {label}"):
                cfg = G.family_config(name, run.sizes)
                torch.manual_seed(0)
                model = G.perturbed(LanguageModel(cfg)).to(run.device).train()
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                x = G.tokens_for(cfg, run.sizes.batch, seed=2).to(run.device)
                router_dtypes, losses, finite = [], [], True
                with G.device_paths(run.device):
                    for _ in range(2):
                        opt.zero_grad(set_to_none=True)
                        with torch.autocast(run.device.type, dtype=dtype), G.router_logit_dtypes(router_dtypes):
                            loss, logits = G.lm_loss(model, x)
                        loss.backward()
                        finite = finite and all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                                if p.grad is not None)
                        opt.step()
                        losses.append(float(loss.detach()))
                routers = set(router_dtypes)
                out.figures[case] = {"losses": losses, "logits_dtype": str(logits.dtype),
                                     "router_logits": sorted(map(str, routers))}
                out.expect(all(math.isfinite(v) for v in losses), f"{case}: loss not finite {losses}")
                out.expect(finite, f"{case}: gradients not finite")
                out.expect(logits.dtype == dtype, f"{case}: logits are {logits.dtype}: autocast did not apply")
                if cfg.token_routed_experts or (cfg.sparse_layers and (
                        cfg.family == "smlp" or TOKEN_ROUTERS[cfg.moe_router].learned_scores)):
                    out.expect(routers == {torch.float32}, f"{case}: router logits {sorted(map(str, routers))}, "
                                                           f"want fp32")
        run.log(f"  autocast {label}: {len(run.families)} families")
    return out


def _auction(run, out: Outcome) -> None:
    """Balanced assignment on the device against the CPU's numpy path with the device's completion checks (the same
    integer algorithm: the same experts and prices), and its host reads per call."""
    # E = 2 is exact; 8192 x 8 runs step 4 (a dry run's shapes: tests/test_hot_path.py checks step 4's reads)
    for S, E in [(80, 4), (64, 2), (512, 8)] if run.dry_run else [(80, 4), (512, 2), (2048, 8), (1024, 32), (8192, 8)]:
        with out.case(key := f"auction {S}x{E}"):
            scores = torch.randn(S, E, generator=torch.Generator().manual_seed(S + E))
            expert_ref, price_ref = assignment.balanced_assignment(scores, with_prices=True,
                                                                   check_every=assignment.ACCELERATOR_CHECKS)
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
            same, price_err = torch.equal(expert_dev.cpu(), expert_ref), G.max_difference(price_dev, price_ref)
            out.figures[key] = {"same_experts": same, "as_every_round_checks": torch.equal(
                expert_ref, assignment.balanced_assignment(scores, check_every=1)), "price_max_difference": price_err,
                "host_reads": syncs.count, "host_reads_allowed": allowed, "step4": step4,
                "median_ms": 1000 * statistics.median(times)}
            out.expect(same, f"{key}: the device's experts differ from the CPU's")
            out.expect(price_err <= 1e-6 * max(1.0, float(price_ref.abs().max())),
                       f"{key}: prices differ by {price_err:.3g}")
            out.expect(syncs.count <= allowed, f"{key}: {syncs.count} host reads, {allowed} allowed "
                                               f"({dict(syncs.sites)})")


def check_host_syncs(run) -> Outcome:
    """Synchronizing calls on the device: the auction's per call (`_auction`), then a training step of every family
    counted by part against tests/test_hot_path.py's budget (none for the token-routed gMLP) and against the CPU
    counter's count of the same step (a sync it does not see is a gap the test suite relies on)."""
    out = Outcome()
    with SyncCount(run.device) as control:  # the counting method sees a sync, and nothing else
        (torch.ones(4, device=run.device) * 2).sum().item()
    out.figures["control"] = {"method": control.method, "count": control.count}
    if not out.expect(control.count == 1, f"the counting method saw {control.count} syncs in a block with one"):
        return out
    _auction(run, out)
    for name in run.families:
        with out.case(name):
            cfg = G.family_config(name, run.sizes)
            x_cpu, counted = G.tokens_for(cfg, run.sizes.batch, seed=5), {}
            for device in (torch.device("cpu"), run.device) if run.device.type != "cpu" else (run.device,):
                torch.manual_seed(0)
                model = G.perturbed(LanguageModel(cfg)).to(device).train()
                opt, x = torch.optim.AdamW(model.parameters(), lr=1e-3), x_cpu.to(device)
                _step(model, opt, x, device, count=False)
                counted[device.type] = _step(model, opt, x, device, count=True)
            dev, cpu = counted[run.device.type], counted["cpu"]  # a dry run's device count is the CPU counter's
            deterministic_smoe = cfg.family == "smlp" and not SMOE_ROUTINGS[cfg.smoe_routing].balanced
            limit = None if cfg.token_routed_experts else 0 if not cfg.sparse_layers else \
                len(model.moe_modules()) - (cfg.sparse_layers if deterministic_smoe else 0) + (
                    3 * cfg.sparse_layers if model.has_balanced_routers else 0)
            f = out.figures[name] = {p: {"count": dev[p].count, "cpu_counter": cpu[p].count,
                                         "sites": dict(dev[p].sites.most_common(8))} for p in ("forward", "backward")}
            f["optimizer"] = None if dev["optimizer"] is None else {"count": dev["optimizer"].count,
                                                                    "sites": dict(dev["optimizer"].sites)}
            f["forward"]["limit"], f["method"] = limit, dev["forward"].method
            for p in ("forward", "backward"):
                out.expect(dev[p].count <= cpu[p].count, f"{name}: {p} made {dev[p].count} host syncs, the CPU "
                                                         f"counter counts {cpu[p].count} ({dict(dev[p].sites)})")
            if limit is not None:
                out.expect(dev["forward"].count <= limit, f"{name}: forward made {dev['forward'].count} host syncs, "
                                                          f"budget {limit} ({dict(dev['forward'].sites)})")
            out.expect(dev["backward"].count == 0, f"{name}: backward made {dev['backward'].count} host syncs "
                                                   f"({dict(dev['backward'].sites)})")
            run.log(f"  host syncs {name}: forward {dev['forward'].count} (CPU counter {cpu['forward'].count}, "
                    f"budget {limit}), backward {dev['backward'].count}"
                    + ("" if dev["optimizer"] is None else f", optimizer step {dev['optimizer'].count}"))
    return out


def _step(model, opt, x, device, count: bool) -> dict:
    """A training step (on the device's paths), counted by part when `count`: the optimizer only on CUDA (on the CPU the
    counter would count the host's own reads of a CPU optimizer)."""
    def counter(on=True):
        return SyncCount(device) if count and on else contextlib.nullcontext()

    with contextlib.nullcontext() if count else G.device_paths(device):
        opt.zero_grad(set_to_none=True)
        with counter() as forward:
            loss, _ = G.lm_loss(model, x)
        with counter() as backward:
            loss.backward()
        with counter(device.type == "cuda") as optimizer:
            opt.step()
    return {"forward": forward, "backward": backward, "optimizer": optimizer}


RUNNERS = {"fp32": check_fp32, "autocast": check_autocast, "host-syncs": check_host_syncs, "speed": G.check_speed}


def summary_line(name: str, o: Outcome) -> str:
    """The table's figures column: the one or two numbers that say most about the check."""
    f = {k: v for k, v in o.figures.items() if k != "errors" and isinstance(v, dict)}
    if name == "speed":
        return "; ".join(f"{config}: sMLP-det {ws['sMLP-det']:,.0f} w/s (MFU {models['sMLP-det']['mfu']:.1%}), "
                         f"fastest {max(ws, key=ws.get)}" for config, models in f.items() if "sMLP-det" in models
                         for ws in [{k: v["words_per_s"] for k, v in models.items() if not k.startswith("_")}])
    if name == "host-syncs":
        return "forward syncs " + ", ".join(f"{k} {v['forward']['count']}" for k, v in f.items() if "forward" in v) \
            + "; auction reads " + ", ".join(f"{k[8:]} {v['host_reads']}" for k, v in f.items() if "host_reads" in v)
    if name == "fp32":
        ratios = [v["logits"]["max_difference"] / v["logits"]["bound"] for v in f.values() if "logits" in v]
        return f"worst logits difference {max(ratios, default=0.0):.2g} of its bound"
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
    return run(parse_checked(p, argv, check_args))


NAMED = {"only": CHECKS, "skip": CHECKS, "families": FAMILIES}  # the options that name checks or families


def _named(args, opt: str) -> list[str]:
    return check_names([n.strip() for n in getattr(args, opt).split(",") if n.strip()], NAMED[opt], f"--{opt}")


def check_args(args) -> None:
    """`smlp-bench gpu-check`'s arguments, before any work: the names of checks and families, the time budget."""
    for opt in NAMED:
        _named(args, opt)
    if args.time_budget <= 0:
        raise BenchError(f"--time-budget {args.time_budget:g}: give the seconds the check may take (> 0)")


def run(args) -> int:
    for opt in NAMED:
        setattr(args, opt, _named(args, opt))
    started, threads = time.monotonic(), torch.get_num_threads()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run on a CPU-only machine", file=sys.stderr)
        return 2
    if args.dry_run:  # tiny models: the kernels of a few rows only wait for each other on more threads
        torch.set_num_threads(1)
    try:
        return _checks(args, started)
    finally:
        torch.set_num_threads(threads)


def _checks(args, started: float) -> int:
    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    run = SimpleNamespace(device=device, dry_run=args.dry_run, sizes=G.DRY_RUN_SIZES if args.dry_run else G.Sizes(),
                          families=tuple(args.families) or (DRY_RUN_FAMILIES if args.dry_run else tuple(FAMILIES)),
                          plant_fault=args.plant_fault, log=log,
                          seconds_left=lambda: started + args.time_budget - time.monotonic())
    chosen = [c for c in CHECKS if (not args.only or c in args.only) and c not in args.skip]
    info, results = G.device_info(device), {}
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
            summary = outcome.skipped or summary_line(name, outcome)
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
              "seconds": time.monotonic() - started, "sizes": run.sizes._asdict() | {"families": list(run.families)},
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
