"""`smlp-demo` (make demo): the whole main job, shortened, through its console script."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from smlp_launch.demo import Curves, main

DEMO = str(Path(sys.executable).parent / "smlp-demo")

# real lines of fairseq-train with our criterion (simple log format)
TRAIN = ("2026-11-23 01:25:40 | INFO | train_inner | epoch 001:     90 / 2834 loss=8.69, nll_loss=8.69, "
         "a2a_ms_0_smoe=3.1, load_0_tmoe=1, ppl=412.9, wps=2000, ups=5, wpb=2048, bsz=32, num_updates=90, lr=0.0027")
VALID = ("2026-11-23 01:25:49 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.548 | nll_loss 8.548 | "
         "a2a_ms_0_smoe 3.249 | load_0_tmoe 1.169 | ppl 374.2 | wps 33081.7 | wpb 2047.9 | bsz 32 | num_updates 100")


def test_arch_is_the_last_one_given():
    from smlp_launch.demo import arch_of

    assert arch_of(["--arch", "smlp_lm_tiny", "--lr", "1", "--arch", "gmlp_lm_tiny"]) == "gmlp_lm_tiny"


def test_log_lines_are_read():
    c = Curves()
    assert c.feed(TRAIN) == "train" and c.feed(VALID) == "valid" and c.feed("| INFO | fairseq.trainer | x") is None
    assert c.train == [(90, 8.69)] and c.valid == [(100, 8.548, 374.2)]


def test_bad_options_fail_before_any_work(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "a"), "--max-update", "0"]) == 2
    assert "--max-update 0 must be >= 1" in capsys.readouterr().err
    kept = tmp_path / "b" / "checkpoints" / "checkpoint_last-rank-0.pt"  # an earlier run's work
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"earlier run")
    assert main(["--out", str(tmp_path / "b"), "--config", str(tmp_path / "nope.args")]) == 1
    err = capsys.readouterr().err
    assert "nope.args does not exist" in err and not (tmp_path / "b" / "data-bin").exists()
    assert kept.read_bytes() == b"earlier run"  # a bad option loses nothing


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([DEMO, "--out", str(out), "--max-update", "40", "--validate-every", "20",
                           "--zeroshot-limit", "40"], capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 40 and summary["workers"] == 2
    assert math.isfinite(summary["valid_ppl"]) and summary["valid_ppl"] < summary["first_valid"]["ppl"]
    assert set(summary["zeroshot"]) == {"copa", "piqa"}
    for m in summary["zeroshot"].values():
        assert 0.0 <= m["acc"] <= 1.0
    zs = json.loads((out / "zeroshot.json").read_text())
    assert all(r["n"] == 40 for r in zs["tasks"].values())
    assert (out / "loss.png").stat().st_size > 1000
    assert list((out / "checkpoints").glob("checkpoint_last-rank-1.pt"))  # expert-parallel shards
    assert "== summary" in proc.stdout and "valid perplexity" in proc.stdout
    sample = summary["sample"]  # the demo ends with a seeded sample of the trained model's text
    assert sample["prompt"] == "To be, or not to be" and sample["continuation"].strip()
    assert sample["settings"]["seed"] == 1 and sample["settings"]["sample"]
    assert (sample["prompt"] + sample["continuation"]).split("\n")[0] in proc.stdout
    hf = out / "hf"  # exported (smlp-export, the rank shards merged) and the lines that load it printed
    assert summary["paths"]["hf"] == str(hf) and (hf / "model.safetensors").is_file()
    assert json.loads((hf / "config.json").read_text())["lm_config"]["num_experts"] == 2
    from smlp_launch.demo import load_lines

    assert all(line in proc.stdout for line in load_lines(hf)) and "== 6/6 export" in proc.stdout
