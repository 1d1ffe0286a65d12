"""The fairseq flag table (fairseq_plugins/config.py FIELDS): one home for every model flag.

Parsed with fairseq's own training parser, as fairseq-train parses them: every field is consumed
(changing it changes the core config or the plugin's settings), flags -> config -> flags round-trips
for every registered architecture and every non-default option, and models.py reads no fairseq field
but through the table.
"""
import ast
import contextlib
import dataclasses
import functools
import io
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("fairseq")

from fairseq import options  # noqa: E402
from fairseq.dataclass.utils import convert_namespace_to_omegaconf  # noqa: E402
from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY  # noqa: E402

import fairseq_plugins  # noqa: E402,F401  (registration)
from fairseq_plugins import config as table  # noqa: E402
from smlp.lm import LMConfig  # noqa: E402
from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS  # noqa: E402

PLUGINS = str(Path(fairseq_plugins.__file__).parent)
VOCAB, PAD = 101, 1
WORLD = ["--distributed-world-size", "4"]  # 4 ranks: any expert count below divides into groups
# a small model of each family, the base every option below is added to
BASE = {"smlp": ["--arch", "smlp_lm_tiny", "--num-experts", "4", "--tokens-per-sample", "24"],
        "gmlp": ["--arch", "gmlp_lm_tiny", "--tokens-per-sample", "24"],
        "transformer": ["--arch", "moe_transformer_lm_tiny", "--num-experts", "4", "--tokens-per-sample", "24"]}

# One non-default value per table field: (family, extra flags, expected core fields or plugin settings).
# A field added to the table without an entry here fails test_every_field_has_an_example.
EXAMPLES = {
    "decoder_embed_dim": ("gmlp", ["--decoder-embed-dim", "48"], {"d_model": 48}),
    "decoder_ffn_embed_dim": ("gmlp", ["--decoder-ffn-embed-dim", "96"], {"d_ffn": 96}),
    "decoder_layers": ("smlp", ["--decoder-layers", "3"], {"dense_layers": 3}),
    "dropout": ("transformer", ["--dropout", "0.25"], {"dropout": 0.25}),
    "activation_fn": ("transformer", ["--activation-fn", "relu"], {"activation": "relu"}),
    "tokens_per_sample": ("gmlp", ["--tokens-per-sample", "16"], {"seq_len": 16}),
    "seq_len": ("smlp", ["--seq-len", "32"], {"seq_len": 32}),
    "add_bos_token": ("smlp", ["--add-bos-token"], {"seq_len": 25}),  # the task's BOS makes 24 + 1 positions
    # accepted, changes nothing: the embeddings are always tied (test_shared_embeddings_flag_is_accepted)
    "share_decoder_input_output_embed": ("transformer", ["--share-decoder-input-output-embed"], {}),
    "ddp_backend": ("smlp", ["--ddp-backend", "no_c10d"], {"ddp_backend": "no_c10d"}),
    "distributed_world_size": ("smlp", ["--num-experts", "0", "--distributed-world-size", "2"],
                               {"world_size": 2, "num_experts": 2}),
    "checkpoint_activations": ("transformer", ["--checkpoint-activations"], {"checkpoint_activations": True}),
    "token_mixer": ("gmlp", ["--token-mixer", "ninformer"], {"token_mixer": "ninformer"}),
    "mixer_dim": ("smlp", ["--token-mixer", "hypermixer", "--mixer-dim", "24"],
                  {"token_mixer": "hypermixer", "mixer_dim": 24}),
    "hypermixer_untied": ("gmlp", ["--token-mixer", "hypermixer", "--hypermixer-untied"],
                          {"token_mixer": "hypermixer", "hypermixer_tied": False}),
    "sparse_layers": ("transformer", ["--sparse-layers", "1"], {"sparse_layers": 1}),
    "num_experts": ("smlp", ["--num-experts", "2"], {"num_experts": 2}),
    "smoe_experts": ("smlp", ["--smoe-experts", "8"], {"smoe_experts": 8}),  # the tMoE keeps --num-experts 4
    "expert_parallel_size": ("transformer", ["--expert-parallel-size", "2"], {"ep_size": 2}),
    "sparse_placement": ("smlp", ["--sparse-placement", "fairseq"], {"sparse_placement": "fairseq"}),
    "all2all_chunks": ("transformer", ["--all2all-chunks", "2"], {"all2all_chunks": 2}),
    "base_shuffle": ("smlp", ["--base-shuffle", "0"], {"base_shuffle": False}),
    "balanced_eval_routing": ("smlp", ["--balanced-eval-routing", "greedy"], {"balanced_eval_routing": "greedy"}),
    "base_layers": ("smlp", ["--sparse-layers", "1"], {"sparse_layers": 1}),  # fairseq's: = --sparse-layers
    "criterion_name": ("transformer", ["--criterion", "smlp_lm_loss"], {"criterion_name": "smlp_lm_loss"}),
    "smoe_routing": ("smlp", ["--smoe-routing", "leaky-full-sequence"], {"smoe_routing": "leaky-full-sequence"}),
    "prefix_fraction": ("smlp", ["--smoe-routing", "partial", "--prefix-fraction", "0.25"],
                        {"smoe_routing": "partial", "prefix_fraction": 0.25}),
    "smoe_parallel": ("smlp", ["--smoe-parallel", "replicated"], {"smoe_parallel": "replicated"}),
    "batch_size": ("smlp", ["--batch-size", "3"], {"batch_size": 3}),
    "max_tokens": ("smlp", ["--max-tokens", "48"], {"batch_size": 2}),  # 48 tokens of 24-token sequences
    "update_freq": ("smlp", ["--update-freq", "2"], {"update_freq": 2}),
    "sgu_heads": ("gmlp", ["--sgu-heads", "2"], {"heads": 2}),
    "token_routed_experts": ("gmlp", ["--token-routed-experts", "2"], {"token_routed_experts": 2}),
    "decoder_attention_heads": ("transformer", ["--decoder-attention-heads", "2"], {"heads": 2}),
    "moe_router": ("transformer", ["--moe-router", "gshard"], {"moe_router": "gshard"}),
    "capacity_factor": ("transformer", ["--capacity-factor", "1.5"], {"capacity_factor": 1.5}),
    "eval_capacity_factor": ("transformer", ["--eval-capacity-factor", "2.0"], {"eval_capacity_factor": 2.0}),
    "gshard_aux_loss": ("transformer", ["--moe-router", "gshard", "--gshard-aux-loss", "fairscale"],
                        {"moe_router": "gshard", "gshard_aux_loss": "fairscale"}),
    "hash_seed": ("transformer", ["--moe-router", "hash", "--hash-seed", "3"], {"moe_router": "hash", "hash_seed": 3}),
}


