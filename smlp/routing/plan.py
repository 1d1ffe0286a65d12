"""The routing plan (where each row goes, with what weight) and the routers' input checks.

A router (routes.py, gates.py) turns logits into a `RoutingPlan` without collectives or parameters,
so every routing rule is testable in one process. Non-finite scores raise `NonFiniteScoresError`
naming the layer (an expert chosen from them would be arbitrary); token ids outside a HASH table
raise ValueError. Inside a layer (`defer_checks=True`) a router leaves its check on the device as a
fault record in the plan, and the dispatcher reads it with the split sizes it reads anyway, so the
check costs no host sync of its own. With expert parallelism the record travels with the counts,
so every rank of the group raises the same error instead of waiting in the all2all until timeout.
Cached decoding on one process asks for the bare verdict (`defer_checks=FLAG_ONLY`: a few operators
instead of the record's two dozen) and on a fault routes again, reading the full check.

Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["RoutingPlan", "NonFiniteScoresError", "DeferredCheck", "FAULT_WIDTH", "FLAG_ONLY", "count_rows",
           "nonfinite_fault", "nonfinite_flag", "nonfinite_rows", "hash_fault", "hash_flag", "routing_error",
           "raise_on_fault", "check_finite_scores", "deferred_or_raised", "score_check", "token_id_check"]


class _PlanFields(NamedTuple):
    experts_SK: Tensor
    weights_SK: Tensor
    aux_loss: Tensor | None = None
    fault: DeferredCheck | Tensor | None = None
    dispatch_counts: Tensor | None = None


class RoutingPlan(_PlanFields):
    """Where each row goes and how its expert output is weighted.

    experts_SK: expert index per (row, slot), -1 where the slot is dropped (over capacity).
    weights_SK: combine weight per (row, slot); differentiable w.r.t. the router's scores.
                A dropped slot has weight 0.
    aux_loss:   auxiliary load-balancing loss (scalar) or None when the router has none.
    fault:      the router's input check left for the dispatcher: a `DeferredCheck` (`defer_checks=True`),
                its bare verdict (FLAG_ONLY), or None when the check was read already.
    dispatch_counts: (E + W L + W,) int64, what the dispatch reads instead of exchanging row counts, or None:
                the rows this rank sends each expert, the rows each rank w sends each of this rank's
                L experts ((W, L), flattened), the non-finite rows among each rank's scores. Base Layers'
                shuffle brings them home with the experts: the ranks that assigned the rows counted them
                (dispatch.AllToAllDispatcher.unshuffle_assignment).

    A tuple: a router module returns it from `forward`, and torch's module hooks (fairseq's
    NanDetector among them) expect a module's output to be a tensor or a tuple of them.
    """

    __slots__ = ()

    def __new__(cls, experts_SK: Tensor, weights_SK: Tensor, aux_loss: Tensor | None = None,
                fault: DeferredCheck | Tensor | None = None, dispatch_counts: Tensor | None = None):
        if experts_SK.dim() != 2 or experts_SK.shape != weights_SK.shape:
            raise ValueError(
                f"RoutingPlan needs experts_SK and weights_SK of the same (S, K) shape, got "
                f"{tuple(experts_SK.shape)} and {tuple(weights_SK.shape)}"
            )
        return super().__new__(cls, experts_SK, weights_SK, aux_loss, fault, dispatch_counts)

    def counts(self, num_experts: int) -> Tensor:
        """Rows per expert (dropped slots excluded): (E,) long, on the device (no host sync)."""
        return count_rows(self.experts_SK.reshape(-1), num_experts)[1:]


def count_rows(expert_S: Tensor, num_experts: int) -> Tensor:
    """(E + 1,) long: rows routed nowhere (expert -1, a dropped slot), then rows per expert.

    A scatter-add, which never waits for the device; bincount reads the largest index on the host."""
    index_S = expert_S.reshape(-1).long() + 1
    return torch.zeros(num_experts + 1, dtype=torch.long, device=expert_S.device).scatter_add_(
        0, index_S, torch.ones_like(index_S))


class NonFiniteScoresError(FloatingPointError):
    """Router scores with NaN or +-inf entries; the message names the layer and what to check."""


class DeferredCheck:
    """A router's input check left for the dispatcher (`defer_checks=True`).

    flag():   its verdict on the device, (1,) bool, True on a fault: a few operators, read with the counts
    record(): its fault record (FAULT_WIDTH,) int64, the figures an error states: built only once a flag
              was read (two dozen operators that a step without a fault does not run)
    Neither reads the host. The check keeps the scores or token ids it reads (the layer's graph keeps them too).
    """

    __slots__ = ("_flag", "_record")

    def __init__(self, flag: Callable[[], Tensor], record: Callable[[], Tensor]):
        self._flag, self._record = flag, record

    def flag(self) -> Tensor:
        return self._flag()

    def record(self) -> Tensor:
        return self._record()


# A fault record: FAULT_WIDTH int64 values, record[0] the kind of fault (0: none), the rest its
# details, so that every rank can word the error of the rank that saw it.
#   NONFINITE:  bad rows, rows, NaN entries, +inf entries, -inf entries, first bad row
#   HASH_RANGE: smallest token id, largest token id, table size, 0, 0, 0
FAULT_WIDTH = 7
NO_FAULT, NONFINITE, HASH_RANGE = 0, 1, 2
# defer_checks=FLAG_ONLY: the check's verdict alone, (1,) bool, True on a fault (`nonfinite_flag`, `hash_flag`)
FLAG_ONLY = "flag"


def nonfinite_fault(scores_SE: Tensor, *, allow_neg_inf: bool = False) -> Tensor:
    """The fault record of a non-finite-scores check, computed on the scores' device (no sync).

    allow_neg_inf: -inf marks an expert a row may not use (a masked logit of a softmax gate);
    a row then still needs one finite score."""
    scores_SE = scores_SE.detach()
    S = scores_SE.shape[0]
    nan_SE, pos_SE, neg_SE = torch.isnan(scores_SE), torch.isposinf(scores_SE), torch.isneginf(scores_SE)
    bad_SE = nan_SE | pos_SE
    if not allow_neg_inf:
        bad_SE = bad_SE | neg_SE
    bad_rows_S = bad_SE.any(dim=-1)
    if allow_neg_inf and scores_SE.shape[-1]:
        bad_rows_S = bad_rows_S | neg_SE.all(dim=-1)
    n_bad = bad_rows_S.sum()
    first = (bad_rows_S.long().cumsum(0) == 0).sum()  # rows before the first bad one
    kind = torch.where(n_bad > 0, NONFINITE, NO_FAULT)
    return torch.stack([kind, n_bad, torch.full_like(n_bad, S), nan_SE.sum(), pos_SE.sum(), neg_SE.sum(),
                        first]).long()


def nonfinite_flag(scores_SE: Tensor, *, allow_neg_inf: bool = False) -> Tensor:
    """(1,) bool: whether `nonfinite_fault` reports a fault, without its figures (no sync)."""
    if not allow_neg_inf:  # x - x is 0 for a finite x, NaN for NaN and +-inf (isfinite takes four ops)
        return (scores_SE - scores_SE).ne(0).any().view(1)
    bad = (torch.isnan(scores_SE) | torch.isposinf(scores_SE)).any()
    if scores_SE.shape[-1]:  # a row whose every expert is masked
        bad = bad | torch.isneginf(scores_SE).all(dim=-1).any()
    return bad.view(1)


def hash_fault(token_ids_S: Tensor, table_size: int) -> Tensor:
    """The fault record of the HASH router's vocabulary check (no sync)."""
    ids_S = token_ids_S.reshape(-1).long()
    if not ids_S.numel():
        return torch.zeros(FAULT_WIDTH, dtype=torch.long, device=ids_S.device)
    lo, hi = ids_S.min(), ids_S.max()
    kind = torch.where((lo < 0) | (hi >= table_size), HASH_RANGE, NO_FAULT)
    zero = torch.zeros_like(lo)
    return torch.stack([kind, lo, hi, torch.full_like(lo, table_size), zero, zero, zero])


def hash_flag(token_ids_S: Tensor, table_size: int) -> Tensor:
    """(1,) bool: whether `hash_fault` reports a fault, without its figures (no sync)."""
    return ((token_ids_S < 0) | (token_ids_S >= table_size)).any().view(1)


def routing_error(records: list[list[int]], layer: str, ranks: list[int] | None = None) -> Exception | None:
    """The error for fault records read on the host, or None when every record is clean.

    records: one record per rank (one in a single process); ranks: their ranks in the expert-
    parallel group, named in the message (None: a single process). Every rank words the first
    faulty record, so all raise the same error."""
    faulty = [i for i, r in enumerate(records) if r[0] != NO_FAULT]
    if not faulty:
        return None
    record = records[faulty[0]]
    kind = record[0]
    if kind == NONFINITE:
        n_bad, S, n_nan, n_pos, n_neg, first = record[1:7]
        message = (
            f"{layer}: router scores are not finite in {n_bad} of {S} rows (first: row {first}; {n_nan} NaN, "
            f"{n_pos} +inf, {n_neg} -inf entries). The layer's input or router weights have diverged or "
            f"overflowed; no expert choice can be made from them. Check the loss before this step, lower the "
            f"learning rate, or train in fp32 / with a smaller --fp16-init-scale.")
        error_type = NonFiniteScoresError
    elif kind == HASH_RANGE:
        lo, hi, table_size = record[1:4]
        message = (f"{layer}: hash routing got token ids in [{lo}, {hi}] but the hash table covers ids "
                   f"0..{table_size - 1}; the vocabulary does not match the table")
        error_type = ValueError
    else:
        raise ValueError(f"{layer}: unknown routing fault record {record}")
    if ranks is not None:
        seen = (f"rank {ranks[faulty[0]]}" if len(faulty) == 1 else
                f"ranks {', '.join(str(ranks[i]) for i in faulty)} (the figures are rank {ranks[faulty[0]]}'s)")
        message += f" [seen on {seen}; every rank of the expert-parallel group raises this error]"
    return error_type(message)


def raise_on_fault(records: list[list[int]], layer: str, ranks: list[int] | None = None) -> None:
    """Raise `routing_error`'s error for fault records read on the host, if there is one."""
    error = routing_error(records, layer, ranks)
    if error is not None:
        raise error


def _raise_now(fault: Tensor, layer: str) -> None:
    raise_on_fault([fault.tolist()], layer)  # one host read


def check_finite_scores(scores_SE: Tensor, layer: str, *, allow_neg_inf: bool = False) -> None:
    """Raise NonFiniteScoresError naming `layer` if any score is NaN or infinite (one host read).

    allow_neg_inf: -inf marks an expert a row may not use (a masked logit of a softmax gate);
    a row then still needs one finite score.
    """
    _raise_now(nonfinite_fault(scores_SE, allow_neg_inf=allow_neg_inf), layer)


def deferred_or_raised(check: DeferredCheck, layer: str, defer: bool) -> DeferredCheck | None:
    """The check to leave in the plan (`defer`), or None after reading its record (and raising if it is a fault)."""
    if defer:
        return check
    _raise_now(check.record(), layer)
    return None


def score_check(scores_SE: Tensor, layer: str, defer: bool | str, *,
                allow_neg_inf: bool = False) -> DeferredCheck | Tensor | None:
    """A rule's check of its scores: read at once (defer False: raises on a fault, returns None), left for
    the dispatcher (True: a DeferredCheck), or its bare verdict (FLAG_ONLY)."""
    if defer == FLAG_ONLY:
        return nonfinite_flag(scores_SE, allow_neg_inf=allow_neg_inf)
    check = DeferredCheck(lambda: nonfinite_flag(scores_SE.detach(), allow_neg_inf=allow_neg_inf),
                          lambda: nonfinite_fault(scores_SE, allow_neg_inf=allow_neg_inf))
    return deferred_or_raised(check, layer, defer)


def token_id_check(token_ids_S: Tensor, table_size: int, layer: str,
                   defer: bool | str) -> DeferredCheck | Tensor | None:
    """The HASH rule's check of its token ids, as `score_check`."""
    if defer == FLAG_ONLY:
        return hash_flag(token_ids_S, table_size)
    check = DeferredCheck(lambda: hash_flag(token_ids_S, table_size), lambda: hash_fault(token_ids_S, table_size))
    return deferred_or_raised(check, layer, defer)


def nonfinite_rows(scores_SE: Tensor) -> Tensor:
    """(S,) bool: the rows with a NaN or infinite score (x - x is 0 for a finite x, NaN otherwise); no sync."""
    return (scores_SE - scores_SE).ne(0).any(dim=-1)
