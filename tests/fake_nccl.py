"""A pretend NCCL backend for CPU-only machines: catches CPU tensors that reach a collective.

NCCL accepts only CUDA tensors, so a CPU tensor handed to one of its collectives fails on a GPU
cluster at the first batch; gloo accepts it, so CPU tests never notice. Inside `pretend_nccl()`:

- `torch.distributed.get_backend()` answers "nccl" and torch.cuda reports one device, so code that
  follows the backend (`smlp_eval.scoring.collective_device`, `AllToAllDispatcher._device`) asks
  for CUDA tensors;
- `FakeCuda`, a TorchFunctionMode, serves those "CUDA" tensors: they are CPU tensors whose storage
  is marked; `.device` reports cuda:0 for them, `.to("cuda")`/`device="cuda"` produce them, results
  of operations on them are marked too, `.cpu()` copies out unmarked;
- the backward pass (`Tensor.backward`) runs under a TorchDispatchMode that marks the results of
  every operation with a marked input, so gradients of "CUDA" tensors are "CUDA" tensors too
  when they reach the collectives of the backward (the all2all's reverse exchange, the replica
  all-reduce of expert gradients). Function modes are off inside autograd's hooks, so there a
  new CPU tensor is caught, but `.cpu()` of a gradient is not (it is the same CPU tensor here);
- every tensor collective of `torch.distributed` first checks that each tensor it is given is
  marked (raises `CpuTensorToNccl` otherwise), then runs on the real gloo group underneath, so the
  values are real and the code goes on as it would. Object collectives (pickling through
  tensors the backend chooses) are refused: the project uses tensor collectives only.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
TENSOR_COLLECTIVES = ("all_reduce", "all_to_all_single", "broadcast", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "reduce_scatter", "all_to_all", "reduce", "gather", "scatter",
                      "send", "recv", "isend", "irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


class CpuTensorToNccl(RuntimeError):
    pass


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_cpu(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cpu")
    return isinstance(device, torch.device) and device.type == "cpu"


class FakeCuda(TorchFunctionMode):
    """CPU tensors that look and behave like CUDA tensors to the code under test."""

    def __init__(self):
        super().__init__()
        # marked storages by address, each with a weak reference: a freed storage's address can be
        # reused by a CPU tensor, which must not count as marked
        self.storages: dict = {}
        self.synchronized: list = []  # torch.cuda.synchronize calls made in the block

    def _key(self, t: torch.Tensor):
        return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else ("empty", id(t))

    def marked(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self.storages.get(self._key(t), False)
        return ref is None or (ref is not False and not ref.expired())

    def _mark(self, obj):
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            self.storages[self._key(obj)] = StorageWeakRef(storage) if storage.nbytes() else None
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                self._mark(o)
        return obj

    def _any_marked(self, args, kwargs) -> bool:
        for a in (*args, *kwargs.values()):
            if self.marked(a) or (isinstance(a, (list, tuple)) and any(self.marked(x) for x in a)):
                return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.backward:  # autograd computes gradients below Python: mark them there
            with _MarkResults(self):
                return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch._C.TensorBase.device:  # the .device getter
            return CUDA if self.marked(args[0]) else torch.device("cpu")
        if func is torch.Tensor.to:
            target = kwargs.get("device")
            rest = list(args[1:])
            for i, a in enumerate(rest):
                if isinstance(a, (str, torch.device)):
                    target, rest[i] = a, "cpu"
            if "device" in kwargs:
                kwargs["device"] = "cpu"
            out = func(args[0], *rest, **kwargs)
            if _is_cuda(target):
                if out is args[0] and not self.marked(args[0]):
                    out = out.clone()  # a copy "on the device"
                return self._mark(out)
            if _is_cpu(target):
                return out.clone() if self.marked(out) else out
            return self._mark(out) if self.marked(args[0]) else out
        if func is torch.Tensor.cuda:
            return self._mark(args[0].clone())
        if func is torch.Tensor.cpu:
            return args[0].clone() if self.marked(args[0]) else args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return self._mark(func(*args, **kwargs))
        out = func(*args, **kwargs)
        if self._any_marked(args, kwargs):
            self._mark(out)
        return out


class _MarkResults(TorchDispatchMode):
    """Results of an operation with a marked ("CUDA") input are marked (used for the backward pass)."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(self.fake.marked(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            for t in pytree.tree_leaves(out):
                self.fake._mark(t)
        return out


@contextlib.contextmanager
def pretend_nccl():
    """Yield (FakeCuda mode, list of (collective, number of tensors checked)) for the block."""
    mode = FakeCuda()
    calls: list = []

    def checked(name, original):
        def collective(*args, **kwargs):
            tensors = []
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    tensors.append(a)
                elif isinstance(a, (list, tuple)):
                    tensors += [x for x in a if isinstance(x, torch.Tensor)]
            for t in tensors:
                if not mode.marked(t):
                    raise CpuTensorToNccl(f"dist.{name} got a CPU tensor (shape {tuple(t.shape)}, {t.dtype}) but the "
                                          f"backend is NCCL, which accepts only CUDA tensors")
            calls.append((name, len(tensors)))
            return original(*args, **kwargs)
        return collective

    def refused(name):
        def collective(*args, **kwargs):
            raise CpuTensorToNccl(f"dist.{name}: object collectives are not used in this project (their tensors "
                                  f"follow the current CUDA device); use a tensor collective on the backend's device")
        return collective

    patches = [mock.patch.object(dist, "get_backend", lambda group=None: "nccl"),
               mock.patch.object(torch.cuda, "is_available", lambda: True),
               mock.patch.object(torch.cuda, "current_device", lambda: 0),
               mock.patch.object(torch.cuda, "device_count", lambda: 1),
               mock.patch.object(torch.cuda, "set_device", lambda device: None),
               # recorded, not done: nothing to wait for (the dispatchers must not ask, see test_collectives)
               mock.patch.object(torch.cuda, "synchronize", lambda device=None: mode.synchronized.append(device))]
    patches += [mock.patch.object(dist, n, checked(n, getattr(dist, n)))
                for n in TENSOR_COLLECTIVES if hasattr(dist, n)]
    patches += [mock.patch.object(dist, n, refused(n)) for n in OBJECT_COLLECTIVES if hasattr(dist, n)]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        with mode:
            yield mode, calls