def fairseq_cfg(flags):
    """fairseq-train's parse of `flags` (fairseq's parser, the plugin's dataclasses), as an omegaconf config."""
    return _parse(tuple(flags))


@functools.cache
def _parse(flags):  # ~0.7 s each here (hydra composes the config): parse each command once
    with tempfile.TemporaryDirectory() as data, contextlib.redirect_stderr(io.StringIO()):
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           [data, "--user-dir", PLUGINS, "--task", "language_modeling", "--cpu",
                                            *flags])
        return convert_namespace_to_omegaconf(args)


def namespace_core(flags) -> LMConfig:
    """The core config from fairseq's argparse namespace (presets applied, no omegaconf: ~0.01 s): model
    fields the flags and the preset leave unset read as the table's defaults, as fairseq's dataclass
    fills them (the legacy `args` path of fairseq's build_model)."""
    with tempfile.TemporaryDirectory() as data, contextlib.redirect_stderr(io.StringIO()):
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           [data, "--user-dir", PLUGINS, "--task", "language_modeling", "--cpu",
                                            *flags])
    return table.to_core_config(args, family_of(flags), VOCAB, PAD)


def family_of(flags) -> str:
    arch = flags[flags.index("--arch") + 1]
    return table.FAMILIES_BY_MODEL[ARCH_MODEL_NAME_REGISTRY[arch]]


def core_of(flags) -> LMConfig:
    return table.to_core_config(fairseq_cfg(flags).model, family_of(flags), VOCAB, PAD)


def outcome(flags) -> dict:
    """Everything the plugin takes from the model flags: the core config's fields and the plugin's settings."""
    cfg = fairseq_cfg(flags)
    core = table.to_core_config(cfg.model, family_of(flags), VOCAB, PAD)
    return {**dataclasses.asdict(core), **dataclasses.asdict(table.plugin_settings(cfg.model))}


