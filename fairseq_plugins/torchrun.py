"""fairseq-train under torchrun: each process becomes the rank torchrun made it.

fairseq 0.12 reads torchrun's variables only when `--distributed-world-size` is above 1, and then sets the
device to `RANK % torch.cuda.device_count()`: on CPU ranks it fails with ZeroDivisionError, and without the
flag (on CPU its default is 1) every process trains on its own and writes the same checkpoint_last.pt.
`install()` wraps `fairseq.distributed.utils.call_main`: when torchrun started the process (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK set, no --distributed-init-method given), the run takes its world size, rank
and local device from torchrun (`env://` rendezvous, one process per rank), on CPU with gloo, as smlp-launch's
workers do. fairseq-train and fairseq-validate run that way; fairseq-eval-lm, which reports each rank's own
share of the data, is refused in one line, as is a --distributed-world-size that contradicts torchrun's.
"""
from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping

from .errors import FlagError

__all__ = ["TORCHRUN_VARIABLES", "install", "torchrun_ranks"]

logger = logging.getLogger(__name__)
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")  # as fairseq's own test
RANKED_PROGRAMS = ("fairseq_cli.train", "fairseq_cli.validate")  # the programs whose ranks share one job
PER_RANK_PROGRAMS = {
    "fairseq_cli.eval_lm": "fairseq-eval-lm reports each rank's own share of the data, not the whole set: run it on "
                           "one process (`smlp-consolidate CHECKPOINT` merges a shard set first), or validate on "
                           "several ranks with `torchrun ... $(which fairseq-validate)`",
}


def torchrun_ranks(cfg, program: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Fill `cfg.distributed_training` (fairseq's config) from torchrun's environment for `program` (the module
    of the program's main). Returns the line to log, None when torchrun did not start the process, or the
    rank layout was given by flags; FlagError when the program or its flags cannot run as torchrun started it."""
    import torch

    dist = cfg.distributed_training
    if dist.distributed_init_method is not None or cfg.common.tpu:
        return None  # the flags say where the ranks meet (smlp-launch, launch/slurm/train.sbatch)
    if not all(k in environ for k in TORCHRUN_VARIABLES):
        return None
    try:
        world, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise FlagError(f"torchrun's WORLD_SIZE={environ['WORLD_SIZE']!r}, RANK={environ['RANK']!r}, LOCAL_RANK="
                        f"{environ.get('LOCAL_RANK')!r} are not rank numbers") from None
    if world <= 1:
        return None
    if program in PER_RANK_PROGRAMS:
        raise FlagError(f"under torchrun ({world} processes): {PER_RANK_PROGRAMS[program]}")
    if program not in RANKED_PROGRAMS:
        return None
    default_world = max(1, torch.cuda.device_count())
    if dist.distributed_world_size not in (world, default_world):
        raise FlagError(f"--distributed-world-size {dist.distributed_world_size} but torchrun started {world} "
                        f"processes (WORLD_SIZE={world}): drop --distributed-world-size, torchrun sets it")
    on_cpu = cfg.common.cpu or not torch.cuda.is_available()
    if on_cpu and dist.distributed_backend == "nccl":  # fairseq's default; NCCL needs GPUs
        dist.distributed_backend = "gloo"
    dist.distributed_init_method = "env://"
    dist.distributed_world_size, dist.distributed_rank, dist.device_id = world, rank, local_rank
    dist.distributed_no_spawn = True  # torchrun started one process per rank
    _copy_world_size(cfg, world)
    return (f"torchrun: rank {rank} of {world} (local rank {local_rank}, {dist.distributed_backend}, "
            f"rendezvous env://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']})")


def _copy_world_size(cfg, world: int) -> None:
    """The sections that copied --distributed-world-size when the command line was parsed (the model's config:
    one expert per rank, the expert-parallel layout; BMUF's) get torchrun's world size too."""
    from omegaconf import open_dict

    for name in ("model", "bmuf"):
        section = cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)
        if section is not None and "distributed_world_size" in section:
            with open_dict(section):
                section.distributed_world_size = world


def _program(main) -> str:
    """The module of a program's main (under the plugins' wrappers of it): its import name also when it runs as
    `python -m` / `torchrun -m`."""
    main = inspect.unwrap(main)
    module = getattr(main, "__module__", "") or ""
    spec = getattr(main, "__globals__", {}).get("__spec__") if module == "__main__" else None
    return spec.name if spec is not None else module


def install() -> bool:
    """Wrap `fairseq.distributed.utils.call_main` (every fairseq program's start) with `torchrun_ranks`."""
    from fairseq.distributed import utils as distributed_utils

    original = distributed_utils.call_main
    wrapper = original
    while wrapper is not None:  # other patches wrap call_main too (precision.py, patches.py): look down the chain
        if getattr(wrapper, "_smlp_torchrun", False):
            return False
        wrapper = getattr(wrapper, "__wrapped__", None)

    def call_main(cfg, main, **kwargs):
        said = torchrun_ranks(cfg, _program(main))
        if said and cfg.distributed_training.distributed_rank == 0:
            logger.info(said)
        return original(cfg, main, **kwargs)

    call_main._smlp_torchrun = True
    call_main.__wrapped__ = original
    distributed_utils.call_main = call_main
    return True
