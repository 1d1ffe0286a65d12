"""Long run: does the resident memory of each rank grow with the number of updates?

    python -m smlp_bench.micro.memory_growth [--updates 3000] [--nproc 2] [--config configs/smlp_tiny.args]
                                             [--data DATA_BIN] [--out results/memory_growth.json]

Trains the tiny preset through `smlp-launch` (real fairseq-train, expert-parallel CPU ranks, with
Base Layers' token shuffle and every all2all) for --updates updates with a checkpoint every
--save-every updates, samples every rank's VmRSS about twice a second together with the update
count rank 0 has logged, and fits RSS = a + b * update per rank over the updates after the first
--warmup-fraction (allocator pools, data loader buffers and the first checkpoint fill up there).
A leak (a tensor, graph or list kept per step) shows as a positive slope b.

glibc's allocator returns and takes back memory in steps of tens of MiB, so RSS wanders by that much
around a level. The verdict therefore compares the median RSS of the last quarter of the window with
that of its first quarter: the run passes when, for every rank, it grew by less than --max-growth-mib
(default 16 MiB: over 2400 measured updates, a leak of about 7 KiB per update would fail). The JSON
record (config, machine, versions, per-rank figures, a trace) goes to --out, every sample to
WORK/samples.json; `--reanalyze` recomputes the verdict from those. Exit status 0 = no growth,
1 = growth, 2 = the run failed.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from smlp_launch.fairseq_log import train_fields

from .harness import environment, parser, write_record

REPO = Path(__file__).resolve().parents[2]


def _tiny_flags(config: Path) -> list[str]:
    return config.read_text().split()


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv=None) -> int:
    from smlp_launch.memory import children_of, vmhwm_bytes, vmrss_bytes

    p = parser("memory_growth", __doc__.split("\n\n")[1], out=REPO / "results" / "memory_growth.json")
    p.add_argument("--updates", type=int, default=3000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "smlp_tiny.args")
    p.add_argument("--data", type=Path, default=None, help="binarized data (default: the demo corpus, built once)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--warmup-fraction", type=float, default=0.2)
    p.add_argument("--max-growth-mib", type=float, default=16.0)
    p.add_argument("--reanalyze", action="store_true", help="recompute the verdict from WORK/samples.json (no run)")
    p.add_argument("--work", type=Path, default=REPO / "results" / "memory_growth")
    args = p.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    if args.reanalyze:
        samples = json.loads((args.work / "samples.json").read_text())
        return report(args, samples, seconds=samples[-1]["t"])
    data = args.data
    if data is None:
        from smlp_launch.data import prepare_data

        data, _ = prepare_data(args.work / "data-bin", demo=True)
    save = args.work / "ckpt"
    cmd = [str(Path(sys.executable).parent / "smlp-launch"), "--nproc", str(args.nproc), "--cpu", "--", str(data),
           "--user-dir", str(REPO / "fairseq_plugins"), *_tiny_flags(args.config), "--max-update", str(args.updates),
           "--save-dir", str(save), "--save-interval-updates", str(args.save_every), "--keep-interval-updates", "1",
           "--no-epoch-checkpoints", "--disable-validation", "--log-format", "simple", "--log-interval", "10",
           "--no-progress-bar"]
    for old in save.glob("checkpoint*.pt"):  # start from scratch
        old.unlink()
    log_path = args.work / "train.log"
    update = [0]
    samples: list[dict] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def read_output():
            for line in proc.stdout:
                log.write(line)
                fields = train_fields(line)
                if fields and "num_updates" in fields:
                    update[0] = int(fields["num_updates"])

        reader = threading.Thread(target=read_output, daemon=True)
        reader.start()
        t0 = time.monotonic()
        workers: list[int] = []
        while proc.poll() is None:
            time.sleep(0.5)
            if len(workers) < args.nproc:
                workers = sorted(children_of(proc.pid))
                continue
            rss = [vmrss_bytes(w) for w in workers]
            if update[0] and all(r is not None for r in rss):
                samples.append({"t": round(time.monotonic() - t0, 2), "update": update[0], "rss": rss,
                                "hwm": [vmhwm_bytes(w) for w in workers]})
        reader.join(timeout=10)
    if proc.returncode != 0 or not samples:
        print(f"the training run failed (exit {proc.returncode}); see {log_path}", file=sys.stderr)
        return 2

    (args.work / "samples.json").write_text(json.dumps(samples) + "\n")
    return report(args, samples, seconds=samples[-1]["t"])


def analyze(samples: list[dict], start: float, nproc: int) -> list[dict]:
    window = [s for s in samples if s["update"] >= start]
    quarter = max(1, len(window) // 4)
    ranks = []
    for r in range(nproc):
        xs = [s["update"] for s in window]
        ys = [s["rss"][r] / 2 ** 20 for s in window]
        _, b = _fit(xs, ys)
        first, last = statistics.median(ys[:quarter]), statistics.median(ys[-quarter:])
        ranks.append({"rank": r, "median_rss_mib_first_quarter": round(first, 1),
                      "median_rss_mib_last_quarter": round(last, 1), "growth_mib": round(last - first, 1),
                      "slope_kib_per_update": round(b * 1024, 3),
                      "rss_mib_min_max": [round(min(ys), 1), round(max(ys), 1)],
                      "peak_rss_mib": round(max(s["hwm"][r] for s in samples) / 2 ** 20, 1)})
    return ranks


def report(args, samples: list[dict], seconds: float) -> int:
    start = args.warmup_fraction * args.updates
    ranks = analyze(samples, start, args.nproc)
    ok = all(r["growth_mib"] < args.max_growth_mib for r in ranks)
    record = {
        "question": "does each rank's resident memory grow per update in a long expert-parallel run?",
        "config": {"updates": args.updates, "nproc": args.nproc, "flags": _tiny_flags(args.config),
                   "save_every": args.save_every, "warmup_fraction": args.warmup_fraction,
                   "max_growth_mib": args.max_growth_mib, "window_updates": [start, args.updates]},
        **environment(),
        "seconds": seconds, "samples": len(samples), "ranks": ranks, "no_growth": ok,
        "trace": samples[:: max(1, len(samples) // 200)],
    }
    for r in ranks:
        print(f"rank {r['rank']}: median RSS {r['median_rss_mib_first_quarter']} -> {r['median_rss_mib_last_quarter']} "
              f"MiB from the first to the last quarter of updates {int(start)}-{args.updates} (growth "
              f"{r['growth_mib']} MiB, fitted slope {r['slope_kib_per_update']} KiB/update, range "
              f"{r['rss_mib_min_max']}), peak {r['peak_rss_mib']} MiB")
    print("no memory growth" if ok else "MEMORY GROWS")
    write_record(args.out, record)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
