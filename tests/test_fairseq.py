"""fairseq plugins through the real entry points (fairseq-train, fairseq-validate, fairseq-eval-lm)."""
from __future__ import annotations

import pytest
import torch

from causality import assert_causal
from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, output, run_fairseq, train_losses, valid_losses

TINY_ARCHS = [
    ("smlp_lm_tiny", []),
    ("smlp_lm_tiny", ["--smoe-routing", "partial"]),
    ("gmlp_lm_tiny", []),
    ("transformer_lm_tiny", []),
    ("gshard_lm_tiny", []),
    ("switch_lm_tiny", []),
    ("base_layers_lm_tiny", []),
    ("hash_layers_lm_tiny", []),
    ("hypermixer_lm_tiny", []),
    ("hypermixer_lm_tiny", ["--hypermixer-untied"]),
    ("ninformer_lm_tiny", []),
    ("smlp_lm_tiny", ["--token-mixer", "hypermixer"]),
]
IDS = ["smlp-det", "smlp-partial", "gmlp", "transformer", "gshard", "switch", "base", "hash",
       "hypermixer", "hypermixer-untied", "ninformer", "smlp-hypermixer"]
DENSE_ARCHS = ("gmlp_lm_tiny", "transformer_lm_tiny", "hypermixer_lm_tiny", "ninformer_lm_tiny")


def build_model(data, arch, extra=(), world=1):
    """Build a registered model through fairseq's own argument parsing and task."""
    import fairseq_plugins  # noqa: F401
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.utils import import_user_module

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", PLUGINS, "--arch", arch, *TINY_TRAIN,
                                                "--cpu", "--distributed-world-size", str(world), *extra])
    import_user_module(args)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model), task


def test_models_architectures_and_criterion_are_registered():
    import fairseq_plugins  # noqa: F401
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    assert {"smlp_lm", "gmlp_lm", "moe_transformer_lm"} <= set(MODEL_REGISTRY)
    for arch in ["smlp_lm_paper_small", "smlp_lm_paper_large", "gmlp_lm_paper_small", "transformer_lm_paper_small",
                 "base_layers_lm_paper_small", "gshard_lm_paper_large", "switch_lm_paper_large",
                 "base_layers_lm_paper_large", "hash_layers_lm_paper_large", "hypermixer_lm_paper_small",
                 "hypermixer_untied_lm_paper_small", "ninformer_lm_paper_small", *[a for a, _ in TINY_ARCHS]]:
        assert arch in ARCH_MODEL_REGISTRY, arch
    assert "smlp_lm_loss" in CRITERION_REGISTRY


@pytest.mark.parametrize("arch, extra", TINY_ARCHS, ids=IDS)
def test_every_model_is_causal_in_eval_mode(tiny_lm_data, arch, extra):
    torch.manual_seed(0)
    model, task = build_model(tiny_lm_data, arch, extra)
    model.eval()
    with torch.no_grad():  # make the spatial weights matter
        for name, p in model.named_parameters():
            if p.dim() == 3 and p.shape[-1] == p.shape[-2]:
                p.normal_(0, p.shape[-1] ** -0.5)
    start = model.core.cfg.prediction_start
    tokens = torch.randint(4, len(task.target_dictionary), (2, 32))
    with torch.no_grad():
        assert_causal(lambda t: model(t)[0], tokens, first_checked=start, positions=[start, 17, 30])


def test_presets_set_paper_sizes(tiny_lm_data):
    import fairseq_plugins  # noqa: F401
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_paper_small",
                                                "--decoder-layers", "3"])
    assert (args.decoder_embed_dim, args.decoder_ffn_embed_dim, args.sparse_layers, args.num_experts) == (1024, 4096, 12, 32)
    assert args.decoder_layers == 3  # a command-line flag wins over the preset


# ---------------------------------------------------------------- real fairseq-train on 2 CPU ranks


@pytest.mark.slow
@pytest.mark.parametrize("arch, extra", TINY_ARCHS, ids=IDS)
def test_every_model_trains_on_two_ranks(tiny_lm_data, tmp_path, arch, extra):
    res = run_fairseq("fairseq-train", [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", arch, *TINY_TRAIN, *extra,
                                        "--max-update", "3", "--save-dir", str(tmp_path)], world=2)
    log = assert_ok(res)
    assert sorted(train_losses(res[0].stdout)) == [1, 2, 3], log[-2000:]
    sparse = arch not in DENSE_ARCHS
    expected = ["checkpoint_last-rank-0.pt", "checkpoint_last-rank-1.pt"] if sparse else ["checkpoint_last.pt"]
    for name in expected:
        assert (tmp_path / name).is_file(), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_smlp_tiny_lowers_validation_loss(tiny_lm_data, tmp_path, routing):
    res = run_fairseq("fairseq-train", [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TINY_TRAIN,
                                        "--smoe-routing", routing, "--max-update", "50",
                                        "--validate-interval-updates", "10", "--save-dir", str(tmp_path),
                                        "--no-save"], world=2)
    assert_ok(res)
    losses = valid_losses(res[0].stdout)
    assert len(losses) >= 5, res[0].stdout[-2000:]
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_resume_continues_exactly(tiny_lm_data, tmp_path):
    common = [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TINY_TRAIN]
    full = run_fairseq("fairseq-train", [*common, "--max-update", "8", "--save-dir", str(tmp_path / "a")], world=2)
    first = run_fairseq("fairseq-train", [*common, "--max-update", "4", "--save-dir", str(tmp_path / "b")], world=2)
    resumed = run_fairseq("fairseq-train", [*common, "--max-update", "8", "--save-dir", str(tmp_path / "b")], world=2)
    for r in (full, first, resumed):
        assert_ok(r)
    assert "Loaded checkpoint" in resumed[0].stdout
    expected, got = train_losses(full[0].stdout), train_losses(resumed[0].stdout)
    assert sorted(got) == [5, 6, 7, 8]
    assert {u: expected[u] for u in got} == got


