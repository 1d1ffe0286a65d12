"""fairseq --user-dir of `smlp-bench chaos --amp`: the sMLP plugins, and gradient overflows injected on cue.

    SMLP_CHAOS_OVERFLOW="P:N,..."   the first N passes of the P-th batch of the first epoch (1-based) overflow: an
                                    inf in one expert's gradient on rank 0 (the whole-model norm makes every rank
                                    skip, as a real overflow does)

With --amp-batch-retries 1, N=1 is a batch fairseq feeds again and applies, N=2 one it skips (the update count
stays: a save due there is written again, holding the skipped batch's routing record). A batch is named by its
place in the epoch, which a checkpoint restores, and its passes are counted in each process: a run resumed before
that batch overflows on it as the uninterrupted run did, and one resumed after it does not (an update count would
name the batch after a skipped one too). The two then end bitwise equal (benchmarks/chaos.py).
"""
import os

import fairseq_plugins  # noqa: F401  (registers the models, installs the patches)

ENV = "SMLP_CHAOS_OVERFLOW"


def plan(spec: str) -> dict[int, int]:
    """batch position -> overflowing passes, from `P:N,...`."""
    try:
        return {int(p): int(n) for p, n in (part.split(":") for part in spec.split(",") if part)}
    except ValueError:
        raise ValueError(f"{ENV}={spec!r} is invalid: use BATCH:PASSES,... e.g. 5:2,8:1") from None


def install(overflows: dict[int, int]) -> None:
    import torch
    import torch.distributed as dist
    from fairseq.trainer import Trainer

    original_step, original_itr, passes, poisoned = Trainer.train_step, Trainer.get_train_iterator, {}, [0]

    def poison(grad):  # the next backward pass of this expert weight after a pass was marked
        if not poisoned[0]:
            return grad
        poisoned[0] -= 1
        return torch.full_like(grad, float("inf"))

    def get_train_iterator(self, *args, **kwargs):
        self._chaos_epoch_itr = original_itr(self, *args, **kwargs)
        return self._chaos_epoch_itr

    def train_step(self, samples, raise_oom=False):
        if not getattr(self, "_chaos_hook", False):
            next(p for p in self.get_model().parameters() if getattr(p, "expert", False)).register_hook(poison)
            self._chaos_hook = True
        itr = self._chaos_epoch_itr
        batch = (itr.epoch, itr.iterations_in_epoch)  # this batch's place, consumed already
        passes[batch] = passes.get(batch, 0) + 1  # fairseq feeds an overflowed batch again through train_step
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and batch[0] == 1 and passes[batch] <= overflows.get(batch[1], 0):
            poisoned[0] = 1
        return original_step(self, samples, raise_oom)

    train_step.__wrapped__, get_train_iterator.__wrapped__ = original_step, original_itr
    Trainer.train_step, Trainer.get_train_iterator = train_step, get_train_iterator


if os.environ.get(ENV):
    install(plan(os.environ[ENV]))
