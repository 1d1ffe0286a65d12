# ruff: noqa: E702  (the counter test pairs each call with its expected count on one line)
"""A training step that does not wait for the device (issue 19), checked on the CPU.

- The host-sync counter (smlp_bench.micro.host_syncs) counts what it claims to (a negative control of
  every kind of sync and host-to-device copy it knows, in the forward and in the project's backward
  functions) and runs balanced assignment and the FFN experts on their accelerator paths.
- Budget per family on that path: dense blocks and the backward pass 0 syncs, the criterion 0,
  a sparse layer one read per dispatch (its split sizes) plus, where balanced assignment runs,
  its completion checks: one per auction at these sizes, so exactly 2 reads per balanced MoE module,
  1 per other MoE module, 0 for sMLP-det's sMoE (issue 47: pinned, no longer bounds; on 2 ranks
  tests/test_collectives.py pins them with the shuffle). Every sync must come from one of those two
  places: no host-to-device
  copy of Python data or of a host tensor, in training (forward, backward, criterion) or in an
  evaluation forward (issue 28).
- The auction on its own: one read per call where it ends within the accelerator's first check
  (ACCELERATOR_CHECKS), one per doubling of its rounds beyond, the same assignment as checking
  every round.
- Removing the syncs changed nothing: the layer equals the former boolean-mask implementation
  (outputs and gradients bit for bit, with dropped slots), the deferred router checks raise the
  errors the routers raise on their own, and the all2all timer only records when asked to, with
  device events that nothing waits for inside the forward.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from smlp.comm_timer import CommTimer
from smlp.config import TMoEConfig
from smlp.dispatch import LocalDispatcher
from smlp.lm import LanguageModel
from smlp.moe import TMoE
from smlp.routing import (
    FAULT_WIDTH,
    DeferredCheck,
    NonFiniteScoresError,
    assignment,
    balanced_assignment,
    base_route,
    hash_fault,
    hash_route,
    nonfinite_fault,
    routing_error,
)
from smlp_bench.micro.host_syncs import HostSyncCounter, accelerator_paths, count_host_syncs
from tiny_steps import FAMILIES, count_step, tiny_config, tokens

# ---------------------------------------------------------------- the counter


def test_the_counter_counts_every_kind_of_sync_and_nothing_else():
    x = torch.arange(12.0).reshape(3, 4)
    idx = torch.tensor([0, 2])
    expected = 0
    with HostSyncCounter() as c:
        x.sum().item(); expected += 1
        x.tolist(); expected += 1
        x.cpu(); expected += 1
        x.to("cpu"); expected += 1
        x.numpy(); expected += 1
        bool(x.sum() > 0); expected += 1
        int(x[0, 0]); expected += 1
        float(x[0, 0]); expected += 1
        torch.nonzero(x); expected += 1
        x[x > 3]; expected += 1  # boolean-mask indexing
        y = x.clone()
        y[y > 3] = 0.0; expected += 1
        torch.bincount(idx); expected += 2
        y.index_fill_(0, idx, torch.tensor(1.0)); expected += 1
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])); expected += 1
        torch.equal(x, x); expected += 1
        # not syncs: device-side counting, selection, a Python fill value, a known output size
        torch.zeros(3, dtype=torch.long, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))
        torch.where(x > 3, x, 0.0)
        y.index_fill_(0, idx, 1.0)
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)
        x.to(x.device)  # follows a tensor: on the GPU in a CUDA run
        x[idx]
    assert c.count == expected == 16, dict(c.by_site)


class _SyncsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()  # a sync in Python code that autograd runs
        return grad * torch.tensor([2.0], device=grad.device)  # and a copy of Python data


def test_the_counter_counts_host_to_device_copies_and_nothing_else():
    """Python data or a host tensor copied to the device waits for the stream (pageable memory); a tensor
    filled on the device, a 0-d host scalar and host-only arithmetic copy nothing."""
    x = torch.arange(12.0).reshape(3, 4)  # made outside: a device tensor in a CUDA run
    expected = 0
    with HostSyncCounter() as c:
        torch.tensor([1, 2], device=x.device); expected += 1
        torch.as_tensor([1.0, 2.0], device=x.device); expected += 1
        torch.tensor(3, dtype=torch.int32, device=x.device); expected += 1
        x.new_tensor([1.0, 2.0]); expected += 1
        h = torch.tensor([0, 2])  # on the host
        h.to(x.device); expected += 1
        h.to(x); expected += 1
        h.to(device=x.device, dtype=torch.int32); expected += 1
        x[h]; expected += 1  # a host index tensor: copied first
        x[:, :2].copy_(torch.ones(3, 2)); expected += 1
        (h + 1).to(x.device); expected += 1  # computed on the host, still a host tensor
        # not copies: filled on the device, host-only work, 0-d host scalars, following a device tensor
        torch.full((2,), 3, device=x.device)
        torch.arange(4, device=x.device)
        torch.zeros_like(x)
        x.new_zeros(3)
        (h * 2).cumsum(0).to(torch.float32)
        x * torch.tensor(2.0)
        torch.tensor([1, 2], device="cpu").to("cpu")
        x.to(x.device)
    assert c.copies == c.count == expected == 10, dict(c.by_site)


def test_the_counter_sees_the_backward_of_the_projects_autograd_functions():
    x = torch.randn(3, requires_grad=True)
    with HostSyncCounter(backward_modules=(__name__,)) as c:
        _SyncsInBackward.apply(x).sum().backward()
    assert (c.count, c.copies) == (2, 1), dict(c.by_site)
    assert all("_SyncsInBackward" not in str(type(f)) for f in (_SyncsInBackward.backward,))
    with HostSyncCounter() as c:  # the project's modules only, by default
        _SyncsInBackward.apply(x).sum().backward()
    assert c.count == 0, dict(c.by_site)


def test_the_counted_path_is_the_accelerator_path_of_balanced_assignment():
    with count_host_syncs():
        assert isinstance(assignment._array_ops(torch.device("cpu")), assignment._TorchOps)
        assert assignment._check_schedule(torch.device("cpu")) == assignment.ACCELERATOR_CHECKS
    assert isinstance(assignment._array_ops(torch.device("cpu")), assignment._NumpyOps)
    assert assignment._check_schedule(torch.device("cpu")) == assignment.CheckSchedule(1)
    assert assignment._check_schedule(torch.device("meta")) == assignment.ACCELERATOR_CHECKS


def test_the_accelerator_checks_at_rounds_16_32_64_and_so_on():
    checks = assignment.ACCELERATOR_CHECKS
    assert [r for r in range(200) if checks.due(r)] == [16, 32, 64, 128]
    assert [r for r in range(10) if assignment.CheckSchedule(3).due(r)] == [3, 6, 9]


def _auction_reads(scores, **kwargs):
    """(assignment, host reads) of balanced_assignment on the accelerator's path."""
    with count_host_syncs() as c:
        expert_S = balanced_assignment(scores, **kwargs)
    assert all(AUCTION_CHECK in site for site in c.by_site), dict(c.by_site)
    return expert_S, c.count