@pytest.mark.slow
def test_two_rank_checkpoint_evaluates_on_one_process(tiny_lm_data, tmp_path):
    """Train on 2 ranks, merge the expert shards, validate on 1 process: the same loss."""
    from fairseq_plugins.checkpoints import consolidate

    res = run_fairseq("fairseq-train", [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TINY_TRAIN,
                                        "--max-update", "6", "--save-dir", str(tmp_path)], world=2)
    assert_ok(res)
    trained = valid_losses(res[0].stdout)[-1]
    ckpt = str(tmp_path / "checkpoint_last.pt")
    consolidate(ckpt)
    eval_flags = [str(tiny_lm_data), "--user-dir", PLUGINS, "--path", ckpt, "--task", "language_modeling",
                  "--tokens-per-sample", "32", "--batch-size", "8"]
    val = run_fairseq("fairseq-validate", [*eval_flags, "--valid-subset", "valid"])
    loss = valid_losses(assert_ok(val))[-1]
    assert loss == pytest.approx(trained, abs=1e-3)
    # fairseq-eval-lm: one process, and expert-parallel on 2 ranks (each rank keeps its expert)
    one = assert_ok(run_fairseq("fairseq-eval-lm", eval_flags + ["--gen-subset", "valid"]))
    two = assert_ok(run_fairseq("fairseq-eval-lm", eval_flags + ["--gen-subset", "valid"], world=2))
    assert "Loss (base 2)" in one and "Loss (base 2)" in two
    # 4 ranks cannot hold 2 experts each evenly: clear error, no hang
    four = run_fairseq("fairseq-eval-lm", eval_flags + ["--gen-subset", "valid"], world=4, timeout=120)
    assert any(r.returncode != 0 for r in four)
    assert "num_experts=2 is smaller than the expert-parallel world size 4" in output(four)


@pytest.mark.slow
def test_expert_gradients_follow_fairseq_normalization(tiny_lm_data, tmp_path):
    """2 ranks x 1 batch == 1 process x 2 accumulated batches, with plain SGD (scale-sensitive).

    HASH routing and deterministic sMoE are independent of how tokens are grouped, so the two runs
    compute the same gradients only if expert gradients are normalized like shared ones.
    """
    common = [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "hash_layers_lm_tiny", *TINY_TRAIN,
              "--optimizer", "sgd", "--lr", "0.5", "--max-update", "4", "--no-save", "--num-experts", "2"]
    two = run_fairseq("fairseq-train", [*common, "--save-dir", str(tmp_path / "a")], world=2)
    one = run_fairseq("fairseq-train", [*common, "--update-freq", "2", "--save-dir", str(tmp_path / "b")])
    a, b = train_losses(assert_ok(two)), train_losses(assert_ok(one))
    assert sorted(a) == [1, 2, 3, 4]
    assert a == pytest.approx(b, abs=2e-3), (a, b)


# ---------------------------------------------------------------- bad flags fail before training


@pytest.mark.parametrize("flags, world, message", [
    (["--arch", "smlp_lm_tiny", "--num-experts", "3"], 2, "num_experts=3 cannot be spread evenly over 2 ranks"),
    (["--arch", "smlp_lm_tiny", "--ddp-backend", "c10d"], 2, "needs --ddp-backend legacy_ddp"),
    (["--arch", "smlp_lm_tiny", "--decoder-embed-dim", "66", "--num-experts", "4"], 1, "must divide the gated width 66"),
    (["--arch", "smlp_lm_tiny", "--smoe-routing", "learned"], 1, "invalid choice: 'learned'"),
    (["--arch", "switch_lm_tiny", "--moe-router", "top3"], 1, "invalid choice: 'top3'"),
    (["--arch", "smlp_lm_tiny", "--seq-len", "16"], 1, "--tokens-per-sample 32 exceeds the model's sequence length 16"),
    (["--arch", "hypermixer_lm_tiny", "--sgu-heads", "2"], 1, "token_mixer='hypermixer' needs heads=1"),
], ids=["experts-vs-world", "c10d", "dims", "routing-name", "router-name", "too-long", "mixer-heads"])
def test_bad_flags_fail_with_a_clear_message_before_training(tiny_lm_data, tmp_path, flags, world, message):
    res = run_fairseq("fairseq-train", [str(tiny_lm_data), "--user-dir", PLUGINS, *TINY_TRAIN, *flags,
                                        "--max-update", "2", "--save-dir", str(tmp_path)], world=world, timeout=120)
    text = output(res)
    assert any(r.returncode != 0 for r in res)
    assert message in text, text[-3000:]
    assert "num_updates=1" not in text
