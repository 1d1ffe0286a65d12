"""Half precision in the core and in the fairseq patches, one process (plus one 2-rank norm test).

References: the fp32 model with the same weights (every family, forward and backward), fp64 on the
same rounded inputs (HyperMixing), hand computations (the gradient norm with experts, one SGD step
under AMP), and fairseq's own per-parameter FP16 optimizer (its flat buffer on CPU).
"""
from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fairseq_helpers import PLUGINS
from smlp.config import SGUConfig, TMoEConfig
from smlp.expert_data_parallel import grad_norm_with_experts
from smlp.experts import SpatialExperts
from smlp.gmlp import SpatialGatingUnit
from smlp.hypermixer import hypermixing
from smlp.lm import LanguageModel, LMConfig
from smlp.moe import TMoE
from smlp.routing.logits import router_logits

HALF = (torch.bfloat16, torch.float16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------- spatial term at gMLP's init


@pytest.mark.parametrize("dtype", HALF)
def test_sgu_spatial_term_survives_half_precision_at_init(dtype):
    """T = 1024 (the paper's): W ~ U(+-1e-3/T) makes W z ~1e-5, which 1 + W z rounds away in bf16 and
    fp16 (relative error 100%). The SGU keeps W z + (b - 1) apart: < 10% (bf16 ~0.3%, fp16 ~3%: about
    3% of fp16's initial weights are subnormal)."""
    torch.manual_seed(0)
    sgu = SpatialGatingUnit(SGUConfig(dim=32, seq_len=1024))
    z = torch.randn(2, 1024, 32)
    with torch.no_grad():
        ref = sgu.proj(sgu.norm(z.chunk(2, -1)[1]))  # W v + (b - 1) in fp32; b = 1
        half = sgu.to(dtype)
        got = half.proj(half.norm(z.to(dtype).chunk(2, -1)[1]))
        out = half(z.to(dtype))
    assert got.dtype == dtype
    assert ref.abs().max() < 1e-3  # the spatial term at init, not the gate
    assert _rel(got, ref) < 0.10, _rel(got, ref)
    # the output is z1 + z1 * (spatial term): the part added to z1 is that term times z1
    z1 = z.to(dtype).chunk(2, -1)[0]
    assert torch.equal(out, z1 + z1 * got)


@pytest.mark.parametrize("dtype", HALF)
def test_smoe_spatial_experts_keep_their_spatial_term_in_half_precision(dtype):
    torch.manual_seed(0)
    experts = SpatialExperts(2, 1024)
    x = torch.randn(6, 1024)
    with torch.no_grad():
        ref = experts(x, [3, 3])
        got = experts.to(dtype)(x.to(dtype), [3, 3])
    assert ref.abs().max() < 1e-3
    assert _rel(got, ref) < 0.10, _rel(got, ref)


# ---------------------------------------------------------------- the gate bias in half-precision weights

# trained gate biases b = 1 + offset with offsets of a few 1e-3 (what a few hundred updates move them)
OFFSETS = torch.linspace(-3e-3, 3e-3, 12)


def _old_format_state(module, prefix: str, offsets: torch.Tensor) -> dict:
    """module's state in the format before issue 28, which stored the gate bias b itself under `bias`."""
    state = {k: v.clone() for k, v in module.state_dict().items() if not k.endswith("bias_offset")}
    state[prefix + "weight"] = torch.zeros_like(state[prefix + "weight"])  # the gate is then b - 1 alone
    state[prefix + "bias"] = (1 + offsets).expand(state[prefix + "weight"].shape[:2]).clone()
    return state


@pytest.mark.parametrize("dtype", HALF)
def test_the_gate_bias_keeps_its_offset_from_one_in_half_precision_weights(dtype):
    """Stored as b, --bf16 weights hold b - 1 only in steps of 2^-7 (fp16: 2^-10): every offset of
    +-3e-3 here became 0 or +-2^-7 in bf16 (relative error ~100%, issue 28). Stored as b - 1 it keeps the
    dtype's relative precision. Loaded from the older format (b), as old checkpoints are."""
    sgu = SpatialGatingUnit(SGUConfig(dim=16, seq_len=12))
    experts = SpatialExperts(2, 12)
    sgu.load_state_dict(_old_format_state(sgu, "proj.", OFFSETS))
    experts.load_state_dict(_old_format_state(experts, "", OFFSETS))
    v = torch.randn(2, 12, 8)
    with torch.no_grad():
        gate_dev = sgu.to(dtype).proj(v.to(dtype))  # W v + (b - 1) with W = 0
        rows_dev = experts.to(dtype)(torch.randn(4, 12, dtype=dtype), [2, 2])
    want = OFFSETS[None, :, None].expand(2, 12, 8)
    assert _rel(gate_dev, want) < torch.finfo(dtype).eps, _rel(gate_dev, want)
    assert _rel(rows_dev, OFFSETS.expand(4, 12)) < torch.finfo(dtype).eps, _rel(rows_dev, OFFSETS.expand(4, 12))


def test_an_older_checkpoint_loads_with_its_gate_biases_converted():
    """Every spatial gate of a model (dense SGUs, sMoE experts) loads from a state that stored b, strictly,
    to b - 1 exactly, and computes what the model with those weights computes."""
    torch.manual_seed(0)
    cfg = LMConfig(family="smlp", vocab_size=30, d_model=16, d_ffn=32, seq_len=12, dense_layers=1,
                   sparse_layers=1, num_experts=2)
    model = LanguageModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias_offset"):
                p.copy_((1 + torch.randn(p.shape) * 1e-2) - 1)  # offsets an fp32 b = 1 + offset holds exactly
    old = {(k[:-len("_offset")] if k.endswith("bias_offset") else k): (v + 1 if k.endswith("bias_offset") else v)
           for k, v in model.state_dict().items()}
    assert {"layers.0.sgu.proj.bias", "layers.1.smoe.experts.bias"} <= set(old)
    loaded = LanguageModel(cfg)
    loaded.load_state_dict(old)  # strict: no missing or unexpected key
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randint(4, 30, (2, 12))
    assert torch.equal(loaded(x), model(x))


# ---------------------------------------------------------------- routers in fp32


@pytest.mark.parametrize("autocast", [False, True])
def test_router_logits_are_the_fp32_product_of_the_upcast_inputs(autocast):
    torch.manual_seed(0)
    x, w = torch.randn(16, 8).bfloat16(), torch.randn(8, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, x.float() @ w.float())


@pytest.mark.parametrize("router", ["switch", "gshard", "base"])
def test_a_half_precision_tmoe_routes_on_fp32_logits(monkeypatch, router):
    """The layer's gate projection goes through router_logits; the plan's weights and aux loss are fp32."""
    import smlp.routing.logits as routers  # the router logits, which the registry's route functions call

    calls = []

    def recording(x, w):
        out = router_logits(x, w)
        calls.append((x, w, out))
        return out

    monkeypatch.setattr(routers, "router_logits", recording)
    torch.manual_seed(0)
    layer = TMoE(TMoEConfig(d_model=8, d_ffn=16, num_experts=4, router=router, shuffle=False)).to(torch.bfloat16)
    x = torch.randn(32, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = layer.route(x)
    (x_seen, w_seen, logits), = calls
    assert torch.equal(x_seen, x) and w_seen.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, x.float() @ w_seen.float())
    assert plan.weights_SK.dtype == torch.float32
    if router != "base":
        assert plan.aux_loss.dtype == torch.float32


# ---------------------------------------------------------------- HyperMixing accumulators


def test_hypermixing_accumulates_half_inputs_in_fp32():
    """n = 1024 > 256 (bf16's arange is wrong past 256). Reference: fp64 on the same bf16 inputs. Prefix
    sums in bf16 gave 0.7% (3.8% at the worst position) here; fp32 accumulation leaves the output's rounding."""
    torch.manual_seed(0)
    n, R, C = 1024, 8, 16
    u, v, w = (torch.randn(2, n, k).bfloat16().requires_grad_(True) for k in (R, C, R))
    ref_in = [t.detach().double().requires_grad_(True) for t in (u, v, w)]
    y, y_ref = hypermixing(u, v, w), hypermixing(*ref_in)
    assert y.dtype == torch.bfloat16
    worst = float(((y.double() - y_ref).norm(dim=-1) / y_ref.norm(dim=-1)).max())
    assert _rel(y, y_ref) < 4e-3 and worst < 8e-3, (_rel(y, y_ref), worst)
    g = torch.randn_like(y_ref)
    y.backward(g.bfloat16())
    y_ref.backward(g)
    for t, r in zip((u, v, w), ref_in):
        assert t.grad.dtype == torch.bfloat16 and _rel(t.grad, r.grad) < 1e-2, _rel(t.grad, r.grad)


# ---------------------------------------------------------------- every family in half precision

FAMILIES = {
    "smlp_deterministic": dict(family="smlp", dense_layers=1, sparse_layers=1, num_experts=2),
    "smlp_partial": dict(family="smlp", dense_layers=1, sparse_layers=1, num_experts=2, smoe_routing="partial"),
    "gmlp_2heads": dict(family="gmlp", dense_layers=2, heads=2),
    "hypermixer": dict(family="gmlp", dense_layers=2, token_mixer="hypermixer"),
    "ninformer": dict(family="gmlp", dense_layers=2, token_mixer="ninformer"),
    "transformer": dict(family="transformer", dense_layers=2, heads=2),
    "switch": dict(family="transformer", dense_layers=1, sparse_layers=1, heads=2, num_experts=2, moe_router="switch"),
    "gshard": dict(family="transformer", dense_layers=1, sparse_layers=1, heads=2, num_experts=2, moe_router="gshard"),
    "base": dict(family="transformer", dense_layers=1, sparse_layers=1, heads=2, num_experts=2, moe_router="base"),
    "hash": dict(family="transformer", dense_layers=1, sparse_layers=1, heads=2, num_experts=2, moe_router="hash"),
}
# relative to fp32 with the same weights and tokens (loss; logits and the concatenated gradient, 2-norm).
# Worst over the families, measured here: bf16 7.3e-4 / 7.2e-3 / 1.0e-2, fp16 8.7e-5 / 2.9e-3 / 4.3e-3,
# amp (fp16 autocast on CPU) 6.4e-5 / 8.4e-4 / 7.4e-4. The bounds leave 3-6x.
BOUNDS = {"bf16": (3e-3, 2e-2, 3e-2), "fp16": (5e-4, 1e-2, 1.5e-2), "amp": (3e-4, 4e-3, 4e-3)}


def _loss_and_grads(model, tokens, autocast=False):
    torch.manual_seed(1)  # GShard's Gumbel noise
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
        aux = model.aux_loss()
        if aux is not None:
            loss = loss + 0.01 * aux
    loss.backward()
    grads = torch.cat([p.grad.double().reshape(-1) for p in model.parameters() if p.grad is not None])
    return loss.detach(), logits.detach(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_finite_and_close_to_fp32_in_half_precision(family):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=100, d_model=32, d_ffn=64, seq_len=64, **FAMILIES[family])
    model = LanguageModel(cfg)
    tokens = torch.randint(4, 100, (4, 64))
    loss, logits, grads = _loss_and_grads(model, tokens)
    for mode, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("amp", None)):
        twin = LanguageModel(cfg)
        twin.load_state_dict(model.state_dict())
        if dtype is not None:
            twin = twin.to(dtype)
        h_loss, h_logits, h_grads = _loss_and_grads(twin, tokens, autocast=dtype is None)
        assert h_logits.dtype == (dtype or torch.float16), (mode, h_logits.dtype)
        assert bool(torch.isfinite(h_logits).all() and torch.isfinite(h_grads).all()), mode
        errors = (abs(float(h_loss) - float(loss)) / float(loss), _rel(h_logits, logits), _rel(h_grads, grads))
        assert all(e < b for e, b in zip(errors, BOUNDS[mode])), (family, mode, errors, BOUNDS[mode])