@pytest.mark.parametrize("S, E, kind", [(80, 4, "randn"), (512, 8, "randn"), (2048, 8, "softmax"),
                                        (4096, 8, "randn"), (1024, 32, "randn")])
def test_an_auction_reads_once_and_assigns_as_checking_every_round(S, E, kind):
    g = torch.Generator().manual_seed(S + E)
    scores = torch.randn(S, E, generator=g)
    if kind == "softmax":
        scores = torch.softmax(3 * scores, -1)
    every_round = balanced_assignment(scores, check_every=1)  # numpy, the CPU's
    expert_S, reads = _auction_reads(scores)
    assert reads == 1
    assert torch.equal(expert_S, every_round)


def test_step_4_adds_at_most_one_read():
    scores = torch.randn(8192, 8, generator=torch.Generator().manual_seed(3))  # 65536 keys: step 4 runs
    expert_S, reads = _auction_reads(scores)
    assert reads <= 2
    assert torch.equal(torch.bincount(expert_S, minlength=8), assignment.expert_capacities(8192, 8))


def test_a_slow_auction_reads_once_per_doubling_of_its_rounds():
    """At a tenth of the default price step the auction takes 16-128 rounds: reads at rounds 16, 32, 64,
    ... until done, never one per few rounds, and the assignment of the every-round checks."""
    scores = torch.randn(1024, 16, generator=torch.Generator().manual_seed(4))
    every_round = balanced_assignment(scores, eps=0.003, tail_fraction=0.0, check_every=1)
    rounds = []
    auction = assignment._auction

    def counted(*args):
        out = auction(*args)
        rounds.append(out[3])
        return out

    with mock.patch.object(assignment, "_auction", counted):
        balanced_assignment(scores, eps=0.003, tail_fraction=0.0, check_every=1)
    assert 16 < rounds[0] <= 128, rounds
    expert_S, reads = _auction_reads(scores, eps=0.003, tail_fraction=0.0)
    assert reads == (rounds[0] - 1).bit_length() - 3  # checks at 16, 32, 64, 128: the first past the end
    assert torch.equal(expert_S, every_round)


