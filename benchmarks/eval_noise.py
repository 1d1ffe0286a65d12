"""How much of a family's validation perplexity is evaluation noise: equal trainings, compared.

    python -m smlp_bench.eval_noise RUN_DIR [RUN_DIR ...] [--out docs/benchmark/eval_noise/results.json]
                                    [--publish docs/benchmarks.md]

Each RUN_DIR holds the `train.log` of one fairseq-train run of the fair configuration (D=128, F=512, T=128,
8 experts, 400 updates) made with `--valid-trained-routing --valid-greedy-routing`; its name is
FAMILY_PERTURBATION (e.g. `det_rep_s2`: sMLP-det, replicated sMoE, seed 2). Per family and update: the
training loss, the validation perplexity with the balanced routers priced (the default), greedy and
assigning as in training, over the family's perturbations (seeds, and for sMLP-det the two sMoE layouts),
and their spread: the standard deviation of log perplexity and the largest ratio between two runs.
`--publish` rewrites the section between `<!-- eval-noise:start -->` and `<!-- eval-noise:end -->`.
"""
from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from .schedule import atomic_write_json

FAMILIES = {"det": "sMLP-det", "base": "Base Layers", "hash": "HASH Layers", "switch": "Switch"}
METRICS = (("ppl", "priced (default)"), ("greedy_routing_ppl", "greedy"),
           ("trained_routing_ppl", "as in training (not causal)"))
START, END = "<!-- eval-noise:start -->", "<!-- eval-noise:end -->"


def read_run(run_dir: Path) -> dict:
    from smlp_launch.fairseq_log import train_records, valid_records

    log = (run_dir / "train.log").read_text(errors="replace")
    train = {int(float(r["num_updates"])): float(r["loss"]) for r in train_records(log) if "loss" in r}
    valid = {}
    for r in valid_records(log):
        u = int(float(r["num_updates"]))
        valid[u] = {m: float(r[m]) for m, _ in METRICS if m in r}
        valid[u].update({k: float(v) for k, v in r.items() if k.startswith(("load_greedy_", "load_")) and
                         k.endswith("tmoe")})
    family, _, perturbation = run_dir.name.partition("_")
    return {"run": run_dir.name, "family": family, "perturbation": perturbation, "train_loss": train,
            "valid": valid}


def spread(values: list[float]) -> dict | None:
    if len(values) < 2:
        return None
    logs = [math.log(v) for v in values]
    return {"sd_log": statistics.stdev(logs), "max_ratio": max(values) / min(values), "n": len(values)}


def summarise(runs: list[dict], update: int) -> dict:
    out = {}
    for family in FAMILIES:
        rs = [r for r in runs if r["family"] == family and update in r["valid"]]
        if not rs:
            continue
        row = {"runs": [r["run"] for r in rs],
               "train_loss": [r["train_loss"].get(update) for r in rs]}
        row["train_loss_spread"] = spread([2 ** v for v in row["train_loss"] if v is not None])
        for metric, _ in METRICS:
            vals = [r["valid"][update].get(metric) for r in rs]
            row[metric] = vals
            row[f"{metric}_spread"] = spread([v for v in vals if v is not None])
        # the evaluation error of a routing: its perplexity over the training-time assignment's, per run
        for metric in ("ppl", "greedy_routing_ppl"):
            row[f"{metric}_over_trained"] = [a / b - 1 if a and b else None
                                             for a, b in zip(row[metric], row["trained_routing_ppl"])]
        out[family] = row
    return out


def render(record: dict) -> str:
    u = record["update"]
    lines = [f"Equal trainings of the fair configuration (D=128, 8 experts, 2 ranks), validation after {u} updates "
             f"on the same 320 blocks, the balanced routers (Base Layers, sMLP's tMoE) evaluated three ways. Spread: "
             f"the standard deviation of log perplexity over a family's runs (their seeds; for sMLP-det also the two "
             f"sMoE layouts of seed 1), and the largest ratio between two of them.", "",
             "| family | runs | training loss (bits) | " + " | ".join(f"valid ppl, {w}" for _, w in METRICS)
             + " | evaluation error: priced, greedy over as in training |",
             "|---|---|---|" + "---:|" * (len(METRICS) + 1)]
    for family, row in record["families"].items():
        def cell(values, s):
            vals = ", ".join(f"{v:.1f}" for v in values if v is not None)
            return f"{vals}<br>sd {100 * s['sd_log']:.2f}%, max/min {s['max_ratio']:.3f}" if s else vals or "-"
        loss = ", ".join(f"{v:.3f}" for v in row["train_loss"] if v is not None)
        cells = [cell(row[m], row[f"{m}_spread"]) for m, _ in METRICS]
        errors = ["/".join(f"{100 * v:+.1f}%" if v is not None else "-" for v in row[f"{m}_over_trained"])
                  for m in ("ppl", "greedy_routing_ppl")]
        cells.append(f"priced {errors[0]}<br>greedy {errors[1]}")
        lines.append(f"| {FAMILIES[family]} | {', '.join(row['runs'])} | {loss} | " + " | ".join(cells) + " |")
    lines += ["", f"Generated by `python -m smlp_bench.eval_noise` from `{record['source']}`."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smlp_bench.eval_noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders, each with its train.log")
    ap.add_argument("--update", type=int, default=400, help="the validation compared (400)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmark/eval_noise/results.json"))
    ap.add_argument("--publish", type=Path, default=None, help="a page with the eval-noise markers to rewrite")
    args = ap.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "train.log").is_file()]
    if missing:
        ap.error(f"no train.log in {', '.join(missing)}")
    runs = [read_run(r) for r in args.runs]
    record = {"benchmark": "eval_noise", "update": args.update, "families": summarise(runs, args.update),
              "runs": runs, "source": str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, record)
    text = render(record)
    print(text)
    if args.publish:
        page = args.publish.read_text()
        if START not in page or END not in page:
            ap.error(f"{args.publish} has no {START} ... {END} section")
        head, rest = page.split(START, 1)
        args.publish.write_text(head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])
        print(f"published: {args.publish}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