# ---------------------------------------------------------------- the whole model's gradient norm


def test_grad_norm_with_experts_on_one_process_is_the_norm_of_every_gradient():
    shared, experts = torch.tensor([3.0, 4.0]), [torch.tensor([12.0]), torch.tensor([[0.0, 84.0]])]
    norm = grad_norm_with_experts(torch.linalg.vector_norm(shared), experts)
    assert float(norm) == pytest.approx(85.0)  # sqrt(9 + 16 + 144 + 7056)
    assert float(grad_norm_with_experts(torch.tensor(5.0), [])) == 5.0
    assert float(grad_norm_with_experts(torch.tensor(5.0), [torch.tensor([float("nan")])])) != 5.0


def _norm_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    shared = torch.tensor(5.0)  # every rank holds the same shared gradients (after legacy_ddp)
    own = [torch.tensor([12.0 * (rank + 1)])]  # rank 0: 12, rank 1: 24
    replica = [torch.tensor([12.0])]  # expert-data parallelism: both ranks hold the same expert
    inf = [torch.tensor([float("inf") if rank == 1 else 1.0])]
    results = [float(grad_norm_with_experts(shared, own)), float(grad_norm_with_experts(shared, replica, replicas=2)),
               float(grad_norm_with_experts(shared, inf))]
    from fake_nccl import pretend_nccl  # NCCL takes CUDA tensors only: the scalar must move to the device

    with pretend_nccl() as (_, calls):
        results.append(float(grad_norm_with_experts(shared.to("cuda"), [g.to("cuda") for g in own])))
        results.append(float(grad_norm_with_experts(shared, own)))  # host gradients (a --cpu trainer) too
    results.append(calls)
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_grad_norm_with_experts_counts_each_expert_once_on_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_norm_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True,
                start_method="forkserver")
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    assert results[0] == results[1]
    own, replicated, overflow, own_nccl, own_nccl_host, calls = results[0]
    assert own == pytest.approx((25 + 144 + 576) ** 0.5)  # shared once, each rank's expert once
    assert own_nccl == own_nccl_host == own and calls == [("all_reduce", 1)] * 2  # one collective, on the device
    assert replicated == pytest.approx(13.0)  # sqrt(25 + 144): the replicated expert counted once
    assert overflow == float("inf")  # rank 1's inf is seen by rank 0 too