def round_trip(core: LMConfig, world=WORLD) -> tuple[str, LMConfig]:
    flags = table.fairseq_flags(core)
    back = core_of(flags.split() + world)
    return flags, back


def same_model(a: LMConfig, b: LMConfig) -> bool:
    """Equal configs; for a dense model, equal but for the expert fields its flags leave out."""
    if a.sparse_layers or b.sparse_layers:
        return a == b
    sparse_only = {f.core for f in table.FIELDS if f.sparse}
    return ({k: v for k, v in dataclasses.asdict(a).items() if k not in sparse_only} ==
            {k: v for k, v in dataclasses.asdict(b).items() if k not in sparse_only})


def assert_round_trip(flags0):
    """flags -> config -> flags -> config: the same config, and the flags written twice are the same."""
    core = core_of(flags0)
    flags1, core1 = round_trip(core)
    assert same_model(core1, core), (flags0, flags1)
    assert table.fairseq_flags(core1) == flags1
    return core, flags1


def test_every_field_has_an_example_and_every_core_field_a_flag():
    assert set(EXAMPLES) == set(table.FIELDS_BY_NAME)
    flagged = {f.core for f in table.FIELDS if f.core is not None}
    core_fields = {f.name for f in dataclasses.fields(LMConfig)}
    assert flagged | set(table.CORE_FIELDS_NOT_FLAGS) == core_fields
    assert not flagged & set(table.CORE_FIELDS_NOT_FLAGS)


def test_registered_dataclasses_are_the_table():
    """The fields fairseq registers for each model are exactly the table's rows of that family, with
    the table's defaults and choices (the core's constants, e.g. the router registry's names)."""
    for model, family in table.FAMILIES_BY_MODEL.items():
        assert MODEL_REGISTRY[model].family == family
        dc = MODEL_DATACLASS_REGISTRY[model]
        fields = {f.name: f for f in dataclasses.fields(dc) if f.name != "_name"}
        rows = table.family_fields(family)
        assert list(fields) == [f.name for f in rows], model
        for row in rows:
            assert fields[row.name].default == row.default, row.name
            if row.choices is not None:
                assert [c.value for c in fields[row.name].type] == list(row.choices), row.name
    # the router flags offer exactly the router registry's names (smlp/routing/registry.py)
    choices = {name: [c.value for c in f.type] for model in table.FAMILIES_BY_MODEL
               for name, f in MODEL_DATACLASS_REGISTRY[model].__dataclass_fields__.items()
               if name in ("moe_router", "smoe_routing")}
    assert choices == {"moe_router": list(TOKEN_ROUTERS), "smoe_routing": list(SMOE_ROUTINGS)}


def test_every_architecture_and_option_round_trips_through_fairseqs_argument_parser():
    """The quick twin of the two tests below (fairseq's argparse namespace, no omegaconf, ~0.01 s a parse):
    flags -> config -> flags -> config for every preset and every non-default option."""
    archs = sorted(a for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m in table.FAMILIES_BY_MODEL)
    commands = [["--arch", arch, *WORLD] for arch in archs]
    commands += [BASE[family] + WORLD + extra for name, (family, extra, _) in EXAMPLES.items()
                 if table.FIELDS_BY_NAME[name].core is not None]
    for flags0 in commands:
        core = namespace_core(flags0)
        flags1 = table.fairseq_flags(core)
        back = namespace_core(flags1.split() + WORLD)
        assert same_model(back, core), (flags0, flags1)
        assert table.fairseq_flags(back) == flags1


@pytest.mark.slow  # ~1.5 s each: two fairseq parses (hydra)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_field_is_consumed_and_round_trips(name):
    """Each field, set to a non-default value, changes what the plugin takes from the flags as the table
    says (a field nothing reads leaves the outcome unchanged and fails), and flags -> config -> flags
    round-trips with it."""
    family, extra, expected = EXAMPLES[name]
    base = BASE[family] + WORLD
    before, after = outcome(base), outcome(base + extra)
    for key, value in expected.items():
        assert after[key] == value, (name, key, after[key])
        assert before[key] != value, (name, key)
    changed = {k for k in after if after[k] != before[k]}
    assert changed == set(expected), (name, changed)
    if name == "base_layers":  # only fairseq reads it: its per-rank checkpoints follow --sparse-layers
        assert fairseq_cfg(base + extra).model.base_layers == 1
    core, flags = assert_round_trip(base + extra)
    row = table.FIELDS_BY_NAME[name]
    if row.core is not None and name != "seq_len":  # --seq-len is written as --tokens-per-sample
        assert (row.flag or "--" + name.replace("_", "-")) in flags.split(), flags


