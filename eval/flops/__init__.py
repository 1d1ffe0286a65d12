"""The FLOPs calculator and the step-time model: FLOPs and parameters of our models, FLOP-matched layer
counts (sMLP section 4.1, Tables 3, 5, 8-10), and the time of a training step on a cluster (Table 4).

    smlp-flops --arch NAME [fairseq model flags] [--tokens-per-sample T] [--vocab-size V]
               [--distributed-world-size W] [--method fvcore|fvcore-full|analytic] [--json | --markdown]
    smlp-flops --match --arch TARGET [flags] [--match-tolerance 0.015] [--smlp-sparse-layers N] [--json | --markdown]
    smlp-flops --paper-tables [--json | --markdown]
    smlp-flops --step-time --arch NAME [model and training flags] [--cluster v100-dgx1 ...] [--json]
    smlp-flops --table4 top|bottom|both [--cluster ...] [--json | --markdown]

`--arch` and the model flags go through fairseq's own parser and our registered presets, then
`fairseq_plugins.config.to_core_config`, so they mean exactly what they mean in training.

    counting.py       counting, with the FLOPs convention and the methods (fvcore on the real modules,
                      analytic formulas)
    model_spec.py     a model given as fairseq flags, and the flags of a core config
    matching.py       FLOP matching and its rule
    paper_figures.py  the paper's published figures (Tables 3, 5, 8-10, 4)
    tables.py         the printed tables
    steptime.py       the step-time model (all2all and all-reduce bytes, memory, time per update)
    command.py        the `smlp-flops` command line (`python -m smlp_eval.flops` runs it too)

The names below are the calculator's public ones, importable from `smlp_eval.flops` itself
(`from smlp_eval import flops as F; F.match(F.count_spec(F.parse_model(...)))`).
"""

from .command import PROG, build_parser, cli, cluster_from_args, main, run
from .counting import (
    CONVENTION,
    FAMILY_NAMES,
    METHODS,
    CostModel,
    Count,
    LayerCost,
    cost_model,
    count,
    count_module,
    executed_macs,
    family_key,
    fvcore_by_module,
    table3,
    table3_module,
)
from .matching import MATCH_FAMILIES, MIXER_FAMILIES, MatchRow, family_config, match
from .model_spec import DEFAULT_VOCAB, ModelSpec, count_spec, fairseq_flags, parse_model, plugin_archs
from .one_gpu import OneGPUDispatcher
from .paper_figures import TABLE3_DIMS
from .steptime import step_time_for, table4
from .tables import (
    describe,
    format_count,
    format_match,
    format_paper_tables,
    format_step_time,
    format_table4,
    paper_tables,
    table5_comparison,
)

__all__ = [
    "CONVENTION", "DEFAULT_VOCAB", "FAMILY_NAMES", "MATCH_FAMILIES", "METHODS", "MIXER_FAMILIES", "TABLE3_DIMS",
    "CostModel", "Count", "LayerCost", "MatchRow", "ModelSpec", "OneGPUDispatcher", "cost_model", "count",
    "count_module", "count_spec", "describe", "executed_macs", "fairseq_flags", "family_config", "family_key",
    "format_count", "format_match", "format_paper_tables", "format_step_time", "format_table4", "fvcore_by_module",
    "match", "paper_tables", "parse_model", "plugin_archs", "step_time_for", "table3", "table3_module", "table4",
    "table5_comparison", "PROG", "build_parser", "cli", "cluster_from_args", "run", "main",
]
