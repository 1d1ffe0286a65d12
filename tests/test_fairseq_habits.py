"""fairseq the way its users drive it: flags and workflows of fairseq's own recipes on our models.

Each is honoured as fairseq does it or refused in one line before any work (docs/training.md, "From fairseq
habits"): --add-bos-token, torchrun (trained with --checkpoint-activations, whose own tests are in
tests/test_activation_checkpointing.py), fairseq-hydra-train with the presets' configurations. Averaging the last
saves of a shard set is tested on the scale-out run's saves (tests/test_scale_out.py).
"""
from __future__ import annotations

import pytest
import torch

from fairseq_helpers import PLUGINS, REPO, TINY_TRAIN, assert_ok, run_in_process, train_losses, valid_losses


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
    # the program is told by its main, under the plugins' wrappers of it
    from fairseq_cli import train

    from fairseq_plugins.torchrun import _program

    assert _program(train.main) == "fairseq_cli.train" and train.main.__module__ != "fairseq_cli.train"


def test_torchrun_on_gpu_nodes_keeps_nccl_and_takes_the_local_rank(monkeypatch):
    """On GPU nodes (faked here: 8 GPUs each) torchrun's 16 processes, 4 per node, run with NCCL; fairseq's default
    world size (a node's GPU count, given here as a GPU node's parse gives it) yields to torchrun's, and each rank
    takes its local rank's GPU (fairseq took RANK % device_count: GPU 5 for rank 5, a GPU of another process's
    share when a node runs fewer processes than it has GPUs)."""
    from fairseq_plugins.torchrun import torchrun_ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cfg = _parsed(["--arch", "smlp_lm_tiny", "--ddp-backend", "legacy_ddp", "--distributed-world-size", "8"])
    env = {**TORCHRUN_ENV, "WORLD_SIZE": "16", "RANK": "5", "LOCAL_RANK": "1"}
    assert torchrun_ranks(cfg, "fairseq_cli.train", env)
    d = cfg.distributed_training
    assert (d.distributed_backend, d.distributed_world_size, d.distributed_rank, d.device_id) == ("nccl", 16, 5, 1)
    assert cfg.model.distributed_world_size == 16


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


# ----------------------------------------------------------------------------- fairseq-hydra-train

RECIPES = sorted((REPO / "configs").glob("*.args"))


def test_a_preset_as_the_models_name_fills_what_the_configuration_leaves_out():
    """`model: {_name: smlp_lm_tiny, decoder_layers: 3}` under fairseq-hydra-train: the preset's sizes, the given
    layer count; a model name or another program's architecture is left to fairseq."""
    from omegaconf import OmegaConf

    from fairseq_plugins.hydra_presets import apply_preset

    cfg = OmegaConf.create({"model": {"_name": "smlp_lm_tiny", "decoder_layers": 3}})
    assert apply_preset(cfg) == "smlp_lm_tiny"
    assert (cfg.model.decoder_embed_dim, cfg.model.decoder_ffn_embed_dim, cfg.model.decoder_layers,
            cfg.model.sparse_layers, cfg.model.dropout) == (64, 128, 3, 2, 0.0)
    for name in ("smlp_lm", "transformer_lm_gpt"):
        other = OmegaConf.create({"model": {"_name": name}})
        assert apply_preset(other) is None and list(other.model) == ["_name"]


def _hydra_model(name: str):
    """The model config fairseq-hydra-train builds from configs/hydra/NAME.yaml (task.data given): hydra's
    composition over fairseq's schema, then fairseq's add_defaults, resolved (fairseq_cli.hydra_train)."""
    from fairseq.dataclass import initialize
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    initialize.hydra_init(name)
    with initialize_config_dir(config_dir=str(REPO / "configs" / "hydra"), version_base="1.1"):  # fairseq's
        cfg = compose(config_name=name, overrides=["task.data=DATA"])
    initialize.add_defaults(cfg)  # the plugins' wrapper: they are imported
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)).model


@pytest.mark.slow
def test_every_recipe_has_a_current_hydra_config_that_builds_its_model():
    """configs/hydra/NAME.yaml is what smlp_launch.hydra_configs writes from configs/NAME.args today, and
    fairseq-hydra-train's composition of it builds the model fairseq-train builds from the recipe's flags."""
    import shlex

    from fairseq.models import ARCH_MODEL_NAME_REGISTRY
    from omegaconf import OmegaConf

    from fairseq_plugins.config import FAMILIES_BY_MODEL, to_core_config
    from smlp_launch.hydra_configs import _config, hydra_yaml

    assert len(RECIPES) >= 15
    for recipe in RECIPES:
        written = REPO / "configs" / "hydra" / f"{recipe.stem}.yaml"
        assert written.is_file() and written.read_text() == hydra_yaml(recipe), \
            f"{written} is not current: run python -m smlp_launch.hydra_configs"
        flags = shlex.split(recipe.read_text())
        arch = flags[flags.index("--arch") + 1]
        family = FAMILIES_BY_MODEL[ARCH_MODEL_NAME_REGISTRY[arch]]
        parsed = OmegaConf.create(_config(flags)).model
        assert to_core_config(_hydra_model(recipe.stem), family, 4000, 1) == \
            to_core_config(parsed, family, 4000, 1), recipe.name


@pytest.mark.slow
def test_fairseq_hydra_train_trains_the_tiny_recipes_model(tiny_lm_data, tmp_path):
    """fairseq-hydra-train with configs/hydra/smlp_tiny.yaml and fairseq-train with configs/smlp_tiny.args: the
    same parameter counts and the same first-update loss."""
    import os
    import shlex
    import subprocess

    from fairseq_helpers import BIN, worker_env

    common = ["--cpu", "--max-update", "1", "--no-save", "--log-format", "simple", "--log-interval", "1"]
    flags = [str(tiny_lm_data), "--user-dir", PLUGINS, *shlex.split((REPO / "configs/smlp_tiny.args").read_text())]
    log = assert_ok(run_in_process("fairseq-train", [*flags, *common]))
    here = tmp_path / "run"  # the folder it runs in
    here.mkdir()
    run = subprocess.run([str(BIN / "fairseq-hydra-train"), f"task.data={tiny_lm_data}", f"common.user_dir={PLUGINS}",
                          "common.cpu=true", "optimization.max_update=1", "checkpoint.no_save=true",
                          "common.log_format=simple", "common.log_interval=1", f"checkpoint.save_dir={tmp_path / 'ck'}",
                          "--config-dir", str(REPO / "configs" / "hydra"), "--config-name", "smlp_tiny"],
                         env=worker_env(1), cwd=here, capture_output=True, text=True, timeout=300)
    hydra_log = run.stdout + run.stderr
    assert run.returncode == 0, hydra_log[-3000:]
    params = [line.split("| ")[-1] for line in log.splitlines() if "model params" in line]
    assert len(params) == 2 and all(p in hydra_log for p in params), (params, hydra_log[-3000:])
    assert train_losses(hydra_log) == train_losses(log) and list(train_losses(log)) == [1], hydra_log[-3000:]
    assert not os.listdir(here), os.listdir(here)  # no hydra_train.log, no .hydra/ folder, no outputs/
