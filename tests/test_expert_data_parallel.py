"""Expert-data parallelism (W = R x G) and expert resharding in the core.

Unit tests check the layout arithmetic and the resharding of model and optimizer state against
merge-then-slice of the full state. The distributed test runs whole language models on 4 gloo
ranks with expert-parallel groups of 2 (two replicas of every expert) against the single-process
model with every expert: outputs, every gradient after the data-parallel reductions, and the
parameters after one Adam step.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from smlp.dispatch import AllToAllDispatcher, LocalDispatcher
from smlp.expert_data_parallel import ExpertDataLayout, average_expert_gradients, expert_data_groups, valid_ep_sizes
from smlp.lm import LanguageModel, LMConfig
from smlp.resharding import (
    check_replicas,
    expert_keys,
    expert_slice,
    merge_expert_shards,
    reshard_model_state,
    reshard_optimizer_state,
    slice_expert_shard,
    source_positions,
)
from tolerance import assert_orders_agree

# Outputs and gradients of two computation orders (tests/tolerance.py): the longest reduction is a weight
# gradient summed over every rank's rows (4 ranks x 2 sequences x 12 positions), over the model's depth;
# the weights after an Adam step keep the fixed tolerance below (Adam divides by sqrt(v): a parameter whose
# true gradient is ~0 moves by its rounding noise / eps, not a computation order's difference).
RULE = dict(reduction=4 * 2 * 12, depth=8)
ATOL = 2e-5


# ---------------------------------------------------------------- layout


def test_layout_groups_tile_the_ranks():
    lay = ExpertDataLayout(world_size=8, ep_size=4, num_experts=8)
    assert (lay.replicas, lay.num_local_experts) == (2, 2)
    assert lay.ep_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.replica_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [lay.ep_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lay.first_expert(r) for r in range(8)] == [0, 2, 4, 6, 0, 2, 4, 6]
    # every rank is in exactly one group of each kind, and the two kinds meet in exactly one rank
    for ep in lay.ep_group_ranks():
        for rep in lay.replica_group_ranks():
            assert len(set(ep) & set(rep)) == 1
    assert ExpertDataLayout.resolve(world_size=64, num_experts=32).ep_size == 32  # default min(W, E)
    assert ExpertDataLayout.resolve(world_size=4, num_experts=8).replicas == 1
    assert valid_ep_sizes(12, 8) == [1, 2, 4]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, ep_size=3, num_experts=6), "ep_size=3 is invalid .* valid values: 1, 2"),
    (dict(world_size=6, ep_size=4, num_experts=4), "must divide both the world size"),
    (dict(world_size=4, ep_size=0, num_experts=4), "ep_size=0 is invalid"),
])
def test_bad_layout_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertDataLayout(**kwargs)


def test_expert_gradients_are_divided_by_the_world_without_replicas():
    """R = 1: the hook divides by W (the all2all backward already summed the group's tokens)."""
    cfg = LMConfig(family="smlp", vocab_size=20, d_model=8, d_ffn=16, seq_len=6, dense_layers=0, sparse_layers=1,
                   num_experts=2, base_shuffle=False)
    torch.manual_seed(0)
    a = LanguageModel(cfg)
    torch.manual_seed(0)
    b = LanguageModel(cfg)
    handles = average_expert_gradients(b, world_size=4)
    assert len(handles) == len(expert_keys(b)) > 0
    tokens = torch.randint(0, 20, (2, 6))
    a(tokens).sum().backward()
    b(tokens).sum().backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        scale = 0.25 if getattr(pa, "expert", False) else 1.0
        torch.testing.assert_close(pb.grad, pa.grad * scale, msg=name)


# ---------------------------------------------------------------- resharding state


def _full_state(E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"shared": torch.randn(3, generator=g), "layers.0.experts.w": torch.randn(E, 2, 3, generator=g),
            "layers.0.experts.b": torch.randn(E, 3, generator=g)}


@pytest.mark.parametrize("E, G_src, G_dst", [(8, 4, 2), (8, 2, 4), (8, 8, 1), (8, 1, 8), (12, 4, 3), (6, 3, 2)])
def test_reshard_model_state_equals_merge_then_slice(E, G_src, G_dst):
    full = _full_state(E)
    keys = ["layers.0.experts.w", "layers.0.experts.b"]
    src = [slice_expert_shard(full, keys, i, G_src) for i in range(G_src)]
    L_src, L_dst = E // G_src, E // G_dst
    for j in range(G_dst):
        need = source_positions(j * L_dst, L_dst, L_src)
        got = reshard_model_state({i: src[i] for i in need}, keys, L_src, j * L_dst, L_dst)
        want = slice_expert_shard(full, keys, j, G_dst)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (k, j)
    if G_src > 1:  # the last expert lives in the last source shard
        with pytest.raises(ValueError, match="missing"):
            expert_slice({0: src[0]["layers.0.experts.b"]}, L_src, E - 1, 1)


def test_reshard_optimizer_state_moves_adam_moments_with_their_experts():
    """Adam moments of an expert parameter follow its experts; steps and shared entries are kept."""
    E, G_src, G_dst = 4, 2, 4
    torch.manual_seed(0)
    full_w = torch.nn.Parameter(torch.randn(E, 3))
    shared = torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.Adam([shared, full_w], lr=0.1)
    (full_w.square().sum() + shared.sum()).backward()
    opt.step()
    full = opt.state_dict()
    def shard(pos, G):
        L = E // G
        s = {"state": {0: dict(full["state"][0]),
                       1: {k: (v[pos * L:(pos + 1) * L].clone() if v.dim() else v)
                           for k, v in full["state"][1].items()}},
             "param_groups": full["param_groups"]}
        return s
    src = {i: shard(i, G_src) for i in range(G_src)}
    for j in range(G_dst):
        need = source_positions(j, 1, E // G_src)
        got = reshard_optimizer_state({i: src[i] for i in need}, {1}, E // G_src, j, 1)
        want = shard(j, G_dst)
        assert torch.equal(got["state"][1]["exp_avg"], want["state"][1]["exp_avg"])
        assert torch.equal(got["state"][1]["exp_avg_sq"], want["state"][1]["exp_avg_sq"])
        assert torch.equal(got["state"][1]["step"], full["state"][1]["step"])
        assert got["state"][0] is src[need[0]]["state"][0]
        assert got["param_groups"] == full["param_groups"]


def test_merge_checks_that_replicas_agree():
    full = _full_state(4)
    keys = ["layers.0.experts.w", "layers.0.experts.b"]
    shards = [slice_expert_shard(full, keys, i, 2) for i in range(2)]
    merged = merge_expert_shards(shards + [dict(s) for s in shards], keys, ep_size=2)  # 4 ranks, 2 replicas
    assert torch.equal(merged["layers.0.experts.w"], full["layers.0.experts.w"])
    bad = dict(shards[1])
    bad["layers.0.experts.b"] = bad["layers.0.experts.b"] + 1e-2
    with pytest.raises(ValueError, match="rank 3 should hold a replica of rank 1's experts"):
        check_replicas(shards + [shards[0], bad], keys, 2)


# ---------------------------------------------------------------- 4 gloo ranks, groups of 2 == one process




MODELS = {
    "smlp": dict(family="smlp", dense_layers=1, sparse_layers=1, smoe_routing="deterministic"),
    "smlp-partial": dict(family="smlp", dense_layers=0, sparse_layers=1, smoe_routing="partial"),
    "switch": dict(family="transformer", dense_layers=1, sparse_layers=1, moe_router="switch", heads=2,
                   capacity_factor=1.5),
}


def _edp_worker(rank, world, init_file, ep_size):
    from test_distributed import _finish, _init

    _init(rank, world, init_file)
    try:
        E = 4
        layout = ExpertDataLayout(world_size=world, ep_size=ep_size, num_experts=E)
        ep_group, replica_group = expert_data_groups(layout, rank)
        for name, extra in MODELS.items():
            cfg = LMConfig(vocab_size=40, d_model=16, d_ffn=32, seq_len=12, num_experts=E, base_shuffle=False,
                           **extra)
            torch.manual_seed(0)
            ref = LanguageModel(cfg, LocalDispatcher(E)).train()
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():  # move every weight off its init (Base's zero w2, near-identity spatial)
                for p in ref.parameters():
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
            torch.manual_seed(0)
            model = LanguageModel(cfg, AllToAllDispatcher(E, ep_group=ep_group)).train()
            keys = expert_keys(model)
            model.load_state_dict(slice_expert_shard(ref.state_dict(), keys, layout.ep_rank(rank), ep_size))
            average_expert_gradients(model, world_size=world, replica_group=replica_group, replicas=layout.replicas)

            gd = torch.Generator().manual_seed(100)
            tokens = [torch.randint(0, 40, (2, 12), generator=gd) for _ in range(world)]
            targets = [torch.randint(0, 40, (2, 12), generator=gd) for _ in range(world)]
            logits = model(tokens[rank])
            F.cross_entropy(logits.reshape(-1, 40), targets[rank].reshape(-1)).backward()
            for p in model.parameters():  # fairseq's legacy_ddp: average the shared gradients over all W
                if not getattr(p, "expert", False):
                    p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
                    dist.all_reduce(p.grad)
                    p.grad /= world
            ref_logits = [ref(t) for t in tokens]
            loss = sum(F.cross_entropy(l.reshape(-1, 40), t.reshape(-1)) for l, t in zip(ref_logits, targets)) / world
            loss.backward()

            assert_orders_agree(logits, ref_logits[rank].detach(), f"{name} output", **RULE)
            ref_params = dict(ref.named_parameters())
            L, first = layout.num_local_experts, layout.first_expert(rank)
            for pname, p in model.named_parameters():
                want = ref_params[pname].grad
                want = torch.zeros_like(ref_params[pname]) if want is None else want
                if pname in keys:
                    want = want[first:first + L]
                assert_orders_agree(p.grad, want, f"{name} gradient of {pname}", **RULE)

            # eps 1e-5: attention's key bias has an exactly zero true gradient (softmax ignores a shift), and
            # Adam's default eps would turn its float noise into steps of +-lr
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-5)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-5)
            opt.step()
            ref_opt.step()
            for pname, p in model.named_parameters():
                want = ref_params[pname].detach()
                want = want[first:first + L] if pname in keys else want
                torch.testing.assert_close(p.detach(), want, atol=ATOL, rtol=1e-4, msg=f"{name} {pname} after a step")
            for pname in keys:  # the replicas of this expert shard hold bit-identical weights
                p = dict(model.named_parameters())[pname].detach()
                copies = [torch.empty_like(p) for _ in range(layout.replicas)]
                dist.all_gather(copies, p.contiguous(), group=replica_group)
                assert all(torch.equal(c, copies[0]) for c in copies), f"{name}: replicas of {pname} differ"
    finally:
        _finish()


@pytest.mark.slow
def test_four_ranks_in_groups_of_two_equal_one_process():
    from test_distributed import run_workers

    run_workers(_edp_worker, 4, 2)


# ---------------------------------------------------------------- optimizer-state sharding (ZeRO-1) with experts


def _oss_worker(rank, world, init_file):
    """ExpertLocalOSS (shared parameters' Adam state split over the ranks, experts' local) steps like plain
    Adam on every rank, and its checkpoint state is plain Adam's: it round-trips into a fresh one."""
    from fairseq_plugins.zero_optimizer import ExpertLocalOSS
    from test_distributed import _finish, _init

    _init(rank, world, init_file)
    try:
        g = torch.Generator().manual_seed(0)
        shared = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (5, 300, 7, 64)]  # same on every rank
        gr = torch.Generator().manual_seed(10 + rank)
        experts = [torch.nn.Parameter(torch.randn(2, 3, generator=gr)) for _ in range(2)]  # this rank's own
        for p in experts:
            p.expert = True
        params = [shared[0], experts[0], shared[1], shared[2], experts[1], shared[3]]
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        ours = ExpertLocalOSS([{"params": params, "lr": 0.1}], torch.optim.Adam, group=None, lr=0.1, eps=1e-6)
        plain = torch.optim.Adam([{"params": twins, "lr": 0.1}], lr=0.1, eps=1e-6)
        owned = {id(p) for p in ours.oss.optim.param_groups[0]["params"]}
        assert 0 < len(owned & {id(p) for p in shared}) < len(shared)  # the shared state really is split
        for step in range(3):
            gs = torch.Generator().manual_seed(100 + step)  # shared gradients: already all-reduced, equal
            ge = torch.Generator().manual_seed(200 + 10 * step + rank)
            for p, t in zip(params, twins):
                grad = torch.randn(p.shape, generator=ge if getattr(p, "expert", False) else gs)
                p.grad, t.grad = grad.clone(), grad.clone()
            for group in ours.param_groups:  # fairseq's set_lr writes through param_groups
                group["lr"] = 0.1 / (step + 1)
            for group in plain.param_groups:
                group["lr"] = 0.1 / (step + 1)
            ours.step()
            plain.step()
            for p, t in zip(params, twins):
                torch.testing.assert_close(p.detach(), t.detach(), atol=1e-6, rtol=1e-6)
        ours.consolidate_state_dict()
        saved, want = ours.state_dict(), plain.state_dict()
        assert sorted(saved["state"]) == sorted(want["state"]) == list(range(len(params)))
        for i in want["state"]:
            for k, v in want["state"][i].items():
                torch.testing.assert_close(torch.as_tensor(saved["state"][i][k]), torch.as_tensor(v))
        assert [g["params"] for g in saved["param_groups"]] == [list(range(len(params)))]
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for f, p in zip(fresh, params):
            if getattr(p, "expert", False):
                f.expert = True
        again = ExpertLocalOSS([{"params": fresh, "lr": 0.1}], torch.optim.Adam, group=None, lr=0.1, eps=1e-6)
        again.load_state_dict(copy.deepcopy(want))  # plain Adam's state (as read from a file): runs switch
        # --zero-sharding on and off
        gs, ge = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8 + rank)
        for f, p, t in zip(fresh, params, twins):
            grad = torch.randn(p.shape, generator=ge if getattr(p, "expert", False) else gs)
            f.grad, t.grad = grad.clone(), grad.clone()
        again.step()
        plain.step()
        for f, t in zip(fresh, twins):
            torch.testing.assert_close(f.detach(), t.detach(), atol=1e-6, rtol=1e-6)
    finally:
        _finish()


