"""fairseq --user-dir of `smlp-bench chaos --amp`: the sMLP plugins, and gradient overflows injected on cue.

    SMLP_CHAOS_OVERFLOW="U:N,..."   the first N passes of the step after update U overflow (an inf in one expert's
                                    gradient on rank 0; the whole-model norm makes every rank skip, as a real
                                    overflow does), in every attempt that runs that step

With --amp-batch-retries 1, N=1 is an overflowed pass fairseq feeds again and applies, N=2 a step it skips (the
update count stays: a save due at U is written again, holding the skipped batch's routing record). The passes are
counted in each process, so a run resumed before the step after U overflows there again, as the uninterrupted run
did: the two end bitwise equal (benchmarks/chaos.py).
"""
import os

import fairseq_plugins  # noqa: F401  (registers the models, installs the patches)

ENV = "SMLP_CHAOS_OVERFLOW"


def plan(spec: str) -> dict[int, int]:
    """update -> overflowing passes of the step after it, from `U:N,...`."""
    try:
        return {int(u): int(n) for u, n in (part.split(":") for part in spec.split(",") if part)}
    except ValueError:
        raise ValueError(f"{ENV}={spec!r} is invalid: use UPDATE:PASSES,... e.g. 4:2,6:1") from None


def install(overflows: dict[int, int]) -> None:
    import torch
    import torch.distributed as dist
    from fairseq.trainer import Trainer

    original, passes, poisoned = Trainer.train_step, {}, [0]

    def poison(grad):  # the next backward pass of this expert weight after a pass was marked
        if not poisoned[0]:
            return grad
        poisoned[0] -= 1
        return torch.full_like(grad, float("inf"))

    def train_step(self, samples, raise_oom=False):
        if not getattr(self, "_chaos_overflow", False):
            next(p for p in self.get_model().parameters() if getattr(p, "expert", False)).register_hook(poison)
            self._chaos_overflow = True
        update = self.get_num_updates()
        passes[update] = passes.get(update, 0) + 1  # fairseq feeds an overflowed batch again through train_step
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and passes[update] <= overflows.get(update, 0):
            poisoned[0] = 1
        return original(self, samples, raise_oom)

    train_step.__wrapped__ = original
    Trainer.train_step = train_step


if os.environ.get(ENV):
    install(plan(os.environ[ENV]))
