"""Mixed precision (--fp16, --bf16, --amp, --memory-efficient-fp16/-bf16) for expert-parallel models,
and the whole model's gradient norm in every precision.

fairseq 0.12 (fairseq-fixed 0.12.3.1, the version these patches target) trains half precision on one
device or on data-parallel ranks that hold the same parameters. With experts (`param.expert =
True`, one set per rank) and on CPU it breaks in the ways listed below.

When they are installed: importing the plugins installs only wrappers that cannot fail
and change nothing by themselves: `fairseq.distributed.utils.call_main` and `Trainer.__init__`,
which call `prepare(cfg)` once the run's configuration is known, and the gradient norm (patch 4,
which every precision uses). `prepare` installs the patches that configuration needs, each only
where it is needed: 2 and 5 with their precision flag, 3 and 6 only off CUDA. Patches 2 and 5
replace fairseq code they were written against and first check its source; where it differs (a
cluster's own fairseq build) or is not installed, the run that needs the patch stops in `prepare`,
before any work, with `FairseqChanged` naming the flag, the installed fairseq version and the
target, while fp32 runs (and the runs of other flags) go on. Nothing is recompiled from fairseq's
source: every patch wraps or replaces an attribute and keeps the original as `__wrapped__`, so an
earlier wrapper of the same attribute keeps working. Each is idempotent.

1. `--bf16` without a TPU (`fairseq.distributed.utils.call_main`). `fairseq.options` turns
   --tpu on whenever --bf16 is given; the trainer then asks torch_xla for a device and fails
   ("'NoneType' object has no attribute 'xrt_world_size'"), on CPU and on a GPU without
   torch_xla alike. Unless --tpu is on the command line, the run is put back on its real
   device (one log line). --amp with --bf16 is refused here, before any work.
2. Flattened fp32 master weights (`FP16Optimizer.build_optimizer`, `build_fp32_params`; --fp16,
   --bf16). --fp16 copies every parameter into one flat fp32 tensor, which drops `param.expert`:
   the gradient norm then mixes each rank's own expert gradients into the "shared" norm, differs
   between ranks, and fairseq's "gradients are inconsistent between workers" check (CUDA only)
   stops training at the first update. A model with expert parameters gets per-parameter
   master weights instead (as --fp16-no-flatten-grads, one log line): the same memory, and the
   optimizer state stays per parameter, which resuming on another world size (elastic.py) and
   --zero-sharding os need. Off CUDA, a flat buffer (a dense model with --fp16 on CPU) is built
   on the parameters' device instead of `torch.cuda.current_device()` (that part checks fairseq's
   source, and only off CUDA).
3. Gradient overflow off CUDA (`Trainer.train_step`; --fp16, --memory-efficient-fp16, off CUDA
   only). fairseq's overflow handler creates the logged norm with `torch.tensor(0.0).cuda()`,
   which raises off CUDA. train_step is wrapped: when that expression fails while an
   OverflowError is being handled, the wrapper finishes fairseq's overflow branch (gradients
   zeroed, no update, the loss scale logged) as fairseq does after that line.
4. The whole model's gradient norm (`Trainer.clip_grad_norm`, `fairseq.utils.clip_grad_norm_`;
   every precision, fp32 included). fairseq leaves expert gradients out of the norm, so its
   clip coefficient scaled the experts by a norm that did not count them, `gnorm` meant
   something else in fp32 than under --bf16, and an inf or NaN in one expert's gradient was
   applied as an update (the weight became NaN); it is also the fp16 loss scaler's only overflow
   test. For models with experts, the norm that is clipped, logged and tested is
   `smlp.expert_data_parallel.grad_norm_with_experts`: shared gradients once, every expert once
   (replicas of expert-data parallelism once), one all-reduce of a scalar on the backend's
   device, the same on every rank. A non-finite gradient anywhere (any rank, any expert) is then
   seen by every rank: with a loss scale all skip the step and lower the scale together; in fp32
   and with --bf16 every rank stops together ("gradients are Nan/Inf"), as fairseq does for a
   non-finite norm (fairseq's comparison of the ranks' norms, `Trainer._check_grad_norms`, is not
   asked to compare equal non-finite norms: inf - inf would read as "gradients are inconsistent
   between workers").
5. AMP's GradScaler (`AMPOptimizer`; --amp). (a) It is built as `torch.amp.GradScaler(device)`
   on the parameters' device type: on CUDA the same scaler as fairseq's
   `torch.cuda.amp.GradScaler`; on CPU an enabled one (fairseq's is disabled there, so --amp was
   plain fp32). (b) fairseq unscales the gradients of `self.optimizer` and then steps
   `self.fp32_optimizer`, another object to the scaler, which therefore unscales the same
   gradients a second time; here the step's object is unscaled, once. (c) The scaler's skip
   decision (found_inf) is set from the whole-model norm of patch 4, so ranks do not decide on
   their own experts (on GPUs an inf on one rank skipped the step there only, and the shared
   weights drifted apart). (d) --amp-scale-window sets the growth interval (fairseq passed
   --amp-init-scale). (e) The scaler's state (scale, growth tracker) is saved with the
   optimizer's and restored on resume: fairseq saved none, so every resume restarted at
   --fp16-init-scale. (f) fairseq counts the passes of an overflowed batch against
   --amp-batch-retries (`Trainer._amp_retries`) and resets the count only when it skips the
   batch: after a retry that succeeded, the next overflowed batch was skipped at once, and a
   resumed run (which starts at 0, the count is not saved) fed it again where the uninterrupted
   run had skipped it (found by `smlp-bench chaos --amp`). The count is reset after every batch
   (`Trainer.train_step`).
6. Autocast for --amp off CUDA (`FairseqTask.train_step`; off CUDA only): fairseq enters
   `torch.cuda.amp.autocast`, a no-op on CPU; on another device the forward runs under
   `torch.autocast(device, float16)`, so a CPU run exercises what --amp does on GPUs (fp16
   matmuls, fp32 routers and reductions, dynamic loss scaling).
"""
from __future__ import annotations