@pytest.mark.slow
def test_optimizer_state_sharding_keeps_experts_local_and_equals_plain_adam():
    from test_distributed import run_workers

    run_workers(_oss_worker, 2)


# ---------------------------------------------------------------- elastic resume on synthetic checkpoint files


def _write_set(directory, world, ep_size, E=4, updates=3, iters=3):
    """A fake fairseq checkpoint set: expert weight + shared weight, Adam moments, iterator, config."""
    g = torch.Generator().manual_seed(0)
    full_w, full_m = torch.randn(E, 3, generator=g), torch.randn(E, 3, generator=g)
    shared, shared_m = torch.randn(5, generator=g), torch.randn(5, generator=g)
    L = E // ep_size
    for r in range(world):
        j = r % ep_size
        state = {
            "cfg": {"model": {"_name": "moe_transformer_lm", "num_experts": E, "expert_parallel_size": ep_size,
                              "distributed_world_size": world},
                    "distributed_training": {"distributed_world_size": world, "distributed_rank": r}},
            "model": {"decoder.core.embed.weight": shared.clone(),
                      "decoder.core.layers.0.ffn.experts.w1": full_w[j * L:(j + 1) * L].clone()},
            "last_optimizer_state": {"state": {0: {"step": 3, "exp_avg": shared_m.clone()},
                                               1: {"step": 3, "exp_avg": full_m[j * L:(j + 1) * L].clone()}},
                                     "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": iters, "version": 2}},
            "optimizer_history": [{"num_updates": updates}],
        }
        name = f"checkpoint_last-rank-{r}.pt" if world > 1 else "checkpoint_last.pt"
        torch.save(state, directory / name)
    return full_w, full_m