# ---------------------------------------------------------------- the budget

DISPATCH_READ = "tolist @ smlp/dispatch.py"
AUCTION_CHECK = "@ smlp/routing/assignment.py"
AUCTION_FAMILIES = {"sMLP-det", "sMLP-partial", "Base"}


def _auction_checks(counter: HostSyncCounter) -> int:
    return sum(n for site, n in counter.by_site.items() if AUCTION_CHECK in site)


def _per_module_syncs(name: str, seed: int = 0, auction_only: bool = False):
    """Host syncs of each MoE module of one training forward (by forward hooks on a counter); with
    auction_only, only the auction's completion checks."""
    torch.manual_seed(seed)
    model = LanguageModel(tiny_config(name)).train()
    counter = HostSyncCounter()
    per_module = {}
    read = _auction_checks if auction_only else (lambda c: c.count)

    def pre(module, args):
        module._syncs_before = read(counter)

    def post(module, args, out):
        per_module[module.layer_name] = read(counter) - module._syncs_before

    for _, module in model.moe_modules():
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    x = tokens(seed=seed)  # made before counting: the batch is on the device in a CUDA run
    with accelerator_paths(), counter:
        model(x)
    return per_module, counter


@pytest.fixture(scope="module")
def steps():
    return {name: count_step(name) for name in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_host_sync_budget_of_a_training_step(steps, name):
    step = steps[name]
    for part in ("forward", "backward", "criterion"):  # issue 28: 26 in sMLP-det's and Base's forward, 52 in
        copies = {site: n for site, n in step[f"{part}_sites"].items() if site.startswith("host-to-device")}
        assert not copies, (part, copies)  # sMLP-partial's (the auction's constants), before
    assert step["backward"] == 0, step["backward_sites"]
    assert step["criterion"] == 0, step["criterion_sites"]
    if name in ("gMLP", "Transformer"):
        assert step["forward"] == 0, step["forward_sites"]
        return
    for site in step["forward_sites"]:  # nothing but split-size reads and auction completion checks
        assert DISPATCH_READ in site or (AUCTION_CHECK in site and name in AUCTION_FAMILIES), site
    dispatches = 2 if name == "sMLP-partial" else 1  # dispatches that read counts, per sparse layer
    reads = sum(n for site, n in step["forward_sites"].items() if DISPATCH_READ in site)
    assert reads == dispatches * step["sparse_layers"], step["forward_sites"]
    per_module, _ = _per_module_syncs(name)
    assert len(per_module) == step["sparse_layers"] * (2 if name.startswith("sMLP") else 1)
    auctions = 0
    for layer, n in per_module.items():
        auction = "TMoE" in layer and name in AUCTION_FAMILIES or "partial" in name
        auctions += auction
        if name == "sMLP-det" and "SMoE" in layer:  # its sMoE knows its counts from the shapes: nothing to read
            assert n == 0, (layer, n)
        else:  # the auction's completion check, the dispatch's split sizes
            assert n == (2 if auction else 1), (layer, n)
    if name in AUCTION_FAMILIES:
        checks, _ = _per_module_syncs(name, auction_only=True)
        assert sum(checks.values()) == auctions, checks
        assert all(n == 1 for layer, n in checks.items() if "TMoE" in layer or "partial" in name), checks


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("gMLP", "Transformer")])
def test_an_evaluation_forward_copies_nothing_to_the_device(name):
    """Greedy routing gives unequal counts at evaluation: the FFN experts' tiles and the sMoE experts'
    biases per row are built without copying counts to the device (issue 28)."""
    torch.manual_seed(0)
    model, x = LanguageModel(tiny_config(name)).eval(), tokens()
    with torch.no_grad(), count_host_syncs() as c:
        model(x)
    assert c.copies == 0, dict(c.by_site)
    assert all(DISPATCH_READ in site for site in c.by_site), dict(c.by_site)


