"""Memory: no dense S x E x C dispatch tensors, peak memory linear in tokens, no growth per update,
and the peak-RSS helpers the launcher and benchmarks use (launch/memory.py).

- Every op's output during forward + backward of each MoE layer is recorded (a TorchDispatchMode):
  with 4x the tokens the largest output may grow at most ~4x. GShard/Switch-style dense dispatch
  (one_hot of shape S x E x C with C ~ S/E, as in fairscale's top2gating) grows 16x and is caught;
  the test shows that on such a tensor.
- Peak allocated bytes (the CPU allocator's own events from torch.profiler) for S, 2S, 4S tokens:
  the second difference is that of a line (a quadratic term doubles the ratio).
- A long run on 2 gloo ranks (a small sMLP LM with every all2all, Adam) keeps its RSS flat.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smlp.config import SMoEConfig, SparseBlockConfig, TMoEConfig
from smlp.moe import SMoE, SparseBlock, TMoE

D, F, E = 16, 32, 8


class LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _layer(kind: str):
    torch.manual_seed(0)
    if kind in ("base", "switch", "gshard", "hash"):
        return TMoE(TMoEConfig(d_model=D, d_ffn=F, num_experts=E, router=kind, vocab_size=100)).train()
    if kind.startswith("smoe"):
        return SMoE(SMoEConfig(dim=D, seq_len=64, num_experts=E, split=False, routing=kind.split("-")[1])).train()
    return SparseBlock(SparseBlockConfig(d_model=D, d_ffn=F, seq_len=64, num_experts=E)).train()


def _step(layer, kind: str, tokens: int):
    """Forward + backward of `layer` on `tokens` tokens (sequences of 64 for the sMoE and the block)."""
    g = torch.Generator().manual_seed(1)
    if isinstance(layer, TMoE):
        x = torch.randn(tokens, D, generator=g, requires_grad=True)
        ids = torch.randint(0, 100, (tokens,), generator=g)
        y = layer(x, ids)
    else:
        x = torch.randn(tokens // 64, 64, D, generator=g, requires_grad=True)
        y = layer(x)
    y.square().sum().backward()


KINDS = ["base", "switch", "gshard", "hash", "smoe-deterministic", "smoe-partial", "block"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_op_output_grows_faster_than_the_tokens(kind):
    layer = _layer(kind)
    sizes = {}
    for tokens in (1024, 4096):
        with LargestOutput() as mode:
            _step(layer, kind, tokens)
        sizes[tokens] = (mode.numel, mode.op)
    assert sizes[4096][0] <= 4.5 * sizes[1024][0], sizes


def test_the_largest_output_check_catches_dense_dispatch():
    """fairscale/GShard-style dispatch: combine_SEC = gates * one_hot(expert) * one_hot(slot), C = 2S/E."""
    def dense_dispatch(S):
        expert = torch.randint(0, E, (S,))
        slot = torch.arange(S) % (2 * S // E)
        combine_SEC = (torch.nn.functional.one_hot(expert, E)[:, :, None]
                       * torch.nn.functional.one_hot(slot, 2 * S // E)[:, None, :])
        return torch.einsum("sec,sd->ecd", combine_SEC.float(), torch.randn(S, D))

    sizes = {}
    for tokens in (1024, 4096):
        with LargestOutput() as mode:
            dense_dispatch(tokens)
        sizes[tokens] = mode.numel
    assert sizes[4096] > 4.5 * sizes[1024], sizes


def _peak_bytes_per_size(layer, kind: str, sizes: list[int]) -> list[int]:
    """Peak of the CPU allocator's live bytes during each forward + backward, in one profiler session."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for tokens in sizes:
            with record_function(f"size_{tokens}"):
                _step(layer, kind, tokens)
    events = list(prof.profiler.kineto_results.events())
    ranges = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name().startswith("size_")}
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks = []
    for tokens in sizes:
        start, end = ranges[f"size_{tokens}"]
        live = peak = 0
        for t, nbytes in memory:
            if start <= t <= end:
                live += nbytes
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["base", "gshard", "smoe-partial", "block"])
def test_peak_memory_grows_linearly_with_tokens(kind):
    layer = _layer(kind)
    _step(layer, kind, 1024)  # warm-up
    p1, p2, p4 = _peak_bytes_per_size(layer, kind, [2048, 4096, 8192])
    assert p1 < p2 < p4, (p1, p2, p4)
    ratio = (p4 - p2) / (p2 - p1)  # 2 for a + b S, 4 for a + c S^2
    assert 1.5 < ratio < 2.6, (kind, p1, p2, p4, ratio)


