"""smlp-bench: FLOP-matched speed and quality of sMLP against its baselines (sMLP Table 4, Figure 5).

    smlp-bench [--preset quick|full|long] [--output-dir DIR] [--resume] [--seeds N] [--models a,b,...]
    smlp-bench --experiment NAME [--output-dir DIR] [--resume]     (benchmarks/experiments.py)
    smlp-bench --publish RESULTS_JSON [RESULTS_JSON ...]           (docs/benchmarks.md sections + docs/benchmark/)
    smlp-bench --chaos [--kills N] [--updates U] [--save-every K]  (a training killed N times ends bitwise equal to
                                                                    an uninterrupted one: benchmarks/chaos.py)

One question: at matched FLOPs on the same data, how fast does each model train (words/s, MFU)
and how low does its validation perplexity go (against tokens and against time)?

1. data:     the demo corpus (Gutenberg plays, sentencepiece 4k, fairseq binary; built once);
2. peak:     dense fp32 matmul FLOP/s of W concurrent processes with one thread each, the MFU
             denominator, measured in this run on this machine (benchmarks/machine.py);
3. matching: the target sMLP-deterministic and every other family FLOP-matched to it by the FLOPs
             calculator (`smlp_eval.flops.match`) at run time (benchmarks/presets.py);
4. training: every model runs the real fairseq-train through `smlp-launch --nproc W --cpu` (one
             gloo rank and one thread per core), same data, tokens, updates, optimizer and seeds,
             in the interleaved schedule of benchmarks/schedule.py: one round per seed, the order
             rotated from round to round (reversed, then shuffled with the recorded --order-seed),
             and a short probe run of the reference model (sMLP-det) before, between and after
             the training runs. Every speed ratio divides each run's words/s by the probes right
             before and after it (runs adjacent in time), and is reported with its range. Each
             finished run is written to OUTPUT_DIR/runs.json at once (temporary file, fsync,
             rename), so `--resume` continues a stopped benchmark: finished runs are skipped, an
             interrupted one starts again. Anchors in the quick and full presets: fairseq's own
             `transformer_lm` (dense, and with --base-layers) at the sizes of our Transformer and
             Base Layers (benchmarks/plan.py runs the schedule, benchmarks/training.py one run);
5. profile:  a window of steps near the end of the first seed's run is profiled inside
             fairseq-train (`SMLP_PROFILE_STEPS`, torch.profiler): routing, all2all, experts,
             token mixing and the rest of a step;
6. report:   results.json, Figure 5 (perplexity against tokens and against time), a Table 4 style
             table (table.md), and a summary on the console (benchmarks/report.py: the figures from
             benchmarks/summary.py, the verdicts from benchmarks/verdicts.py, the figure from
             benchmarks/plots.py). `--publish` writes docs/ from the JSON (benchmarks/publish.py).

The presets and why they have their size: benchmarks/presets.py. The time axis, words/s and MFU:
benchmarks/summary.py and benchmarks/training.py.

This module is the command line. The FLOP-matched benchmark's modules and the paper's other
experiments (benchmarks/experiments.py), which build on them, sit below it, so none imports it back.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import schedule as S
from .experiments import EXPERIMENTS, finish, get_experiment
from .plan import run_schedule
from .presets import MODEL_ORDER, PRESETS, BenchError, plan_models
from .publish import FIGURE_DIR, PAGE, publish
from .report import fmt, report

PROG = "smlp-bench"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="quick, full (default) or long")
    p.add_argument("--quick", action="store_true", help="the same as --preset quick")
    p.add_argument("--experiment", default=None, metavar="NAME",
                   help="one of the paper's other experiments (benchmarks/experiments.py): "
                        "figure7-routing, table7-token-routed-gmlp, figure4-dense, table4-speed")
    p.add_argument("--fair", action="store_true",
                   help="the deciding benchmark (benchmarks/fair.py): a learning-rate sweep per family, then every "
                        "family at its rate with 8 experts on seeds the sweep did not use, an expert sweep and a "
                        "second width; each stage resumable, its store in docs/benchmark/fair/ (in the repository)")
    p.add_argument("--stages", default=None,
                   help="with --fair: a comma-separated list of its stages, in order (default: lr-sweep,deciding,"
                        "experts; width runs only when named)")
    p.add_argument("--no-pin", action="store_true",
                   help="with --fair: run this checkout's code instead of each stage's pinned commit (to try out "
                        "uncommitted code; such a stage resumes only while the code that decides perplexity is "
                        "unchanged)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="with --fair: where the runs' logs and the stages' pinned worktrees (WORK_DIR/code/) go "
                        "(default results/fair-work; the store keeps each run's figures, not its log)")
    p.add_argument("--commit-store", action="store_true",
                   help="with --fair: commit each stage's store (runs.json, results.json) to the repository that "
                        "holds it after every finished run, so that --resume continues from a fresh clone")
    p.add_argument("--chaos", action="store_true",
                   help="a 2-rank sMLP-det training killed --kills times at random moments (SIGKILL of a worker, "
                        "SIGTERM of the job, both also inside a checkpoint write), resumed each time by smlp-launch, "
                        "against the same training uninterrupted: final weights, optimizer state and every logged "
                        "loss must be bitwise equal (benchmarks/chaos.py; record in OUTPUT_DIR/chaos.json)")
    p.add_argument("--kills", type=int, default=20, help="with --chaos: how many kills (20)")
    p.add_argument("--save-every", type=int, default=4, help="with --chaos: updates between checkpoints (4)")
    p.add_argument("--chaos-seed", type=int, default=1, help="with --chaos: seed of the kills' kinds and moments (1)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where results go (results/bench, or results/<experiment>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the benchmark recorded in OUTPUT_DIR/runs.json: skip finished runs, start the "
                        "interrupted one again")
    p.add_argument("--data", type=Path, default=None,
                   help="a fairseq data-bin (default: the demo corpus, built into OUTPUT_DIR/data-bin once)")
    p.add_argument("--models", default=None,
                   help=f"comma-separated subset of {','.join(MODEL_ORDER)} (default: the preset's)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per model (quick: 1, full: 3, long: 1 + phase 2)")
    p.add_argument("--updates", type=int, default=None,
                   help="training updates per run (quick: 24, full: 60, long: 750)")
    p.add_argument("--nproc", type=int, default=2, help="expert-parallel CPU ranks = experts (2)")
    p.add_argument("--order-seed", type=int, default=1, help="seed of the shuffled orders of rounds 3+ (recorded)")
    p.add_argument("--source", type=Path, default=None, metavar="RESULTS_JSON",
                   help="table4-speed: the long benchmark's results.json (default docs/benchmark/long/results.json)")
    p.add_argument("--report", type=Path, default=None, metavar="OUTPUT_DIR",
                   help="do not train: rewrite results.json, table.md and the figure from OUTPUT_DIR/runs.json "
                        "(also while a benchmark is running or stopped)")
    p.add_argument("--publish", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                   help="do not train: copy each RESULTS_JSON's figures to docs/benchmark/ and rewrite the sections "
                        "of docs/benchmarks.md it feeds (preset table, long-preset verdict, claims table); run from "
                        "the repository root")
    return p


def prepare(args) -> Path:
    if args.data:
        if not (args.data / "dict.txt").is_file():
            raise BenchError(f"--data {args.data} is not a fairseq data-bin (no dict.txt); build one with "
                             f"smlp-prepare-data")
        return args.data.expanduser().absolute()
    from smlp_launch.data import DataPrepError, prepare_data

    try:
        # the fair benchmark's output folder is in the repository: its data goes to the work folder
        out, _ = prepare_data((getattr(args, "work_dir", None) or args.output_dir) / "data-bin", demo=True,
                              vocab_size=4000, seed=1,
                              log=lambda msg: print(f"   {msg}", flush=True))
    except DataPrepError as exc:
        raise BenchError(f"data preparation failed: {exc}") from exc
    return out


def vocab_size(data: Path) -> int:
    """The size of the dictionary fairseq builds for this data-bin (its specials included)."""
    from fairseq.data import Dictionary

    return len(Dictionary.load(str(data / "dict.txt")))


def settings_from_args(args) -> tuple[str, dict]:
    name = "quick" if args.quick else (args.preset or "full")
    settings = dict(PRESETS[name])
    if args.seeds is not None:
        settings["seeds"] = args.seeds
    if args.updates is not None:
        settings["updates"] = args.updates
    if args.models:
        settings["models"] = tuple(k.strip() for k in args.models.split(",") if k.strip())
    return name, settings


def check_settings(settings: dict, nproc: int) -> None:
    if nproc < 2:
        raise BenchError(f"--nproc {nproc}: expert parallelism needs at least 2 ranks")
    if settings["seeds"] < 1 or settings["updates"] < 2 * settings["validate_every"]:
        raise BenchError(f"--seeds must be >= 1 and --updates >= {2 * settings['validate_every']}")


def _stop_on_sigterm():
    """SIGTERM (kill, a scheduler's stop) stops like Ctrl-C: the running launcher and its workers are
    stopped too (run_training's cleanup), and --resume restarts the interrupted run. Returns the
    previous handler (restored when main returns)."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous_sigterm = None
    if args.publish:
        try:
            root = Path.cwd()
            for line in publish(args.publish, root / PAGE, root / FIGURE_DIR,
                                      experiment_order=list(EXPERIMENTS), readme=root / "README.md"):
                print(f"   {line}")
        except (BenchError, OSError, KeyError, json.JSONDecodeError) as exc:
            print(f"{PROG}: error: cannot publish {' '.join(map(str, args.publish))}: {exc}",
                  file=sys.stderr)
            return 1
        return 0
    try:
        if args.report:
            store = S.RunStore.load(args.report / "runs.json")
            record = report(store, args.report)
            if record.get("experiment"):
                finish(record, args.report)
            print(f"   results: {args.report / 'results.json'} ({'complete' if record['complete'] else 'PARTIAL'})")
            return 0
        if args.chaos:
            from . import chaos

            args.output_dir = (args.output_dir or Path("results/chaos")).expanduser().absolute()
            args.output_dir.mkdir(parents=True, exist_ok=True)
            previous_sigterm = _stop_on_sigterm()
            return chaos.main(args, prepare(args))
        if args.fair:
            from . import fair

            args.output_dir = (args.output_dir or Path("docs/benchmark/fair")).expanduser().absolute()
            args.output_dir.mkdir(parents=True, exist_ok=True)
            args.work_dir = (args.work_dir or Path("results/fair-work")).expanduser().absolute()
            args.work_dir.mkdir(parents=True, exist_ok=True)
            previous_sigterm = _stop_on_sigterm()
            data = prepare(args)
            return fair.main(args, data, vocab_size(data))
        if args.experiment:
            exp = get_experiment(args.experiment)
            args.output_dir = (args.output_dir or Path("results") / exp.name).expanduser().absolute()
            if exp.needs_training is False:
                args.output_dir.mkdir(parents=True, exist_ok=True)
                exp.run_without_training(args)
                return 0
            name, settings = exp.name, dict(exp.settings, models=tuple(m.key for m in exp.models))
        else:
            name, settings = settings_from_args(args)
            args.output_dir = (args.output_dir or Path("results/bench")).expanduser().absolute()
        check_settings(settings, args.nproc)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        previous_sigterm = _stop_on_sigterm()
        t0 = time.time()
        print(f"== {PROG} ({name}): {len(settings['models'])} models x {settings['seeds']} seed(s), "
              f"{settings['updates']} updates each, {args.nproc} ranks, output {args.output_dir}", flush=True)
        print("== 1/4 data", flush=True)
        data = prepare(args)
        print("== 2/4 models", flush=True)
        if args.experiment:
            models, matching = exp.plan_models(vocab_size(data), args.nproc)
        else:
            models, matching = plan_models(vocab_size(data), args.nproc, settings["models"],
                                                 settings["target"])
        for m in models:
            print(f"   {m.title:<40} {m.layers:>6}  {m.fwd_flops_per_seq / 1e9:.3f} GFLOPs/seq  {m.note}")
        print("== 3/4 training", flush=True)
        store = run_schedule(name, settings, models, matching, data, args.nproc, args.output_dir,
                             resume=args.resume, order_seed=args.order_seed,
                             experiment=args.experiment and exp.name)
        print("== 4/4 report", flush=True)
        record = report(store, args.output_dir)
        if args.experiment:
            exp.finish(record, args.output_dir)
        print()
        for t in ([] if args.experiment else record["targets"]):
            met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
            print(f"   {met:>6}  {t['target']}: {fmt(t['measured'])} (goal {t['goal']})")
        for v in record["verdicts"].values():
            if v:
                print(f"   {v['model']}: {v['text']}")
        print(f"   results: {args.output_dir / 'results.json'}, {args.output_dir / 'table.md'}, "
              f"{args.output_dir / 'figure5.png'}  ({(time.time() - t0) / 60:.1f} min)")
    except (BenchError, S.ScheduleError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; continue with --resume", file=sys.stderr)
        return 130
    finally:
        if previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_sigterm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