# ---------------------------------------------------------------- fairseq patches, one process


def _cfg(*flags: str, arch: str = "smlp_lm_tiny"):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = ["unused-data", "--user-dir", PLUGINS, "--arch", arch, "--task", "language_modeling", "--cpu",
            "--optimizer", "adam", "--lr", "1e-3", *flags]
    namespace = options.parse_args_and_arch(options.get_training_parser(), input_args=args)
    return convert_namespace_to_omegaconf(namespace), args


def test_bf16_no_longer_implies_a_tpu_unless_asked_for():
    from fairseq_plugins.precision import bf16_without_tpu

    cfg, argv = _cfg("--bf16")
    assert cfg.common.tpu  # fairseq's options.py: --bf16 sets --tpu
    assert bf16_without_tpu(cfg, argv=argv)
    assert not cfg.common.tpu and not cfg.task.tpu and not cfg.optimizer.tpu and not cfg.distributed_training.tpu
    cfg, argv = _cfg("--bf16", "--tpu")
    assert not bf16_without_tpu(cfg, argv=argv) and cfg.common.tpu  # a TPU run stays one
    cfg, argv = _cfg("--fp16")
    assert not bf16_without_tpu(cfg, argv=argv) and not cfg.common.tpu
    cfg, argv = _cfg("--amp", "--bf16")
    with pytest.raises(ValueError, match="Pass one of --amp, --bf16, --memory-efficient-bf16, --fp16"):
        bf16_without_tpu(cfg, argv=argv)


