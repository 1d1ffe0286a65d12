"""Reading fairseq-train's log lines: the figures of each training and validation line and the
updates at which checkpoints were loaded or saved. The launcher's demo, the benchmarks and the
tests read the logs through this module only, so a change of fairseq's log format is fixed here.

fairseq 0.12 (`--log-format simple`) writes, e.g.
    ... | INFO | train_inner | epoch 001:     10 / 20 loss=5.21, ppl=37.1, wps=812, ..., num_updates=10, ...
    ... | INFO | valid | epoch 001 | valid on 'valid' subset | loss 5.02 | ppl 32.5 | ... | num_updates 20
    ... Loaded checkpoint ckpt/checkpoint_last.pt (epoch 2 @ 20 updates)
    ... Saved checkpoint ckpt/checkpoint_last.pt (epoch 2 @ 20 updates, score 5.0) (writing took ...)
A field is `name=value` (training) or `name value` (validation); values are kept as logged
(strings) by the `*_fields` functions, `as_floats` converts them. `--log-format tqdm` prints the same
lines; `--log-format json` prints each record as one JSON object after the tag (`| train_inner | {...}`,
`| valid | {"valid_loss": ...}`, every validation key prefixed with the subset's name), read here into the
same fields. `--log-format none` prints no figures at all.
"""
from __future__ import annotations

import json
import re

__all__ = ["TRAIN_LINE", "VALID_LINE", "JSON_LINE", "FIELD", "train_fields", "valid_fields", "train_records",
           "valid_records", "as_floats", "loaded_updates", "saved_updates"]

TRAIN_LINE = re.compile(r"\| train_inner \| (.*)")
VALID_LINE = re.compile(r"\| valid on 'valid' subset \| (.*)")
JSON_LINE = re.compile(r"\| (train_inner|valid) \| (\{.*\})\s*$")
FIELD = re.compile(r"(\w+)[= ]([-\d.eE+]+)")
_LOADED = re.compile(r"Loaded checkpoint .*?@ (\d+) updates")
_SAVED = re.compile(r"Saved checkpoint .*?@ (\d+) updates")


def _json_fields(line: str, tag: str) -> dict[str, str] | None:
    """The fields of a `--log-format json` record of `tag` (validation keys without their "valid_" prefix), as
    strings like the other formats' fields; None for any other line."""
    m = JSON_LINE.search(line)
    if not m or m.group(1) != tag:
        return None
    try:
        record = json.loads(m.group(2))
    except ValueError:
        return None
    prefix = "valid_" if tag == "valid" else ""
    return {k[len(prefix):] if prefix and k.startswith(prefix) else k: str(v) for k, v in record.items()
            if not prefix or k.startswith(prefix)}


def train_fields(line: str) -> dict[str, str] | None:
    """The fields of a train_inner line (as logged), None for any other line."""
    m = TRAIN_LINE.search(line)
    if m and m.group(1).startswith("{"):
        return _json_fields(line, "train_inner")
    return dict(FIELD.findall(m.group(1))) if m else None


def valid_fields(line: str) -> dict[str, str] | None:
    """The fields of a validation line (as logged), None for any other line."""
    m = VALID_LINE.search(line)
    return dict(FIELD.findall(m.group(1))) if m else _json_fields(line, "valid")


def train_records(text: str) -> list[dict[str, str]]:
    """The fields of every train_inner line of a log, in order."""
    return [f for f in map(train_fields, text.splitlines()) if f is not None]


def valid_records(text: str) -> list[dict[str, str]]:
    """The fields of every validation line of a log, in order."""
    return [f for f in map(valid_fields, text.splitlines()) if f is not None]


def as_floats(fields: dict[str, str]) -> dict[str, float]:
    return {k: float(v) for k, v in fields.items()}


def loaded_updates(text: str) -> list[int]:
    """The update count of every checkpoint fairseq loaded, in order."""
    return [int(u) for u in _LOADED.findall(text)]


def saved_updates(text: str) -> list[int]:
    """The update count of every checkpoint fairseq saved, in order."""
    return [int(u) for u in _SAVED.findall(text)]