@pytest.mark.parametrize("seed", range(4))
def test_the_budget_holds_for_other_batches(seed):
    """The auction's checks depend on the scores: other seeds stay within budget too."""
    for name in ("Base", "sMLP-partial", "GShard"):
        per_module, _ = _per_module_syncs(name, seed)
        for layer, n in per_module.items():
            assert n <= (2 if name != "GShard" else 1), (name, seed, layer, n)


def test_a_padded_partial_prediction_batch_costs_the_criterion_one_read():
    from tiny_steps import _Replay, criterion, fairseq_model, lm_sample

    torch.manual_seed(0)
    core = LanguageModel(tiny_config("sMLP-partial")).train()
    model, dictionary = fairseq_model(core)
    sample = lm_sample(tokens(), dictionary.pad())
    counted = {}
    for padded in (False, True):
        if padded:
            sample["target"][1, 15:] = dictionary.pad()
            sample["ntokens"] = int((sample["target"] != dictionary.pad()).sum())
        out = model(**sample["net_input"])
        with HostSyncCounter() as c:
            loss, sample_size, log = criterion(dictionary)(_Replay(model, out), sample)
        start = core.cfg.prediction_start
        assert sample_size == log["ntokens"] == int((sample["target"][:, start:] != dictionary.pad()).sum())
        counted[padded] = c.count
    assert counted == {False: 0, True: 1}


# ---------------------------------------------------------------- nothing else changed


def _former_route_and_compute(layer: TMoE, x_SD: torch.Tensor, token_ids_S=None) -> torch.Tensor:
    """The TMoE step before issue 19: dropped slots removed by boolean masks, bincount counts."""
    plan = layer.route(x_SD, token_ids_S)
    K = plan.experts_SK.shape[1]
    kept = (plan.experts_SK >= 0).reshape(-1)
    row_idx = torch.arange(x_SD.shape[0]).repeat_interleave(K)[kept]
    expert_idx = plan.experts_SK.reshape(-1)[kept]
    weight = plan.weights_SK.reshape(-1)[kept].to(x_SD.dtype)
    order = torch.argsort(expert_idx, stable=True)
    counts = torch.bincount(expert_idx, minlength=layer.cfg.num_experts).tolist()
    y_sorted = layer.experts(x_SD[row_idx][order], counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return torch.zeros_like(x_SD).index_add(0, row_idx, y_sorted[inverse] * weight[:, None])


@pytest.mark.parametrize("router", ["switch", "gshard", "base", "hash"])
def test_layers_equal_the_former_boolean_mask_implementation_bit_for_bit(router):
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, capacity_factor=0.5,
                            vocab_size=40, shuffle=False)).train()
    with torch.no_grad():
        layer.experts.w2.normal_()  # Base Layers' zero-initialised output would hide differences
    x = torch.randn(37, 8)
    ids = torch.randint(0, 40, (37,))
    results = []
    for step in (layer, lambda x, ids: _former_route_and_compute(layer, x, ids)):
        xi = x.clone().requires_grad_()
        layer.zero_grad()
        torch.manual_seed(1)  # GShard's Gumbel noise
        y = step(xi, ids)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
    if router in ("switch", "gshard"):
        assert (layer.route(x).experts_SK == -1).any()  # capacity 0.5: slots were dropped
    for new, old in zip(*results):
        assert torch.equal(new, old)