import inspect
import logging
import sys
import traceback

import torch

from smlp.expert_data_parallel import grad_norm_with_experts
from smlp.experts import is_expert

logger = logging.getLogger(__name__)

__all__ = ["FairseqChanged", "WholeModelGradNorm", "install", "prepare", "update_applied"]

FAIRSEQ_TARGET = "fairseq-fixed 0.12.3.1"
_MARK = "_smlp_precision"


def _patched(obj) -> bool:
    """Whether obj, or a function it wraps (another patch may wrap the same attribute since), is ours."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        if getattr(obj, _MARK, False):
            return True
        seen.add(id(obj))
        obj = getattr(obj, "__wrapped__", None)
    return False


def _mark(fn, original):
    setattr(fn, _MARK, True)
    fn.__wrapped__ = original
    return fn


class FairseqChanged(RuntimeError):
    """The fairseq code a patch replaces is not the code it was written for."""


def _source(fn) -> str | None:
    """fairseq's source of `fn` (wrappers unwrapped), or None where fairseq is installed without it."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _check_source(fn, expected: str, what: str) -> None:
    """FairseqChanged unless fairseq's source of `fn` contains `expected` (the code a patch replaces)."""
    source = _source(fn)
    if source is None:
        raise FairseqChanged(f"{what}: fairseq is installed without its source, which the patch checks")
    if expected not in source:
        raise FairseqChanged(f"{what} is not {FAIRSEQ_TARGET}'s (expected `{expected}`)")


def _fairseq_version() -> str:
    import fairseq

    return getattr(fairseq, "__version__", "unknown")


def _off_cuda(common) -> bool:
    return bool(getattr(common, "cpu", False)) or not torch.cuda.is_available()


def _flag(common) -> str:
    """The precision flag of a run, as typed (fairseq sets fp16 / bf16 for the memory-efficient forms too)."""
    for name in ("amp", "memory_efficient_fp16", "memory_efficient_bf16", "fp16", "bf16"):
        if getattr(common, name, False):
            return "--" + name.replace("_", "-")
    return "fp32"


# ------------------------------------------------------------------ 1. --bf16 without --tpu


def _tpu_on_command_line(argv: list[str]) -> bool:
    return any(a == "--tpu" for a in argv)


