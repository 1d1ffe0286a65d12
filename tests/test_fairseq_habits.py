"""fairseq the way its users drive it: flags and workflows of fairseq's own recipes on our models.

Each is honoured as fairseq does it or refused in one line before any work (docs/training.md, "From fairseq
habits"): --add-bos-token, torchrun, fairseq-hydra-train with the presets' configs, --checkpoint-activations,
averaging the last saves of a shard set.
"""
from __future__ import annotations

import pytest
import torch

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_in_process, train_losses, valid_losses


@pytest.mark.slow
def test_add_bos_token_trains_with_a_spatial_weight_one_position_longer(tiny_lm_data, tmp_path):
    """--add-bos-token puts a BOS before each 32-token block: the model is built for 33 positions, trains, and
    its checkpoint validates with the same flags (the saved model keeps its 33 positions)."""
    flags = [str(tiny_lm_data), "--user-dir", PLUGINS, "--task", "language_modeling", "--tokens-per-sample", "32",
             "--batch-size", "8", "--add-bos-token"]
    log = assert_ok(run_in_process("fairseq-train", [*flags, *TINY_TRAIN, "--arch", "smlp_lm_tiny", "--max-update",
                                                     "2", "--disable-validation", "--save-dir", str(tmp_path)]))
    assert sorted(train_losses(log)) == [1, 2], log[-2000:]
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    spatial = {k: tuple(v.shape) for k, v in state["model"].items() if k.endswith("proj.weight") and v.dim() == 3}
    assert spatial and all(shape[-2:] == (33, 33) for shape in spatial.values()), spatial
    valid = assert_ok(run_in_process("fairseq-validate", [*flags, "--path", str(tmp_path / "checkpoint_last.pt"),
                                                          "--valid-subset", "valid"]))
    assert len(valid_losses(valid)) == 1, valid[-2000:]


# ----------------------------------------------------------------------------- torchrun


def _parsed(flags):
    """fairseq-train's configuration of `flags` (its parser, the plugins'), as fairseq_cli.train builds it."""
    import tempfile

    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    with tempfile.TemporaryDirectory() as data:
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           [data, "--user-dir", PLUGINS, "--task", "language_modeling", *flags])
        return convert_namespace_to_omegaconf(args)


TORCHRUN_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


def test_torchrun_environment_gives_the_ranks_and_refuses_what_cannot_run():
    """Under torchrun's variables fairseq-train's configuration gets torchrun's world, rank and device (env://
    rendezvous, one process per rank, gloo on CPU), the model's copy of the world size too (one expert per rank);
    a --distributed-world-size that contradicts torchrun, and fairseq-eval-lm (per-rank figures), are refused;
    explicit rendezvous flags (smlp-launch, train.sbatch) and a process torchrun did not start are left alone."""
    from fairseq_plugins.errors import FlagError
    from fairseq_plugins.torchrun import torchrun_ranks

    cfg = _parsed(["--arch", "smlp_lm_tiny", "--cpu", "--ddp-backend", "legacy_ddp"])
    said = torchrun_ranks(cfg, "fairseq_cli.train", TORCHRUN_ENV)
    d = cfg.distributed_training
    assert (d.distributed_init_method, d.distributed_world_size, d.distributed_rank, d.device_id,
            d.distributed_no_spawn, d.distributed_backend) == ("env://", 2, 1, 1, True, "gloo")
    assert cfg.model.distributed_world_size == 2 and "rank 1 of 2" in said

    with pytest.raises(FlagError, match="--distributed-world-size 4 but torchrun started 2 processes"):
        torchrun_ranks(_parsed(["--arch", "smlp_lm_tiny", "--cpu", "--distributed-world-size", "4"]),
                       "fairseq_cli.train", TORCHRUN_ENV)
    with pytest.raises(FlagError, match="fairseq-eval-lm reports each rank's own share of the data"):
        torchrun_ranks(_parsed(["--arch", "smlp_lm_tiny", "--cpu"]), "fairseq_cli.eval_lm", TORCHRUN_ENV)
    explicit = _parsed(["--arch", "smlp_lm_tiny", "--cpu", "--distributed-init-method", "tcp://127.0.0.1:1234"])
    assert torchrun_ranks(explicit, "fairseq_cli.train", TORCHRUN_ENV) is None
    assert explicit.distributed_training.distributed_world_size == 1
    alone = _parsed(["--arch", "smlp_lm_tiny", "--cpu"])
    assert torchrun_ranks(alone, "fairseq_cli.train", {}) is None
    assert alone.distributed_training.distributed_init_method is None


@pytest.mark.slow
def test_fairseq_train_under_torchrun_logs_the_losses_of_the_two_rank_run(smlp_tiny_two_ranks, tiny_lm_data, tmp_path):
    """`torchrun --nproc_per_node 2 $(which fairseq-train) ... --cpu --ddp-backend legacy_ddp` (no rank flags) is
    the 2-rank expert-parallel run that smlp-launch's workers make: the shared run's first losses, one expert per
    rank, one rank shard per rank. It runs with --checkpoint-activations, which changes no loss (one training
    for both: the recomputed blocks' gradients are the plain ones bit for bit)."""
    import os
    import subprocess

    from fairseq_helpers import BIN, free_port, smlp_tiny_flags, worker_env

    _, reference = smlp_tiny_two_ranks("deterministic")
    args = [*smlp_tiny_flags(tiny_lm_data, "deterministic"), "--cpu", "--ddp-backend", "legacy_ddp",
            "--checkpoint-activations", "--max-update", "3", "--save-dir", str(tmp_path)]
    env = {k: v for k, v in worker_env(1).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    run = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                          str(BIN / "fairseq-train"), *args], env=env, cwd=os.getcwd(), capture_output=True,
                         text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    want = train_losses(reference)
    assert train_losses(log) == {u: want[u] for u in (1, 2, 3)}, log[-3000:]
    assert "torchrun: rank 0 of 2" in log and "'checkpoint_activations': True" in log
    assert sorted(p.name for p in tmp_path.glob("checkpoint_last*.pt")) == ["checkpoint_last-rank-0.pt",
                                                                            "checkpoint_last-rank-1.pt"]