def test_fault_records_against_a_direct_count():
    scores = torch.randn(32, 4)
    scores[5, 1] = float("nan")
    scores[9] = float("inf")
    scores[20, 2] = float("-inf")
    record = nonfinite_fault(scores).tolist()
    assert len(record) == FAULT_WIDTH and record == [1, 3, 32, 1, 4, 1, 5]
    assert nonfinite_fault(scores, allow_neg_inf=True).tolist() == [1, 2, 32, 1, 4, 1, 5]
    assert nonfinite_fault(torch.randn(8, 4)).tolist() == [0, 0, 8, 0, 0, 0, 8]
    assert hash_fault(torch.tensor([3, 9, 0]), 10).tolist()[:4] == [0, 0, 9, 10]
    assert hash_fault(torch.tensor([3, 12, -1]), 10).tolist()[:4] == [2, -1, 12, 10]
    assert routing_error([[0] * FAULT_WIDTH] * 2, "layer") is None
    two = routing_error([[0] * FAULT_WIDTH, record, record], "layers.3 (TMoE)", ranks=[4, 5, 6])
    assert isinstance(two, NonFiniteScoresError)
    assert str(two).startswith("layers.3 (TMoE): router scores are not finite in 3 of 32 rows (first: row 5;")
    assert str(two).endswith("[seen on ranks 5, 6 (the figures are rank 5's); every rank of the expert-parallel "
                             "group raises this error]")
    one = routing_error([record, [0] * FAULT_WIDTH], "x", ranks=[0, 1])
    assert str(one).endswith("[seen on rank 0; every rank of the expert-parallel group raises this error]")


@pytest.mark.parametrize("router", ["base", "switch", "gshard", "hash"])
def test_a_deferred_check_raises_what_the_router_raises_on_its_own(router):
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, vocab_size=10)).train()
    layer.layer_name = "layers.1.ffn (TMoE)"
    x, ids = torch.randn(12, 8), torch.randint(0, 10, (12,))
    if router == "hash":
        ids[4] = 17
    else:
        x[4, 0] = float("nan")
    with pytest.raises((NonFiniteScoresError, ValueError)) as own:
        layer.route(x, ids)  # read at once
    plan = layer.route(x, ids, defer_checks=True)
    assert isinstance(plan.fault, DeferredCheck)  # left for the dispatcher: a verdict, the record when asked
    assert plan.fault.flag().tolist() == [True] and plan.fault.record()[0] != 0
    with HostSyncCounter() as c, pytest.raises(type(own.value)) as deferred:
        layer(x, ids)  # read with the split sizes
    assert str(deferred.value) == str(own.value) and str(own.value).startswith("layers.1.ffn (TMoE): ")
    # the verdict read with the split sizes, then (on the fault path only) the record that words the error
    assert c.count == 2 or router == "base"  # base: plus its auction's checks


@pytest.mark.parametrize("name", ["sMLP-det", "sMLP-partial", "Base", "GShard", "HASH", "Switch"])
def test_a_training_forward_builds_a_fault_record_only_on_a_fault(name):
    """A router's check is a verdict of a few operators read with the counts (issue 47: the record's two dozen
    operators per layer and forward were built in every step); the record, whose figures the error states, is
    built only once a verdict shows a fault, and the error is the router's own."""
    from smlp.routing import plan as plan_module

    torch.manual_seed(0)
    model, x = LanguageModel(tiny_config(name)).train(), tokens()
    with mock.patch.object(plan_module, "nonfinite_fault", wraps=plan_module.nonfinite_fault) as nonfinite, \
            mock.patch.object(plan_module, "hash_fault", wraps=plan_module.hash_fault) as hashed:
        model(x)
        assert nonfinite.call_count == hashed.call_count == 0
        if name in ("HASH", "sMLP-det"):  # no scores: token ids always in the table / no router
            return
        _, module = [(n, m) for n, m in model.moe_modules() if getattr(m, "router", None) is not None][-1]
        router = module.router  # the sMoE's router weight, or a tMoE's router module
        if not isinstance(router, torch.nn.Parameter):
            router = router.centroids if hasattr(router, "centroids") else router.gate.weight
        with torch.no_grad():
            router[0, 0] = float("nan")
        with pytest.raises(NonFiniteScoresError, match="router scores are not finite"):
            model(x)
        assert nonfinite.call_count == 1


