"""Count host syncs on CPU: the device-to-host reads a CUDA run of the same code would stall on (the host syncs of
the step breakdown, the GPU check's CPU reference, the budget tests/test_hot_path.py enforces).

On a GPU every read of a device value by the host (a Python number from a tensor, a branch on a
tensor, an output whose size depends on the data) waits until the stream has caught up. On the
CPU nothing waits, so such reads go unnoticed; `HostSyncCounter`, a TorchFunctionMode, counts
the Python-level calls that are host syncs on CUDA:

    .item() .tolist() .cpu() .numpy() .to("cpu")     a copy to the host (`.to(device)` with a  1
                                                      device object is not counted: it follows
                                                      a tensor that is on the GPU in CUDA runs)
    bool() int() float() index() of a tensor          a branch or number from a device value  1
    nonzero, argwhere, where(cond), masked_select,    output size depends on the data          1
    unique, repeat_interleave(tensor) without
    output_size, equal, allclose
    bincount                                          a max, then the result (CUDA: two)      2
    x[mask], x[mask] = v (boolean index)              nonzero of the mask                     1
    index_fill_(dim, index, tensor value)             value.item()                            1

and the host-to-device copies, which wait for the stream as well: a tensor made from Python data
on the device is a pageable copy that synchronizes (c10's `memcpy_and_sync`), as is `.to(device)`
of a tensor that lives on the host:

    torch.tensor / as_tensor / asarray(data, device=d)  Python data (or a host tensor) copied to d    1
    x.new_tensor(data)                                  Python data copied to x's device            1
    h.to(device or device tensor), h.cuda(),            a host tensor copied to the device          1
    d.copy_(h)
    an operation mixing a host tensor (not 0-d) with    the host operand copied first (or an error  1
    a device tensor, e.g. d[h]                          on CUDA)

A host tensor is one the code made on the host: by a factory without a device (torch.tensor(data),
torch.arange(n), ...) or with device "cpu", by .cpu(), from numpy, or computed from host tensors
only. Everything else (parameters, inputs, tensors made with a device taken from another tensor,
and whatever they compute) is on the device in a CUDA run. A 0-d host tensor is a scalar operand
(read on the host, no copy).

Python code run by autograd in the backward pass (custom `torch.autograd.Function`s) is outside
any TorchFunctionMode; while counting, the backward methods of the project's Functions (smlp,
fairseq_plugins) re-enter the counter, so their syncs and copies are counted too. Syncs inside
C++ kernels that Python never sees are not counted (there are none on the paths counted here
besides those listed: bincount and boolean indexing are listed by their Python call).
`balanced_assignment` runs numpy on the CPU; `accelerator_paths()` makes it run its torch path,
checking completion when an accelerator does (assignment.ACCELERATOR_CHECKS), and the FFN experts
take their grouped product for unequal counts, as on an accelerator, so the count is the CUDA one.
Each sync is recorded with the first frame in the project's code that caused it.
"""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
_PROJECT_DIRS = tuple(str(REPO / d) + "/" for d in ("smlp", "fairseq_plugins"))

_COPIES = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__array__}
_SCALARS = {torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
            torch.Tensor.__complex__}
_DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
                   torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
                   torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.equal, torch.Tensor.equal,
                   torch.allclose, torch.Tensor.allclose}
_BINCOUNT = {torch.bincount, torch.Tensor.bincount}
_INDEX_FILL = {torch.Tensor.index_fill_, torch.Tensor.index_fill, torch.index_fill}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


def _is_mask(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_is_mask(i) for i in index)
    return False


def _is_host_device(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


# ---------------------------------------------------------------- host-to-device copies

_HOST = "_smlp_host_tensor"  # set on tensors the code made on the host (module docstring)
_NEW_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor,
              torch.tril_indices, torch.triu_indices}
_TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
_FOLLOWS_SELF = {torch.Tensor.new_tensor, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
                 torch.Tensor.new_empty}


def _tensors(args, kwargs) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]


def is_host(t) -> bool:
    """Whether the counted code made `t` on the host (module docstring)."""
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _names_host(device) -> bool:
    """A device given as "cpu" names the host; a device object follows a tensor (on the GPU in a CUDA run)."""
    return isinstance(device, str) and _is_host_device(device)


def _target_device(args, kwargs):
    """Where Tensor.to sends its tensor: a device (str or object), a tensor's device, or None (a dtype)."""
    target = kwargs.get("device")
    for a in list(args[1:]) + [kwargs.get("other")]:
        if isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor):
            target = a
    return target