def test_fp16_flat_master_weights_work_on_cpu_as_the_per_parameter_ones():
    """A dense model keeps fairseq's flat fp32 buffer; on CPU it is keyed by the parameters' device (fairseq
    used torch.cuda.current_device()). One Adam step equals the per-parameter optimizer's, bitwise."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from fairseq_plugins.precision import prepare

    torch.manual_seed(0)
    weights = [torch.randn(5, 3), torch.randn(7)]
    runs = {}
    for flat in (True, False):
        cfg, _ = _cfg("--fp16", *([] if flat else ["--fp16-no-flatten-grads"]), arch="gmlp_lm_tiny")
        prepare(cfg)  # what a run does first (call_main, Trainer): the patches --fp16 needs off CUDA
        params = [torch.nn.Parameter(w.clone().half()) for w in weights]
        opt = FP16Optimizer.build_optimizer(cfg, params)
        assert opt.has_flat_params == flat
        opt.zero_grad()
        opt.backward(sum((p.float() * (i + 1)).sum() for i, p in enumerate(params)))
        opt.multiply_grads(1.0)
        opt.clip_grad_norm(0.0)
        opt.step()
        runs[flat] = [p.detach().clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
    assert not torch.equal(runs[True][0], weights[0].half())


def test_amp_unscales_once_and_steps_on_cpu():
    """SGD with lr 1 on loss = sum(w * x): w must become w - x. fairseq unscaled the gradients twice (once for
    self.optimizer, once more when stepping fp32_optimizer, another object to the scaler): w - x / 128."""
    from fairseq.optim.amp_optimizer import AMPOptimizer

    from fairseq_plugins.precision import prepare

    cfg, _ = _cfg("--amp", "--optimizer", "sgd", "--lr", "1.0", "--momentum", "0")
    prepare(cfg)
    w = torch.nn.Parameter(torch.ones(3))
    x = torch.tensor([0.5, -2.0, 3.0])
    opt = AMPOptimizer.build_optimizer(cfg, [w])
    assert opt.scaler.is_enabled() and opt.scaler.get_scale() == cfg.common.fp16_init_scale
    opt.backward((w * x).sum())
    assert torch.equal(w.grad, x * cfg.common.fp16_init_scale)  # scaled loss
    norm = opt.clip_grad_norm(0.0)
    assert float(norm) == pytest.approx(float(x.norm()))
    opt.step()
    assert torch.equal(w.detach(), torch.ones(3) - x)


def test_amp_saves_and_restores_its_scaler_state():
    """The GradScaler's scale and growth tracker travel with the optimizer's state (fairseq saved none: every
    resume restarted at --fp16-init-scale)."""
    from fairseq.optim.amp_optimizer import AMPOptimizer

    from fairseq_plugins.precision import AMP_SCALER_KEY, prepare

    cfg, _ = _cfg("--amp", "--optimizer", "sgd", "--lr", "0.1", "--amp-scale-window", "1")
    prepare(cfg)
    w = torch.nn.Parameter(torch.ones(3))
    opt = AMPOptimizer.build_optimizer(cfg, [w])
    for _ in range(3):  # three clean steps: the scale doubles after each (growth interval 1)
        opt.backward((w * 2).sum())
        opt.clip_grad_norm(0.0)
        opt.step()
        opt.zero_grad()
    scale = opt.scaler.get_scale()
    assert scale == cfg.common.fp16_init_scale * 8
    state = opt.state_dict()
    assert state[AMP_SCALER_KEY]["scale"] == scale and "state" in state and "param_groups" in state
    resumed = AMPOptimizer.build_optimizer(cfg, [torch.nn.Parameter(torch.ones(3))])
    assert resumed.scaler.get_scale() == cfg.common.fp16_init_scale
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == scale and resumed.scaler.state_dict() == opt.scaler.state_dict()
    assert AMP_SCALER_KEY in state  # loading did not consume the caller's state


def test_precision_patches_install_only_what_a_run_needs_and_once():
    from fairseq import utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import FP16Optimizer, _FP16OptimizerMixin
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer

    from fairseq_plugins import precision

    def targets():
        return (distributed_utils.call_main, Trainer.__init__, Trainer.clip_grad_norm, utils.clip_grad_norm_,
                FP16Optimizer.__dict__["build_optimizer"], _FP16OptimizerMixin.__dict__["build_fp32_params"],
                Trainer.train_step, AMPOptimizer.__init__, AMPOptimizer.state_dict, FairseqTask.train_step)

    def marked(t):  # ours, or wrapped by another patch of the list since (call_main)
        return precision._patched(getattr(t, "__func__", t))

    before = targets()
    precision.install()
    assert targets() == before and all(marked(t) for t in before[:4])  # at import: the wrappers only
    assert precision.prepare(_cfg()[0]) == []  # fp32: nothing more
    assert len(precision.prepare(_cfg("--fp16")[0])) == 3  # off CUDA: master weights, flat buffer, overflow
    assert precision.prepare(_cfg("--memory-efficient-bf16")[0]) == []
    assert len(precision.prepare(_cfg("--amp")[0])) == 2  # the scaler, and autocast off CUDA
    after = targets()
    assert all(marked(t) for t in after)
    for flags in ((), ("--fp16",), ("--amp",), ("--bf16",)):
        precision.prepare(_cfg(*flags)[0])
    precision.install()
    assert targets() == after
    # train_step is wrapped, not recompiled from fairseq's source: the code is ours, the original kept
    assert Trainer.train_step.__code__.co_filename == precision.__file__
    assert inspect.unwrap(Trainer.train_step).__code__.co_filename.endswith("fairseq/trainer.py")


def _unpatched(monkeypatch, cls, *names):
    """cls's attributes as fairseq (or an earlier wrapper) defines them, for this test only."""
    for name in names:
        attr = cls.__dict__[name]
        fn = getattr(attr, "__func__", attr)
        while getattr(fn, "_smlp_precision", False):
            fn = fn.__wrapped__
        monkeypatch.setattr(cls, name, classmethod(fn) if isinstance(attr, classmethod) else fn)


