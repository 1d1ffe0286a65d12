"""Evaluation routing of the balanced routers: greedy on the scores minus the experts' prices.

Training assigns rows to experts with exact balance (assignment.py); evaluation cannot, because a
balanced assignment couples the rows of a batch (a token's expert would depend on later tokens).
Plain greedy routing (argmax of the scores, fairseq's BaseLayer) routes differently from training:
at the scale of this project's benchmarks the busiest expert gets 2-5x the mean load, and the
validation loss depends on which experts a run happens to overload, so equal trainings score
6-12% apart.

The auction that makes the balanced assignment also yields its dual: one price per expert, such
that argmax_e(score - price_e) gives every row its assigned expert (up to the auction's eps).
`RouterPrices` keeps an exponential average of those prices over training steps, averaged over
all data-parallel ranks (one all-reduce of E + 1 numbers at the start of each training forward of
the layer), and evaluation routes each row on its own by argmax(score - price):
per row (causal, independent of the batch), and as training would assign on average.

Shapes: the core's legend (smlp/__init__.py); here S rows, E experts.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from .assignment import balanced_assignment

__all__ = ["RouterPrices", "BALANCED_EVAL_ROUTINGS", "DEFAULT_PRICE_DECAY"]

logger = logging.getLogger(__name__)

# "priced": argmax(score - price) with the averaged training prices; "greedy": argmax(score)
BALANCED_EVAL_ROUTINGS = ("priced", "greedy")
DEFAULT_PRICE_DECAY = 0.95


class RouterPrices(nn.Module):
    """The expert prices a balanced router evaluates with, averaged over training steps.

    Buffers (in the checkpoint, kept in fp32 whatever the model's dtype):
        price_E: (E,) the exponential average of the auction's centred prices, in score units
        price_weight: () the average's total weight (0 before the first training step: then the
                 prices are zero and evaluation is greedy)
    """

    def __init__(self, num_experts: int, decay: float = DEFAULT_PRICE_DECAY):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"price decay {decay} must be in [0, 1) (the weight of the previous average per step)")
        self.decay = decay
        self.register_buffer("price_E", torch.zeros(num_experts))
        self.register_buffer("price_weight", torch.zeros(()))
        self._pending: Tensor | None = None  # (E + 1,) prices x rows and rows recorded since the last fold

    def observe(self, price_E: Tensor, rows: int) -> None:
        """Record one assignment's prices (from `rows` rows) for the next `fold`; no collective, no host read."""
        with torch.no_grad():
            stat = torch.cat([price_E.float() * rows, price_E.new_full((1,), float(rows), dtype=torch.float32)])
            self._pending = stat if self._pending is None else self._pending + stat.to(self._pending.device)

    def fold(self, reduce=None) -> None:
        """Fold the prices recorded since the last fold into the average.

        The owning layer calls it once at the start of every training forward, on every rank, whatever its
        rows (so every rank makes the same collectives): `reduce` sums over the data-parallel ranks (the
        dispatcher's `sum_over_ranks`), and every rank gets the same average, the rows-weighted mean of the
        ranks' prices. Nothing recorded on any rank changes nothing. No host read.
        """
        with torch.no_grad():
            stat = self._pending if self._pending is not None else self.price_E.new_zeros(self.price_E.shape[0] + 1)
            self._pending = None
            if reduce is not None:
                stat = reduce(stat)
            stat = stat.to(self.price_E.device)
            total = stat[-1]
            mean_E = stat[:-1] / total.clamp(min=1.0)
            step = (total > 0).float() * (1.0 - self.decay)
            self.price_E.mul_(1.0 - step).add_(step * mean_E)
            self.price_weight.mul_(1.0 - step).add_(step)

    def experts(self, scores_SE: Tensor, *, assign: bool, observe: bool, priced: bool) -> Tensor | None:
        """The rows' experts (S,) under a balanced router: with `assign` the balanced assignment of the rows
        (its prices recorded when `observe`, a training step); otherwise argmax(score - price) per row when
        `priced`, else None (greedy: the rule takes the argmax of the scores)."""
        with torch.no_grad():
            if assign:
                expert_S, price_E = balanced_assignment(scores_SE.detach(), with_prices=True)
                if observe:
                    self.observe(price_E, scores_SE.shape[0])
                return expert_S
            return self.route(scores_SE.detach()) if priced else None

    def prices(self) -> Tensor:
        """(E,) the bias-corrected average; zeros before any training step (0 / tiny)."""
        return self.price_E / self.price_weight.clamp(min=1e-12)

    def route(self, scores_SE: Tensor) -> Tensor:
        """(S,) each row's expert: argmax_e(score - price_e), row by row (greedy before any training step)."""
        return (scores_SE.float() - self.prices()).argmax(dim=-1)

    def _apply(self, fn, recurse=True):
        # model.half() / .to(bfloat16) would round the prices: keep them in fp32 on the new device
        saved = {name: getattr(self, name) for name in ("price_E", "price_weight")}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = getattr(self, name)
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        missing = [n for n in ("price_E", "price_weight") if prefix + n not in state_dict]
        if missing:
            # a checkpoint written before routers kept prices: evaluation stays greedy until training updates them
            logger.warning("%s: the checkpoint holds no evaluation prices; this router evaluates greedily "
                           "(argmax of its scores) until a training step records prices", prefix.rstrip("."))
            for n in missing:
                state_dict[prefix + n] = torch.zeros_like(getattr(self, n))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