def test_elastic_reshards_model_optimizer_and_data_position(tmp_path):
    from fairseq_plugins.elastic import ReshardError, plan_resume, reshard_checkpoint

    full_w, full_m = _write_set(tmp_path, world=4, ep_size=2)
    base = str(tmp_path / "checkpoint_last.pt")
    one = ExpertDataLayout(world_size=1, ep_size=1, num_experts=4)
    with pytest.raises(ReshardError, match="holds 4 experts per sparse layer but this run builds 8"):
        plan_resume(base, world_size=1, sharded=False, layout=ExpertDataLayout(world_size=1, ep_size=1, num_experts=8),
                    num_experts=8)
    target = str(tmp_path / "checkpoint_resharded_3_w1.pt")
    plan = plan_resume(base, world_size=1, sharded=False, layout=one, num_experts=4, target=target)
    assert (plan.saved.world_size, plan.saved.ep_size, plan.saved.local_experts) == (4, 2, 2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    reshard_checkpoint(plan, 0, [False, True])
    # written beside: the 4-rank set is left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "checkpoint_resharded_3_w1.pt"])
    assert all((tmp_path / name).read_bytes() == data for name, data in before.items())
    base = target
    st = torch.load(base, weights_only=False)
    assert torch.equal(st["model"]["decoder.core.layers.0.ffn.experts.w1"], full_w)
    assert torch.equal(st["last_optimizer_state"]["state"][1]["exp_avg"], full_m)
    assert st["extra_state"]["train_iterator"]["iterations_in_epoch"] == 12  # 4 ranks x 3 batches, now one rank
    assert st["cfg"]["model"]["expert_parallel_size"] == 1
    assert st["cfg"]["distributed_training"]["distributed_world_size"] == 1
    assert plan_resume(base, world_size=1, sharded=False, layout=one, num_experts=4) is None  # nothing left to do

    # one file -> 8 ranks in groups of 4 (two replicas), each rank writing its own file in any order
    eight = ExpertDataLayout(world_size=8, ep_size=4, num_experts=4)
    plan = plan_resume(base, world_size=8, sharded=True, layout=eight, num_experts=4,
                       target=str(tmp_path / "checkpoint_resharded_3_w8.pt"))
    for r in [7, 3, 5, 1, 2, 6, 4, 0]:
        reshard_checkpoint(plan, r, [False, True])
    for r in range(8):
        st = torch.load(tmp_path / f"checkpoint_resharded_3_w8-rank-{r}.pt", weights_only=False)
        j = r % 4
        assert torch.equal(st["model"]["decoder.core.layers.0.ffn.experts.w1"], full_w[j:j + 1])
        assert torch.equal(st["last_optimizer_state"]["state"][1]["exp_avg"], full_m[j:j + 1])
        assert st["last_optimizer_state"]["state"][0]["step"] == 3
        # 12 batches over 8 ranks: each skips 1, 4 batches are seen twice (a warning says so)
        assert st["extra_state"]["train_iterator"]["iterations_in_epoch"] == 1
    assert (tmp_path / "checkpoint_resharded_3_w1.pt").exists()  # the source stays
    # consolidation reads the group size from the rewritten config and merges the first 4 of the 8 shards
    from fairseq_plugins.checkpoints import saved_ep_size

    states = [torch.load(tmp_path / f"checkpoint_resharded_3_w8-rank-{r}.pt", weights_only=False) for r in range(8)]
    keys = ["decoder.core.layers.0.ffn.experts.w1"]
    G = saved_ep_size(states[0], 8, keys)
    assert G == 4
    assert torch.equal(merge_expert_shards([s["model"] for s in states], keys, G)[keys[0]], full_w)


# ---------------------------------------------------------------- the sMoE's two layouts (--smoe-parallel)

SMOE, TMOE = "decoder.core.layers.1.smoe.experts.weight", "decoder.core.layers.1.tmoe.experts.w1"


def _write_layout_set(directory, smoe_replicated, E=4, world=2, N=0):
    """A fake 2-rank set: the tMoE spread over the ranks, the sMoE (N experts, 0: E) spread too or whole in
    every file."""
    g = torch.Generator().manual_seed(1)
    S = N or E
    full = {SMOE: torch.randn(S, 3, 3, generator=g), TMOE: torch.randn(E, 2, generator=g)}
    moments = {SMOE: torch.randn(S, 3, 3, generator=g), TMOE: torch.randn(E, 2, generator=g)}
    shared = torch.randn(5, generator=g)
    for r in range(world):
        def mine(t, whole, r=r):
            L = t.shape[0] // world
            return t.clone() if whole else t[r * L:(r + 1) * L].clone()
        state = {
            "cfg": {"model": {"_name": "smlp_lm", "num_experts": E, "expert_parallel_size": world,
                              "distributed_world_size": world, **({"smoe_experts": N} if N else {})},
                    "distributed_training": {"distributed_world_size": world, "distributed_rank": r}},
            "model": {"decoder.core.embed.weight": shared.clone(), SMOE: mine(full[SMOE], smoe_replicated),
                      TMOE: mine(full[TMOE], False)},
            "last_optimizer_state": {"state": {0: {"step": 2, "exp_avg": shared.clone()},
                                               1: {"step": 2, "exp_avg": mine(moments[SMOE], smoe_replicated)},
                                               2: {"step": 2, "exp_avg": mine(moments[TMOE], False)}},
                                     "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]},
            "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 2, "version": 2}},
            "optimizer_history": [{"num_updates": 2}],
        }
        torch.save(state, directory / f"checkpoint_last-rank-{r}.pt")
    return full, moments


@pytest.mark.parametrize("saved_replicated", [False, True], ids=["expert-to-replicated", "replicated-to-expert"])
def test_checkpoints_move_between_the_smoe_layouts(tmp_path, saved_replicated):
    """fairseq-train's resume (elastic.py) rewrites a 2-rank set for the other sMoE layout: the sMoE's weights
    and Adam moments whole in every file (replicated) or this rank's slice (expert), the tMoE's untouched; a
    set of either layout consolidates into the same full model, and a rank loads a whole layer by slicing it."""
    from fairseq_plugins.checkpoints import adapt_expert_state, saved_ep_size
    from fairseq_plugins.elastic import plan_resume, reshard_checkpoint
    from smlp.resharding import replicated_keys

    full, moments = _write_layout_set(tmp_path, saved_replicated)
    base = str(tmp_path / "checkpoint_last.pt")
    layout = ExpertDataLayout(world_size=2, ep_size=2, num_experts=4)
    target = () if saved_replicated else (SMOE,)
    assert plan_resume(base, world_size=2, sharded=True, layout=layout, num_experts=4,
                       replicated=(SMOE,) if saved_replicated else ()) is None  # its own layout: nothing to do
    plan = plan_resume(base, world_size=2, sharded=True, layout=layout, num_experts=4, replicated=target,
                       target=str(tmp_path / "moved.pt"))
    assert plan is not None and plan.saved.replicated == ((SMOE,) if saved_replicated else ())
    for r in (1, 0):
        reshard_checkpoint(plan, r, [None, SMOE, TMOE])
    states = [torch.load(tmp_path / f"moved-rank-{r}.pt", weights_only=False) for r in range(2)]
    for r, st in enumerate(states):
        for key, whole in ((SMOE, not saved_replicated), (TMOE, False)):
            want = (full[key], moments[key]) if whole else (full[key][2 * r:2 * r + 2], moments[key][2 * r:2 * r + 2])
            idx = 1 if key == SMOE else 2
            assert torch.equal(st["model"][key], want[0]), (r, key)
            assert torch.equal(st["last_optimizer_state"]["state"][idx]["exp_avg"], want[1]), (r, key)
    assert replicated_keys(states[0]["model"], [SMOE, TMOE]) == list(target)
    models, keys = [st["model"] for st in states], [SMOE, TMOE]  # as smlp-consolidate merges them
    merged = merge_expert_shards(models, keys, saved_ep_size(states[0], 2, keys), replicated_keys(models[0], keys))
    assert torch.equal(merged[SMOE], full[SMOE]) and torch.equal(merged[TMOE], full[TMOE])

    class Spread(torch.nn.Module):  # rank 1 of a model spreading both layers over 2 positions
        def state_dict(self):
            return {SMOE: full[SMOE][2:], TMOE: full[TMOE][2:]}

    got = adapt_expert_state(Spread(), states[1]["model"], 1, 2)
    assert torch.equal(got[SMOE], full[SMOE][2:]) and torch.equal(got[TMOE], full[TMOE][2:])


class _Core(torch.nn.Module):
    """A stand-in for one of our models on rank `rank` of 2: its state (each layer spread, or the sMoE whole) and
    the core config its layers' expert counts come from (checkpoints.model_totals)."""

    def __init__(self, full, rank, smoe_whole, E, N):
        super().__init__()
        self.core = type("core", (), {"cfg": type("cfg", (), {"num_experts": E, "smoe_experts": N})})()
        self._state = {SMOE: full[SMOE] if smoe_whole else full[SMOE][rank * N // 2:(rank + 1) * N // 2],
                       TMOE: full[TMOE][rank * E // 2:(rank + 1) * E // 2]}

    def state_dict(self):
        return self._state


@pytest.mark.parametrize("saved_replicated", [False, True], ids=["smoe-spread", "smoe-replicated"])
def test_checkpoints_of_a_model_with_its_own_smoe_experts(tmp_path, saved_replicated):
    """--smoe-experts 2 apart from the tMoE's 4 on 2 ranks: with the sMoE replicated each file holds 2 sMoE and
    2 tMoE experts, the shapes alone cannot tell the layouts apart (the saved --smoe-experts does). The set
    consolidates into the full model, reshards to one file, to 4 ranks and to the other sMoE layout (weights and
    Adam moments), a whole layer loads into either layout, and another --smoe-experts is refused."""
    from fairseq_plugins.checkpoints import adapt_expert_state, merge_rank_models
    from fairseq_plugins.elastic import ReshardError, plan_resume, reshard_checkpoint

    E, N = 4, 2
    full, moments = _write_layout_set(tmp_path, saved_replicated, E=E, N=N)
    base = str(tmp_path / "checkpoint_last.pt")
    states = [torch.load(tmp_path / f"checkpoint_last-rank-{r}.pt", weights_only=False) for r in range(2)]
    merged = merge_rank_models(states)  # what smlp-consolidate and the evaluators merge
    assert torch.equal(merged[SMOE], full[SMOE]) and torch.equal(merged[TMOE], full[TMOE])
    for r in range(2):  # a consolidated (whole) state into rank r of either layout
        for whole in (False, True):
            model = _Core(full, r, whole, E, N)
            got = adapt_expert_state(model, merged, r, 2)
            assert all(torch.equal(got[k], v) for k, v in model.state_dict().items()), (r, whole)
    two = ExpertDataLayout(world_size=2, ep_size=2, num_experts=E)
    here = (SMOE,) if saved_replicated else ()
    assert plan_resume(base, world_size=2, sharded=True, layout=two, num_experts=E, replicated=here,
                       smoe_experts=N) is None  # its own layout: nothing to do
    with pytest.raises(ReshardError, match="holds 2 experts in each sMoE but this run builds 4.*--smoe-experts 2"):
        plan_resume(base, world_size=1, sharded=False, layout=ExpertDataLayout(world_size=1, ep_size=1,
                                                                               num_experts=E), num_experts=E)
    # the other sMoE layout on the same 2 ranks
    other = () if saved_replicated else (SMOE,)
    plan = plan_resume(base, world_size=2, sharded=True, layout=two, num_experts=E, replicated=other, smoe_experts=N,
                       target=str(tmp_path / "other.pt"))
    assert plan.saved.smoe_experts == N and plan.saved.replicated == here
    for r in (1, 0):
        reshard_checkpoint(plan, r, [None, SMOE, TMOE])
    for r in range(2):
        st = torch.load(tmp_path / f"other-rank-{r}.pt", weights_only=False)
        for key, idx, total in ((SMOE, 1, N), (TMOE, 2, E)):
            lo, hi = (0, total) if key in other else (r * total // 2, (r + 1) * total // 2)
            assert torch.equal(st["model"][key], full[key][lo:hi]), (r, key)
            assert torch.equal(st["last_optimizer_state"]["state"][idx]["exp_avg"], moments[key][lo:hi]), (r, key)
    # ... then one file (every expert), then 4 ranks: one tMoE expert each, the sMoE's 2 spread over groups of 2
    one = ExpertDataLayout(world_size=1, ep_size=1, num_experts=E)
    base = str(tmp_path / "other.pt")
    plan = plan_resume(base, world_size=1, sharded=False, layout=one, num_experts=E, smoe_experts=N,
                       target=str(tmp_path / "one.pt"))
    reshard_checkpoint(plan, 0, [None, SMOE, TMOE])
    base = str(tmp_path / "one.pt")
    st = torch.load(base, weights_only=False)
    assert torch.equal(st["model"][SMOE], full[SMOE]) and torch.equal(st["model"][TMOE], full[TMOE])
    assert st["cfg"]["model"]["smoe_experts"] == N and st["cfg"]["model"]["num_experts"] == E
    four = ExpertDataLayout(world_size=4, ep_size=4, num_experts=E)
    with pytest.raises(ReshardError, match="sMoE's 2 experts over expert-parallel groups of 4.*replicated"):
        plan_resume(base, world_size=4, sharded=True, layout=four, num_experts=E, smoe_experts=N)
    plan = plan_resume(base, world_size=4, sharded=True, layout=four, num_experts=E, replicated=(SMOE,),
                       smoe_experts=N, target=str(tmp_path / "four.pt"))
    for r in (3, 1, 2, 0):
        reshard_checkpoint(plan, r, [None, SMOE, TMOE])
    for r in range(4):
        st = torch.load(tmp_path / f"four-rank-{r}.pt", weights_only=False)
        assert torch.equal(st["model"][SMOE], full[SMOE]) and torch.equal(st["model"][TMOE], full[TMOE][r:r + 1])


def test_a_replicated_layer_refuses_one_rank_shard_with_the_fix():
    from fairseq_plugins.checkpoints import adapt_expert_state

    class Replicated(torch.nn.Module):  # the sMoE whole, the tMoE spread over 2 positions
        def state_dict(self):
            return {SMOE: torch.zeros(4, 3, 3), TMOE: torch.zeros(2, 2)}

    with pytest.raises(ValueError, match="one rank.s shard of .*smoe.*smlp-consolidate"):
        adapt_expert_state(Replicated(), {SMOE: torch.zeros(2, 3, 3), TMOE: torch.zeros(2, 2)}, 0, 2)


def test_merge_takes_replicated_layers_once_and_checks_them():
    full = _full_state(4)
    spread, whole = "layers.0.experts.w", "layers.0.experts.b"
    shards = [{**slice_expert_shard(full, [spread], r, 2), whole: full[whole].clone()} for r in range(2)]
    merged = merge_expert_shards(shards, [spread, whole], 2, replicated=[whole])
    assert torch.equal(merged[spread], full[spread]) and torch.equal(merged[whole], full[whole])
    shards[1][whole] = shards[1][whole] + 1e-2
    with pytest.raises(ValueError, match="should hold a replica"):
        merge_expert_shards(shards, [spread, whole], 2, replicated=[whole])
