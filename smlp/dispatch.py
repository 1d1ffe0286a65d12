"""Dispatchers: move routed rows to the experts that own them and bring the results back.

Shapes: the core's legend (smlp/__init__.py); here S rows on this rank, R rows its experts receive
(grouped by local expert), D row width (M positions for sMoE rows), X values each rank sends every
other rank with its counts (row counts, a router's check verdict, the row width).

Both dispatchers share one interface, so every expert-parallel layer has a single-process twin:

    x_RD, counts_L, state = dispatcher.dispatch(x_SD, expert_S, fault=plan.fault, layer=name)
    y_SD = dispatcher.combine(experts(x_RD, counts_L), state)

plus `shuffle` / `unshuffle_assignment` for Base Layers' training-time shuffle of routing scores. Each
dispatch reads one thing on the host, its split sizes, and the router's check travels with them, so a
fault seen by one rank raises the same error on every rank before any row moves. Within `one_forward`
(one forward of a model whose layers share the dispatcher) what does not change from layer to layer is
exchanged once: the shuffle's split sizes (begun without waiting at the start of the forward,
`prepare_shuffle`), the deterministic sMoE's counts. Dispatchers hold no parameters, take their process
group as an argument, and are the only place that calls a collective.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from . import expert_data_parallel
from .comm_timer import CommTimer
from .process_group import collective_device
from .routing.plan import FAULT_WIDTH, DeferredCheck, count_rows, nonfinite_rows, raise_on_fault
from .row_moves import RowPermutation, permute_rows, start_all_to_all, unpermute_rows, wait_all_to_all

__all__ = ["LocalDispatcher", "AllToAllDispatcher", "ShuffleState", "Chunks", "ExchangedChunks", "all_to_all",
           "start_all_to_all", "wait_all_to_all", "synchronize", "RowPermutation", "permute_rows", "unpermute_rows"]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (no-op on the CPU, where collectives are synchronous)."""
    if device.type == "cpu" or device.type == "meta":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


@dataclass
class ShuffleState:
    order: RowPermutation  # the random permutation applied to the local rows before sending
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)