def bf16_without_tpu(cfg, argv: list[str] | None = None) -> bool:
    """Undo fairseq's --bf16 => --tpu unless --tpu was asked for; refuse --amp with --bf16. True if changed."""
    common = cfg.common
    if getattr(common, "amp", False) and getattr(common, "bf16", False):
        raise ValueError("--amp with --bf16 (or --memory-efficient-bf16) mixes two precisions: --amp trains fp32 "
                         "weights with fp16 autocast and loss scaling, --bf16 casts the model to bfloat16. Pass one "
                         "of --amp, --bf16, --memory-efficient-bf16, --fp16, --memory-efficient-fp16")
    argv = sys.argv[1:] if argv is None else argv
    if not (getattr(common, "bf16", False) and getattr(common, "tpu", False)) or _tpu_on_command_line(argv):
        return False
    from omegaconf import OmegaConf, open_dict

    for name in cfg.keys():  # task.tpu, optimizer.tpu, ... may hold a copy of common.tpu
        group = cfg.get(name)
        if name != "common" and OmegaConf.is_config(group) and "tpu" in group \
                and not OmegaConf.is_interpolation(group, "tpu") and group.tpu is True:
            with open_dict(group):
                group.tpu = False
    with open_dict(common):
        common.tpu = False
    device = "CPU" if common.cpu or not torch.cuda.is_available() else "GPU"
    logger.info("--bf16: training in bfloat16 on %s; fairseq 0.12 sets --tpu with --bf16, which this run did not "
                "ask for (pass --tpu to train on TPUs)", device)
    return True


def _install_call_main() -> None:
    from fairseq.distributed import utils as distributed_utils

    if _patched(distributed_utils.call_main):
        return
    original = distributed_utils.call_main

    def call_main(cfg, main, **kwargs):
        bf16_without_tpu(cfg)
        prepare(cfg)  # the patches this run needs, or a clear stop before any work
        return original(cfg, main, **kwargs)

    distributed_utils.call_main = _mark(call_main, original)


# ------------------------------------------------------------------ 2. fp32 master weights


def _install_fp16_master_weights() -> None:
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    if not _patched(FP16Optimizer.__dict__["build_optimizer"].__func__):
        original_build = FP16Optimizer.__dict__["build_optimizer"].__func__

        def build_optimizer(cls, cfg, params, **kwargs):
            params = list(params)
            experts = [p for p in params if is_expert(p)]
            common = cfg.common
            if experts and not getattr(common, "fp16_no_flatten_grads", False) and not getattr(common, "bf16", False):
                from omegaconf import open_dict

                with open_dict(common):
                    common.fp16_no_flatten_grads = True  # what this run does (also lets --zero-sharding os pass)
                logger.info("--fp16: %d expert parameter tensors would lose param.expert in fairseq's flattened "
                            "fp32 master copy; keeping per-parameter fp32 master weights instead (as "
                            "--fp16-no-flatten-grads: same memory, optimizer state per parameter)", len(experts))
            return original_build(cls, cfg, params, **kwargs)

        FP16Optimizer.build_optimizer = classmethod(_mark(build_optimizer, original_build))


def _install_fp32_flat_buffer_off_cuda() -> None:
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    if not _patched(_FP16OptimizerMixin.__dict__["build_fp32_params"].__func__):
        original_fp32 = _FP16OptimizerMixin.__dict__["build_fp32_params"].__func__
        _check_source(original_fp32, "torch.cuda.current_device()", "fairseq's build_fp32_params")

        def build_fp32_params(cls, args, params, flatten=True):
            pipeline = getattr(args, "pipeline_model_parallel", False) and getattr(args, "distributed_no_spawn", False)
            if not flatten or pipeline or not params or params[0].device.type == "cuda":
                return original_fp32(cls, args, params, flatten=flatten)
            # fairseq keys the flat buffer by torch.cuda.current_device(); the gradient sync looks it up
            # by p.device.index, which is None off CUDA: key it by the parameters' own device.
            total = sum(p.data.numel() for p in params)
            flat = params[0].new(0).float().new(total)
            offset = 0
            for p in params:
                flat[offset:offset + p.data.numel()].copy_(p.data.view(-1))
                offset += p.data.numel()
            flat = torch.nn.Parameter(flat)
            flat.grad = flat.data.new(total)
            return {params[0].device.index: flat}

        _FP16OptimizerMixin.build_fp32_params = classmethod(_mark(build_fp32_params, original_fp32))


# ------------------------------------------------------------------ 3. overflow off CUDA


