"""smlp_launch.fairseq_log, the one reader of fairseq-train's log lines, against the regexes the demo,
the benchmark and the tests each used before (issue 20), on lines in fairseq 0.12's simple format."""
from __future__ import annotations

import re

from smlp_launch import fairseq_log as L

LOG = """\
2026-11-24 01:00:00 | INFO | fairseq_cli.train | task: LanguageModelingTask
2026-11-24 01:00:01 | INFO | fairseq.checkpoint_utils | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 2 @ 12 updates)
2026-11-24 01:00:02 | INFO | train_inner | epoch 002:      4 / 8 loss=7.913, ppl=241.02, wps=1510.3, ups=2.95, \
wpb=512, bsz=4, num_updates=14, lr=0.0005, gnorm=1.41, load_cv_1_tmoe=0.25, idle_1_tmoe=0, wall=9
2026-11-24 01:00:03 | INFO | train_inner | epoch 002:      6 / 8 loss=7.702, nll_loss=7.7, ppl=208.3, wps=1498, \
num_updates=16, lr=0.0005, wall=10
2026-11-24 01:00:04 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 7.61 | nll_loss 7.61 | ppl 195.37 | \
wps 4012.1 | wpb 512 | bsz 4 | num_updates 16 | best_loss 7.61
2026-11-24 01:00:05 | INFO | fairseq.checkpoint_utils | Saved checkpoint c/checkpoint_last.pt (epoch 2 @ 16 updates, \
score 7.61) (writing took 0.1 seconds)
"""

# the readers this module replaced, verbatim (launch/demo.py, tests/fairseq_helpers.py,
# tests/test_launch.py, tests/test_fairseq.py)
OLD_DEMO_TRAIN = re.compile(r"\| train_inner \| .*?loss=([\d.]+).*?num_updates=(\d+)")
OLD_DEMO_VALID = re.compile(r"\| valid on 'valid' subset \| loss ([\d.]+) \|.*? \| ppl ([\d.]+) \|.*?"
                            r"\| num_updates (\d+)")
OLD_SUITE_FIELD = re.compile(r"(\w+)[= ]([-\d.eE+]+)")


def test_the_readers_agree_with_the_regexes_they_replace():
    train = L.train_records(LOG)
    assert [(int(f["num_updates"]), float(f["loss"])) for f in train] == \
        [(int(u), float(loss)) for loss, u in (m.groups() for m in OLD_DEMO_TRAIN.finditer(LOG))] == \
        [(14, 7.913), (16, 7.702)]
    assert [int(f["num_updates"]) for f in train] == \
        [int(m) for m in re.findall(r"train_inner .*?num_updates=(\d+),", LOG)]
    old_losses = re.findall(r"train_inner .*?\bloss=([\d.]+),.*?num_updates=(\d+),", LOG)
    assert [f["loss"] for f in train] == [loss for loss, _ in old_losses]
    old_fields = [dict(re.findall(r"(\w+)=([-\d.eE+]+)", line)) for line in re.findall(r"train_inner \| (.*)", LOG)]
    assert [{k: v for k, v in f.items() if k in o} for f, o in zip(train, old_fields)] == old_fields  # '=' only
    assert old_fields[0]["load_cv_1_tmoe"] == "0.25"
    valid = L.valid_records(LOG)
    old_valid = [(int(u), float(loss), float(ppl)) for loss, ppl, u in OLD_DEMO_VALID.findall(LOG)]
    assert [(int(f["num_updates"]), float(f["loss"]), float(f["ppl"])) for f in valid] == old_valid == \
        [(16, 7.61, 195.37)]
    for line in LOG.splitlines():
        for new, old in ((L.train_fields, r"\| train_inner \| (.*)"),
                         (L.valid_fields, r"\| valid on 'valid' subset \| (.*)")):
            m = re.search(old, line)
            assert new(line) == (dict(OLD_SUITE_FIELD.findall(m.group(1))) if m else None)
    assert L.as_floats(valid[0])["best_loss"] == 7.61
    assert L.loaded_updates(LOG) == [12] and L.saved_updates(LOG) == [16]


# the same records as LOG's, as fairseq 0.12 prints them with --log-format json
JSON_LOG = """\
2026-11-24 01:00:02 | INFO | train_inner | {"epoch": 2, "update": 1.5, "loss": "7.913", "ppl": "241.02", \
"wps": "1510.3", "num_updates": "14", "lr": "0.0005", "load_cv_1_tmoe": "0.25", "wall": "9"}
2026-11-24 01:00:03 | INFO | train_inner | {"epoch": 2, "update": 1.75, "loss": "7.702", "nll_loss": "7.7", \
"ppl": "208.3", "wps": "1498", "num_updates": "16", "lr": "0.0005", "wall": "10"}
2026-11-24 01:00:04 | INFO | valid | {"epoch": 2, "valid_loss": "7.61", "valid_nll_loss": "7.61", "valid_ppl": \
"195.37", "valid_wps": "4012.1", "valid_num_updates": "16", "valid_best_loss": "7.61"}
"""


def test_json_log_lines_give_the_fields_of_simple_ones():
    """--log-format json: the same training and validation figures as the simple format's lines (validation keys
    without their subset prefix); other lines are still None."""
    simple, js = L.train_records(LOG), L.train_records(JSON_LOG)
    assert [(f["num_updates"], f["loss"], f["ppl"]) for f in js] == [(f["num_updates"], f["loss"], f["ppl"])
                                                                     for f in simple]
    assert js[0]["load_cv_1_tmoe"] == "0.25"
    valid = L.valid_records(JSON_LOG)
    assert [(v["num_updates"], v["loss"], v["ppl"], v["best_loss"]) for v in valid] == \
        [("16", "7.61", "195.37", "7.61")]
    assert L.valid_fields(JSON_LOG.splitlines()[0]) is None and L.train_fields(JSON_LOG.splitlines()[-1]) is None
    assert L.train_fields("2026-11-24 | INFO | fairseq_cli.train | {'_name': None}") is None
