"""The user-facing tools tried with the mistakes a new user makes (issue 40): each is refused with one line on
stderr, `PROG: error: ...`, naming the offending value and what would be valid, before any work starts, and
nothing outside the tool's own files changes (`snapshot` before and after).

The programs run through their console entry points (`main(argv)`) in this process; the cases that need a
trained checkpoint share the one-process run of tests/test_bad_inputs.py's kind (`trained`, 2 updates) and
build what else they need from it (a 2-rank set, a consolidated file older than its shards) by rewriting
files, not by training again. docs/faults.md lists the cases.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from fairseq_helpers import PLUGINS, TRAIN, fairseq_train


def snapshot(*roots: Path) -> dict[str, str]:
    """path -> sha256 of every file under `roots` (folders as "dir") but a save folder's lock (smlp/folder_lock.py:
    its holder line is rewritten by every run that takes it)."""
    from smlp.folder_lock import LOCK_NAME

    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            if p.name != LOCK_NAME:
                out[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_error_line(err: str, prog: str) -> str:
    """The single `PROG: error: ...` line of a refusal (other stderr lines are log records, never tracebacks)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- smlp-export


def test_export_force_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """--force into a folder of one's own files: refused before the checkpoint is even read, the files kept."""
    from smlp_eval import hf_export

    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "thesis.tex").write_text("\\documentclass{article}")
    before = snapshot(tmp_path)
    assert hf_export.main([str(tmp_path / "no-such.pt"), "--hf", str(mine), "--force"]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-export")
    assert f"--force replaces only a folder smlp-export wrote, and {mine} is not one" in line
    assert "thesis.tex" in line and "nothing was changed" in line
    assert snapshot(tmp_path) == before


def test_export_hf_under_a_file_is_refused_before_the_work(tmp_path, capsys):
    from smlp_eval import hf_export

    (tmp_path / "hf").write_text("a file")
    before = snapshot(tmp_path)
    assert hf_export.main([str(tmp_path / "no-such.pt"), "--hf", str(tmp_path / "hf" / "plays")]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-export")
    assert f"--hf {tmp_path / 'hf' / 'plays'}: {tmp_path / 'hf'} is a file, not a folder" in line
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- checkpoints to resume


def two_rank_set(trained: Path, save: Path, names=("checkpoint_last", "checkpoint_best")) -> Path:
    """`save` holding what a 2-rank run of the one-process checkpoint would have written: for each name, rank
    shards X-rank-0/1.pt with one expert each (fairseq_plugins.elastic's resharding, rank by rank), tagged as
    one save of a 2-rank run; the Adam state is left out (the resume resets it)."""
    from fairseq_plugins.elastic import Plan, inspect_saved, resharded_state
    from smlp.expert_data_parallel import ExpertDataLayout

    save.mkdir(parents=True, exist_ok=True)
    base = trained / "checkpoint_last.pt"
    state = torch.load(base, map_location="cpu", weights_only=False)
    state["last_optimizer_state"] = None
    targets = tuple(str(save / f"checkpoint_last-rank-{r}.pt") for r in range(2))
    plan = Plan(inspect_saved(str(base)), ExpertDataLayout(world_size=2, ep_size=2, num_experts=2), 2, True, targets)
    for rank in range(2):
        shard = resharded_state(plan, rank, {0: state}, [])
        for name in names:
            torch.save(shard, save / f"{name}-rank-{rank}.pt")
    return save


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gmlp_lm_tiny", "moe_transformer_lm"])
def test_resuming_an_smlp_set_as_another_model_names_both_architectures_first(arch, smlp_tiny_one_process,
                                                                              tiny_lm_data, tmp_path, capsys):
    """docs/faults.md's message, before the expert count (which gmlp has no flag for) or --fp16 are named."""
    from fairseq.checkpoint_utils import load_checkpoint

    from fairseq_plugins.errors import refusal_line

    save = two_rank_set(smlp_tiny_one_process, tmp_path / "ckpt")
    before = snapshot(tmp_path)
    argv = [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", arch, *TRAIN, "--save-dir", str(save)]
    with pytest.raises(ValueError) as err:
        fairseq_train(argv)
    assert type(err.value).__name__ == "CheckpointSetError"
    assert load_checkpoint.__module__ == "fairseq_plugins.checkpoint_sources"
    line = refusal_line(err.value, "fairseq-train")
    assert line.startswith(f"fairseq-train: error: {save / 'checkpoint_last-rank-0.pt'} does not fit the model of "
                           f"this run: the checkpoint is of another architecture or size (checkpoint: --arch "
                           f"smlp_lm_tiny, this run: --arch {arch}"), line
    assert "--num-experts" not in line and "--fp16" not in line
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_run_resumed_on_fewer_ranks_leaves_no_shard_of_the_earlier_run(smlp_tiny_one_process, tiny_lm_data,
                                                                         tmp_path):
    """A 2-rank set resumed on one process (resharded), validated and saved: checkpoint_best.pt of this run
    supersedes the 2-rank run's checkpoint_best-rank-*.pt, which are removed; the set of each name loads."""
    from fairseq_plugins.checkpoints import check_current, read_checkpoint_any_layout

    save = two_rank_set(smlp_tiny_one_process, tmp_path / "ckpt")
    fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", "--num-experts", "2",
                   *TRAIN, "--max-update", "3", "--save-dir", str(save), "--valid-subset", "valid",
                   "--max-valid-steps", "2", "--no-epoch-checkpoints"])
    names = sorted(p.name for p in save.iterdir() if p.is_file() and not p.name.startswith("."))
    assert names == ["checkpoint_best.pt", "checkpoint_last.pt"], names
    for name in names:
        check_current(str(save / name))
        assert read_checkpoint_any_layout(str(save / name))[0]["optimizer_history"][-1]["num_updates"] == 3


def went_on(save: Path, name: str, updates: int) -> None:
    """As if training had gone on: the shards of `name` now hold another save (`updates`) of the same run."""
    for shard in sorted(save.glob(f"{name}-rank-*.pt")):
        state = torch.load(shard, map_location="cpu", weights_only=False)
        state["optimizer_history"][-1]["num_updates"] = updates
        state["smlp_shard"] = {**state["smlp_shard"], "num_updates": updates,
                               "set_id": f"{state['smlp_shard']['set_id'].rsplit(':', 1)[0]}:{updates}"}
        torch.save(state, shard)


@pytest.fixture
def stale(smlp_tiny_one_process, tmp_path) -> Path:
    """README's `smlp-consolidate .../checkpoint_best.pt` in place (update 2), then training went on and saved
    update 5's shards beside it."""
    from smlp_launch.consolidate import consolidate_main

    save = two_rank_set(smlp_tiny_one_process, tmp_path / "ckpt", names=("checkpoint_best",))
    assert consolidate_main([str(save / "checkpoint_best.pt")]) == 0
    went_on(save, "checkpoint_best", 5)
    return save / "checkpoint_best.pt"


STALE = ("checkpoint_best.pt and its rank shards hold different saves (checkpoint_best.pt: update 2, merged by "
         "smlp-consolidate from 2 shards; checkpoint_best-rank-0.pt: update 5, written by a 2-rank run")


@pytest.mark.slow
@pytest.mark.parametrize("prog", ["smlp-generate", "smlp-zeroshot", "smlp-export"])
def test_a_consolidated_file_older_than_its_shards_is_refused_by_our_programs(prog, stale, tiny_lm_data, tmp_path,
                                                                              capsys, monkeypatch):
    from smlp_eval import generate, hf_export, zeroshot

    data = tmp_path / "copa.jsonl"
    data.write_text('{"premise": "It rained.", "choice1": "a", "choice2": "b", "question": "effect", "label": 0}\n')
    before = snapshot(tmp_path)
    main, argv = {"smlp-generate": (generate.main, ["--path", str(stale), "--prompts", str(data)]),
                  "smlp-zeroshot": (zeroshot.main, ["--path", str(stale), "--task", "copa", "--data", str(data)]),
                  "smlp-export": (hf_export.main, [str(stale), "--hf", str(tmp_path / "hf")])}[prog]
    assert main([*argv, "--data-dir", str(tiny_lm_data)]) == 2
    line = one_error_line(capsys.readouterr().err, prog)
    assert STALE in line and f"run `smlp-consolidate {stale}` again" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("prog", ["fairseq-eval-lm", "fairseq-validate"])
def test_a_consolidated_file_older_than_its_shards_is_refused_by_fairseqs_programs(prog, stale, tiny_lm_data):
    from fairseq_helpers import run_in_process

    with pytest.raises(ValueError) as err:
        run_in_process(prog, [str(tiny_lm_data), "--user-dir", PLUGINS, "--path", str(stale), "--task",
                              "language_modeling", "--tokens-per-sample", "32", "--batch-size", "8"])
    assert STALE in str(err.value) and type(err.value).__name__ == "CheckpointSetError"


# ----------------------------------------------------------------------------- smlp-launch and fairseq-train


@pytest.mark.slow
def test_launcher_says_a_refused_flag_once_in_one_line(tiny_lm_data, tmp_path):
    """Every worker checks the flags before it joins the others; the launcher prints the refusal once, without
    the ranks' tracebacks, and leaves no save directory or rank log behind. (The other flags take the same path;
    tests/test_bad_inputs.py runs each through fairseq-train.)"""
    import subprocess
    import sys

    launch = Path(sys.executable).parent / "smlp-launch"
    save = tmp_path / "ckpt"
    proc = subprocess.run([str(launch), "--nproc", "2", "--cpu", "--", str(tiny_lm_data), "--user-dir", PLUGINS,
                           "--arch", "smlp_lm_tiny", *TRAIN, "--save-dir", str(save), "--num-experts", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr, "smlp-launch")
    message = "--num-experts 3 cannot be spread evenly over 2 ranks: it must be a multiple of the world size"
    assert message in line and proc.stderr.count(message) == 1, proc.stderr
    assert "Traceback" not in proc.stdout and not save.exists()


def test_launcher_workers_refuse_asynchronous_checkpoints_before_joining(tiny_lm_data, tmp_path):
    """smlp-launch's workers check the checkpoint flags with the others before any rendezvous: --save-async (the
    short name of --write-checkpoints-asynchronously) is refused in one line naming the flag to drop."""
    from smlp_launch.preflight import refusal

    argv = [str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TRAIN, "--save-dir",
            str(tmp_path / "ckpt")]
    assert refusal(argv) is None
    line = refusal([*argv, "--save-async"])
    assert line.startswith("--write-checkpoints-asynchronously (--save-async) writes each rank's file from a thread")
    assert "drop the flag" in line and "\n" not in line and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("extra, message", [
    (lambda t: ["--save-dir", str(t / "a-file" / "ckpt")], "--save-dir {t}/a-file/ckpt cannot be created: {t}/a-file "
                                                           "is a file; choose a folder path"),
    (lambda t: ["--save-dir", str(t / "ckpt"), "--restore-file", str(t / "nope.pt")],
     "--restore-file {t}/nope.pt does not exist (nor its rank shards {t}/nope-rank-R.pt): fairseq would silently "
     "start from scratch"),
    (lambda t: ["--save-dir", str(t / "ckpt"), "--finetune-from-model", str(t / "nope.pt")],
     "--finetune-from-model {t}/nope.pt does not exist"),
], ids=["save-dir-under-a-file", "missing-restore-file", "missing-finetune-model"])
def test_launcher_refuses_paths_before_any_worker_starts(extra, message, tiny_lm_data, tmp_path, capsys,
                                                         monkeypatch):
    from smlp_launch import local

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setattr(local.Launcher, "start", lambda self: pytest.fail("a worker was started"))
    before = snapshot(tmp_path)
    assert local.main(["--nproc", "2", "--cpu", "--", str(tiny_lm_data), "--user-dir", PLUGINS, *extra(tmp_path)]) == 2
    assert message.format(t=tmp_path) in one_error_line(capsys.readouterr().err, "smlp-launch")
    assert snapshot(tmp_path) == before


def test_fairseq_programs_print_a_refusal_as_one_line(capsys, monkeypatch):
    """fairseq-train / -validate / -eval-lm let the plugins' refusals reach the interpreter: one line, not the
    traceback around it; other errors keep their traceback."""
    import sys

    import fairseq_plugins  # noqa: F401  (installs the hook at import)
    from fairseq_plugins.errors import FlagError, print_refusals

    # an in-process init_process_group of an earlier test in this worker may have wrapped the hook in torch's
    # "[rankN]: " prefix: start from the interpreter's hook
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert print_refusals() and not print_refusals()  # installs over the interpreter's hook, once
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fairseq-train", "data"])
    try:
        raise FlagError("--decoder-ffn-embed-dim 127 must be even")
    except FlagError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert capsys.readouterr().err == "fairseq-train: error: --decoder-ffn-embed-dim 127 must be even\n"
    try:
        raise KeyError("a bug")
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert "Traceback" in capsys.readouterr().err


# ----------------------------------------------------------------------------- evaluation programs


@pytest.mark.slow
def test_validate_takes_the_sequence_length_from_the_checkpoint(smlp_tiny_one_process, tiny_lm_data):
    """fairseq-validate --tokens-per-sample 16 on a T = 32 model: blocks of 16, the model's weights as trained;
    64 is refused in one line naming both, by fairseq-validate and fairseq-eval-lm."""
    from fairseq_helpers import run_in_process, valid_losses
    from fairseq_plugins.errors import FlagError

    ckpt = str(smlp_tiny_one_process / "checkpoint_last.pt")
    flags = [str(tiny_lm_data), "--user-dir", PLUGINS, "--path", ckpt, "--task", "language_modeling",
             "--batch-size", "8"]
    (res,) = run_in_process("fairseq-validate", [*flags, "--tokens-per-sample", "16", "--max-valid-steps", "2"])
    assert len(valid_losses(res.stdout)) == 1, res.stdout[-2000:]
    with pytest.raises(FlagError, match=r"--tokens-per-sample 64 exceeds the model's sequence length 32 .*give "
                                        r"--tokens-per-sample 32 or less"):
        run_in_process("fairseq-validate", [*flags, "--tokens-per-sample", "64"])
    with pytest.raises(FlagError, match=r"blocks of 64 tokens \(--tokens-per-sample\) to a model whose spatial "
                                        r"weights cover 32 positions"):
        run_in_process("fairseq-eval-lm", [*flags, "--tokens-per-sample", "64"])


@pytest.mark.slow
def test_generate_refuses_fairseqs_own_transformer_lm(tiny_lm_data, tmp_path, capsys):
    """A checkpoint of fairseq's own model: named, with the program that generates from it."""
    from smlp_eval import generate

    save = tmp_path / "fairseq-lm"
    fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "transformer_lm", "--decoder-layers", "1",
                   "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
                   *["cross_entropy" if f == "smlp_lm_loss" else f for f in TRAIN], "--max-update", "1",
                   "--save-dir", str(save), "--disable-validation", "--no-epoch-checkpoints"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("To be\n")
    before = snapshot(tmp_path)
    assert generate.main(["--path", str(save / "checkpoint_last.pt"), "--prompts", str(prompts)]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-generate")
    assert "holds a transformer_lm model, not one of this project's (smlp_lm, gmlp_lm, moe_transformer_lm)" in line
    assert "fairseq-interactive --path" in line and snapshot(tmp_path) == before


@pytest.mark.parametrize("prog", ["smlp-zeroshot", "smlp-generate"])
def test_output_json_is_checked_before_the_work(prog, tmp_path, capsys):
    """Under a file: refused before the checkpoint is read, not after the scoring."""
    from smlp_eval import generate, zeroshot

    (tmp_path / "results").write_text("a file")
    out = tmp_path / "results" / "zs.json"
    main = zeroshot.main if prog == "smlp-zeroshot" else generate.main
    before = snapshot(tmp_path)
    assert main(["--path", str(tmp_path / "no-such.pt"), "--output-json", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, prog)
    assert f"--output-json {out}: {tmp_path / 'results'} is a file, not a folder" in line
    assert snapshot(tmp_path) == before


def test_generate_says_it_reads_prompts_from_a_terminal(capsys, monkeypatch):
    import io

    from smlp_eval.generate import read_prompts

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal("To be\n"))
    assert read_prompts("-") == ["To be"]
    assert "smlp-generate: reading prompts from standard input, one per line; end with Ctrl-D" in \
        capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("piped\n"))  # a pipe: nothing said
    assert read_prompts("-") == ["piped"] and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- smlp-flops


def test_flops_refuses_a_match_no_layer_count_reaches(capsys):
    """No sMLP with 1000 sparse blocks comes near the small sMLP's FLOPs: an error, not a +2277% "nearest"."""
    from smlp_eval import flops

    assert flops.main(["--arch", "smlp_lm_paper_small", "--match", "--smlp-sparse-layers", "1000",
                       "--method", "analytic"]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-flops")
    assert "--smlp-sparse-layers 1000: the smallest sMLP with 1000 sparse blocks (1 dense + 1000 sparse) has" in line
    assert "none matches within 1.5%; give fewer sparse blocks (the target has 12)" in line


def test_flops_counts_a_preset_as_its_recipe_trains_it(capsys):
    """smlp_lm_tiny is counted as configs/smlp_tiny.args trains it, T = 64 on the demo corpus (V = 4000), not
    with fairseq's T = 1024 and the paper's V = 51200."""
    import json

    from smlp_eval import flops

    assert flops.main(["--arch", "smlp_lm_tiny", "--num-experts", "2", "--json", "--method", "analytic"]) == 0
    out = capsys.readouterr()
    counted = json.loads(out.out)
    assert (counted["tokens"], counted["seq_len"], counted["vocab_size"]) == (64, 64, 4000), counted
    assert "smlp_lm_tiny as its recipe trains it: --tokens-per-sample 64 (configs/smlp_tiny.args), --vocab-size " \
           "4000" in out.err
    assert flops.main(["--arch", "smlp_lm_tiny", "--num-experts", "2", "--json", "--method", "analytic",
                       "--tokens-per-sample", "32", "--vocab-size", "100"]) == 0  # given flags win
    counted = json.loads(capsys.readouterr().out)
    assert (counted["tokens"], counted["vocab_size"]) == (32, 100)


# ----------------------------------------------------------------------------- outputs of the evaluation tools


def test_consolidate_checks_its_output_before_merging(tmp_path, capsys):
    """--out under a file: refused before the shards are read (a missing folder is created: the next test)."""
    from smlp_launch.consolidate import consolidate_main

    (tmp_path / "a-file").write_text("x")
    before = snapshot(tmp_path)
    assert consolidate_main([str(tmp_path / "no-such.pt"), "--out", str(tmp_path / "a-file" / "m.pt")]) == 2
    line = one_error_line(capsys.readouterr().err, "smlp-consolidate")
    assert f"--out {tmp_path / 'a-file' / 'm.pt'}: {tmp_path / 'a-file'} is a file, not a folder" in line
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_outputs_go_into_missing_folders(smlp_tiny_one_process, tiny_lm_data, tmp_path, capsys):
    """smlp-consolidate --out and smlp-zeroshot --output-json into folders that do not exist yet: created."""
    import json

    from smlp_eval import zeroshot
    from smlp_launch.consolidate import consolidate_main

    save = two_rank_set(smlp_tiny_one_process, tmp_path / "ckpt", names=("checkpoint_best",))
    merged = tmp_path / "merged" / "best.pt"
    assert consolidate_main([str(save / "checkpoint_best.pt"), "--out", str(merged)]) == 0 and merged.is_file()
    copa = tmp_path / "copa.jsonl"
    copa.write_text('{"premise": "It rained.", "choice1": "a", "choice2": "b", "question": "effect", "label": 0}\n')
    out = tmp_path / "results" / "today" / "zs.json"
    assert zeroshot.main(["--path", str(merged), "--task", "copa", "--data", str(copa), "--data-dir",
                          str(tiny_lm_data), "--max-unk-rate", "0.99", "--output-json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["tasks"]["copa"]["n"] == 1
    assert "truncated" in capsys.readouterr().out