def copies_to_device(func, args, kwargs) -> int:
    """Host-to-device copies a CUDA run of `func(*args, **kwargs)` makes (see the module docstring)."""
    if func in _NEW_DATA:
        data = args[0] if args else kwargs.get("data")
        device = kwargs.get("device")
        on_host = not isinstance(data, torch.Tensor) or is_host(data)
        return 1 if device is not None and not _names_host(device) and on_host else 0
    if func is torch.Tensor.new_tensor:
        data = args[1] if len(args) > 1 else kwargs.get("data")
        return 1 if not is_host(args[0]) and (not isinstance(data, torch.Tensor) or is_host(data)) else 0
    if func in _TO_DEVICE:
        if not is_host(args[0]):
            return 0
        if func is torch.Tensor.cuda:
            return 1
        target = _target_device(args, kwargs)
        if isinstance(target, torch.Tensor):
            return 0 if is_host(target) else 1
        return 0 if target is None or _names_host(target) else 1
    if func is torch.Tensor.copy_:
        return 1 if is_host(args[1]) and not is_host(args[0]) else 0
    tensors = _tensors(args, kwargs)
    mixed = any(is_host(t) and t.dim() > 0 for t in tensors) and any(not is_host(t) for t in tensors)
    return 1 if mixed else 0


def _made_on_host(func, args, kwargs) -> bool:
    """Whether the result of func lives on the host in a CUDA run (see the module docstring)."""
    if func in _NEW_DATA or func in _FACTORIES:
        device = kwargs.get("device")
        return device is None or _names_host(device)
    if func in (torch.Tensor.cpu, torch.from_numpy):
        return True
    if func in _FOLLOWS_SELF:
        return is_host(args[0])
    if func in _TO_DEVICE:
        if func is torch.Tensor.cuda:
            return False
        target = _target_device(args, kwargs)
        if target is None:
            return is_host(args[0])
        return is_host(target) if isinstance(target, torch.Tensor) else _names_host(target)
    tensors = _tensors(args, kwargs)
    return bool(tensors) and all(is_host(t) for t in tensors)


def _mark_host(out) -> None:
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _HOST, True)
            except (AttributeError, RuntimeError):  # a tensor that takes no attribute: left unmarked
                pass


def syncs_of(func, args, kwargs) -> int:
    """Host syncs a CUDA run of `func(*args, **kwargs)` makes (see the module docstring)."""
    if func in _COPIES or func in _SCALARS or func in _DATA_DEPENDENT:
        return 1
    if func in _BINCOUNT:
        return 2
    if func is torch.Tensor.to:
        # Only an explicit "cpu" is a copy to the host: `.to(other.device)` follows a tensor that is
        # on the CPU here but on the GPU in a CUDA run (see the module docstring).
        device = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                device = a
        return 1 if isinstance(device, str) and _is_host_device(device) and not is_host(args[0]) else 0
    if func is torch.where:
        return 1 if len(args) + len(kwargs) == 1 else 0
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put,
                torch.index_put):
        return 1 if len(args) > 1 and _is_mask(args[1]) else 0
    if func in _INDEX_FILL:
        value = args[3] if len(args) > 3 else kwargs.get("value")
        return 1 if isinstance(value, torch.Tensor) else 0
    if func in _REPEAT:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return 1 if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None else 0
    return 0


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_PROJECT_DIRS):
            return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno} {frame.name}"
    return "outside the project"


_BACKWARD_MODULES = ("smlp", "fairseq_plugins")


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
    """Counts host syncs and host-to-device copies (see the module docstring); `by_site` says where each
    came from, `copies` how many of `count` were host-to-device copies.

    backward_modules: top-level packages whose autograd Functions' backward passes are counted."""

    def __init__(self, backward_modules=_BACKWARD_MODULES):
        super().__init__()
        self.count = 0
        self.copies = 0
        self.by_site: Counter = Counter()
        self.backward_modules = tuple(backward_modules)
        self._patched: list = []
        self._depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", func)
        n = syncs_of(func, args, kwargs)
        if n:
            self.count += n
            self.by_site[f"{name} @ {_where()}"] += n
        copies = copies_to_device(func, args, kwargs)
        if copies:
            self.count += copies
            self.copies += copies
            self.by_site[f"host-to-device {name} @ {_where()}"] += copies
        out = func(*args, **kwargs)
        if _made_on_host(func, args, kwargs):
            if any(out is t and not is_host(t) for t in _tensors(args, kwargs)):
                # .cpu() / .to("cpu") of a CPU tensor return the tensor itself: in a CUDA run they return a
                # host copy of a device tensor, so mark an alias and leave the device tensor as it is
                out = out.view_as(out)
            _mark_host(out)
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
    counter = HostSyncCounter()
    with accelerator_paths(), counter:
        yield counter