@pytest.mark.parametrize("router", ["base", "switch", "gshard", "hash"])
def test_a_decoding_step_raises_what_the_router_raises_on_its_own(router):
    """The cached decoding step reads the check's bare verdict with the experts and, on a fault, routes again
    reading the full check: the router's own error; without a fault the step gives the layer's forward."""
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, vocab_size=10)).eval()
    layer.layer_name = "layers.1.ffn (TMoE)"
    x, ids = torch.randn(1, 8), torch.randint(0, 10, (1,))
    with torch.no_grad():
        torch.testing.assert_close(layer.step(x, ids), layer(x, ids))  # one product against the tiled one
        if router == "hash":
            ids[0] = 17
        else:
            x[0, 0] = float("nan")
        with pytest.raises((NonFiniteScoresError, ValueError)) as own:
            layer.route(x, ids)
        with pytest.raises(type(own.value)) as step:
            layer.step(x, ids)
    assert str(step.value) == str(own.value) and str(own.value).startswith("layers.1.ffn (TMoE): ")


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators that reach the kernels (below autograd), by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_decoding_step_takes_its_experts_and_prices_as_prepared():
    """Cached decoding (issue 47): a tMoE step picks its expert's weights from views made once and routes by prices
    divided out once, so neither costs an operator per token (8 of the 33 of a Base Layers step before); the views
    and prices follow every change of the weights and buffers (in place, a load, a move), and the step equals the
    layer's forward."""
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router="base")).eval()
    with torch.no_grad():
        layer.experts.w2.normal_()
        layer.router.eval_prices.observe(torch.randn(4), rows=8)
        layer.router.eval_prices.fold(layer.router.eval_prices.pending_E1.clone())
    x = torch.randn(1, 8)
    with torch.no_grad():
        layer.step(x)  # prepares
        with _Ops() as ops:
            y = layer.step(x)
        assert not [n for n in ops.names if "select" in n or "unbind" in n or "div" in n or "clamp" in n], ops.names
        assert len(ops.names) <= 25, ops.names
        torch.testing.assert_close(y, layer(x))
        # an in-place update, a load, a move to another dtype, new prices: each reaches the next step
        layer.experts.w1.mul_(2)
        torch.testing.assert_close(layer.step(x), layer(x))
        state = {k: v * 3 if k.endswith("b2") or k.endswith("price_E") else v for k, v in layer.state_dict().items()}
        layer.load_state_dict(state)
        torch.testing.assert_close(layer.step(x), layer(x))
        layer.load_state_dict({k: v.clone() * 0.5 for k, v in state.items()}, assign=True)
        torch.testing.assert_close(layer.step(x), layer(x))
        layer.double()
        torch.testing.assert_close(layer.step(x.double()), layer(x.double()))
        layer.router.eval_prices.price_E.mul_(-1)
        assert torch.equal(layer.router.eval_prices.prices(),
                           layer.router.eval_prices.price_E / layer.router.eval_prices.price_weight.clamp(min=1e-12))
        torch.testing.assert_close(layer.step(x.double()), layer(x.double()))


def test_standalone_routers_still_raise_at_once():
    with pytest.raises(NonFiniteScoresError, match="base router: router scores are not finite in 32 of 32"):
        base_route(torch.full((32, 4), float("nan")))
    with pytest.raises(ValueError, match="hash table covers ids 0..4"):
        hash_route(torch.tensor([1, 5]), torch.arange(5))


# ---------------------------------------------------------------- all2all timing


