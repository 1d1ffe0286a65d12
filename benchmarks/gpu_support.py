"""The GPU check's parts (benchmarks/gpu_check.py runs the checks; docs/gpu.md): families and sizes, losses and
bounds, the host-sync count on CUDA, one routing replayed on two devices, and the speed check."""
from __future__ import annotations

import contextlib
import math
import statistics
import time
import traceback
import warnings
from collections import Counter, namedtuple
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from smlp.dispatch import synchronize
from smlp.lm import LanguageModel, LMConfig
from smlp.routing import assignment
from smlp_eval.flops.counting import count as count_flops
from smlp_eval.flops.matching import match

from .fair import FAIR_TARGET
from .machine import matmul_rate
from .micro.host_syncs import HostSyncCounter, accelerator_paths
from .presets import MATCH_TOLERANCE

# every family, with the core config fields that make it (the sizes come from `Sizes`)
FAMILIES = {"sMLP-det": dict(family="smlp", smoe_routing="deterministic"),
            "sMLP-partial": dict(family="smlp", smoe_routing="partial"),
            **{n: dict(family="transformer", moe_router=n.lower()) for n in ("Base", "GShard", "HASH", "Switch")},
            "gMLP": dict(family="gmlp"), "Transformer": dict(family="transformer"),
            "gMLP token-routed": dict(family="gmlp", token_routed_experts=-1),  # -1: the check's num_experts
            "HyperMixer": dict(family="gmlp", token_mixer="hypermixer"),
            "NiNformer": dict(family="gmlp", token_mixer="ninformer")}
# a dry run's: every path of the checks (partial prediction's two auctions, GShard's noise, a family without a
# host-sync budget, the deterministic sMoE's budget) at a fraction of the time
DRY_RUN_FAMILIES = ("sMLP-det", "sMLP-partial", "GShard", "gMLP token-routed")
SPEED_FAMILIES = ("gmlp", "transformer", "switch", "gshard", "base", "hash")  # besides sMLP-det (matching's keys)
SPEED_NAMES = dict(zip(SPEED_FAMILIES, ("gMLP", "Transformer", "Switch", "GShard", "Base", "HASH")))
# the correctness checks' models (tiny: they compare paths, not speed); dense families get dense + sparse layers (the
# token-routed gMLP: dense)
Sizes = namedtuple("Sizes", "vocab_size d_model d_ffn seq_len num_experts batch dense sparse",
                   defaults=(64, 32, 64, 32, 4, 4, 2, 2))
DRY_RUN_SIZES = Sizes(vocab_size=32, d_model=16, d_ffn=32, seq_len=12, batch=2, dense=1, sparse=1)
# one configuration of the speed check: the sMLP-det target and how it trains (dtype: autocast's, None: fp32)
SpeedConfig = namedtuple("SpeedConfig", "name d_model d_ffn seq_len dense sparse experts vocab_size batch dtype "
                                        "families", defaults=(SPEED_FAMILIES,))


def family_config(name: str, s: Sizes, **overrides) -> LMConfig:
    spec = dict(FAMILIES[name])
    if spec.get("token_routed_experts") == -1:
        spec["token_routed_experts"] = s.num_experts
    layers = dict(dense_layers=s.dense, sparse_layers=s.sparse) if spec["family"] == "smlp" or "moe_router" in spec \
        else dict(dense_layers=s.dense if "token_routed_experts" in spec else s.dense + s.sparse)
    heads = 2 if spec["family"] == "transformer" else 1  # SGU heads of gMLP blocks stay 1 (token mixers need it)
    return LMConfig(vocab_size=s.vocab_size, d_model=s.d_model, d_ffn=s.d_ffn, seq_len=s.seq_len,
                    num_experts=s.num_experts, heads=heads, **layers, **{**spec, **overrides})