@pytest.mark.slow  # ~20 s: one omegaconf parse per architecture
def test_every_architecture_round_trips():
    """flags -> config -> flags for every registered architecture of ours (the size presets). A dense
    model's flags leave its expert fields out: they read back as the defaults."""
    archs = sorted(a for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m in table.FAMILIES_BY_MODEL)
    assert len(archs) >= 20
    for arch in archs:
        # the preset's config from the argparse namespace, its flags parsed back as fairseq-train does: the
        # same config (and the two parsing paths agree)
        core = namespace_core(["--arch", arch, *WORLD])
        flags = table.fairseq_flags(core)
        back = core_of(flags.split() + WORLD)
        assert same_model(back, core), (arch, flags)
        assert table.fairseq_flags(back) == flags
        assert flags.split()[1] == ARCH_MODEL_NAME_REGISTRY[arch]


def test_models_reads_fairseq_fields_only_through_the_table():
    """fairseq_plugins/models.py touches no field of the fairseq model config itself: `cfg` only goes to
    the table module's functions (to_core_config, plugin_settings); the architecture presets set only
    fields the table knows."""
    tree = ast.parse(Path(fairseq_plugins.__file__).with_name("models.py").read_text())
    preset = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_preset")
    inside_preset = {id(n) for n in ast.walk(preset)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("cfg", "args"):
            pytest.fail(f"models.py line {node.lineno} reads {node.value.id}.{node.attr} directly")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id in ("getattr", "setattr", "hasattr") and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in ("cfg", "args") and id(node) not in inside_preset:
            name = node.args[1]
            assert isinstance(name, ast.Constant) and name.value in table.FIELDS_BY_NAME, \
                f"models.py line {node.lineno}: {ast.unparse(node)} reads a field the table does not know"
        if node.func.id == "_preset":  # the presets' helpers (_large_moe, _tiny_moe) end in _preset too
            for kw in node.keywords:
                assert kw.arg in table.FIELDS_BY_NAME, f"a preset sets {kw.arg}, a field the table does not know"
        if any(isinstance(a, ast.Name) and a.id == "cfg" for a in node.args):
            assert node.func.id in ("to_core_config", "plugin_settings"), \
                f"models.py line {node.lineno} passes the fairseq config to {node.func.id}"


def test_shared_embeddings_flag_is_accepted_and_the_model_is_tied():
    """--share-decoder-input-output-embed (fairseq's transformer_lm recipes) parses for every family and builds
    the same model as without it, whose output projection is its input embedding."""
    import torch

    from smlp.lm import LanguageModel

    for flags in BASE.values():
        assert namespace_core(flags + WORLD + ["--share-decoder-input-output-embed"]) == namespace_core(flags + WORLD)
    model = LanguageModel(namespace_core(BASE["smlp"] + WORLD)).eval()
    tokens = torch.randint(4, VOCAB, (2, 8))
    assert torch.equal(model(tokens), model.features(tokens) @ model.embed.weight.t())


@pytest.mark.parametrize("d_model, heads", [(1024, 16), (256, 4), (128, 2), (64, 1), (32, 1), (200, 2), (96, 1)])
def test_attention_heads_default_to_the_papers_head_width(d_model, heads):
    """Without --decoder-attention-heads a Transformer gets heads of dimension 64, as the paper's 16 heads at
    D=1024 (issue 29): D / 64, one head below 64 channels, else the most heads of >= 64 channels dividing D."""
    from smlp.lm import HEAD_DIM, attention_heads_for
    from smlp_eval import flops as F

    assert attention_heads_for(d_model) == heads
    assert d_model % heads == 0 and (heads == 1 or d_model // heads >= HEAD_DIM)
    flags = ["--decoder-embed-dim", str(d_model), "--decoder-ffn-embed-dim", "64", "--decoder-layers", "1",
             "--tokens-per-sample", "8", "--sparse-layers", "0"]
    assert F.parse_model("moe_transformer_lm", flags, vocab_size=20).cfg.heads == heads
    given = F.parse_model("moe_transformer_lm", [*flags, "--decoder-attention-heads", "1"], vocab_size=20)
    assert given.cfg.heads == 1
