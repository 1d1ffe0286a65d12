"""Expert-data parallelism: W = R x G ranks, experts sharded over G, replicated R times.

The W ranks form R expert-parallel groups of G consecutive ranks. Inside a group the E experts of a
sparse layer are spread over the G ranks (E / G local experts each) and the routed rows travel by
all2all (the dispatcher's `ep_group`); the ranks r % G == j of all groups form the replica group of
expert shard j. A group is consecutive ranks so that on a GPU cluster it shares a node: every sparse
layer's all2all stays on NVLink, and only the replicas' gradient all-reduce crosses the network.

Every gradient is the average over the W ranks, as under DDP: the data-parallel wrapper averages the
non-expert parameters and `average_expert_gradients` the experts'. `grad_norm_with_experts` is the
whole model's gradient norm, the same on every rank. The caller creates the groups and passes them
in: nothing here reads a global process group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import _positive
from .experts import is_expert
from .process_group import collective_device, rank_and_world

__all__ = ["ExpertDataLayout", "average_expert_gradients", "collective_device", "expert_data_groups",
           "expert_parallel_layout", "grad_norm_with_experts", "valid_ep_sizes"]


def expert_parallel_layout(num_experts: int, world_size: int) -> int:
    """Local experts per rank for E experts on W ranks; ValueError when they do not fit."""
    if num_experts < 1 or world_size < 1:
        raise ValueError(f"num_experts={num_experts} and world_size={world_size} must both be >= 1")
    if num_experts % world_size:
        if world_size % num_experts == 0:
            raise ValueError(
                f"num_experts={num_experts} is smaller than the expert-parallel world size {world_size}: an "
                f"expert-parallel group holds at most one rank per expert; on more ranks, replicate the experts "
                f"over groups of {num_experts} (expert-data parallelism, ExpertDataLayout) or use "
                f"num_experts equal to a multiple of {world_size}"
            )
        raise ValueError(
            f"num_experts={num_experts} cannot be spread evenly over {world_size} ranks: it must be a "
            f"multiple of the world size (e.g. {world_size} or {2 * world_size})"
        )
    return num_experts // world_size


def valid_ep_sizes(world_size: int, num_experts: int) -> list[int]:
    """Expert-parallel group sizes G that work for E experts on W ranks: G divides both W and E."""
    return [g for g in range(1, min(world_size, num_experts) + 1) if world_size % g == 0 and num_experts % g == 0]


@dataclass(frozen=True, kw_only=True)
class ExpertDataLayout:
    """Where the experts of every sparse layer live on W = R x G ranks.

    world_size:  W, all ranks.
    ep_size:     G, ranks of one expert-parallel group (all2all inside it); must divide W and E.
    num_experts: E, experts per sparse layer.
    """

    world_size: int
    ep_size: int
    num_experts: int

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size)
        _positive("ep_size", self.ep_size)
        _positive("num_experts", self.num_experts)
        if self.world_size % self.ep_size or self.num_experts % self.ep_size:
            valid = valid_ep_sizes(self.world_size, self.num_experts)
            raise ValueError(
                f"ep_size={self.ep_size} is invalid for num_experts={self.num_experts} on world_size="
                f"{self.world_size}: the expert-parallel group size must divide both the world size (the groups "
                f"tile the ranks) and the number of experts (each rank holds as many); valid values: "
                f"{', '.join(map(str, valid))}")
        expert_parallel_layout(self.num_experts, self.ep_size)

    @classmethod
    def resolve(cls, *, world_size: int, num_experts: int, ep_size: int = 0) -> ExpertDataLayout:
        """ep_size 0 means the default, min(W, E): pure expert parallelism when W <= E."""
        if ep_size < 0:
            raise ValueError(f"ep_size={ep_size} is invalid: give a positive group size or 0 for min(W, E)")
        return cls(world_size=world_size, num_experts=num_experts,
                   ep_size=ep_size or min(world_size, num_experts))

    @property
    def replicas(self) -> int:
        """R: copies of every expert (one per expert-parallel group)."""
        return self.world_size // self.ep_size

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def ep_rank(self, rank: int) -> int:
        """Position of `rank` in its expert-parallel group (which experts it holds)."""
        self._check_rank(rank)
        return rank % self.ep_size

    def first_expert(self, rank: int) -> int:
        return self.ep_rank(rank) * self.num_local_experts

    def ep_group_ranks(self) -> list[list[int]]:
        """The R expert-parallel groups: G consecutive ranks each."""
        G = self.ep_size
        return [list(range(k * G, (k + 1) * G)) for k in range(self.replicas)]

    def replica_group_ranks(self) -> list[list[int]]:
        """The G replica groups: the R ranks holding the same experts."""
        G = self.ep_size
        return [list(range(j, self.world_size, G)) for j in range(G)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of {self.world_size} ranks")


def average_expert_gradients(module: nn.Module, *, world_size: int, replica_group=None,
                             replicas: int = 1) -> list:
    """Hook every expert parameter so its gradient becomes the average over all W ranks.

    1. The all2all backward has summed the contributions of the G ranks of this expert-parallel
       group on the owning rank.
    2. Divide by W before summing, so that low precision does not overflow.
    3. Sum over the R replicas of this expert shard (`replica_group`); skipped when R = 1.

    The reduction runs in every micro-batch's backward pass; a sum is linear, so gradient accumulation
    gives the same result. Every rank runs the same backward graph, so the collectives are issued in
    the same order on all ranks. Returns the hook handles.
    """
    _positive("world_size", world_size)
    _positive("replicas", replicas)
    if replicas > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("averaging expert gradients over replicas needs an initialized process group")

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / world_size
        if replicas > 1:
            dist.all_reduce(grad, group=replica_group)
        return grad

    return [p.register_hook(hook) for p in module.parameters() if is_expert(p) and p.requires_grad]


def expert_data_groups(layout: ExpertDataLayout, rank: int):
    """(expert-parallel group, replica group) of `rank`, creating every group of the layout.

    torch.distributed.new_group must be entered by every rank for every group, in the same order,
    so each rank creates all of them and keeps its own two. A group of the whole world is the default
    group (None), and without replicas there is no replica group (None).
    """
    ep_group = replica_group = None
    if layout.ep_size < layout.world_size:
        for ranks in layout.ep_group_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_group = group
    if layout.replicas > 1:
        for ranks in layout.replica_group_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                replica_group = group
    return ep_group, replica_group


def grad_norm_with_experts(shared_norm: torch.Tensor, expert_grads: list[torch.Tensor], *, replicas: int = 1,
                           group=None) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, identical on every rank (one all-reduce of a scalar).

    shared_norm:  the norm of the gradients every rank holds the same copy of (after the data-parallel
                  all-reduce), computed locally on each rank.
    expert_grads: this rank's expert gradients (after `average_expert_gradients`).
    replicas:     R, copies of every expert (expert-data parallelism); 1 without replicas.
    group:        the ranks that hold the experts between them (the default group: all W ranks).

    1. s = sum of squares of this rank's expert gradients, in fp32, divided by R: summed over the W
       ranks, each expert then counts once (its R replicas hold the same gradient).
    2. All-reduce s (sum) over the group, on the backend's device (NCCL: a CUDA tensor).
    3. sqrt(shared_norm^2 + s).
    An inf or NaN gradient on any rank makes the result non-finite on every rank, so all ranks skip
    the step together. On one rank step 2 is skipped.
    """
    _positive("replicas", replicas)
    if expert_grads:
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in expert_grads]).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=shared_norm.device)
    if replicas > 1:
        sq = sq / replicas
    if rank_and_world(group)[1] > 1:
        device = collective_device(group)
        sq_dev = sq.to(device)
        dist.all_reduce(sq_dev, group=group)
        sq = sq_dev
    shared_sq = shared_norm.to(device=sq.device, dtype=torch.float32).square()
    return (shared_sq + sq).sqrt().to(shared_norm.device)
