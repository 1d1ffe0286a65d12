"""The GPU check's parts that are not checks: the families and their sizes, losses and bounds, the host-sync
counter on CUDA, and the replay of one routing on two devices (benchmarks/gpu_check.py runs the checks).
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from smlp.dispatch import synchronize
from smlp.lm import LanguageModel, LMConfig
from smlp.routing import assignment

from .fair import FAIR_TARGET
from .micro.host_syncs import FAMILIES as HOT_PATH_FAMILIES
from .micro.host_syncs import HostSyncCounter, accelerator_paths

# Every family, with the core config fields that make it (the sizes come from `Sizes`): the hot-path
# benchmark's families and the token mixers and token-routed gMLP beside them.
FAMILIES = {
    **HOT_PATH_FAMILIES,
    "gMLP token-routed": dict(family="gmlp", token_routed_experts=-1),  # -1: the check's number of experts
    "HyperMixer": dict(family="gmlp", token_mixer="hypermixer"),
    "NiNformer": dict(family="gmlp", token_mixer="ninformer"),
}
# A dry run's families: every path of the checks (both auctions of partial prediction, GShard's noise, a
# model without cached decoding, the deterministic sMoE's budget) at a fraction of the time.
DRY_RUN_FAMILIES = ("sMLP-det", "sMLP-partial", "GShard", "gMLP token-routed")
# The families of the speed check: sMLP-det, its dense rivals and the Transformer-MoEs (matching.py's keys).
SPEED_FAMILIES = ("gmlp", "transformer", "switch", "gshard", "base", "hash")
SPEED_NAMES = dict(zip(SPEED_FAMILIES, ("gMLP", "Transformer", "Switch", "GShard", "Base", "HASH")))


@dataclass(frozen=True)
class Sizes:
    """The models of the correctness checks (tiny: they compare paths, not speed): dense + sparse layers of
    the sparse families, dense + sparse layers of the dense ones (the token-routed gMLP: dense)."""

    vocab_size: int = 64
    d_model: int = 32
    d_ffn: int = 64
    seq_len: int = 32
    num_experts: int = 4
    batch: int = 4
    dense: int = 2
    sparse: int = 2


DRY_RUN_SIZES = Sizes(vocab_size=32, d_model=16, d_ffn=32, seq_len=12, batch=2, dense=1, sparse=1)


@dataclass(frozen=True)
class SpeedConfig:
    """One configuration of the speed check: the sMLP-det target and how it trains."""

    name: str
    d_model: int
    d_ffn: int
    seq_len: int
    dense: int
    sparse: int
    experts: int
    vocab_size: int
    batch: int
    dtype: torch.dtype | None  # autocast dtype, None: fp32
    families: tuple[str, ...] = SPEED_FAMILIES  # besides sMLP-det


def speed_configs(dry_run: bool) -> list[SpeedConfig]:
    if dry_run:
        return [SpeedConfig("fair", 16, 32, 8, 2, 1, 4, 32, 2, None, ("gmlp", "switch")),
                SpeedConfig("gpu-sized", 16, 32, 8, 2, 1, 4, 32, 2, torch.bfloat16, ("gmlp", "switch"))]
    t = FAIR_TARGET
    # the fair benchmark's tokens per update (2 ranks x 16 x 128) in one process
    return [SpeedConfig("fair", t["d_model"], t["d_ffn"], t["seq_len"], t["dense"], t["sparse"], t["experts"],
                        4000, 32, None),
            SpeedConfig("gpu-sized", 1024, 4096, 512, 9, 3, 8, 32000, 8, torch.bfloat16)]


def family_config(name: str, s: Sizes, **overrides) -> LMConfig:
    """The check's config of a family (see Sizes)."""
    spec = dict(FAMILIES[name])
    sparse = spec["family"] == "smlp" or "moe_router" in spec
    if spec.get("token_routed_experts") == -1:
        spec["token_routed_experts"] = s.num_experts
    layers = dict(dense_layers=s.dense, sparse_layers=s.sparse) if sparse else \
        dict(dense_layers=s.dense if "token_routed_experts" in spec else s.dense + s.sparse)
    heads = 2 if spec["family"] == "transformer" else 1  # SGU heads of gMLP blocks stay 1 (token mixers need it)
    return LMConfig(vocab_size=s.vocab_size, d_model=s.d_model, d_ffn=s.d_ffn, seq_len=s.seq_len,
                    num_experts=s.num_experts, heads=heads, **layers, **{**spec, **overrides})


def tokens_for(cfg: LMConfig, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, cfg.vocab_size, (batch, cfg.seq_len), generator=g)


