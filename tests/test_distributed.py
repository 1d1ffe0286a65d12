"""Expert-parallel layers on 2 and 4 gloo ranks against their single-process twins.

Every rank builds the single-process reference (all experts local) with the same weights, runs
it on every rank's input, and checks its own share: outputs, input gradients, its experts'
gradients, and the all-reduced gradients of the shared (non-expert) parameters.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smlp.config import SGUConfig, SMoEConfig, SparseBlockConfig, TMoEConfig
from smlp.dispatch import AllToAllDispatcher
from smlp.mixers import SpatialGatingUnit
from smlp.moe import SMoE, SparseBlock, TMoE
from smlp.sharding import expert_keys, slice_expert_shard

pytestmark = pytest.mark.slow
ATOL = 1e-5


def run_workers(fn, world: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, os.path.join(tmp, "rendezvous"), *args), nprocs=world, join=True)


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _randomize_spatial(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 3 and p.shape[-1] == p.shape[-2]:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _inputs(world, shape_fn, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape_fn(r), generator=g) for r in range(world)]


def _check_shared_grads(model, ref, skip=()):
    """Non-expert gradients summed over ranks equal the reference's (DDP would average them)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if getattr(p, "expert", False) or name in skip:
            continue
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        expected = ref_params[name].grad if ref_params[name].grad is not None else torch.zeros_like(p)
        assert torch.allclose(g, expected, atol=ATOL), f"shared gradient of {name} differs"


def _check_expert_grads(model, ref, rank, world):
    ref_params = dict(ref.named_parameters())
    for name in expert_keys(model):
        full = ref_params[name].grad
        local = full.shape[0] // world
        mine = dict(model.named_parameters())[name].grad
        assert torch.allclose(mine, full[rank * local:(rank + 1) * local], atol=ATOL), f"expert gradient {name}"


def _run_pair(model, ref, xs, gs, rank, world, seed_base=1000, extra=None):
    """Forward/backward the distributed model on this rank's input and the reference on all inputs."""
    x = xs[rank].clone().requires_grad_(True)
    torch.manual_seed(seed_base + rank)
    y = model(x, *([extra[rank]] if extra else []))
    y.backward(gs[rank])
    ref_out = []
    for r in range(world):
        xr = xs[r].clone().requires_grad_(True)
        torch.manual_seed(seed_base + r)
        yr = ref(xr, *([extra[r]] if extra else []))
        yr.backward(gs[r])
        ref_out.append((yr.detach(), xr.grad))
    assert torch.allclose(y, ref_out[rank][0], atol=ATOL), "forward differs from the single-process layer"
    assert torch.allclose(x.grad, ref_out[rank][1], atol=ATOL), "input gradient differs"
    return y


# ---------------------------------------------------------------- sMoE deterministic == multi-head SGU


def _smoe_worker(rank, world, init_file, split, lengths):
    _init(rank, world, init_file)
    try:
        torch.manual_seed(0)
        ref = SpatialGatingUnit(SGUConfig(dim=16, seq_len=12, heads=world, split=split))
        _randomize_spatial(ref)
        model = SMoE(SMoEConfig(dim=16, seq_len=12, num_experts=world, split=split), AllToAllDispatcher(world))
        with torch.no_grad():
            model.norm.load_state_dict(ref.norm.state_dict())
            model.experts.weight.copy_(ref.proj.weight[rank:rank + 1])
            model.experts.bias.copy_(ref.proj.bias[rank:rank + 1])
        xs = _inputs(world, lambda r: (2 + r % 2, lengths[r], 16))
        gs = _inputs(world, lambda r: (2 + r % 2, lengths[r], 16 // 2 if split else 16), seed=200)
        _run_pair(model, ref, xs, gs, rank, world)
        assert torch.allclose(model.experts.weight.grad, ref.proj.weight.grad[rank:rank + 1], atol=ATOL)
        assert torch.allclose(model.experts.bias.grad, ref.proj.bias.grad[rank:rank + 1], atol=ATOL)
        _check_shared_grads(model, _sgu_as_smoe_names(ref))
    finally:
        _finish()


def _sgu_as_smoe_names(ref):
    """Expose the SGU's LayerNorm under the sMoE's parameter names for the shared-gradient check."""
    holder = torch.nn.Module()
    holder.norm = ref.norm
    return holder


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("split", [True, False])
def test_smoe_deterministic_matches_multihead_sgu(world, split):
    run_workers(_smoe_worker, world, split, [12] * world)


def test_smoe_ranks_with_different_sequence_lengths():
    run_workers(_smoe_worker, 2, True, [12, 7])


# ---------------------------------------------------------------- tMoE


def _tmoe_worker(rank, world, init_file, router, experts_per_rank, tokens):
    _init(rank, world, init_file)
    try:
        E = world * experts_per_rank
        cfg = TMoEConfig(d_model=8, d_ffn=16, num_experts=E, router=router, vocab_size=40, capacity_factor=1.5)
        torch.manual_seed(0)
        ref = TMoE(cfg).train()
        model = TMoE(cfg, AllToAllDispatcher(E)).train()
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        xs = _inputs(world, lambda r: (tokens[r], 8))
        gs = _inputs(world, lambda r: (tokens[r], 8), seed=200)
        g = torch.Generator().manual_seed(300)
        ids = [torch.randint(0, 40, (tokens[r],), generator=g) for r in range(world)]
        _run_pair(model, ref, xs, gs, rank, world, extra=ids)
        _check_expert_grads(model, ref, rank, world)
        _check_shared_grads(model, ref)
        if router == "base":
            counts = model.load_E.tolist()
            assert sum(counts) == tokens[rank]
            assert max(counts) - min(counts) == (0 if tokens[rank] % E == 0 else 1), counts
    finally:
        _finish()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("experts_per_rank", [1, 2])
def test_base_tmoe_matches_single_process(world, experts_per_rank):
    E = world * experts_per_rank
    run_workers(_tmoe_worker, world, "base", experts_per_rank, [4 * E] * world)


@pytest.mark.parametrize("router", ["switch", "gshard", "hash"])
def test_other_token_routers_match_single_process(router):
    run_workers(_tmoe_worker, 2, router, 2, [16, 24])


def test_token_counts_not_divisible_by_experts_do_not_hang():
    # 4 experts on 2 ranks; 7 and 13 tokens, one rank even fewer tokens than experts later
    run_workers(_tmoe_worker, 2, "base", 2, [7, 13])
    run_workers(_tmoe_worker, 2, "base", 2, [3, 9])


# ---------------------------------------------------------------- the sparse block


def _block_worker(rank, world, init_file, routing):
    _init(rank, world, init_file)
    try:
        cfg = SparseBlockConfig(d_model=16, d_ffn=24, seq_len=20, num_experts=2 * world, smoe_routing=routing)
        torch.manual_seed(0)
        ref = SparseBlock(cfg).train()
        _randomize_spatial(ref)
        model = SparseBlock(cfg, AllToAllDispatcher(2 * world)).train()
        model.load_state_dict(slice_expert_shard(ref.state_dict(), expert_keys(ref), rank, world))
        xs = _inputs(world, lambda r: (2, 20, 16))
        gs = _inputs(world, lambda r: (2, 20, 16), seed=200)
        _run_pair(model, ref, xs, gs, rank, world)
        _check_expert_grads(model, ref, rank, world)
        _check_shared_grads(model, ref)
    finally:
        _finish()


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_sparse_block_matches_single_process(routing):
    run_workers(_block_worker, 2, routing)