def test_a_fairseq_that_differs_stops_only_the_runs_that_need_the_patch(monkeypatch):
    """A planted difference in the fairseq code a patch replaces (a cluster's own fairseq build): importing
    the plugins and fp32 runs go on; a run with the flag that needs the patch stops before any work, with
    the flag, the installed fairseq version and the version the patch targets. Before issue 28 the import
    itself raised FairseqChanged, so fp32 training and evaluation broke too."""
    import fairseq
    from fairseq.distributed import utils as distributed_utils
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    from fairseq_plugins import precision

    _unpatched(monkeypatch, AMPOptimizer, "__init__", "clip_grad_norm", "state_dict", "load_state_dict")

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):  # the planted difference
        return self.fp32_optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)

    monkeypatch.setattr(AMPOptimizer, "clip_grad_norm", clip_grad_norm)
    precision.install()  # the plugins' import
    assert precision.prepare(_cfg()[0]) == []
    with pytest.raises(precision.FairseqChanged) as stopped:
        precision.prepare(_cfg("--amp")[0])
    message = str(stopped.value)
    assert message.startswith(f"--amp cannot run with the installed fairseq {fairseq.__version__}: ")
    assert "AMPOptimizer.clip_grad_norm is not fairseq-fixed 0.12.3.1's" in message
    assert "Runs without --amp (fp32) are not affected" in message
    assert AMPOptimizer.clip_grad_norm is clip_grad_norm  # nothing replaced

    work = []
    with pytest.raises(precision.FairseqChanged, match="--amp cannot run"):  # before the program's main
        distributed_utils.call_main(_cfg("--amp")[0], lambda cfg, **kw: work.append(cfg))
    assert work == []
    # fairseq installed without its source: the patch that checks it cannot apply either
    _unpatched(monkeypatch, _FP16OptimizerMixin, "build_fp32_params")
    monkeypatch.setattr(precision.inspect, "getsource", lambda fn: (_ for _ in ()).throw(OSError("no source")))
    with pytest.raises(precision.FairseqChanged, match=r"--fp16 cannot run .* installed without its source"):
        precision.prepare(_cfg("--fp16")[0])
    assert precision.prepare(_cfg("--bf16", "--memory-efficient-bf16")[0]) == []