def shuffle_splits(num_rows: int, world_size: int) -> list[int]:
    """Rows sent to each rank by the shuffle: equal shares, the first num_rows % W ranks one more.

    fairseq's BaseLayer sends S / W rows to every rank and needs W to divide S; this is the same
    split whenever it does, and any S works."""
    return [num_rows // world_size + (1 if w < num_rows % world_size else 0) for w in range(world_size)]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward pass is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group=None) -> Tensor:
    """Differentiable all_to_all_single: send x[rows of split i] to rank i, receive out_splits[i] rows."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _Arriving:
    """Split sizes on their way: an exchange begun without waiting (`prepare_shuffle`); `result()` waits for it
    and reads them (the one host read the exchange costs)."""

    __slots__ = ("recv_W", "send_W", "work")

    def __init__(self, recv_W: Tensor, send_W: Tensor, work):
        self.recv_W, self.send_W, self.work = recv_W, send_W, work  # the buffers live until the work is done

    def wait(self) -> None:
        self.work.wait()  # NCCL: the current stream waits for the exchange's; gloo: this thread for gloo's

    def result(self) -> list[int]:
        self.wait()
        return self.recv_W.tolist()


_SHUFFLE_SPLITS = "the shuffle's split sizes"


@dataclass
class DispatchState:
    sort: RowPermutation | None  # the rows sorted by expert (None: they came sorted)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    regroup: RowPermutation | None = None  # received rows from (source rank, local expert) to (local expert, rank)
    dropped: int = 0  # rows routed nowhere (expert -1): sorted first, kept home, combined as zeros
    # rows per local expert on the device (the experts' grouped product reads its offsets there), or None
    counts_dev_L: Tensor | None = None


@dataclass
class _Counts:
    """What a dispatch over the group reads before the rows move: rows routed nowhere (kept home), rows this
    rank sends each expert, rows each rank sends each local expert here (host ints, and on the device for
    the regrouping and the experts' offsets), and the widest rank's row width (common_width) or None."""

    dropped: int
    sent_E: list[int]
    recv_WL: list[list[int]]
    recv_dev_WL: Tensor
    widest: int | None = None


class LocalDispatcher:
    """All experts live in this process: sorting rows by expert is the whole dispatch.

    replicated: this process is one of several data-parallel ranks that each hold a copy of every
    expert of the layer (the sMoE's replicated layout, expert_data_parallel.py): no collective,
    and the experts built on it are ordinary data-parallel parameters (not marked expert), whose
    gradients the data-parallel all-reduce averages with the others.
    """

    def __init__(self, num_experts: int, *, timing: bool = False, replicated: bool = False, chunks: int = 1):
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} is invalid: the rows of a layer go in 1 piece (no overlap) or more")
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.first_expert = 0
        self.world_size = 1
        self.replicated = replicated
        self.chunks = chunks  # > 1: the layers pipeline their rows in as many chunks (dispatch_chunks)
        self.timer = CommTimer(timing)
        self._fixed: dict | None = None  # what `one_forward` keeps: name -> (key, value)
        self._forwards = 0  # depth of nested `one_forward` blocks

    @property
    def comm_seconds(self) -> float:
        return self.timer.seconds

    def with_experts(self, num_experts: int) -> LocalDispatcher:
        """A dispatcher of this layout (its process group, replication and chunks) for a layer with another
        number of experts: the sMoE's own count (SparseBlockConfig.smoe_experts). It shares this one's timer,
        so `--log-a2a-time` covers both layers."""
        other = LocalDispatcher(num_experts, replicated=self.replicated, chunks=self.chunks)
        other.timer = self.timer
        return other

    @contextlib.contextmanager
    def one_forward(self):
        """Within the block: one forward of a model whose layers share this dispatcher (LanguageModel). Every
        layer's rows come in the same numbers on each rank then (the tokens of the batch, the sMoE rows of its
        sequences), so what an exchange's split sizes depend on is exchanged by the first layer and kept until
        the block ends (`_once`); a later layer with other numbers raises instead of exchanging alone."""
        self._forwards += 1
        if self._forwards == 1:
            self._fixed = {}
        try:
            yield self
        finally:
            self._forwards -= 1
            if self._forwards == 0:
                for _, value in self._fixed.values():
                    if isinstance(value, _Arriving):  # begun for a shuffle that did not come: let it finish
                        value.wait()
                self._fixed = None

    def _once(self, what: str, key, make):
        """make(), or inside `one_forward` its value from the first layer that asked, whose `key` (the row
        counts it depends on) every later layer must repeat: every rank's layers ask in the same order, so a
        rank that skipped an exchange another rank made would leave its peers waiting."""
        if self._fixed is None:
            return make()
        if what in self._fixed:
            known, value = self._fixed[what]
            if known != key:
                raise RuntimeError(f"{what}: a layer of this forward has row counts {key} where its first layer had "
                                   f"{known}; within one_forward every layer sharing the dispatcher must route "
                                   f"the same rows (exchange per layer outside it)")
            if isinstance(value, _Arriving):  # begun at the start of the forward: read by the first layer
                value = value.result()
                self._fixed[what] = (known, value)
            return value
        value = make()
        self._fixed[what] = (key, value)
        return value

    def prepare_shuffle(self, num_rows: int) -> None:
        """At the start of a forward, inside `one_forward`: its layers will shuffle `num_rows` rows each (Base
        Layers' training). One process shuffles nothing."""

    def shuffle(self, x_SD: Tensor) -> tuple[Tensor, ShuffleState | None]:
        """One process: every row stays here, so the shuffle is the identity.

        The shuffle exists to decide *which* tokens are balanced together (fairseq: "to break
        correlations within the batch"); with one process they are all the rows of the batch
        either way, and balanced assignment does not depend on the order of its rows."""
        return x_SD, None

    def unshuffle(self, y_SD: Tensor, state: ShuffleState | None) -> Tensor:
        return y_SD

    def unshuffle_assignment(self, expert_S: Tensor, state: ShuffleState | None,
                             scores_SE: Tensor) -> tuple[Tensor, Tensor | None]:
        """One process: the experts as assigned, and no counts (the dispatch counts the rows itself)."""
        return expert_S, None

    def dispatch(self, x_SD: Tensor, expert_S: Tensor | None, *, presorted: bool = False,
                 counts_E1: Tensor | None = None, host_counts_E: list[int] | None = None,
                 fault: DeferredCheck | None = None, layer: str = "", common_width: bool = False,
                 assigned: Tensor | None = None) -> tuple[Tensor, list[int], DispatchState]:
        """Sort the rows by expert; rows of expert -1 (dropped slots) come first and are cut off.

        expert_S:      (S,) each row's expert; None for presorted rows whose counts are given (host_counts_E
                       here, counts_E1 for an exchange): nothing to sort, count or cut off.
        presorted:     the caller guarantees expert_S is non-decreasing (no sort, no gather).
        counts_E1:     `count_rows(expert_S, E)` if the caller has it (on the device).
        host_counts_E: rows per expert when the caller knows them on the host (no dropped rows):
                       then nothing is read from the device unless there is a check.
        fault:         the router's deferred check (routing/plan.py): its verdict is read with the counts,
                       and a fault raises the router's error naming `layer`.
        common_width:  the ranks' rows may differ in width (sMoE rows are as long as the local
                       sequence): zero-pad them on the right to the widest (nothing to do here).
        assigned:      a plan's dispatch_counts (AllToAllDispatcher; one process never has them).
        """
        E = self.num_experts
        sort = _sort_by_expert(expert_S, presorted)
        x_sorted = permute_rows(x_SD, sort)
        counts_dev_L = None
        if host_counts_E is not None:
            counts, dropped = list(host_counts_E), 0
            if fault is not None and bool(fault.flag()):
                raise_on_fault([fault.record().tolist()], layer)
        else:
            counts_E1 = count_rows(expert_S, E) if counts_E1 is None else counts_E1
            parts = [counts_E1] if fault is None else [counts_E1, fault.flag().to(counts_E1.device)]
            host = torch.cat(parts).tolist()  # the one host read of a dispatch
            if fault is not None and host[E + 1]:  # a fault: its record, which words the error
                raise_on_fault([fault.record().tolist()], layer)
            dropped, counts = host[0], host[1:E + 1]
            counts_dev_L = counts_E1[1:]
        return _kept(x_sorted, dropped), counts, DispatchState(sort, dropped=dropped, counts_dev_L=counts_dev_L)

    def combine(self, y_RD: Tensor, state: DispatchState) -> Tensor:
        return unpermute_rows(_restore_dropped(y_RD, state.dropped), state.sort)

    def dispatch_chunks(self, chunks: list[tuple[Tensor, Tensor]], *, presorted: bool = False,
                        host_counts: list[list[int]] | None = None, fault: DeferredCheck | None = None,
                        layer: str = "", common_width: bool = False) -> Chunks:
        """`dispatch` of each chunk (x_SD, expert_S) of a layer's rows, for a pipelined layer (module
        docstring): in one process each chunk is dispatched at once. `host_counts`: rows per expert of
        each chunk when known on the host; `fault` (one record for all chunks) is read with the first."""
        parts = [self.dispatch(x, e, presorted=presorted, host_counts_E=None if host_counts is None else host_counts[i],
                               fault=fault if i == 0 else None, layer=layer, common_width=common_width)
                 for i, (x, e) in enumerate(chunks)]
        return Chunks(self, parts)

    # -- cached decoding (smlp/decoding_cache.py): the sMoE experts compute only the positions asked for

    def gather_spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Every rank's span [lo, hi) of positions its sMoE rows want computed, by rank."""
        return [(lo, hi)]

    def received_counts(self, state: DispatchState, counts_L: list[int]) -> list[list[int]]:
        """Rows received per (local expert, source rank), in the order the experts see them."""
        return [[c] for c in counts_L]


class Chunks:
    """The chunks of one pipelined dispatch (`dispatch_chunks`), as the layer's experts take them:

        chunks = dispatcher.dispatch_chunks([(x0_SD, e0_S), (x1_SD, e1_S)], ...)
        for i in range(2):
            x_RD, counts_L = chunks.rows(i)        # chunk i's rows (waits for their exchange)
            chunks.send_back(i, experts(x_RD, counts_L))   # starts their way home
        y0_SD, y1_SD = chunks.results()            # every chunk home, in its rows' order

    In one process (this class) nothing is exchanged; `ExchangedChunks` overlaps the exchanges."""

    def __init__(self, dispatcher, parts: list):
        self.dispatcher, self.parts = dispatcher, parts
        self.back: list[Tensor | None] = [None] * len(parts)

    def rows(self, i: int) -> tuple[Tensor, list[int]]:
        return self.parts[i][0], self.parts[i][1]

    def send_back(self, i: int, y_RD: Tensor) -> None:
        self.back[i] = y_RD

    def results(self) -> list[Tensor]:
        return [self.dispatcher.combine(y, part[2]) for y, part in zip(self.back, self.parts)]


class ExchangedChunks(Chunks):
    """The chunks of a pipelined dispatch over the expert-parallel group: every chunk's rows are sent at
    once (async), `rows(i)` waits only for chunk i, `send_back(i, y)` starts its way home at once, and
    `results()` waits for the rest. What the layer computes between these calls overlaps the exchanges
    (the experts of chunk 0 with the rows of chunk 1 arriving, those of chunk 1 with chunk 0's results
    leaving; in the backward pass the same, reversed)."""

    def __init__(self, dispatcher, states: list[DispatchState], flights: list, counts: list[list[int]]):
        super().__init__(dispatcher, [])
        self.states, self.flights, self.counts = states, flights, counts
        self.back = [None] * len(states)

    def rows(self, i: int) -> tuple[Tensor, list[int]]:
        state = self.states[i]
        with self.dispatcher.timer(self.flights[i][0].device):  # the exchange's time not hidden by compute
            x_recv = wait_all_to_all(*self.flights[i])
        return permute_rows(x_recv, state.regroup), self.counts[i]

    def send_back(self, i: int, y_RD: Tensor) -> None:
        state = self.states[i]
        y_recv = unpermute_rows(y_RD, state.regroup)
        self.back[i] = start_all_to_all(y_recv, state.send_splits, state.recv_splits, self.dispatcher.ep_group)

    def results(self) -> list[Tensor]:
        out = []
        for state, (y_sorted, flight) in zip(self.states, self.back):
            with self.dispatcher.timer(y_sorted.device):
                y_sorted = wait_all_to_all(y_sorted, flight)
            out.append(unpermute_rows(_restore_dropped(y_sorted, state.dropped), state.sort))
        return out


class AllToAllDispatcher(LocalDispatcher):
    """Expert parallelism over a process group: rank r of `ep_group` owns experts [r*L, (r+1)*L)."""

    def __init__(self, num_experts: int, ep_group=None, *, timing: bool = False, chunks: int = 1):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "AllToAllDispatcher needs an initialized torch.distributed process group; "
                "use LocalDispatcher for single-process runs"
            )
        world = dist.get_world_size(ep_group)
        local = expert_data_parallel.expert_parallel_layout(num_experts, world)
        super().__init__(num_experts, timing=timing, chunks=chunks)
        self.ep_group = ep_group
        self.world_size = world
        self.rank = dist.get_rank(ep_group)
        self.num_local_experts = local
        self.first_expert = self.rank * local
        # global ranks of the group, named in routing errors
        self.group_ranks = (list(range(world)) if ep_group is None
                            else [dist.get_global_rank(ep_group, r) for r in range(world)])
        self._indices: dict = {}  # split sizes -> _AssignmentIndex (`unshuffle_assignment`)
        self._labels: dict = {}  # device -> (W L,) the local expert of each received block (`_regroup`)

    def with_experts(self, num_experts: int) -> AllToAllDispatcher:
        """The same expert-parallel group for a layer with `num_experts` experts (LocalDispatcher.with_experts);
        ValueError when the group's size does not divide them."""
        other = AllToAllDispatcher(num_experts, self.ep_group, chunks=self.chunks)
        other.timer = self.timer
        return other

    def _exchange_counts(self, counts_WX: Tensor) -> Tensor:
        """counts_WX[w] goes to rank w; returns what arrives from each rank, on the collective's device."""
        counts_WX = counts_WX.to(self._device)
        recv_WX = torch.empty_like(counts_WX)
        dist.all_to_all_single(recv_WX, counts_WX, group=self.ep_group)
        return recv_WX

    def shuffle(self, x_SD: Tensor) -> tuple[Tensor, ShuffleState]:
        """Send the local rows to random ranks (fairseq BaseLayer's `base_shuffle`).

        1. Draw a random permutation of the local rows from the global RNG, exactly as fairseq
           does (`torch.randperm(S, device=...)`), so a seeded run shuffles like fairseq's.
        2. Cut the permuted rows into W near-equal consecutive pieces; piece w goes to rank w.
        3. Rows arrive ordered by source rank; `unshuffle` reverses both steps.
        """
        S, W = x_SD.shape[0], self.world_size
        order = RowPermutation(torch.randperm(S, device=x_SD.device))
        send_splits = shuffle_splits(S, W)
        with self.timer(x_SD.device):
            # what every rank sends this one: exchanged once per `one_forward` (every layer shuffles the
            # same number of rows on each rank)
            recv_splits = self._once(_SHUFFLE_SPLITS, S, lambda: self._shuffle_splits(S).result())
            x_recv = all_to_all(permute_rows(x_SD, order), recv_splits, send_splits, self.ep_group)
        return x_recv, ShuffleState(order, send_splits, recv_splits)

    def prepare_shuffle(self, num_rows: int) -> None:
        """At the start of a forward, inside `one_forward`: begin exchanging the split sizes of a shuffle of
        `num_rows` rows without waiting (async_op), so that the first layer that shuffles reads them arrived
        instead of waiting for an exchange in the middle of the forward. Outside `one_forward` nothing."""
        if self._fixed is not None and _SHUFFLE_SPLITS not in self._fixed:
            self._fixed[_SHUFFLE_SPLITS] = (num_rows, self._shuffle_splits(num_rows))

    def _shuffle_splits(self, S: int) -> _Arriving:
        """What every rank's shuffle sends this one, begun (`_Arriving.result()` reads it)."""
        W = self.world_size
        # the split sizes made on the collective's device (no host-to-device copy)
        send_W = S // W + (torch.arange(W, device=self._device) < S % W).long()
        recv_W = torch.empty_like(send_W)
        return _Arriving(recv_W, send_W, dist.all_to_all_single(recv_W, send_W, group=self.ep_group, async_op=True))

    def unshuffle(self, y_SD: Tensor, state: ShuffleState) -> Tensor:
        with self.timer(y_SD.device):
            y_home = all_to_all(y_SD, state.send_splits, state.recv_splits, self.ep_group)
        return unpermute_rows(y_home, state.order)

    def unshuffle_assignment(self, expert_R: Tensor, state: ShuffleState, scores_RE: Tensor) -> tuple[Tensor, Tensor]:
        """The experts this rank assigned to the rows the shuffle brought it, sent home, with what the home
        rank's dispatch would otherwise exchange (sMLP's tMoE, Base Layers): this rank knows the expert and
        the home of every row it assigned, so the counts need no exchange of their own nor a read before it.

        1. Count, on the device, the rows from each rank w per expert, c[w, e], and the non-finite rows
           among each rank's scores (the router's check: whose scores they were travels with the count).
        2. Send rank h, after the experts of its rows: c[h, :] (its rows per expert), c[:, experts of h]
           (the rows each rank will send h's experts) and the non-finite rows per rank.
        3. Each rank sums what the assigning ranks sent it: `RoutingPlan.dispatch_counts`, (E + W L + W,),
           which `dispatch` reads (its one host read) in place of the count exchange.

        Returns:
            expert_S: (S,) int64 each home row's expert, in the home rows' order
            counts_X: (E + W L + W,) int64 the plan's dispatch_counts
        """
        W, L, E = self.world_size, self.num_local_experts, self.num_experts
        device = expert_R.device
        X = E + W * L + W
        key = (tuple(state.send_splits), tuple(state.recv_splits), E, X, device)
        index = self._indices.get(key)
        if index is None:  # the same split sizes come back step after step: kept for the last few
            index = self._indices[key] = _AssignmentIndex(state, E, X, device)
            while len(self._indices) > 4:
                self._indices.pop(next(iter(self._indices)))
        # 1. one scatter into (W, E + 1); a non-finite row counts in column E instead of its expert's (then
        #    every rank raises before the counts are used)
        at_R = torch.where(nonfinite_rows(scores_RE), index.bad_R, expert_R + index.first_R)
        counts_WE1 = torch.zeros(W * (E + 1), dtype=torch.long, device=device).scatter_add_(
            0, at_R, torch.ones_like(at_R)).view(W, E + 1)
        c_WE, bad_W = counts_WE1[:, :E], counts_WE1[:, E]
        # 2. row h of extra_WX goes to rank h, after the experts of h's rows
        extra_WX = torch.cat([c_WE, c_WE.reshape(W, W, L).transpose(0, 1).reshape(W, W * L), bad_W.expand(W, W)], 1)
        send = torch.cat([expert_R, extra_WX.view(-1)])[index.send]
        with self.timer(device):
            received = _exchange(send, index.out_splits, index.in_splits, self.ep_group)
        # 3. this rank's rows' experts (in the order they were sent) and the counts summed over the assigners
        counts_X = received[index.received_counts].view(W, X).sum(0)
        return unpermute_rows(received[index.received_experts], state.order), counts_X

    @property
    def _device(self) -> torch.device:
        # NCCL needs device tensors, gloo host tensors; follow the backend of the group.
        return collective_device(self.ep_group)

    def dispatch(self, x_SD: Tensor, expert_S: Tensor | None, *, presorted: bool = False,
                 counts_E1: Tensor | None = None, host_counts_E: list[int] | None = None,
                 fault: DeferredCheck | None = None, layer: str = "", common_width: bool = False,
                 assigned: Tensor | None = None) -> tuple[Tensor, list[int], DispatchState]:
        """As LocalDispatcher.dispatch, over the group. With common_width every rank's row width travels with
        its counts, and the rows are zero-padded on the right to the widest before they move: no collective of
        its own. With `assigned` (a plan's dispatch_counts, which Base Layers' shuffle brought home with the
        experts) nothing is exchanged before the rows. Rows whose counts are known on the host and that carry
        no check (the deterministic sMoE's) exchange their counts once per `one_forward`."""
        W, L = self.world_size, self.num_local_experts
        # 1. Sort rows by global expert: rows for rank w are then contiguous, ordered by local expert
        #    (already so when the caller says expert_S is non-decreasing, e.g. deterministic sMoE);
        #    dropped rows (expert -1) come first.
        sort = _sort_by_expert(expert_S, presorted)
        x_sorted = permute_rows(x_SD, sort)
        width = x_SD.shape[-1] if common_width else None
        with self.timer(x_SD.device):
            # 2. Learn how many rows every rank sends each local expert here, how many this rank sends each
            #    expert, and whether a rank's router saw a fault: from the assignment's counts, or by
            #    exchanging this rank's counts, check verdict and row width with every rank (`_counts`).
            # 3. One host read (`_Counts`); on a fault every rank raises the same error before the rows move.
            if assigned is not None:
                counts = self._assigned_counts(assigned, fault, layer)
            elif host_counts_E is not None and fault is None:
                counts = self._once("the presorted rows' counts", (tuple(host_counts_E), width),
                                    lambda: self._counts([(expert_S, counts_E1)], None, layer, width)[0])
            else:
                counts = self._counts([(expert_S, counts_E1)], fault, layer, width)[0]
            send_splits = [sum(counts.sent_E[w * L:(w + 1) * L]) for w in range(W)]
            recv_splits = [sum(row) for row in counts.recv_WL]
            x_send = _kept(x_sorted, counts.dropped)
            if width is not None and counts.widest > width:
                x_send = torch.nn.functional.pad(x_send, (0, counts.widest - width))
            # 4. Exchange the rows; they arrive grouped by (source rank, local expert).
            x_recv = all_to_all(x_send, recv_splits, send_splits, self.ep_group)
        # 5. Regroup by (local expert, source rank) so each local expert sees one contiguous block
        #    (nothing to do with one local expert per rank, the paper's layout).
        counts_L = [sum(row[l] for row in counts.recv_WL) for l in range(L)]
        counts_dev_L = counts.recv_dev_WL.sum(0)  # on the device, for the experts' grouped product
        regroup = self._regroup(counts.recv_dev_WL, sum(recv_splits), x_SD.device)
        state = DispatchState(sort, send_splits, recv_splits, regroup, counts.dropped, counts_dev_L)
        return permute_rows(x_recv, regroup), counts_L, state

    def _regroup(self, recv_dev_WL: Tensor, num_rows: int, device: torch.device) -> RowPermutation | None:
        """The received rows, which come in blocks (source rank, local expert), regrouped by local expert, each
        expert's by source rank: a stable sort of the rows' local experts, made on the device from the counts
        (no host read). None with one local expert (the paper's layout): nothing to regroup."""
        W, L = self.world_size, self.num_local_experts
        if L == 1:
            return None
        labels_X = self._labels.get(device)
        if labels_X is None:  # block (w, l) holds rows of local expert l
            labels_X = self._labels[device] = torch.arange(L, device=device).repeat(W)
        local_R = torch.repeat_interleave(labels_X, recv_dev_WL.to(device).reshape(-1), output_size=num_rows)
        return RowPermutation(torch.argsort(local_R, stable=True))

    def _counts(self, chunks: list[tuple[Tensor | None, Tensor | None]], fault: DeferredCheck | None, layer: str,
                width: int | None) -> list[_Counts]:
        """Exchange every chunk's rows per local expert (counted on the device unless given), the check's verdict
        and, with a `width`, the row width with every rank; read them with this rank's counts (one host read).
        chunks: (expert_S, counts_E1 or None) of each chunk of a layer's rows."""
        W, L, E = self.world_size, self.num_local_experts, self.num_experts
        counts = [count_rows(e, E) if c is None else c for e, c in chunks]
        n = len(counts)
        flag = fault.flag().to(counts[0].device) if fault is not None else counts[0].new_zeros(1)
        parts = [c[1:].view(W, L) for c in counts] + [flag.view(1, 1).expand(W, 1)]
        if width is not None:
            parts.append(counts[0].new_full((W, 1), width))
        recv_WX = self._exchange_counts(torch.cat(parts, 1))
        host = torch.cat([*(c.to(recv_WX.device) for c in counts), recv_WX.reshape(-1)]).tolist()
        X = n * L + 1 + (width is not None)
        mine, recv = host[:n * (E + 1)], [host[n * (E + 1) + w * X:n * (E + 1) + (w + 1) * X] for w in range(W)]
        if any(row[n * L] for row in recv):
            self._raise_fault(fault, layer)
        widest = max(row[-1] for row in recv) if width is not None else None
        return [_Counts(mine[i * (E + 1)], mine[i * (E + 1) + 1:(i + 1) * (E + 1)],
                        [row[i * L:(i + 1) * L] for row in recv], recv_WX[:, i * L:(i + 1) * L], widest)
                for i in range(n)]

    def _assigned_counts(self, counts_X: Tensor, fault: DeferredCheck | None, layer: str) -> _Counts:
        """A plan's dispatch_counts read on the host (`unshuffle_assignment`): a fault raises on every rank."""
        W, L, E = self.world_size, self.num_local_experts, self.num_experts
        host = counts_X.tolist()  # the one host read of this dispatch
        if any(host[E + W * L:]):  # non-finite scores on some rank: every rank counted them
            self._raise_fault(fault, layer)
        recv = host[E:E + W * L]
        return _Counts(0, host[:E], [recv[w * L:(w + 1) * L] for w in range(W)], counts_X[E:E + W * L].view(W, L))

    def _raise_fault(self, fault: DeferredCheck | None, layer: str) -> None:
        """Every rank of the group read a fault verdict: each sends the others its fault record (zeros where its
        check passed) and all raise the error of the first faulty one, naming every rank that saw a fault."""
        W = self.world_size
        record = fault.record().to(self._device) if fault is not None else \
            torch.zeros(FAULT_WIDTH, dtype=torch.long, device=self._device)
        records = self._exchange_counts(record.view(1, FAULT_WIDTH).expand(W, FAULT_WIDTH).contiguous()).tolist()
        raise_on_fault(records, layer, self.group_ranks)
        raise RuntimeError(f"{layer}: a rank's router check failed but no rank's fault record shows a fault")

    def dispatch_chunks(self, chunks: list[tuple[Tensor, Tensor]], *, presorted: bool = False,
                        host_counts: list[list[int]] | None = None, fault: DeferredCheck | None = None,
                        layer: str = "", common_width: bool = False) -> ExchangedChunks:
        """As `dispatch` for each chunk (x_SD, expert_S) of a layer's rows, every chunk's rows sent at once
        without waiting (`ExchangedChunks`). host_counts is not needed (the counts are exchanged anyway).

        1. Sort each chunk's rows by global expert (dropped rows first), count them on the device.
        2. One exchange of every chunk's counts per local expert, the check's verdict (one for the layer)
           and, with common_width, the row width: one host read for all chunks; a fault raises on
           every rank before any row moves.
        3. Start every chunk's row exchange (async); `ExchangedChunks.rows(i)` waits for chunk i."""
        W, L = self.world_size, self.num_local_experts
        sorts = [_sort_by_expert(e, presorted) for _, e in chunks]
        device = chunks[0][0].device
        width = max(x.shape[-1] for x, _ in chunks) if common_width else None
        with self.timer(device):
            counts = self._counts([(e, None) for _, e in chunks], fault, layer, width)
        states, flights, counts_L = [], [], []
        for (x_SD, _), sort, c in zip(chunks, sorts, counts):
            send_splits = [sum(c.sent_E[w * L:(w + 1) * L]) for w in range(W)]
            recv_splits = [sum(r) for r in c.recv_WL]
            x_send = _kept(permute_rows(x_SD, sort), c.dropped)
            if width is not None and c.widest > x_send.shape[-1]:
                x_send = torch.nn.functional.pad(x_send, (0, c.widest - x_send.shape[-1]))
            flights.append(start_all_to_all(x_send, recv_splits, send_splits, self.ep_group))
            states.append(DispatchState(sort, send_splits, recv_splits,
                                        self._regroup(c.recv_dev_WL, sum(recv_splits), device), c.dropped))
            counts_L.append([sum(r[l] for r in c.recv_WL) for l in range(L)])
        return ExchangedChunks(self, states, flights, counts_L)

    def combine(self, y_RD: Tensor, state: DispatchState) -> Tensor:
        # Reverse of dispatch: undo the regrouping, send rows home, undo the sort.
        y_recv = unpermute_rows(y_RD, state.regroup)
        with self.timer(y_RD.device):
            y_sorted = all_to_all(y_recv, state.send_splits, state.recv_splits, self.ep_group)
        return unpermute_rows(_restore_dropped(y_sorted, state.dropped), state.sort)

    def gather_spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        with self.timer(self._device):
            span = torch.tensor([lo, hi], dtype=torch.long, device=self._device)
            spans = [torch.empty_like(span) for _ in range(self.world_size)]
            dist.all_gather(spans, span, group=self.ep_group)
        return [(int(s[0]), int(s[1])) for s in torch.stack(spans).cpu()]

    def received_counts(self, state: DispatchState, counts_L: list[int]) -> list[list[int]]:
        # With one local expert the rows arrive grouped by source rank; otherwise the regrouping
        # permutation tells where each (source rank, local expert) block went.
        if state.regroup is None:
            return [list(state.recv_splits)]
        W = self.world_size
        source_R = torch.repeat_interleave(torch.arange(W), torch.tensor(state.recv_splits))
        source_R = source_R[state.regroup.order_S.cpu()]
        out, first = [], 0
        for c in counts_L:
            out.append(torch.bincount(source_R[first:first + c], minlength=W).tolist())
            first += c
        return out


class _AssignmentIndex:
    """Where `unshuffle_assignment`'s values go, for one shuffle's split sizes (kept while they recur): each
    received row's place in the (W, E + 1) counts, the send buffer's order (rank h's rows' experts, then the
    X counts for h) and where the experts and the counts lie in what arrives. Made on the device from
    ranges: no host-to-device copy."""

    def __init__(self, state: ShuffleState, E: int, X: int, device: torch.device):
        sent, received = state.send_splits, state.recv_splits
        R = sum(received)
        self.first_R = torch.cat([torch.full((n,), w * (E + 1), dtype=torch.long, device=device)
                                  for w, n in enumerate(received)])
        self.bad_R = self.first_R + E
        starts = [sum(received[:h]) for h in range(len(received))]
        self.send = torch.cat([torch.arange(a, b, device=device) for h, n in enumerate(received)
                               for a, b in ((starts[h], starts[h] + n), (R + h * X, R + (h + 1) * X))])
        self.out_splits, self.in_splits = [n + X for n in sent], [n + X for n in received]
        firsts = [sum(self.out_splits[:a]) for a in range(len(sent))]
        self.received_experts = torch.cat([torch.arange(f, f + n, device=device) for f, n in zip(firsts, sent)])
        self.received_counts = torch.cat([torch.arange(f + n, f + n + X, device=device) for f, n in zip(firsts, sent)])


def _sort_by_expert(expert_S: Tensor | None, presorted: bool) -> RowPermutation | None:
    """The rows sorted by expert (dropped rows, expert -1, first), each expert's in their order; None for
    presorted rows."""
    return None if presorted else RowPermutation(torch.argsort(expert_S, stable=True))


def _kept(x_sorted: Tensor, dropped: int) -> Tensor:
    """The rows after the `dropped` ones sorted first; the rows themselves when none was dropped (a slice
    of all of them would cost a zero-filled copy of their gradient in the backward pass)."""
    return x_sorted[dropped:] if dropped else x_sorted


def _restore_dropped(y_RD: Tensor, dropped: int) -> Tensor:
    """Zero rows in front for the dropped rows (their slot contributes nothing)."""
    if not dropped:
        return y_RD
    return torch.cat([y_RD.new_zeros((dropped,) + tuple(y_RD.shape[1:])), y_RD])