# ----------------------------------------------------------------------------- long run, 2 ranks


def _long_run(rank, world, init_file, steps, results):
    import torch.distributed as dist

    from smlp.dispatch import AllToAllDispatcher
    from smlp.lm import LanguageModel, LMConfig
    from smlp_launch.memory import vmrss_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = LMConfig(family="smlp", vocab_size=64, d_model=16, d_ffn=32, seq_len=16, dense_layers=1, sparse_layers=2,
                       num_experts=2 * world, smoe_routing="partial")
        model = LanguageModel(cfg, AllToAllDispatcher(2 * world)).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        rss = {}
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 64, (2 + step % 3, 16), generator=g)  # the batch size varies, as in training
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            shared = [p.grad for p in model.parameters() if not getattr(p, "expert", False) and p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in shared])
            dist.all_reduce(flat)  # shared gradients summed over ranks in one bucket, as legacy_ddp does
            for grad, summed in zip(shared, torch._utils._unflatten_dense_tensors(flat, shared)):
                grad.copy_(summed)
            opt.step()
            if step % (steps // 10) == 0:
                rss[step] = vmrss_bytes(os.getpid())
        results.put((rank, rss))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_no_memory_growth_over_many_updates_on_two_ranks():
    """300 updates (docs/faults.md: the 3,000-update version through fairseq-train was removed); RSS after the first
    20% may move by allocator noise, not by a per-step leak."""
    import torch.multiprocessing as mp

    steps = 300
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_long_run, args=(r, 2, os.path.join(tmp, "rdv"), steps, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 600
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                rank, rss = results.get(timeout=1)
                got[rank] = rss
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed, f"a rank failed (exit codes {[p.exitcode for p in procs]}); see its traceback above"
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert len(got) == len(procs), "timed out"
    for rank, rss in got.items():
        after_warmup = [v for s, v in sorted(rss.items()) if s >= steps // 5]
        growth_mib = (after_warmup[-1] - after_warmup[0]) / 2 ** 20
        assert growth_mib < 2.0, (rank, {s: round(v / 2 ** 20, 1) for s, v in sorted(rss.items())})


# ----------------------------------------------------------------------------- peak-RSS helpers


ALLOCATE = "import sys, time; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
           "del b; print('ready', flush=True); time.sleep(30)"


def test_peak_rss_of_a_process_set_and_the_monitor():
    from smlp_launch.memory import PeakRSSMonitor, format_bytes, peak_rss, process_tree, vmhwm_bytes

    procs = [subprocess.Popen([sys.executable, "-c", ALLOCATE, str(mb)], stdout=subprocess.PIPE, text=True)
             for mb in (40, 160)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        peaks = peak_rss([p.pid for p in procs])
        # the buffers were freed before "ready": VmHWM still remembers them (VmRSS would not)
        assert 40 * 2 ** 20 < peaks[procs[0].pid] < 160 * 2 ** 20 < peaks[procs[1].pid], peaks
        with PeakRSSMonitor({"small": procs[0].pid, "large": procs[1].pid}, interval=0.05) as mon:
            time.sleep(0.2)
        assert mon.peaks == {"small": peaks[procs[0].pid], "large": peaks[procs[1].pid]}
        assert os.getpid() in process_tree(os.getppid()) and procs[0].pid in process_tree(os.getpid())
        assert vmhwm_bytes(os.getpid()) > 0 and format_bytes(3 * 2 ** 20) == "3.0 MiB"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert peak_rss([p.pid for p in procs]) == {}  # gone: nothing to read
    assert mon.peaks["large"] > 160 * 2 ** 20  # the monitor kept what it saw
