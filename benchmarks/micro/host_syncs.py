"""Count host syncs on CPU: the device-to-host reads and host-to-device copies a CUDA run of the same code would stall
on (docs/training.md, "What the host-sync counter counts"). `accelerator_paths()` puts the code on the paths an
accelerator takes, so the count is the CUDA one; each sync is recorded with the first frame in the project's code."""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
_PROJECT_DIRS = tuple(str(REPO / d) + "/" for d in ("smlp", "fairseq_plugins"))
_BACKWARD_MODULES = ("smlp", "fairseq_plugins")
T = torch.Tensor
_ONE_SYNC = {T.item, T.tolist, T.cpu, T.numpy, T.__array__,  # a copy to the host
             T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__,  # a branch or number from a device value
             # an output whose size depends on the data
             torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select, torch.unique,
             T.unique, torch.unique_consecutive, T.unique_consecutive, torch.equal, T.equal, torch.allclose, T.allclose}
_BINCOUNT = {torch.bincount, T.bincount}  # a max, then the result: two on CUDA
_MASK_INDEX = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}  # nonzero of a bool mask
_INDEX_FILL = {T.index_fill_, T.index_fill, torch.index_fill}  # a tensor value: its .item()
_REPEAT = {torch.repeat_interleave, T.repeat_interleave}  # tensor repeats without output_size
_HOST = "_smlp_host_tensor"  # set on tensors the code made on the host
_NEW_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor,
              torch.tril_indices, torch.triu_indices}
_TO_DEVICE = {T.to, T.cuda}
_FOLLOWS_SELF = {T.new_tensor, T.new_zeros, T.new_ones, T.new_full, T.new_empty}


def _is_mask(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    return isinstance(index, (tuple, list)) and any(_is_mask(i) for i in index)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]


def is_host(t) -> bool:
    """Whether the counted code made `t` on the host."""
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _names_host(device) -> bool:
    """A device given as "cpu" names the host; a device object follows a tensor (on the GPU in a CUDA run)."""
    return isinstance(device, str) and torch.device(device).type == "cpu"


def _target_device(args, kwargs):
    """Where Tensor.to sends its tensor: a device (str or object), a tensor's device, or None (a dtype)."""
    target = kwargs.get("device")
    for a in list(args[1:]) + [kwargs.get("other")]:
        if isinstance(a, (str, torch.device, torch.Tensor)):
            target = a
    return target


def copies_to_device(func, args, kwargs) -> int:
    """Host-to-device copies a CUDA run of `func(*args, **kwargs)` makes."""
    if func in _NEW_DATA:
        data, device = args[0] if args else kwargs.get("data"), kwargs.get("device")
        return int(device is not None and not _names_host(device) and (not isinstance(data, torch.Tensor)
                                                                        or is_host(data)))
    if func is T.new_tensor:
        data = args[1] if len(args) > 1 else kwargs.get("data")
        return int(not is_host(args[0]) and (not isinstance(data, torch.Tensor) or is_host(data)))
    if func in _TO_DEVICE:
        if not is_host(args[0]):
            return 0
        target = _target_device(args, kwargs)
        if func is T.cuda or isinstance(target, torch.Tensor):
            return int(func is T.cuda or not is_host(target))
        return int(target is not None and not _names_host(target))
    if func is T.copy_:
        return int(is_host(args[1]) and not is_host(args[0]))
    tensors = _tensors(args, kwargs)
    return int(any(is_host(t) and t.dim() > 0 for t in tensors) and any(not is_host(t) for t in tensors))


def _made_on_host(func, args, kwargs) -> bool:
    """Whether the result of func lives on the host in a CUDA run."""
    if func in _NEW_DATA or func in _FACTORIES:
        return kwargs.get("device") is None or _names_host(kwargs.get("device"))
    if func in (T.cpu, torch.from_numpy):
        return True
    if func in _FOLLOWS_SELF:
        return is_host(args[0])
    if func in _TO_DEVICE:
        target = None if func is T.cuda else _target_device(args, kwargs)
        if target is None:
            return func is T.to and is_host(args[0])
        return is_host(target) if isinstance(target, torch.Tensor) else _names_host(target)
    tensors = _tensors(args, kwargs)
    return bool(tensors) and all(is_host(t) for t in tensors)


