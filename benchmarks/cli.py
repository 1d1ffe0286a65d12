"""smlp-bench: every benchmark of the project, each a program over one harness (plan, run, record, publish).

The earlier spellings stay: `smlp-bench [--preset P | --quick] ...` (no command) is `preset`, `--fair` is `fair`,
`--experiment NAME` is `experiment NAME`, `--report DIR` is `report DIR`, `--publish FILES` is `publish FILES`,
`--chaos` is `chaos`.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import chaos, fair, gpu_check, speed
from .experiments import EXPERIMENTS, get_experiment
from .micro import activation_memory, step_breakdown
from .presets import MODEL_ORDER, PRESETS, BenchError, check_at_least, parse_names, plan_models
from .publish import FIGURE_DIR, PAGE, publish
from .report import fmt, report
from .store import RunStore
from .training import check_options, prepare, run_schedule, vocab_size

PROG = "smlp-bench"
ALIASES = {"--fair": "fair", "--experiment": "experiment", "--report": "report", "--publish": "publish",
           "--chaos": "chaos"}


def add_training(p: argparse.ArgumentParser, output: str) -> None:
    """The options of every program that trains through the harness."""
    p.add_argument("--output-dir", type=Path, default=None, help=f"where results go ({output})")
    p.add_argument("--resume", action="store_true",
                   help="continue the benchmark recorded in OUTPUT_DIR: skip finished runs, start the interrupted one "
                        "again")
    p.add_argument("--data", type=Path, default=None,
                   help="a fairseq data-bin (default: the demo corpus, built once into the output or work folder)")
    p.add_argument("--nproc", type=int, default=2, help="expert-parallel CPU ranks (2)")
    p.add_argument("--order-seed", type=int, default=1, help="seed of the shuffled orders of rounds 3+ (recorded)")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line, as every refusal of smlp-bench (the commands' parsers too)."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__.split("\n\n")[1])
    old = p.add_argument_group("the earlier spellings (each is rewritten to its command)")
    old.add_argument("--fair", action="store_true", help="smlp-bench fair")
    old.add_argument("--experiment", metavar="NAME", help="smlp-bench experiment NAME")
    old.add_argument("--report", metavar="OUTPUT_DIR", help="smlp-bench report OUTPUT_DIR")
    old.add_argument("--publish", metavar="RESULTS_JSON", nargs="+", help="smlp-bench publish RESULTS_JSON ...")
    old.add_argument("--chaos", action="store_true", help="smlp-bench chaos")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("preset", help="FLOP-matched speed and quality of every family (the default command)")
    s.add_argument("--preset", choices=tuple(PRESETS), default=None, help="quick, full (default) or long")
    s.add_argument("--quick", action="store_true", help="the same as --preset quick")
    s.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODEL_ORDER)}")
    s.add_argument("--seeds", type=int, default=None, help="seeds per model (quick: 1, full: 3, long: 1 + phase 2)")
    s.add_argument("--updates", type=int, default=None, help="updates per run (quick: 24, full: 60, long: 750)")
    add_training(s, "results/bench")
    s = sub.add_parser("fair", help="the deciding comparison; each stage resumable, its store in docs/benchmark/fair/")
    s.add_argument("--corpus", choices=tuple(fair.COMPARISONS), default="demo",
                   help="the comparison, by the corpus read: demo (Shakespeare, stores in docs/benchmark/fair/) or "
                        "kernel-docs (read once, 1500 updates; stores in docs/benchmark/fair-docs/)")
    s.add_argument("--stages", default=None, help="comma-separated stages, in order (demo: lr-sweep,deciding,experts,"
                                                   "experts-seeds,smoe-experts, width only when named; kernel-docs: "
                                                   "rate,deciding,experts)")
    s.add_argument("--no-pin", action="store_true",
                   help="run this checkout's code instead of each stage's pinned commit (to try out uncommitted code; "
                        "such a stage resumes only while the code that decides perplexity is unchanged)")
    s.add_argument("--work-dir", type=Path, default=None,
                   help="where the runs' logs and the stages' pinned worktrees (WORK_DIR/code/) go (results/fair-work)")
    s.add_argument("--commit-store", action="store_true",
                   help="commit each stage's store (runs.json, results.json) after every finished run, so that "
                        "--resume continues from a fresh clone")
    s.add_argument("--report-only", action="store_true",
                   help="do not train: OUTPUT_DIR/results.json and its figures from the stages' records as they are "
                        "(finished or not), by this checkout's report code; then `smlp-bench --publish` it")
    add_training(s, "docs/benchmark/fair")
    s = sub.add_parser("experiment", help="one of the paper's other experiments")
    s.add_argument("name", choices=tuple(EXPERIMENTS), metavar="NAME", help=", ".join(EXPERIMENTS))
    add_training(s, "results/NAME")
    s = sub.add_parser("report", help="do not train: results.json, table.md and the figure from OUTPUT_DIR/runs.json "
                                      "(also while a benchmark runs or after it stopped)")
    s.add_argument("report", type=Path, metavar="OUTPUT_DIR")
    s = sub.add_parser("publish", help="do not train: copy each record's figures to docs/benchmark/ and rewrite the "
                                       "sections of docs/benchmarks.md (and README) it feeds; run from the root")
    s.add_argument("publish", type=Path, nargs="+", metavar="RESULTS_JSON")
    for name, module in (("chaos", chaos), ("speed", speed), ("gpu-check", gpu_check), ("breakdown", step_breakdown),
                         ("activations", activation_memory)):
        module.add_arguments(sub.add_parser(name, help=getattr(module, "HELP", module.__doc__.split("\n")[0])))
    return p


def spelled(argv: Sequence[str]) -> list[str]:
    """argv with an earlier spelling rewritten to its command (no command at all: `preset`)."""
    argv = list(argv)
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help")):
        return argv
    for flag, command in ALIASES.items():
        for i, a in enumerate(argv):
            if a == flag or a.startswith(f"{flag}="):
                return [command, *argv[:i], *([a.split("=", 1)[1]] if "=" in a else []), *argv[i + 1:]]
    return ["preset", *argv]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(spelled(sys.argv[1:] if argv is None else argv))


def _out(args, default: Path, *, make: bool = True) -> Path:
    """OUTPUT_DIR (its default `default`), absolute; made unless `make` is False (the checks make nothing)."""
    out = (args.output_dir or default).expanduser().absolute()
    if make:
        args.output_dir = out
        out.mkdir(parents=True, exist_ok=True)
    return out


def run_fair(args) -> int:
    comp = fair.comparison_of(args)
    _out(args, comp.output)
    if args.report_only:
        return fair.report_only(args.output_dir, comp)
    args.work_dir = (args.work_dir or Path("results/fair-work")).expanduser().absolute()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    # the store is in the repository: the data goes to the work folder
    data = prepare(args.data, args.work_dir, comp.corpus)
    return fair.main(args, data, vocab_size(data))


def trainings(args, *, make: bool = True):
    """The preset benchmark's or the experiment's (experiment or None, name, settings, OUTPUT_DIR)."""
    exp = get_experiment(args.name) if args.command == "experiment" else None
    if exp is not None:
        settings = dict(exp.settings, models=tuple(m.key for m in exp.models))
        return exp, exp.name, settings, _out(args, Path("results") / exp.name, make=make)
    name = "quick" if args.quick else (args.preset or "full")
    settings = dict(PRESETS[name], **{k: v for k in ("seeds", "updates") if (v := getattr(args, k)) is not None})
    if args.models is not None:
        settings["models"] = tuple(parse_names(args.models, MODEL_ORDER, "--models"))
    return None, name, settings, _out(args, Path("results/bench"), make=make)


def check_trainings(args) -> None:
    """`smlp-bench preset` / `experiment`'s arguments, before any work: the models, the counts, the training
    options, and a run store in OUTPUT_DIR only with --resume."""
    _, _, settings, out = trainings(args, make=False)
    check_at_least(settings["seeds"], 1, "--seeds")
    check_at_least(settings["updates"], 2 * settings["validate_every"], "--updates",
                   "two validations of the preset")
    check_options(args, least_nproc=2)
    RunStore.check_start(out / "runs.json", resume=args.resume)


def run_trainings(args) -> int:
    """The preset benchmark, or an experiment: plan, train every run of the schedule, report (arguments checked by
    `check_trainings`)."""
    exp, name, settings, out = trainings(args)
    t0 = time.time()
    print(f"== {PROG} ({name}): {len(settings['models'])} models x {settings['seeds']} seed(s), "
          f"{settings['updates']} updates each, {args.nproc} ranks, output {out}\n== 1/4 data", flush=True)
    data = prepare(args.data, out)
    print("== 2/4 models", flush=True)
    models, matching = exp.plan_models(vocab_size(data), args.nproc) if exp else \
        plan_models(vocab_size(data), args.nproc, settings["models"], settings["target"])
    for m in models:
        print(f"   {m.title:<40} {m.layers:>6}  {m.fwd_flops_per_seq / 1e9:.3f} GFLOPs/seq  {m.note}")
    print("== 3/4 training", flush=True)
    store = run_schedule(name, settings, models, matching, data, args.nproc, out, resume=args.resume,
                         order_seed=args.order_seed, experiment=exp and exp.name)
    print("== 4/4 report", flush=True)
    record = report(store, out)
    if exp is not None:
        exp.finish(record, out)
    else:
        for t in record["targets"]:
            print(f"   {({True: 'met', False: 'MISSED', None: '-'}[t['met']]):>6}  {t['target']}: "
                  f"{fmt(t['measured'])} (goal {t['goal']})")
    for v in record["verdicts"].values():
        if v:
            print(f"   {v['model']}: {v['text']}")
    print(f"   results: {out / 'results.json'}, {out / 'table.md'}, {out / 'figure5.png'}  "
          f"({(time.time() - t0) / 60:.1f} min)")
    return 0


def run_report(args) -> int:
    if (record := report(RunStore.load(args.report / "runs.json"), args.report)).get("experiment"):
        get_experiment(record["experiment"]).finish(record, args.report)
    print(f"   results: {args.report / 'results.json'} ({'complete' if record['complete'] else 'PARTIAL'})")
    return 0


def run_publish(args) -> int:
    try:
        root = Path.cwd()
        for line in publish(args.publish, root / PAGE, root / FIGURE_DIR, experiment_order=list(EXPERIMENTS),
                            readme=root / "README.md"):
            print(f"   {line}")
    except (BenchError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"{PROG}: error: cannot publish {' '.join(map(str, args.publish))}: {exc}", file=sys.stderr)
        return 1
    return 0


def run_chaos(args) -> int:
    return chaos.main(args, prepare(args.data, _out(args, chaos.OUTPUT)))


COMMANDS = {"chaos": run_chaos, "preset": run_trainings, "experiment": run_trainings, "fair": run_fair,
            "report": run_report, "publish": run_publish, "speed": speed.run, "gpu-check": gpu_check.run,
            "breakdown": step_breakdown.run, "activations": activation_memory.run}
# each command's arguments checked before any work (no corpus built, no folder made, no model planned): a refusal is
# one line, `smlp-bench: error: ...`
CHECKS = {"chaos": chaos.check_args, "preset": check_trainings, "experiment": check_trainings, "fair": fair.check_args,
          "speed": speed.check_args, "gpu-check": gpu_check.check_args, "breakdown": step_breakdown.check_args,
          "activations": activation_memory.check_args}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum, frame):  # SIGTERM (kill, a scheduler's stop) stops like Ctrl-C: the runs stop, --resume goes on
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        previous = None
    try:
        if (check := CHECKS.get(args.command)) is not None:
            check(args)
        return COMMANDS[args.command](args)
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; continue with --resume", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