def _overflow_buffer_failed(exc: BaseException, trainer_file: str) -> bool:
    """Whether `exc` is fairseq's `torch.tensor(0.0).cuda()` failing off CUDA: raised in Trainer.train_step
    while an OverflowError was being handled (its context), by the CUDA initialization."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    in_train_step = any(f.f_code.co_name == "train_step" and f.f_code.co_filename == trainer_file for f in frames)
    return isinstance(exc.__context__, OverflowError) and in_train_step and "cuda" in str(exc).lower()


def _install_overflow_off_cuda() -> None:
    from fairseq import trainer as trainer_module
    from fairseq.logging import metrics

    Trainer = trainer_module.Trainer
    if _patched(Trainer.train_step):
        return
    original = Trainer.train_step
    trainer_file = trainer_module.__file__

    def train_step(self, samples, raise_oom=False):
        if self.cuda:
            return original(self, samples, raise_oom)
        try:
            return original(self, samples, raise_oom)
        except (AssertionError, RuntimeError) as exc:
            if not _overflow_buffer_failed(exc, trainer_file):
                raise
        # the rest of fairseq's overflow branch after that line: the step is skipped, nothing is updated
        with metrics.aggregate("train"):
            self.zero_grad()
            if self.cfg.common.fp16 or self.cfg.common.amp:
                scaler = self.optimizer.scaler
                metrics.log_scalar("loss_scale", scaler.loss_scale if self.cfg.common.fp16 else scaler.get_scale(),
                                   priority=700, round=4, weight=0)
            metrics.log_stop_time("train_wall")
        return None

    Trainer.train_step = _mark(train_step, original)


# ------------------------------------------------------------------ 4. whole-model gradient norm


class WholeModelGradNorm:
    """Passed by the trainer as `aggregate_norm_fn`: tells `clip_grad_norm_` to include the experts.

    fairseq's optimizers hand `aggregate_norm_fn` through to `fairseq.utils.clip_grad_norm_`
    unchanged, whichever wrapper (FP16, memory-efficient, AMP) holds the gradients, so this
    object reaches the one place where the norm is computed.
    """

    def __init__(self, *, replicas: int = 1, group=None):
        self.replicas = replicas
        self.group = group

    def clip_(self, params, max_norm: float, shared_norm_fn) -> torch.Tensor:
        params = [p for p in params if p is not None and getattr(p, "grad", None) is not None]
        shared = [p for p in params if not is_expert(p)]
        experts = [p.grad.detach() for p in params if is_expert(p)]
        shared_norm = shared_norm_fn(shared, 0)  # fairseq's own norm (fused kernel where available)
        if not shared:
            shared_norm = torch.zeros((), device=experts[0].device if experts else "cpu")
        total = grad_norm_with_experts(shared_norm, experts, replicas=self.replicas, group=self.group)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total + 1e-6)).clamp_(max=1)
            torch._foreach_mul_([p.grad.detach() for p in params], clip_coef)
        return total

    def __call__(self, total_norm):  # fairseq's aggregate_norm_fn signature; clip_grad_norm_ never calls it
        raise RuntimeError("WholeModelGradNorm is read by the patched clip_grad_norm_, not called")


def whole_model_norm_for(trainer) -> WholeModelGradNorm | None:
    """The norm aggregator a trainer of an expert model uses, in every precision; None: fairseq's norm.

    Decided once per trainer (the model's parameters do not change). The group is the default one:
    the experts are spread over all W ranks (smlp.expert_data_parallel.ExpertDataLayout)."""
    if "_smlp_whole_model_norm" not in trainer.__dict__:
        aggregate = None
        model = trainer.get_model()
        if not trainer.is_fsdp and any(map(is_expert, model.parameters())):
            layout = getattr(model, "expert_layout", None)
            aggregate = WholeModelGradNorm(replicas=layout.replicas if layout is not None else 1, group=None)
        trainer._smlp_whole_model_norm = aggregate
    return trainer._smlp_whole_model_norm


def _install_grad_norm() -> None:
    from fairseq import trainer as trainer_module
    from fairseq import utils

    if not _patched(utils.clip_grad_norm_):
        original_clip = utils.clip_grad_norm_

        def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
            if isinstance(aggregate_norm_fn, WholeModelGradNorm):
                if isinstance(params, torch.Tensor):
                    params = [params]
                return aggregate_norm_fn.clip_(list(params), max_norm, original_clip)
            return original_clip(params, max_norm, aggregate_norm_fn)

        utils.clip_grad_norm_ = _mark(clip_grad_norm_, original_clip)

    Trainer = trainer_module.Trainer
    if not _patched(Trainer.clip_grad_norm):
        original = Trainer.clip_grad_norm

        def clip_grad_norm(self, clip_norm):
            aggregate = whole_model_norm_for(self)
            if aggregate is None:
                return original(self, clip_norm)
            return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=aggregate)

        Trainer.clip_grad_norm = _mark(clip_grad_norm, original)

    if not _patched(Trainer._check_grad_norms):
        original_check = Trainer._check_grad_norms

        def _check_grad_norms(self, grad_norm):
            if whole_model_norm_for(self) is not None and not bool(torch.isfinite(grad_norm).all()):
                # all-reduced: every rank holds the same non-finite norm, which fairseq's comparison of the
                # ranks' norms (inf - inf) would report as "gradients are inconsistent between workers";
                # the trainer raises "gradients are Nan/Inf" (or skips the step under --amp) right after
                return None
            return original_check(self, grad_norm)

        Trainer._check_grad_norms = _mark(_check_grad_norms, original_check)


# ------------------------------------------------------------------ 5. AMP's GradScaler


def _device_type(params) -> str:
    for p in params:
        return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def agree_on_overflow(scaler, optimizer, grad_norm: torch.Tensor) -> None:
    """Set the scaler's skip decision for `optimizer` from the whole-model norm (the same on every rank).

    GradScaler records found_inf per device from this rank's gradients only; with experts, ranks
    would then disagree. The norm includes every gradient, so "not finite" is the global answer.
    """
    state = scaler._per_optimizer_states.get(id(optimizer))
    found = state.get("found_inf_per_device") if state else None
    if found is None:
        raise FairseqChanged("torch's GradScaler keeps no found_inf for the optimizer after unscale_(): the "
                             "overflow agreement of fairseq_plugins.precision was written for torch 2.13")
    overflow = (~torch.isfinite(grad_norm.detach())).float()
    for t in found.values():
        t.copy_(overflow.to(t.device))


def update_applied(optimizer) -> torch.Tensor | None:
    """Whether the optimizer step about to run updates the model: None when it does for sure (fp32, --bf16, and
    --fp16, whose overflow is raised before the step); under --amp, where fairseq steps on an overflow too and
    the GradScaler skips the update, a 0-dim tensor on the device, 0 for a skip (`agree_on_overflow`'s decision,
    the same on every rank; read on the device, no host sync). Called before `optimizer.step()`."""
    scaler = getattr(optimizer, "_grad_scaler", None)
    inner = getattr(optimizer, "fp32_optimizer", None)
    if scaler is None or inner is None:
        return None
    state = scaler._per_optimizer_states.get(id(inner))
    found = state.get("found_inf_per_device") if state else None
    if not found:
        return None
    return (torch.stack([t.float().to(next(iter(found.values())).device) for t in found.values()]).sum() == 0).float()


AMP_SCALER_KEY = "amp_scaler"  # the GradScaler's state in the optimizer's saved state


def _install_amp() -> None:
    from fairseq import optim
    from fairseq.optim.amp_optimizer import AMPOptimizer

    if _patched(AMPOptimizer.__init__):
        return
    original_init, original_clip = AMPOptimizer.__init__, AMPOptimizer.clip_grad_norm
    original_state, original_load = AMPOptimizer.state_dict, AMPOptimizer.load_state_dict
    _check_source(original_clip, "self.scaler.unscale_(self.optimizer)", "AMPOptimizer.clip_grad_norm")

    def __init__(self, cfg, params, fp32_optimizer, **kwargs):
        optim.FairseqOptimizer.__init__(self, cfg.optimizer)
        self.fp32_optimizer = fp32_optimizer
        kw = {"init_scale": cfg.common.fp16_init_scale}
        if getattr(cfg.common, "amp_scale_window", None) is not None:
            kw["growth_interval"] = cfg.common.amp_scale_window
        self._grad_scaler = torch.amp.GradScaler(_device_type(params), **kw)
        self.min_loss_scale = cfg.common.min_loss_scale

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        self.scaler.unscale_(self.fp32_optimizer)  # the object step() hands the scaler: unscaled once
        grad_norm = self.fp32_optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)
        agree_on_overflow(self.scaler, self.fp32_optimizer, grad_norm)
        if not torch.isfinite(grad_norm).all():
            new_loss_scale = self.next_loss_scale
            if new_loss_scale <= self.min_loss_scale:
                raise FloatingPointError(
                    f"AMP: Minimum loss scale reached ({self.min_loss_scale}). Your loss is probably exploding. "
                    f"Try restarting training or use fp32. {new_loss_scale}")
            logger.info(f"AMP: overflow detected, setting scale to {new_loss_scale}")
        return grad_norm

    def state_dict(self):
        state = dict(self.fp32_optimizer.state_dict())
        state[AMP_SCALER_KEY] = self.scaler.state_dict()  # scale and growth tracker: a resume continues them
        return state

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        state_dict = dict(state_dict)
        scaler = state_dict.pop(AMP_SCALER_KEY, None)
        self.fp32_optimizer.load_state_dict(state_dict, optimizer_overrides)
        if scaler:
            self.scaler.load_state_dict(scaler)

    from fairseq.trainer import Trainer

    original_step = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        try:
            return original_step(self, samples, raise_oom)
        finally:
            self._amp_retries = 0  # a budget per batch (fairseq feeds an overflowed one again from inside the call)

    train_step.__wrapped__ = original_step
    Trainer.train_step = train_step
    AMPOptimizer.__init__ = _mark(__init__, original_init)
    AMPOptimizer.clip_grad_norm = _mark(clip_grad_norm, original_clip)
    AMPOptimizer.state_dict = _mark(state_dict, original_state)
    AMPOptimizer.load_state_dict = _mark(load_state_dict, original_load)


# ------------------------------------------------------------------ 6. autocast for --amp off CUDA


def _install_amp_autocast() -> None:
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.tasks.fairseq_task import FairseqTask

    if _patched(FairseqTask.train_step):
        return
    original = FairseqTask.train_step

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        if isinstance(optimizer, AMPOptimizer):
            device = next(model.parameters()).device
            if device.type != "cuda":  # fairseq's torch.cuda.amp.autocast covers CUDA only
                with torch.autocast(device_type=device.type, dtype=torch.float16):
                    return original(self, sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)
        return original(self, sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)

    FairseqTask.train_step = _mark(train_step, original)


def _install_trainer_init() -> None:
    from fairseq.trainer import Trainer

    if _patched(Trainer.__init__):
        return
    original = Trainer.__init__

    def __init__(self, cfg, *args, **kwargs):
        prepare(cfg)  # trainers built without call_main (in-process runs) get their patches too
        original(self, cfg, *args, **kwargs)

    Trainer.__init__ = _mark(__init__, original)


def _needed(common) -> list[tuple[str, str, object]]:
    """(patch, the flag that needs it, its installer) for a run's `common` config, in order."""
    flag, off_cuda = _flag(common), _off_cuda(common)
    fp16, bf16, amp = (bool(getattr(common, k, False)) for k in ("fp16", "bf16", "amp"))
    memory_efficient = bool(getattr(common, "memory_efficient_fp16", False)
                            or getattr(common, "memory_efficient_bf16", False))
    needed = []
    if (fp16 or bf16) and not memory_efficient:  # fairseq's FP16Optimizer holds fp32 master weights
        needed.append(("2. per-parameter fp32 master weights", flag, _install_fp16_master_weights))
        if off_cuda:
            needed.append(("2. the flat fp32 buffer off CUDA", flag, _install_fp32_flat_buffer_off_cuda))
    if fp16 and off_cuda:  # the loss scaler's overflow reaches the .cuda() buffer
        needed.append(("3. the gradient overflow off CUDA", flag, _install_overflow_off_cuda))
    if amp:
        needed.append(("5. AMP's GradScaler", flag, _install_amp))
        if off_cuda:
            needed.append(("6. autocast for --amp off CUDA", flag, _install_amp_autocast))
    return needed


def prepare(cfg) -> list[str]:
    """Install the patches the run of `cfg` needs (module docstring), or stop it before any work.

    Returns the patches installed (or already installed). Raises FairseqChanged, naming the flag, the
    installed fairseq version and the version the patch targets, when one cannot apply; a run that
    needs none (fp32) is never stopped here."""
    common = getattr(cfg, "common", cfg)
    done = []
    for name, flag, installer in _needed(common):
        try:
            installer()
        except FairseqChanged as exc:
            raise FairseqChanged(
                f"{flag} cannot run with the installed fairseq {_fairseq_version()}: the sMLP plugins' patch "
                f"{name} (fairseq_plugins/precision.py) was written for {FAIRSEQ_TARGET}, and {exc}. Runs "
                f"without {flag} (fp32) are not affected; install {FAIRSEQ_TARGET} or train without {flag}") from exc
        done.append(name)
    return done


def install() -> None:
    """At plugin import: the wrappers that install the rest once a run's configuration is known
    (`prepare`, from call_main and Trainer.__init__), and the whole-model gradient norm (patch 4,
    every precision). None checks fairseq's source: importing the plugins cannot fail here."""
    _install_call_main()
    _install_trainer_init()
    _install_grad_norm()
