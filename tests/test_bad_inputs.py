"""The bad-input catalogue (docs/faults.md, "Bad input catalogue"): each case is refused with a clear error
before any work starts, and nothing in the save directory or the data directory is overwritten.

Training cases run the real `fairseq_cli.train.main` in this process (one process, or rank 0 of a
2-rank world simulated with torch's fake process group, where only the world size matters), with
fairseq's training loop replaced by a tripwire: a case that reached training fails. Each checks the
error's type and wording (the offending value and what would be valid) and that every file that
existed before is byte-identical afterwards and no checkpoint was written.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fairseq_helpers import PLUGINS, TRAIN, fairseq_train


class TrainingStarted(Exception):
    pass


def snapshot(*dirs: Path) -> dict[str, str]:
    """path -> sha256 of every file under `dirs` but a save folder's lock (smlp/folder_lock.py: its holder line is
    rewritten by every run that takes it, refused later or not)."""
    from smlp.folder_lock import LOCK_NAME

    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in dirs if d.is_dir() for p in sorted(d.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


@pytest.fixture(scope="module")
def trained(smlp_tiny_one_process) -> Path:
    """A save directory after 2 updates of smlp_lm_tiny with 2 experts on one process (conftest.py)."""
    return smlp_tiny_one_process


@dataclass
class Ctx:
    tmp: Path
    data: Path
    trained: Path
    save: Path

    def with_checkpoint(self) -> Path:
        shutil.copytree(self.trained, self.save, dirs_exist_ok=True)
        return self.save / "checkpoint_last.pt"


def smlp(*extra):
    return lambda c: [str(c.data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", *TRAIN, "--save-dir", str(c.save),
                      *extra]


def arch(name, *extra):
    return lambda c: [str(c.data), "--user-dir", PLUGINS, "--arch", name, *TRAIN, "--save-dir", str(c.save), *extra]


def other_dictionary(c: Ctx) -> list[str]:
    """The data directory's dict.txt (consistent with its data) has 100 symbols more than the checkpoint's."""
    c.with_checkpoint()
    data = c.tmp / "other-data"
    shutil.copytree(c.data, data)
    lines = (data / "dict.txt").read_text().splitlines()
    (data / "dict.txt").write_text("\n".join(lines + [f"madeup{i} 1" for i in range(100)]) + "\n")
    return [str(data), *smlp("--num-experts", "2")(c)[1:]]


def data_copy(change: Callable[[Path], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        data = c.tmp / "data"
        shutil.copytree(c.data, data)
        change(data)
        return [str(data), *smlp("--num-experts", "2")(c)[1:]]
    return build


def cut_short(data: Path) -> None:
    raw = (data / "train.bin").read_bytes()
    (data / "train.bin").write_bytes(raw[: len(raw) // 2])


def fewer_symbols(data: Path) -> None:
    lines = (data / "dict.txt").read_text().splitlines()
    (data / "dict.txt").write_text("\n".join(lines[:500]) + "\n")


def no_train_split(c: Ctx) -> list[str]:
    data = c.tmp / "valid-only"
    data.mkdir()
    for name in ("dict.txt", "valid.bin", "valid.idx"):
        shutil.copy(c.data / name, data / name)
    return [str(data), *smlp("--num-experts", "2")(c)[1:]]


def resume(*extra, prepare: Callable[[Ctx], None] | None = None):
    def build(c: Ctx) -> list[str]:
        c.with_checkpoint()
        if prepare:
            prepare(c)
        return smlp(*extra)(c)
    return build


def truncate_copy(c: Ctx) -> None:
    data = (c.save / "checkpoint_last.pt").read_bytes()
    (c.save / "cut.pt").write_bytes(data[: len(data) // 3])


def as_rank_shards(c: Ctx) -> None:
    for r in (0, 1):
        shutil.copy(c.save / "checkpoint_last.pt", c.save / f"checkpoint_last-rank-{r}.pt")
    (c.save / "checkpoint_last.pt").unlink()


def save_dir_under_a_file(c: Ctx) -> list[str]:
    (c.tmp / "a-file").write_text("x")
    c.save = c.tmp / "a-file" / "ckpt"
    return smlp()(c)


# (id, argv builder, world, exception type, message fragments)
CASES = [
    # flags and dimensions
    ("experts-do-not-divide-the-width", smlp("--num-experts", "3"), 1, ValueError,
     ["--num-experts 3 must divide the gated width 64 (--decoder-embed-dim 64)"]),
    ("tokens-per-sample-above-seq-len", smlp("--seq-len", "16"), 1, ValueError,
     ["--tokens-per-sample 32 exceeds the model's sequence length 16", "raise --seq-len to 32"]),
    ("add-bos-token-beyond-seq-len", smlp("--seq-len", "32", "--add-bos-token"), 1, ValueError,
     ["--tokens-per-sample 32 with --add-bos-token (33 positions) exceeds the model's sequence length 32",
      "give --tokens-per-sample 31 or less", "raise --seq-len to 33"]),
    ("routing-prefix-covers-the-sequence", smlp("--smoe-routing", "partial", "--seq-len", "160"), 1, ValueError,
     ["routes on the first 32 positions", "no position would be predicted", "use --seq-len 32"]),
    ("prefix-fraction-out-of-range", smlp("--smoe-routing", "partial", "--prefix-fraction", "1.5"), 1, ValueError,
     ["--prefix-fraction 1.5 must be in (0, 1)"]),
    ("base-shuffle-not-0-or-1", smlp("--base-shuffle", "2"), 1, ValueError,
     ["--base-shuffle 2 is invalid: use 1 (shuffle, the default) or 0"]),
    ("sgu-heads-do-not-divide", arch("gmlp_lm_tiny", "--sgu-heads", "3"), 1, ValueError,
     ["--sgu-heads 3 must divide the gated width 64 (half of --decoder-ffn-embed-dim 128)"]),
    ("no-layer-at-all", arch("gmlp_lm_tiny", "--decoder-layers", "0"), 1, ValueError,
     ["--decoder-layers 0: the model needs at least one layer"]),
    ("attention-heads-do-not-divide", arch("transformer_lm_tiny", "--decoder-attention-heads", "5"), 1, ValueError,
     ["--decoder-attention-heads 5 must divide --decoder-embed-dim 64"]),
    ("every-other-placement-without-enough-dense", arch("switch_lm_tiny", "--decoder-layers", "1",
                                                        "--sparse-placement", "every_other"), 1, ValueError,
     ["every-other placement needs at least as many dense as sparse layers, got 1 dense and 2 sparse"]),
    ("capacity-factor-zero", arch("switch_lm_tiny", "--capacity-factor", "0"), 1, ValueError,
     ["--capacity-factor 0.0 is invalid: it must be > 0"]),
    ("eval-capacity-factor-negative", arch("switch_lm_tiny", "--eval-capacity-factor", "-1"), 1, ValueError,
     ["--eval-capacity-factor -1.0 is invalid: give a factor > 0", "or 0 for no capacity limit at evaluation"]),
    ("dropout-one", smlp("--dropout", "1.0"), 1, ValueError, ["--dropout 1.0 is invalid: it must be in [0, 1)"]),
    ("ffn-width-odd", smlp("--decoder-ffn-embed-dim", "127"), 1, ValueError,
     ["--decoder-ffn-embed-dim 127 must be even", "(e.g. --decoder-ffn-embed-dim 128)"]),
    ("negative-experts", smlp("--num-experts", "-1"), 1, ValueError,
     ["--num-experts -1 is invalid: give a positive number, or 0 for one per rank"]),
    ("smoe-experts-do-not-divide-the-width", smlp("--smoe-experts", "3"), 1, ValueError,
     ["--smoe-experts 3 must divide --decoder-embed-dim 64", "valid counts up to 64: 1, 2, 4, 8, 16, 32, 64"]),
    ("negative-smoe-experts", smlp("--smoe-experts", "-1"), 1, ValueError,
     ["--smoe-experts -1 is invalid: give a positive number of sMoE experts, or 0 for as many as the tMoE's experts"]),
    ("batch-size-zero", smlp("--batch-size", "0"), 1, ValueError,
     ["--batch-size 0 is not a batch size: fairseq would take it as no limit", "give a number >= 1"]),
    ("unknown-smoe-routing", smlp("--smoe-routing", "learned"), 1, SystemExit,
     ["--smoe-routing: invalid choice: 'learned'", "deterministic", "partial"]),
    # (these three ran as fairseq-train subprocesses in test_fairseq.py, the rest of that list is above and below)
    ("experts-do-not-divide-a-wider-width", smlp("--decoder-embed-dim", "66", "--num-experts", "4"), 1, ValueError,
     ["--num-experts 4 must divide the gated width 66"]),
    ("unknown-moe-router", arch("switch_lm_tiny", "--moe-router", "top3"), 1, SystemExit,
     ["--moe-router: invalid choice: 'top3'"]),
    ("hypermixer-with-sgu-heads", arch("hypermixer_lm_tiny", "--sgu-heads", "2"), 1, ValueError,
     ["--token-mixer hypermixer needs --sgu-heads 1"]),
    # experts vs world size (rank 0 of 2)
    ("experts-not-a-multiple-of-the-world", smlp("--num-experts", "3", "--distributed-world-size", "2"), 2, ValueError,
     ["--num-experts 3 cannot be spread evenly over 2 ranks", "multiple of the world size (e.g. 2 or 4)"]),
    ("expert-group-does-not-tile-the-ranks", smlp("--num-experts", "4", "--expert-parallel-size", "3",
                                                  "--distributed-world-size", "2"), 2, ValueError,
     ["--expert-parallel-size 3 does not divide the world size 2"]),
    ("smoe-experts-do-not-fit-the-expert-parallel-group", smlp("--num-experts", "2", "--smoe-experts", "1",
                                                              "--ddp-backend", "legacy_ddp",
                                                              "--smoe-parallel", "expert",
                                                              "--distributed-world-size", "2"), 2, ValueError,
     ["--smoe-parallel expert spreads the sMoE's 1 experts (--smoe-experts 1) over expert-parallel groups of 2 ranks",
      "give --smoe-experts a multiple of 2, or --smoe-parallel replicated"]),
    ("c10d-would-average-experts", smlp("--num-experts", "2", "--distributed-world-size", "2", "--ddp-backend", "c10d"),
     2, ValueError, ["--ddp-backend c10d would average expert weights", "needs --ddp-backend legacy_ddp"]),
    ("fully-sharded-would-shard-experts", smlp("--num-experts", "2", "--distributed-world-size", "2", "--ddp-backend",
                                               "fully_sharded"), 2, ValueError,
     ["--ddp-backend fully_sharded shards every parameter over the ranks", "--zero-sharding os",
      "needs --ddp-backend legacy_ddp"]),
    # data directory
    ("data-dir-missing", lambda c: [str(c.tmp / "no-such-data"), *smlp()(c)[1:]], 1, FileNotFoundError,
     ["no-such-data does not exist; pass the output folder of smlp-prepare-data or fairseq-preprocess"]),
    ("data-dir-not-binarized", lambda c: [str(c.tmp), *smlp()(c)[1:]], 1, FileNotFoundError,
     ["has no dict.txt; pass the output folder"]),
    ("data-dir-without-train-split", no_train_split, 1, FileNotFoundError, ["Dataset not found: train"]),
    ("data-dir-with-another-dictionary", other_dictionary, 1, ValueError,
     ["trained with a 2000-symbol dictionary and the data directory's dict.txt has 2100 symbols"]),
    ("train-bin-cut-short", data_copy(cut_short), 1, FileNotFoundError,
     ["/data/train.bin holds", "bytes but its index train.idx describes", "sentences): the file is cut short"]),
    ("dictionary-smaller-than-the-data", data_copy(fewer_symbols), 1, FileNotFoundError,
     ["/data/valid.bin holds token id", "but", "/data/dict.txt has 504 symbols (ids 0-503): the data was binarized "
                                              "with another, larger dictionary"]),
    # checkpoints
    ("checkpoint-of-another-architecture", resume("--arch", "gmlp_lm_tiny"), 1, ValueError,
     ["does not fit the model of this run: the checkpoint is of another architecture",
      "checkpoint: --arch smlp_lm_tiny, this run: --arch gmlp_lm_tiny"]),
    ("checkpoint-of-another-expert-count", resume("--num-experts", "4"), 1, ValueError,
     ["the checkpoint holds 2 expert(s) per file and this run 4 (--num-experts or the world size differ)"]),
    ("checkpoint-of-another-smoe-expert-count", resume("--num-experts", "2", "--smoe-experts", "4"), 1, ValueError,
     ["the checkpoint holds 2 expert(s) per file and this run 4 (--smoe-experts, --smoe-parallel or the world size "
      "differ)"]),
    ("restore-file-names-a-rank-shard", lambda c: smlp("--restore-file", str(c.save / "checkpoint_last-rank-0.pt"))(c),
     1, ValueError, ["names one rank's shard", "Pass the checkpoint name without the suffix"]),
    ("restore-file-does-not-exist", resume("--num-experts", "2", "--restore-file", "/nonexistent/model.pt"), 1,
     ValueError, ["--restore-file /nonexistent/model.pt: model.pt: missing", "silently start from scratch"]),
    ("restore-file-truncated", lambda c: resume("--num-experts", "2", "--restore-file", str(c.save / "cut.pt"),
                                                prepare=truncate_copy)(c), 1, ValueError,
     ["cut.pt: unreadable (truncated or corrupt file", "The file is damaged"]),
    # (a real 2-rank set resumes on one process: fairseq_plugins.elastic reshards it, tests/test_scale_out.py)
    ("rank-shards-copied-from-a-one-process-run", resume("--num-experts", "2", prepare=as_rank_shards), 1, ValueError,
     ["checkpoint_last.pt: 2 rank shards on disk but they were written by a 1-rank run",
      "the save set is mixed or incomplete"]),
    ("finetune-from-a-missing-model", smlp("--finetune-from-model", "/nonexistent/pretrained.pt"), 1, ValueError,
     ["--finetune-from-model /nonexistent/pretrained.pt does not exist"]),
    # (fairseq's asynchronous write skips the atomic tagged write and copies nothing to checkpoint_last)
    ("checkpoints-written-asynchronously", smlp("--num-experts", "2", "--save-async"), 1, ValueError,
     ["--write-checkpoints-asynchronously (--save-async)", "copies nothing to checkpoint_last", "drop the flag"]),
    # save directory
    ("save-dir-not-creatable", save_dir_under_a_file, 1, OSError,
     ["a-file/ckpt cannot be created (Not a directory", "choose a folder you can write"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case_id, build, world, exc_type, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_training_input_is_refused_before_work_starts(case_id, build, world, exc_type, fragments, tiny_lm_data,
                                                         trained, tmp_path, monkeypatch, capsys):
    from fairseq_cli import train as fairseq_cli_train

    def tripwire(*args, **kwargs):
        raise TrainingStarted(case_id)

    monkeypatch.setattr(fairseq_cli_train, "train", tripwire)
    ctx = Ctx(tmp=tmp_path, data=tiny_lm_data, trained=trained, save=tmp_path / "ckpt")
    argv = build(ctx)
    before = snapshot(ctx.save, tiny_lm_data, tmp_path)
    with pytest.raises(exc_type) as err:
        fairseq_train(argv, world)
    text = str(err.value) + capsys.readouterr().err
    if os.environ.get("SMLP_SHOW_ERRORS"):
        print(f"\n[{case_id}] {type(err.value).__name__}: {str(err.value) or text[-300:]}")
    for fragment in fragments:
        assert fragment in text, text[-2000:]
    after = snapshot(ctx.save, tiny_lm_data, tmp_path)
    changed = [p for p, h in before.items() if after.get(p) != h]
    written = [p for p in after if p not in before and Path(p).name.startswith("checkpoint")]
    assert not changed and not written, (changed, written)


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tiny_lm_data, tmp_path, monkeypatch):
    """fsync fails with ENOSPC while update 2 is saved: training stops with an error naming the file and
    the free space, checkpoint_last.pt still holds update 1 and loads, and no partial file is left."""
    save = tmp_path / "ckpt"
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up while update 2's checkpoint is written
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".checkpoint_1_2.pt.smlp-tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as err:
        fairseq_train([str(tiny_lm_data), "--user-dir", PLUGINS, "--arch", "smlp_lm_tiny", "--num-experts", "2",
                       *TRAIN, "--save-dir", str(save), "--save-interval-updates", "1", "--no-epoch-checkpoints",
                       "--max-update", "3", "--disable-validation"])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert err.value.errno == errno.ENOSPC
    assert f"could not write checkpoint {save / 'checkpoint_1_2.pt'}: No space left on device" in str(err.value)
    assert sorted(p.name for p in save.iterdir()) == [".smlp-save-dir.lock", "checkpoint_1_1.pt", "checkpoint_last.pt"]
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 1


# ----------------------------------------------------------------------------- evaluation inputs


@pytest.mark.parametrize("name, content, fragments", [
    ("latin1.jsonl", '{"premise": "caf\xe9.", "choice1": "a", "choice2": "b", "question": "cause", "label": 0}\n'
     .encode("latin-1"), ["latin1.jsonl, line 1: not UTF-8 text (byte 0xe9 at offset 16)", "Latin-1",
                          "iconv -f latin1 -t utf-8"]),
    ("utf16.jsonl", '{"premise": "a."}\n'.encode("utf-16"), ["utf16.jsonl, line 1: not UTF-8 text (byte 0xff",
                                                              "UTF-16", "iconv -f utf-16"]),
    ("second-line.jsonl", b'{"premise": "a."}\n{"premise": "\xff"}\n', ["second-line.jsonl, line 2: not UTF-8"]),
    ("empty.jsonl", b"", ["copa: ", "empty.jsonl holds no examples"]),
    ("blank-lines.jsonl", b"\n\n  \n", ["blank-lines.jsonl holds no examples"]),
], ids=["latin-1", "utf-16", "bad-byte-on-line-2", "empty", "only-blank-lines"])
def test_malformed_eval_files_are_refused_naming_file_and_line(tmp_path, name, content, fragments):
    """Missing fields, bad labels and invalid JSON are covered by test_zeroshot.py (BAD_INPUTS)."""
    from smlp_eval.tasks import DataFormatError, load_examples

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFormatError) as err:
        load_examples("copa", str(path))
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_storycloze_csv_in_utf16_is_refused(tmp_path):
    from smlp_eval.tasks import DataFormatError, load_examples

    path = tmp_path / "cloze.csv"
    path.write_text("InputSentence1,InputSentence2\na,b\n", encoding="utf-16")
    with pytest.raises(DataFormatError, match=r"cloze\.csv, line 1: not UTF-8 text .* UTF-16"):
        load_examples("storycloze", str(path))


@pytest.mark.slow
def test_eval_lm_blocks_longer_than_the_spatial_weight_are_refused(trained, tiny_lm_data, monkeypatch, capsys):
    """fairseq-eval-lm would skip every 64-token block (the model covers 32) and report the rest."""
    import sys

    from fairseq_cli import eval_lm

    monkeypatch.setattr(sys, "argv", ["fairseq-eval-lm", str(tiny_lm_data), "--user-dir", PLUGINS, "--path",
                                      str(trained / "checkpoint_last.pt"), "--task", "language_modeling",
                                      "--tokens-per-sample", "64", "--gen-subset", "test", "--cpu"])
    with pytest.raises(ValueError, match=r"blocks of 64 tokens \(--tokens-per-sample\) to a model whose spatial "
                                         r"weights cover 32 positions.*Use --tokens-per-sample 32"):
        eval_lm.cli_main()


def test_a_sequence_longer_than_the_spatial_weight_is_refused_by_the_model():
    from smlp.lm import LanguageModel, LMConfig

    model = LanguageModel(LMConfig(family="smlp", vocab_size=20, d_model=8, d_ffn=16, seq_len=12, dense_layers=1,
                                   sparse_layers=1, num_experts=2))
    with pytest.raises(ValueError, match="12"):
        model(torch.randint(0, 20, (1, 13)))


# ----------------------------------------------------------------------------- launcher inputs


@pytest.mark.parametrize("argv, env, fragment", [
    (["--nproc", "2", "--cpu", "--timeout", "0", "--"], {}, "--timeout must be > 0 seconds, got 0"),
    (["--nproc", "2", "--cpu", "--"], {"SMLP_DIST_TIMEOUT": "ten"}, "SMLP_DIST_TIMEOUT='ten' is not a number"),
    (["--worker", "--"], {"SMLP_STOP_SIGNALS": "KILL"}, "SIGKILL cannot be a graceful-stop signal"),
], ids=["timeout-zero", "timeout-not-a-number", "kill-as-stop-signal"])
def test_bad_launcher_settings_are_refused(tmp_path, monkeypatch, capsys, argv, env, fragment):
    from smlp_launch.local import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([*argv, str(tmp_path)]) == 2
    assert fragment in capsys.readouterr().err
