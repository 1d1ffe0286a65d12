"""The dispatchers' own row moves (smlp/dispatch.py uses them; nothing else calls their collectives): a permutation
of rows whose backward gathers with the inverse (Megatron-Core's permute / unpermute), and an all2all begun
without waiting, whose backward reverses it (the exchanges overlapped with the experts, `dispatch.Chunks`).
Shapes: the core's legend (smlp/__init__.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RowPermutation", "permute_rows", "unpermute_rows", "start_all_to_all", "wait_all_to_all"]


class RowPermutation:
    """A permutation of rows, to move rows into another order and back (Megatron-Core's permute and
    unpermute): row i of the moved rows is row order_S[i]. Its inverse is made once, by the first move, and
    serves the way back and both backwards."""

    __slots__ = ("order_S", "_inverse_S")

    def __init__(self, order_S: Tensor):
        self.order_S, self._inverse_S = order_S, None

    @property
    def inverse_S(self) -> Tensor:
        if self._inverse_S is None:
            self._inverse_S = torch.argsort(self.order_S)  # the values are distinct: any sort gives the inverse
        return self._inverse_S


class _PermuteRows(torch.autograd.Function):
    """x[index_S] for a permutation index_S; the backward gathers the gradient with the inverse permutation.
    Each row has exactly one destination, so this equals indexing's backward (a zero fill and an accumulating
    scatter: 0 + g is g) with one operator instead of two."""

    @staticmethod
    def forward(ctx, x: Tensor, index_S: Tensor, inverse_S: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_S)
        return x.index_select(0, index_S)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inverse_S, = ctx.saved_tensors
        return grad.index_select(0, inverse_S), None, None


def permute_rows(x: Tensor, perm: RowPermutation | None) -> Tensor:
    """x's rows in `perm`'s order, x[perm.order_S] (x itself for None)."""
    return x if perm is None else _PermuteRows.apply(x, perm.order_S, perm.inverse_S)


def unpermute_rows(y: Tensor, perm: RowPermutation | None) -> Tensor:
    """Rows in `perm`'s order back in their own order (the inverse of `permute_rows`)."""
    return y if perm is None else _PermuteRows.apply(y, perm.inverse_S, perm.order_S)


class _Flight:
    """One exchange in flight: started by `_Start`, completed by `_Wait`; in the backward pass the reverse
    exchange is started by `_Wait.backward` and completed by `_Start.backward`. Holds the tensors the
    collective reads and writes until it is waited for."""

    __slots__ = ("out_splits", "in_splits", "group", "work", "keep", "grad", "grad_work", "grad_keep")

    def __init__(self, out_splits: list[int], in_splits: list[int], group):
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = self.keep = self.grad = self.grad_work = self.grad_keep = None


def _start_exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    return out, x, dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


class _Start(torch.autograd.Function):
    """Start an all2all (async_op: gloo runs it on its own thread, NCCL on its own stream); the output
    is not to be read before `_Wait`. Backward: wait for the reverse exchange `_Wait.backward` started."""

    @staticmethod
    def forward(ctx, x: Tensor, flight: _Flight) -> Tensor:
        ctx.flight = flight
        out, flight.keep, flight.work = _start_exchange(x, flight.out_splits, flight.in_splits, flight.group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        flight = ctx.flight
        flight.grad_work.wait()
        grad, flight.grad, flight.grad_keep, flight.grad_work = flight.grad, None, None, None
        return grad, None


class _Wait(torch.autograd.Function):
    """Wait for the exchange `_Start` began. Backward: start the reverse exchange of the gradient (its
    result is the gradient of `_Start`'s input, returned by `_Start.backward` once it has arrived)."""

    @staticmethod
    def forward(ctx, out: Tensor, flight: _Flight) -> Tensor:
        ctx.flight = flight
        flight.work.wait()
        flight.work = flight.keep = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        flight = ctx.flight
        flight.grad, flight.grad_keep, flight.grad_work = _start_exchange(grad, flight.in_splits, flight.out_splits,
                                                                           flight.group)
        return grad, None  # the received rows' gradient, unchanged: `_Start.backward` returns the exchanged one


def start_all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group=None) -> tuple[Tensor, _Flight]:
    """`all_to_all` begun without waiting: (the output, not to be read yet, its flight). The work between
    this and `wait_all_to_all(output, flight)` overlaps the exchange, in the forward pass and, reversed,
    in the backward pass (autograd runs the later-created of two ready nodes first: the reverse exchange
    started by the wait's backward overlaps what the forward did between start and wait)."""
    flight = _Flight(list(out_splits), list(in_splits), group)
    return _Start.apply(x, flight), flight


def wait_all_to_all(out: Tensor, flight: _Flight) -> Tensor:
    """The received rows of an exchange begun by `start_all_to_all`."""
    return _Wait.apply(out, flight)
