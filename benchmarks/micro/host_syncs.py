"""Count host syncs on CPU: the device-to-host reads a CUDA run of the same code would stall on.

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

Syncs inside C++ kernels that Python never sees are not counted (there are none on the paths
counted here besides those listed: bincount and boolean indexing are listed by their Python
call). `balanced_assignment` runs numpy on the CPU; `torch_assignment_path()` makes it run its
torch path, checking completion every 4 rounds as on an accelerator, so the count is the CUDA
one. Each sync is recorded with the first frame in the project's code that caused it.
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
        return 1 if isinstance(device, str) and _is_host_device(device) else 0
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


class HostSyncCounter(TorchFunctionMode):
    """Counts host syncs (see the module docstring); `by_site` says where each came from."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_site: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = syncs_of(func, args, kwargs)
        if n:
            self.count += n
            self.by_site[f"{getattr(func, '__name__', func)} @ {_where()}"] += n
        return func(*args, **kwargs)


@contextlib.contextmanager
def torch_assignment_path():
    """balanced_assignment on its torch path with the accelerator's completion-check interval."""
    from smlp.routing import assignment

    with mock.patch.object(assignment, "_array_ops", lambda device: assignment._TorchOps(device)), \
            mock.patch.object(assignment, "_check_interval", lambda device: assignment.ACCELERATOR_CHECK_EVERY):
        yield


@contextlib.contextmanager
def count_host_syncs():
    """Yield a HostSyncCounter active for the block (balanced assignment on its torch path)."""
    counter = HostSyncCounter()
    with torch_assignment_path(), counter:
        yield counter