def tokens_for(cfg: LMConfig, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: LanguageModel, tokens_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy on the predicted positions + 0.01 x the routers' auxiliary loss, logits)."""
    logits, start = model(tokens_BN), model.cfg.prediction_start
    loss = F.cross_entropy(logits[:, start:-1].float().flatten(0, 1), tokens_BN[:, start + 1:].flatten())
    return (loss if (aux := model.aux_loss()) is None else loss + 0.01 * aux), logits


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights moved off their init (a zero-initialised expert output would hide an expert's difference)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed.weight":
                p.add_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return model


def rounding_bound(expected: torch.Tensor, reduction: int, depth: int, scale: float | None = None) -> float:
    """tests/tolerance.py's order_tolerance: depth x reduction x eps(fp32) x scale."""
    scale = float(expected.detach().abs().max()) if scale is None else scale
    return depth * reduction * torch.finfo(torch.float32).eps * scale


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if bool(torch.isfinite(a).all()) != bool(torch.isfinite(b).all()):
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def device_paths(device: torch.device):
    """The paths the device takes: on the CPU (a dry run) the accelerator's, forced (host_syncs.accelerator_paths)."""
    return accelerator_paths() if device.type == "cpu" else contextlib.nullcontext()


class SyncCount:
    """Synchronizing calls inside the block: on CUDA every one torch.cuda.set_sync_debug_mode warns about, with its
    Python line; on the CPU (a dry run) the CPU counter's count on the accelerator's paths. `count`, `sites`."""

    def __init__(self, device: torch.device):
        self.device, self.count, self.sites, self._stack = device, 0, Counter(), contextlib.ExitStack()
        self.method = "torch.cuda.set_sync_debug_mode" if device.type == "cuda" else "HostSyncCounter (CPU)"

    def __enter__(self):
        if self.device.type == "cuda":
            self._caught = self._stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.synchronize(self.device)  # what was queued before is not this block's
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._stack.enter_context(accelerator_paths())
            self._counter = self._stack.enter_context(HostSyncCounter())
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            for w in (w for w in self._caught if "synchroniz" in str(w.message)):
                parts = Path(w.filename).parts
                anchor = next((a for a in ("smlp", "benchmarks", "torch") if a in parts), None)
                where = "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):]) if anchor else w.filename
                self.count += 1
                self.sites[f"{where}:{w.lineno}"] += 1
        self._stack.close()
        if self.device.type != "cuda":
            self.count, self.sites = self._counter.count, Counter(self._counter.by_site)
        return False


@contextlib.contextmanager
def same_routing(assignments: list, replay: bool):
    """Routing decisions that depend on other rows or on random draws, made on the CPU (`assignments` records them)
    and replayed on the device: balanced assignments (an auction's result moves with a rounding of its scores) and
    GShard's Gumbel noise (each device has its own generator). Top-k choices and capacities stay the device's own."""
    from smlp.routing import gates, prices, token_routers

    original, replayed, draws = assignment.balanced_assignment, iter(assignments), iter(range(1 << 30))

    def assigned(scores_SE, **kwargs):
        if not replay:
            assignments.append(out := original(scores_SE, **kwargs))
            return out
        out = next(replayed)
        return tuple(t.to(scores_SE.device) for t in out) if isinstance(out, tuple) else out.to(scores_SE.device)

    def gumbel(logits_SE):
        u = torch.rand(logits_SE.shape, generator=torch.Generator().manual_seed(next(draws)))
        return (-(-u.clamp(torch.finfo(torch.float32).tiny, 1 - 1e-7).log()).log()).to(logits_SE.device)

    with mock.patch.object(prices, "balanced_assignment", assigned), \
            mock.patch.object(token_routers, "balanced_assignment", assigned), \
            mock.patch.object(gates, "_gumbel_like", gumbel):
        yield


@contextlib.contextmanager
def router_logit_dtypes(seen: list):
    """Records the dtype of every router's logits (smlp/routing/logits.py) computed inside the block."""
    from smlp import moe, token_routed
    from smlp.routing import logits

    original = logits.router_logits

    def recorded(x_SD, weight_DE):
        seen.append((out := original(x_SD, weight_DE)).dtype)
        return out

    with mock.patch.object(logits, "router_logits", recorded), mock.patch.object(moe, "router_logits", recorded), \
            mock.patch.object(token_routed, "router_logits", recorded):
        yield


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

    @contextlib.contextmanager
    def case(self, what: str):
        """An error in one case is that case's failure (with its traceback in the figures): the others still run."""
        try:
            yield
        except Exception as e:
            self.failures.append(f"{what}: error: {type(e).__name__}: {e}")
            self.figures.setdefault("errors", {})[what] = traceback.format_exc().splitlines()[-12:]

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("failed" if self.failures else "passed")


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": device.type, "name": "CPU (dry run)"}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": p.total_memory / 2 ** 30, "multiprocessors": p.multi_processor_count,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def speed_configs(dry_run: bool) -> list[SpeedConfig]:
    if dry_run:
        return [SpeedConfig(n, 16, 32, 8, 2, 1, 4, 32, 2, d, ("gmlp", "switch"))
                for n, d in (("fair", None), ("gpu-sized", torch.bfloat16))]
    t = FAIR_TARGET  # the fair comparison's tokens per update (2 ranks x 16 x 128) in one process
    return [SpeedConfig("fair", t["d_model"], t["d_ffn"], t["seq_len"], t["dense"], t["sparse"], t["experts"], 4000, 32,
                        None), SpeedConfig("gpu-sized", 1024, 4096, 512, 9, 3, 8, 32000, 8, torch.bfloat16)]


def speed_models(c: SpeedConfig) -> dict[str, LMConfig]:
    """sMLP-det at the configuration and its FLOP matches (smlp_eval's analytic counts: no fairseq)."""
    target = LMConfig(family="smlp", vocab_size=c.vocab_size, d_model=c.d_model, d_ffn=c.d_ffn, seq_len=c.seq_len,
                      dense_layers=c.dense, sparse_layers=c.sparse, num_experts=c.experts)
    rows = match(count_flops(target, method="analytic"), tolerance=MATCH_TOLERANCE, method="analytic",
                 families=c.families)
    return {"sMLP-det": target, **{SPEED_NAMES[r.family]: r.count.cfg for r in rows}}


def _speed_of(run, c: SpeedConfig, peak_bf16: float, budget_s: float) -> Outcome:
    """Every model of the configuration built and warmed up, then timed in turns (a, b, a, b, ...: a change of load
    weighs on all alike), at least 5 rounds and more until each has run its share of `budget_s`."""
    out, device, steps, models, memory = Outcome(), run.device, {}, {}, {}
    for name, cfg in speed_models(c).items():
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        torch.manual_seed(0)
        model = LanguageModel(cfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches, state = [tokens_for(cfg, c.batch, seed=i).to(device) for i in range(2)], {"i": 0, "loss": None}

        def step(model=model, opt=opt, batches=batches, state=state):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=c.dtype, enabled=c.dtype is not None):
                loss, _ = lm_loss(model, batches[state["i"] % 2])
            loss.backward()
            opt.step()
            state["i"], state["loss"] = state["i"] + 1, loss.detach()
            synchronize(device)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(1 if run.dry_run else 3):  # warm-up: caches, kernels, the optimizer's state
            step()
        # the step's peak above what the models built before this one hold
        memory[name] = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else None
        steps[name], models[name] = step, (model, cfg, state)
        run.log(f"  speed {c.name} {name}: {cfg.dense_layers}+{cfg.sparse_layers} layers built and warm")
    times = {name: [] for name in steps}
    (iters, most), least_s = (2, 3) if run.dry_run else (5, 200), 0.0 if run.dry_run else budget_s / max(1, len(steps))
    while (done := min(map(len, times.values()))) < iters or (done < most and min(map(sum, times.values())) < least_s):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, (model, cfg, state) in models.items():
        median, flops, final = statistics.median(times[name]), count_flops(cfg, method="analytic"), float(state["loss"])
        per_token, wps = 3 * flops.flops / cfg.seq_len, c.batch * c.seq_len / median
        out.figures[name] = {"layers": f"{cfg.dense_layers}+{cfg.sparse_layers}", "heads": cfg.heads,
                             "words_per_s": wps, "median_step_ms": 1000 * median, "steps_timed": len(times[name]),
                             "train_flops_per_token": per_token, "fwd_flops_per_seq": flops.flops,
                             "mfu": per_token * wps / peak_bf16,
                             "peak_memory_gib": None if memory[name] is None else memory[name] / 2 ** 30,
                             "params": sum(p.numel() for p in model.parameters()), "final_loss": final}
        out.expect(math.isfinite(final), f"{c.name} {name}: loss not finite ({final})")
    out.figures["_config"] = {"d_model": c.d_model, "d_ffn": c.d_ffn, "seq_len": c.seq_len,
                              "target": f"{c.dense}+{c.sparse}", "experts": c.experts, "vocab_size": c.vocab_size,
                              "batch": c.batch, "tokens_per_step": c.batch * c.seq_len,
                              "dtype": str(c.dtype or torch.float32), "match_tolerance": MATCH_TOLERANCE}
    return out


def check_speed(run) -> Outcome:
    """Training words/s, MFU and peak memory of sMLP-det and its FLOP matches, per configuration (one process, every
    expert local)."""
    out, (n, seconds), configs = Outcome(), (128, 0.05) if run.dry_run else (8192, 1.0), speed_configs(run.dry_run)
    peak_bf16 = matmul_rate(n, seconds, run.device, torch.bfloat16)
    out.figures["matmul_flops_per_s"] = {"bf16": peak_bf16, "n": n,
                                         "fp32": matmul_rate(n // 2, seconds, run.device, torch.float32)}
    run.log(f"  matmul bf16 {peak_bf16 / 1e12:.1f} TFLOP/s")
    for i, c in enumerate(configs):
        with out.case(c.name):
            budget = 0.0 if run.dry_run else max(10.0, min(60.0, 0.4 * run.seconds_left() / (len(configs) - i)))
            part = _speed_of(run, c, peak_bf16, budget)
            out.figures[c.name], out.failures = part.figures, out.failures + part.failures
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    return out