class _FakeEvent:
    log: list = []

    def __init__(self, device=None, enable_timing=False):
        assert enable_timing and torch.device(device).type == "cuda"
        self.t = None

    def record(self, stream=None):
        self.t = len(self.log)
        self.log.append("record")

    def synchronize(self):
        self.log.append("wait")

    def elapsed_time(self, end):
        return 1000.0 * (end.t - self.t)  # milliseconds


def test_the_all2all_timer_is_off_by_default_and_never_synchronises(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the device was synchronised inside the forward")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch, "Event", _FakeEvent)
    _FakeEvent.log = []
    assert LocalDispatcher(4).timer.enabled is False
    off = CommTimer()
    with off(torch.device("cuda", 0)):
        pass
    assert off.records == [] and _FakeEvent.log == []

    timer = CommTimer(enabled=True)
    mark = timer.mark()
    for _ in range(2):
        with timer(torch.device("cuda", 0)):
            _FakeEvent.log.append("collective")
    assert _FakeEvent.log == ["record", "collective", "record"] * 2  # marks on the stream, no wait
    taken = timer.take(mark)
    assert timer.records == [] and len(taken.records) == 2
    assert taken.seconds == pytest.approx(2 * 2.0)  # read afterwards: waits for the end events
    assert _FakeEvent.log.count("wait") == 2

    cpu = CommTimer(enabled=True)
    with cpu(torch.device("cpu")):
        pass
    assert len(cpu.records) == 1 and isinstance(cpu.records[0], float) and cpu.seconds >= 0.0


def test_the_criterion_logs_tensors_and_the_all2all_time_only_when_asked(monkeypatch):
    from tiny_steps import criterion, fairseq_model, lm_sample

    torch.manual_seed(0)
    core = LanguageModel(tiny_config("Switch")).train()
    model, dictionary = fairseq_model(core)
    sample = lm_sample(tokens(), dictionary.pad())
    _, _, log = criterion(dictionary)(model, sample)
    assert not any(k.startswith("a2a_ms_") for k in log)
    loads = {k: v for k, v in log.items() if k.startswith("moe_load_")}
    assert len(loads) == 2 and all(torch.is_tensor(v) for v in loads.values())
    assert torch.is_tensor(log["aux_loss"]) and log["aux_count"] == 1 and torch.is_tensor(log["z_loss"])
    for _, module in core.moe_modules():  # the per-expert counts, summed by fairseq over ranks
        key = f"{_.split('.')[1]}_{_.split('.')[-1]}"
        assert loads[f"moe_load_{key}"].tolist() == module.load_E.tolist()
        assert torch.is_tensor(log[f"moe_drop_{key}"]) and log[f"moe_slots_{key}"] == module.slots > 0
    crit = criterion(dictionary)
    crit.log_a2a_time = True
    _, _, log = crit(model, sample)
    assert core.dispatcher.timer.enabled
    assert sorted(k for k in log if k.startswith("a2a_ms_")) == ["a2a_ms_1_ffn", "a2a_ms_3_ffn"]


@pytest.mark.parametrize("break_mode", ["none", "complete"])  # "eos" fails in fairseq on numpy 2
def test_the_batch_token_count_the_criterion_reads_is_the_count_of_targets(tiny_lm_data, break_mode):
    """fairseq's collater counts `ntokens` on the host; it equals the non-padding targets of every
    batch (padded ones included), so the criterion need not count them on the device."""
    from fairseq_plugins.criterion import predicted_tokens
    from test_fairseq import build_model

    _, task = build_model(tiny_lm_data, "gmlp_lm_tiny", ["--sample-break-mode", break_mode])
    task.load_dataset("valid")
    batches = task.get_batch_iterator(task.dataset("valid"), max_sentences=8).next_epoch_itr(shuffle=False)
    pad = task.target_dictionary.pad()
    padded = 0
    for sample in batches:
        target = sample["target"]
        padded += int((target == pad).any())
        assert sample["ntokens"] == int((target != pad).sum())
        for start in (0, 6):
            masked = target.clone()
            masked[:, :start] = pad
            assert predicted_tokens(sample, masked, start, pad) == int((masked != pad).sum())
    assert padded > 0  # padded batches were among them (the last one with break mode none)
