"""One GPU of an expert-parallel group, in one process: what the FLOPs calculator and the activation measurement
build a model with, so that each routed row costs one expert of its layer while the model holds only one GPU's
expert weights. Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from smlp.dispatch import DispatchState, LocalDispatcher

__all__ = ["OneGPUDispatcher", "check_experts_per_gpu"]


def check_experts_per_gpu(num_experts: int, experts_per_gpu: int) -> None:
    """ValueError unless `experts_per_gpu` local experts spread the `num_experts` of a layer evenly."""
    if experts_per_gpu < 1 or num_experts % experts_per_gpu:
        raise ValueError(f"{experts_per_gpu} experts per GPU do not divide num_experts={num_experts}: the experts "
                         f"of a layer must spread evenly over the GPUs")


@dataclass
class _KeptRows(DispatchState):
    kept_S: Tensor | None = None  # (S,) bool, the rows computed (the others were dropped), or None: every row


class OneGPUDispatcher(LocalDispatcher):
    """One GPU's view of expert parallelism: the routed rows all computed by this rank's experts.

    Holds `experts_per_gpu` local experts of `num_experts`; every row is computed by one of them
    (rows dealt out evenly), so each row costs one expert of its layer, as in the expert-parallel
    group, while the model holds only one GPU's expert weights. Outputs keep the rows' order.
    """

    def __init__(self, num_experts: int, experts_per_gpu: int = 1):
        super().__init__(num_experts)
        check_experts_per_gpu(num_experts, experts_per_gpu)
        self.num_local_experts = experts_per_gpu
        self.world_size = num_experts // experts_per_gpu

    def with_experts(self, num_experts: int) -> OneGPUDispatcher:
        """The same GPU for a layer of `num_experts` experts (the sMoE's own count): spread over the same GPUs
        where they divide it, else every GPU holds all of them (the sMoE's replicated layout)."""
        if num_experts % self.world_size == 0:
            return OneGPUDispatcher(num_experts, num_experts // self.world_size)
        whole = OneGPUDispatcher(num_experts, num_experts)
        whole.world_size, whole.replicated = self.world_size, True  # data-parallel weights: not counted per GPU
        return whole

    def dispatch(self, x_SD, expert_S, *, presorted: bool = False, **unused):
        # rows of dropped slots (expert -1, over capacity) are computed by no expert: cut them off
        # meta: nothing routed, nothing dropped; no experts: presorted rows with their counts, none dropped
        kept_S = None if x_SD.device.type == "meta" or expert_S is None else expert_S >= 0
        if kept_S is not None and not bool(kept_S.all()):
            x_SD = x_SD[kept_S]
        S, L = x_SD.shape[0], self.num_local_experts
        counts_L = [S // L + (i < S % L) for i in range(L)]
        return x_SD, counts_L, _KeptRows(None, kept_S=kept_S)

    def combine(self, y_RD, state):
        kept_S = state.kept_S
        if kept_S is None or y_RD.shape[0] == kept_S.shape[0]:
            return y_RD
        y_SD = y_RD.new_zeros((kept_S.shape[0],) + tuple(y_RD.shape[1:]))
        y_SD[kept_S] = y_RD
        return y_SD
