"""Deprecated: `smlp_bench.suite` was cut along its sections (issue 27); import from the new modules.

    presets   the models and presets (TARGET, PRESETS, Model, plan_models, BenchError, ...)
    machine   machine_info, matmul_peak
    training  one training run (Run, train_command, run_training, clean_wps, run_record, ...)
    plan      make_plan, initial_schedule, the second phase, execute
    summary   summarise, speeds, ratios
    verdicts  analyse_curves, verdict, targets
    report    report, table, fmt (was `_fmt`)
    plots     plot
    publish   publish and the docs markers (PAGE, FIGURE_DIR, TABLE_START, ...)
    cli       build_parser, prepare, settings_from_args, PROG (smlp-bench's command line)

Every name this module had still resolves here for one release, with a DeprecationWarning.
"""
from __future__ import annotations

import warnings

from . import cli, machine, plan, plots, presets, publish, report, schedule, summary, training, verdicts

warnings.warn("smlp_bench.suite is deprecated: import from smlp_bench.presets, training, plan, summary, verdicts, "
              "report, plots, publish or cli (see its docstring)", DeprecationWarning, stacklevel=2)

_RENAMED = {"_fmt": report.fmt, "_at": verdicts.ppl_at, "write_json": schedule.atomic_write_json}
_HOMES = (presets, machine, training, plan, summary, verdicts, report, plots, publish, cli)


def __getattr__(name: str):
    if name in _RENAMED:
        return _RENAMED[name]
    for module in _HOMES:
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
