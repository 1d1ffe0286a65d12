"""smlp-bench's command line: the FLOP-matched benchmark (benchmarks/suite.py) and the paper's other
experiments (benchmarks/experiments.py), which build on the suite; this module sits above both, so
neither imports the other back. Usage and what each step does: benchmarks/suite.py.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import schedule as S
from . import suite
from .experiments import EXPERIMENTS, finish, get_experiment


def main(argv: Sequence[str] | None = None) -> int:
    args = suite.build_parser().parse_args(argv)
    previous_sigterm = None
    if args.publish:
        try:
            root = Path.cwd()
            for line in suite.publish(args.publish, root / suite.PAGE, root / suite.FIGURE_DIR,
                                      experiment_order=list(EXPERIMENTS), readme=root / "README.md"):
                print(f"   {line}")
        except (suite.BenchError, OSError, KeyError, json.JSONDecodeError) as exc:
            print(f"{suite.PROG}: error: cannot publish {' '.join(map(str, args.publish))}: {exc}",
                  file=sys.stderr)
            return 1
        return 0
    try:
        if args.report:
            store = S.RunStore.load(args.report / "runs.json")
            record = suite.report(store, args.report)
            if record.get("experiment"):
                finish(record, args.report)
            print(f"   results: {args.report / 'results.json'} ({'complete' if record['complete'] else 'PARTIAL'})")
            return 0
        if args.experiment:
            exp = get_experiment(args.experiment)
            args.output_dir = (args.output_dir or Path("results") / exp.name).expanduser().absolute()
            if exp.needs_training is False:
                args.output_dir.mkdir(parents=True, exist_ok=True)
                exp.run_without_training(args)
                return 0
            name, settings = exp.name, dict(exp.settings, models=tuple(m.key for m in exp.models))
        else:
            name, settings = suite.settings_from_args(args)
            args.output_dir = (args.output_dir or Path("results/bench")).expanduser().absolute()
        suite.check_settings(settings, args.nproc)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        previous_sigterm = suite._stop_on_sigterm()
        t0 = time.time()
        print(f"== {suite.PROG} ({name}): {len(settings['models'])} models x {settings['seeds']} seed(s), "
              f"{settings['updates']} updates each, {args.nproc} ranks, output {args.output_dir}", flush=True)
        print("== 1/5 data", flush=True)
        data = suite.prepare(args)
        print("== 2/5 models", flush=True)
        if args.experiment:
            models, matching = exp.plan_models(suite.vocab_size(data), args.nproc)
        else:
            models, matching = suite.plan_models(suite.vocab_size(data), args.nproc, settings["models"],
                                                 settings["target"])
        for m in models:
            print(f"   {m.title:<40} {m.layers:>6}  {m.fwd_flops_per_seq / 1e9:.3f} GFLOPs/seq  {m.note}")
        by_key = {m.key: m for m in models}
        reference = suite.REFERENCE if suite.REFERENCE in by_key else models[0].key
        plan = suite.make_plan(name, settings, models, args.nproc, args.order_seed, reference,
                         experiment=args.experiment and exp.name)
        store = S.RunStore.open(args.output_dir / "runs.json", plan, resume=args.resume)
        if not store.slots:
            store.slots = suite.initial_schedule(plan)
            store.extra["matching"] = matching
        store.extra["machine"] = suite.machine_info()
        print(f"== 3/5 dense matmul peak ({args.nproc} processes x 1 thread)", flush=True)
        peak = suite.matmul_peak(args.nproc)
        store.extra.setdefault("peaks", []).append({"total": peak["total"], "at": time.time()})
        store.save()
        print(f"   {peak['total'] / 1e9:.1f} GFLOP/s in total", flush=True)
        for rid in store.prepare_resume():
            print(f"   resuming: the probe before the next run is measured again ({rid})", flush=True)
        print(f"== 4/5 training: {len(store.pending())} of {len(store.slots)} runs to go "
              f"({len([s for s in store.slots if s.kind == S.PROBE])} of them probes)", flush=True)
        suite.execute(store, by_key, data, args, out_dir=args.output_dir,
                      on_recorded=lambda: suite.report(store, args.output_dir, quiet=True))
        print("== 5/5 report", flush=True)
        record = suite.report(store, args.output_dir)
        if args.experiment:
            exp.finish(record, args.output_dir)
        print()
        for t in ([] if args.experiment else record["targets"]):
            met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
            print(f"   {met:>6}  {t['target']}: {suite._fmt(t['measured'])} (goal {t['goal']})")
        for v in record["verdicts"].values():
            if v:
                print(f"   {v['model']}: {v['text']}")
        print(f"   results: {args.output_dir / 'results.json'}, {args.output_dir / 'table.md'}, "
              f"{args.output_dir / 'figure5.png'}  ({(time.time() - t0) / 60:.1f} min)")
    except (suite.BenchError, S.ScheduleError) as exc:
        print(f"{suite.PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{suite.PROG}: interrupted; continue with --resume", file=sys.stderr)
        return 130
    finally:
        if previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_sigterm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