def lm_loss(model: LanguageModel, tokens_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy on the predicted positions + 0.01 x the routers' auxiliary loss, logits)."""
    logits = model(tokens_BN)
    start = model.cfg.prediction_start
    loss = F.cross_entropy(logits[:, start:-1].float().flatten(0, 1), tokens_BN[:, start + 1:].flatten())
    aux = model.aux_loss()
    return (loss if aux is None else loss + 0.01 * aux), logits


def grads_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights moved off their init (a zero-initialised expert output would hide an expert's difference)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed.weight":
                p.add_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return model


def rounding_bound(expected: torch.Tensor, reduction: int, depth: int, scale: float | None = None) -> float:
    """tests/tolerance.py's order_tolerance: depth x reduction x eps(fp32) x scale (tests/test_gpu_check.py
    checks that the two agree)."""
    scale = float(expected.detach().abs().max()) if scale is None else scale
    return depth * reduction * torch.finfo(torch.float32).eps * scale


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if bool(torch.isfinite(a).all()) != bool(torch.isfinite(b).all()):
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def device_paths(device: torch.device):
    """The paths the device takes: on the CPU (a dry run) the accelerator's forced (torch auction with its
    completion checks, grouped expert products); on an accelerator they are the defaults already."""
    return accelerator_paths() if device.type == "cpu" else contextlib.nullcontext()


# ---------------------------------------------------------------- counting host syncs


class SyncCount:
    """Synchronizing calls inside the block: on CUDA every call torch.cuda.set_sync_debug_mode warns about,
    with the Python line it came from; on the CPU the CPU counter's count on the accelerator's paths (a dry
    run). `count`, `sites` ("file:line" or the counter's site -> calls)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.count = 0
        self.sites: Counter = Counter()
        self.method = "torch.cuda.set_sync_debug_mode" if device.type == "cuda" else "HostSyncCounter (CPU)"
        self._stack = contextlib.ExitStack()

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
            for w in self._caught:
                if "synchroniz" in str(w.message):
                    self.count += 1
                    self.sites[f"{_short(w.filename)}:{w.lineno}"] += 1
        self._stack.close()
        if self.device.type != "cuda":
            self.count, self.sites = self._counter.count, Counter(self._counter.by_site)
        return False


def _short(filename: str) -> str:
    parts = Path(filename).parts
    for anchor in ("smlp", "benchmarks", "torch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return filename


# ---------------------------------------------------------------- the same routing on both devices


class SameRouting:
    """Routing decisions that depend on other rows or on random draws, made on the CPU and replayed on the
    device: balanced assignments (an auction's result moves with a rounding of its scores) and GShard's
    Gumbel noise (each device has its own generator). Top-k choices and capacities stay the device's own."""

    def __init__(self):
        self.assignments: list = []

    @contextlib.contextmanager
    def recording(self):
        with self._patched(replay=False):
            yield

    @contextlib.contextmanager
    def replaying(self):
        with self._patched(replay=True):
            yield

    @contextlib.contextmanager
    def _patched(self, replay: bool):
        from smlp.routing import gates, prices, token_routers

        original = assignment.balanced_assignment
        replayed = iter(self.assignments)
        draws = iter(range(1 << 30))

        def assigned(scores_SE, **kwargs):
            if replay:
                out = next(replayed)
                return tuple(t.to(scores_SE.device) for t in out) if isinstance(out, tuple) else \
                    out.to(scores_SE.device)
            out = original(scores_SE, **kwargs)
            self.assignments.append(out)
            return out

        def gumbel(logits_SE):
            g = torch.Generator().manual_seed(next(draws))
            u = torch.rand(logits_SE.shape, generator=g).clamp(torch.finfo(torch.float32).tiny, 1 - 1e-7)
            return (-(-u.log()).log()).to(logits_SE.device)

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
        out = original(x_SD, weight_DE)
        seen.append(out.dtype)
        return out

    with mock.patch.object(logits, "router_logits", recorded), mock.patch.object(moe, "router_logits", recorded), \
            mock.patch.object(token_routed, "router_logits", recorded):
        yield


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    """Dense matmul FLOP/s of n x n products in `dtype` on `device` (fp32 without TF32)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        synchronize(device)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                a @ b
            synchronize(device)
            done += 10
        return 2 * n ** 3 * done / (time.perf_counter() - start)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": device.type, "name": "CPU (dry run)"}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": p.total_memory / 2 ** 30, "multiprocessors": p.multi_processor_count,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def time_in_turns(fns: dict, iters: int, *, min_seconds: float = 0.0, max_iters: int = 1000) -> dict[str, list]:
    """Seconds of every call of each function, called in turn (a, b, a, b, ...) so that a change of the load weighs
    on all alike: at least `iters` rounds, more (up to `max_iters`) until each has run `min_seconds`."""
    times = {name: [] for name in fns}
    while (done := min(map(len, times.values()))) < iters or (
            done < max_iters and min(map(sum, times.values())) < min_seconds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _numpy_version() -> str | None:
    try:
        import numpy

        return numpy.__version__
    except ImportError:
        return None