def syncs_of(func, args, kwargs) -> int:
    """Host syncs a CUDA run of `func(*args, **kwargs)` makes."""
    if func in _ONE_SYNC:
        return 1
    if func in _BINCOUNT:
        return 2
    if func is T.to:
        # Only an explicit "cpu" is a copy to the host: `.to(other.device)` follows a tensor that is
        # on the CPU here but on the GPU in a CUDA run.
        device = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                device = a
        return int(_names_host(device) and not is_host(args[0]))
    if func is torch.where:
        return int(len(args) + len(kwargs) == 1)
    if func in _MASK_INDEX:
        return int(len(args) > 1 and _is_mask(args[1]))
    if func in _INDEX_FILL:
        return int(isinstance(args[3] if len(args) > 3 else kwargs.get("value"), torch.Tensor))
    if func in _REPEAT:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return int(isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None)
    return 0


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_PROJECT_DIRS):
            return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno} {frame.name}"
    return "outside the project"


def _project_functions(prefixes=_BACKWARD_MODULES) -> list[type]:
    """The torch.autograd.Function subclasses defined in the project's modules."""
    found, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in prefixes and "backward" in cls.__dict__:
            found.append(cls)
    return found


class HostSyncCounter(TorchFunctionMode):
    """Counts host syncs and host-to-device copies; `by_site` says where each came from, `copies` how many of `count`
    were host-to-device copies. backward_modules: top-level packages whose autograd Functions' backward passes are
    counted."""

    def __init__(self, backward_modules=_BACKWARD_MODULES):
        super().__init__()
        self.count, self.copies, self.by_site = 0, 0, Counter()
        self.backward_modules, self._patched, self._depth = tuple(backward_modules), [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", func)
        if n := syncs_of(func, args, kwargs):
            self.count += n
            self.by_site[f"{name} @ {_where()}"] += n
        if copies := copies_to_device(func, args, kwargs):
            self.count += copies
            self.copies += copies
            self.by_site[f"host-to-device {name} @ {_where()}"] += copies
        out = func(*args, **kwargs)
        if _made_on_host(func, args, kwargs):
            if any(out is t and not is_host(t) for t in _tensors(args, kwargs)):
                # .cpu() / .to("cpu") of a CPU tensor return the tensor itself: in a CUDA run they return a
                # host copy of a device tensor, so mark an alias and leave the device tensor as it is
                out = out.view_as(out)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    with contextlib.suppress(AttributeError, RuntimeError):  # a tensor that takes no attribute
                        setattr(t, _HOST, True)
        return out

    def __enter__(self):
        if self._depth == 0:  # the outermost entry counts the backward passes of the project's Functions
            for cls in _project_functions(self.backward_modules):
                original = cls.__dict__["backward"]
                cls.backward = staticmethod(self._counted(original.__func__))
                self._patched.append((cls, original))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for cls, original in reversed(self._patched):
                cls.backward = original
            self._patched.clear()
        return super().__exit__(*exc)

    def _counted(self, backward):
        def counted(ctx, *grads):
            with self:  # autograd runs backward outside every TorchFunctionMode
                return backward(ctx, *grads)
        return counted


@contextlib.contextmanager
def torch_assignment_path():
    """balanced_assignment on its torch path with the accelerator's completion checks."""
    from smlp.routing import assignment

    with mock.patch.object(assignment, "_array_ops", lambda device: assignment._TorchOps(device)), \
            mock.patch.object(assignment, "_check_schedule", lambda device: assignment.ACCELERATOR_CHECKS):
        yield


@contextlib.contextmanager
def accelerator_paths():
    """The paths an accelerator takes: balanced assignment on its torch path (`torch_assignment_path`),
    and the FFN experts' grouped product for unequal counts in training (smlp/experts.py)."""
    from smlp import experts

    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the grouped product's one-time probe, not a step's
        experts.grouped_mm_supported(torch.device("cpu"), dtype)
    with torch_assignment_path(), mock.patch.object(experts, "_grouped_by_default", lambda device: True):
        yield


@contextlib.contextmanager
def count_host_syncs():
    """Yield a HostSyncCounter active for the block (on the accelerator's paths)."""
    with accelerator_paths(), HostSyncCounter() as counter:
        yield counter
