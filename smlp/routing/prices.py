"""Evaluation routing of the balanced routers: each row to argmax of its score minus the experts' prices.

Training assigns rows with exact balance (assignment.py); evaluation cannot, because a balanced assignment
couples the rows of a batch (a token's expert would depend on later tokens). Greedy routing (argmax of the
scores, fairseq's BaseLayer) sends far more rows to a few experts than training does and costs perplexity
(docs/benchmarks.md, "Evaluation noise").

The auction that makes the balanced assignment also yields its dual: one price per expert, such that
argmax_e(score - price_e) gives every row its assigned expert (up to the auction's eps). `RouterPrices`
(one per balanced layer, its buffers in the checkpoint) records those prices while the layer trains;
`fold_prices` folds every layer's record into its exponential average once per optimizer step that updates
the model, all layers in one all-reduce over the ranks that hold copies of the routers, so every rank ends
each step with the same prices. A step a loss scaler skips folds nothing (its record waits, and is saved
with the checkpoint); a batch that does not train (fairseq's dummy batch) is not recorded (`uncounted`).
The fairseq plugin folds before every optimizer step (fairseq_plugins/patches.py); a plain loop calls
`install_price_fold(optimizer, model, group)`. `RouterPrices.experts` alone decides between priced routing,
greedy routing (`eval_routing="greedy"`, `route_greedily`) and the training assignment.

Shapes: the core's legend (smlp/__init__.py); here S rows, E experts.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..process_group import collective_device, rank_and_world
from .assignment import AuctionChecks, balanced_assignment

__all__ = ["RouterPrices", "BALANCED_EVAL_ROUTINGS", "DEFAULT_PRICE_DECAY", "price_modules", "fold_prices",
           "install_price_fold", "uncounted"]

logger = logging.getLogger(__name__)

# "priced": argmax(score - price) with the averaged training prices; "greedy": argmax(score)
BALANCED_EVAL_ROUTINGS = ("priced", "greedy")
DEFAULT_PRICE_DECAY = 0.95
_BUFFERS = ("price_E", "price_weight", "pending_E1")


class RouterPrices(nn.Module):
    """The expert prices a balanced router evaluates with, averaged over optimizer steps.

    Buffers (in the checkpoint, kept in fp32 whatever the model's dtype):
        price_E: (E,) the exponential average of the auction's centred prices, in score units
        price_weight: () the average's total weight (0 before the first step: then the prices are zero
                 and evaluation is greedy)
        pending_E1: (E + 1,) prices x rows and rows recorded since the last fold (zero after every optimizer
                 step; kept so that a step skipped by a loss scaler loses nothing across a checkpoint)
    """

    def __init__(self, num_experts: int, eval_routing: str = "priced", decay: float = DEFAULT_PRICE_DECAY):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"price decay {decay} must be in [0, 1) (the weight of the previous average per step)")
        if eval_routing not in BALANCED_EVAL_ROUTINGS:
            raise ValueError(f"eval_routing={eval_routing!r}: valid: {', '.join(BALANCED_EVAL_ROUTINGS)}")
        self.decay, self.eval_routing = decay, eval_routing
        self.route_greedily = False  # LanguageModel.routing_greedily: the greedy diagnostic
        self.auction_checks = AuctionChecks()  # the layer's assignments' completion checks on an accelerator
        self.recording = True  # False during a training forward whose batch does not count (`uncounted`)
        self.voided = False  # such a forward ran since the last fold: the step's record is dropped
        self._prices: tuple | None = None  # (the buffers' versions, `prices()`): made once per change
        self.register_buffer("price_E", torch.zeros(num_experts))
        self.register_buffer("price_weight", torch.zeros(()))
        self.register_buffer("pending_E1", torch.zeros(num_experts + 1))

    @property
    def priced(self) -> bool:
        """Whether evaluation routes by the prices (else greedily, by the scores alone)."""
        return self.eval_routing == "priced" and not self.route_greedily

    def observe(self, price_E: Tensor, rows: int) -> None:
        """Record one assignment's prices (from `rows` rows) for the next fold; no collective, no host read."""
        if not self.recording:
            return
        with torch.no_grad():
            self.pending_E1[:-1].add_(price_E.to(self.pending_E1.device, torch.float32), alpha=float(rows))
            self.pending_E1[-1].add_(float(rows))

    def fold(self, stat_E1: Tensor, applied: Tensor | None = None, void: Tensor | None = None) -> None:
        """Fold a recorded statistic (prices x rows, rows: this layer's `pending_E1` summed over the ranks,
        `fold_prices`) into the average and clear the record. Nothing recorded changes nothing. 0-dim tensors
        (None: no such case): `applied` 0 when the optimizer step will not update the model (a loss scaler's
        skip): the average and the record stay as they are, bit for bit; `void` nonzero when a batch of the
        step does not count: the average stays and the record is dropped. No host read."""
        with torch.no_grad():
            stat_E1 = stat_E1.to(self.price_E.device, torch.float32)
            total = stat_E1[-1]
            mean_E = stat_E1[:-1] / total.clamp(min=1.0)
            step = (total > 0).float() * (1.0 - self.decay)
            if applied is None and void is None:
                self.price_E.mul_(1.0 - step).add_(step * mean_E)
                self.price_weight.mul_(1.0 - step).add_(step)
                self.pending_E1.zero_()
                return
            device = self.price_E.device
            skipped = torch.zeros((), dtype=torch.bool, device=device) if applied is None else applied.to(device) == 0
            voided = torch.zeros((), dtype=torch.bool, device=device) if void is None else void.to(device) != 0
            for buf, new, keep in ((self.price_E, self.price_E * (1.0 - step) + step * mean_E, skipped | voided),
                                   (self.price_weight, self.price_weight * (1.0 - step) + step, skipped | voided),
                                   (self.pending_E1, torch.zeros_like(self.pending_E1), skipped & ~voided)):
                buf.copy_(torch.where(keep, buf, new))

    def experts(self, scores_SE: Tensor, *, assign: bool, observe: bool) -> Tensor | None:
        """The rows' experts (S,) under a balanced router, the one place that decides: with `assign` the
        balanced assignment of the rows (its prices recorded when `observe`, a training forward); otherwise
        argmax(score - price) per row when `priced`, else None (greedy: the rule takes the argmax)."""
        with torch.no_grad():
            if assign:
                expert_S, price_E = balanced_assignment(scores_SE.detach(), with_prices=True,
                                                        check_every=self.auction_checks)
                if observe:
                    self.observe(price_E, scores_SE.shape[0])
                return expert_S
            return self.route(scores_SE.detach()) if self.priced else None

    def prices(self) -> Tensor:
        """(E,) the bias-corrected average; zeros before any training step (0 / tiny). Made once per change of
        the buffers (a fold, a load, a move; their version counters tell), not once per decoding step."""
        key = tuple((id(t), t._version, t.data_ptr()) for t in (self.price_E, self.price_weight))
        if self._prices is None or self._prices[0] != key:
            with torch.no_grad():
                self._prices = (key, self.price_E / self.price_weight.clamp(min=1e-12))
        return self._prices[1]

    def route(self, scores_SE: Tensor) -> Tensor:
        """(S,) each row's expert: argmax_e(score - price_e), row by row (greedy before any training step)."""
        return (scores_SE.float() - self.prices()).argmax(dim=-1)

    def _apply(self, fn, recurse=True):
        # model.half() / .to(bfloat16) would round the prices: keep them in fp32 on the new device
        saved = {name: getattr(self, name) for name in _BUFFERS}
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
        if prefix + "pending_E1" not in state_dict:  # written before the record was kept: nothing pending
            state_dict[prefix + "pending_E1"] = torch.zeros_like(self.pending_E1)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def price_modules(model: nn.Module) -> list[RouterPrices]:
    """Every balanced router's prices in `model`, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, RouterPrices)]


def fold_prices(model: nn.Module, group=None, applied: Tensor | None = None) -> None:
    """Fold every balanced layer's recorded prices into its average: once per optimizer step, on every rank
    of `group` (the ranks that hold copies of the routers: the data-parallel group, which expert parallelism
    does not split, since routers are replicated), all layers in one all-reduce. Every rank then holds the
    same prices, the rows-weighted mean over the ranks and micro-batches of the step. `applied` (0-dim, the
    same on every rank): 0 when the step will not update the model; the record then waits for the next step.
    A step in which any rank ran a batch that does not count (`uncounted`) drops every rank's record: the
    all-reduce carries one more entry, how many ranks did (see `RouterPrices.fold`). No host read."""
    mods = price_modules(model)
    if not mods:
        return
    voided = any(m.voided for m in mods)
    flat = torch.cat([*(m.pending_E1 for m in mods), mods[0].pending_E1.new_full((1,), float(voided))])
    if rank_and_world(group)[1] > 1:
        flat = flat.to(collective_device(group), copy=True)
        dist.all_reduce(flat, group=group)
    void = flat[-1]
    for m, stat in zip(mods, flat[:-1].split([m.pending_E1.numel() for m in mods])):
        m.fold(stat, applied, void)
        m.voided = False


def install_price_fold(optimizer: torch.optim.Optimizer, model: nn.Module, group=None):
    """For a plain torch training loop: fold the prices before every `optimizer.step()` (an optimizer pre-step
    hook, as torchtitan updates its routers' balancing state; a GradScaler that skips a step does not call
    `optimizer.step()`, so nothing is folded then). Returns the hook's handle."""
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: fold_prices(model, group))


@contextlib.contextmanager
def uncounted(model: nn.Module):
    """A training forward whose batch does not count (fairseq's dummy batch, which a rank with no batch left
    runs with its loss zeroed so the others' collectives meet): its assignments are not recorded, and the
    next fold drops the step's record on every rank (the shuffle mixed the batch's rows into the others')."""
    mods = price_modules(model)
    before = [m.recording for m in mods]
    for m in mods:
        m.recording, m.voided = False, True
    try:
        yield
    finally:
        for m, recording in zip(mods, before):
            m.recording = recording
