"""The two facts about a process group the rest of the code asks for: this process's rank and the world
size, and the device of the tensors its collectives accept; and the two object collectives by which ranks
take a decision together (every rank's finding, rank 0's choice).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["broadcast_object", "collective_device", "gather_objects", "rank_and_world"]


def rank_and_world(group=None) -> tuple[int, int]:
    """(rank, world size) of this process in `group` (default: the whole world); (0, 1) without a
    process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def collective_device(group=None) -> torch.device:
    """The device of the tensors `group`'s collectives accept: CUDA for NCCL (a host tensor fails at the
    first collective), the host for gloo and MPI (so also for a mixed "cpu:gloo,cuda:nccl" group), and
    the current accelerator for another accelerator's backend."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()  # another accelerator's backend (xccl, hccl, ...)
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank of `group`; [obj] without a process group."""
    if rank_and_world(group)[1] == 1:
        return [obj]
    out = [None] * rank_and_world(group)[1]
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, group=None):
    """Rank 0's `obj` on every rank of `group` (`obj` itself without a process group)."""
    if rank_and_world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
