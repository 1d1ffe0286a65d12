"""The step breakdown (smlp_bench.micro.step_breakdown, issue 38) on a tiny sMLP-det, 1 process and 2 gloo ranks.

- the record has a training breakdown per world size and rank, and a decoding count;
- the parts of a step plus `rest` add up to the profiled step, and rest is at most 15% of it;
- operator counts are positive integers, their parts add up to the step's, and the forward counts by
  block add up to a plain count of the forward (nothing counted twice or lost);
- on 2 ranks the tMoE's all2all and the gradient all-reduce are there, and waiting is not negative;
- a baseline record's operator counts are shown beside the run's.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from smlp.lm import LanguageModel, LMConfig
from smlp_bench.micro import step_breakdown as sb
from tiny_steps import PlainOpCount

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("breakdown") / "record.json"
    assert sb.main(["--size", "tiny", "--families", "smlp_det", "--ranks", "1,2", "--steps", "1", "--warmup", "1",
                    "--decode-steps", "2", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _families(record):
    for world, ranks in record["training"].items():
        assert len(ranks) == int(world)
        for r in ranks:
            for key, f in r["families"].items():
                yield int(world), r["rank"], key, f


def test_the_record_has_every_world_rank_and_family(record):
    assert set(record) >= {"question", "config", "machine", "versions", "training", "decoding"}
    assert set(record["training"]) == {"1", "2"}
    seen = [(w, rank, key) for w, rank, key, _ in _families(record)]
    assert seen == [(1, 0, "smlp_det"), (2, 0, "smlp_det"), (2, 1, "smlp_det")]
    assert record["config"]["models"]["smlp_det"]["sparse_layers"] == 1
    assert record["decoding"]["smlp_det"]["step_ms"] > 0


def test_the_parts_and_rest_add_up_to_the_step_and_rest_is_small(record):
    for world, rank, _, f in _families(record):
        parts = f["breakdown_ms"]
        step = f["profiled_step_ms"]
        assert all(v >= 0 for v in parts.values()), parts
        assert sum(parts.values()) == pytest.approx(step, rel=1e-6), (world, rank, parts)
        assert parts["rest"] <= 0.15 * step, (world, rank, parts)
        assert parts["forward/smoe"] > 0 and parts["forward/tmoe"] > 0 and parts["backward"] > 0
        assert sum(f["backward_by_block_ms"].values()) == pytest.approx(parts["backward"], rel=1e-6)
        if world == 2:  # the tMoE's experts are spread over the ranks; shared gradients are all-reduced
            assert parts["all2all"] > 0 and parts["grad_all_reduce"] > 0 and parts["collective_wait"] >= 0
        else:
            assert "all2all" not in parts and parts["grad_all_reduce"] == 0


def test_operator_counts_are_positive_integers_that_add_up(record):
    for world, _, _, f in _families(record):
        ops = f["ops"]
        counts = [ops["total"], *ops["forward"].values(), *ops["backward"].values()]
        assert all(isinstance(n, int) and n > 0 for n in counts), ops
        parts = sum(ops["forward"].values()) + sum(ops["backward"].values()) + sum(
            ops[p] for p in ("loss", "optimizer", "grad_all_reduce", "loop"))
        assert parts == ops["total"]
        assert (ops["grad_all_reduce"] > 0) == (world == 2)
        for kind in ("gmlp_block", "smoe", "tmoe", "embedding_head"):
            assert ops["per_block"][kind]["forward"] > 0 and ops["per_block"][kind]["backward"] > 0
        assert ops["per_block"]["gmlp_block"]["blocks"] == 2 and ops["per_block"]["smoe"]["blocks"] == 1
        assert isinstance(f["profiler_events"], int) and f["profiler_events"] > ops["total"]
    dec = record["decoding"]["smlp_det"]
    assert isinstance(dec["ops"], int) and dec["ops"] == sum(dec["ops_by_block"].values()) > 0


def test_a_baseline_s_operator_counts_are_shown_beside_the_run_s(record):
    base = {"label": "before", **sb.op_counts(record)}
    total = record["training"]["2"][0]["families"]["smlp_det"]["ops"]["total"]
    assert base["training"]["2"]["smlp_det"]["total"] == total
    text = sb.table(dict(record, label="after", baseline=base))
    assert "operators: before -> after" in text and f"2 rank(s) smlp_det     step {total} -> {total}" in text
    assert f"decoding    smlp_det     step {record['decoding']['smlp_det']['ops']} -> " in text


def test_the_forward_counted_by_block_is_the_forward_counted_whole():
    cfg = LMConfig(**sb.TINY, **sb.TINY_LAYERS["smlp_det"])
    loop = sb.Loop(LanguageModel(cfg).train(), 1)
    tokens = sb.batches(cfg, 2, 0, 1)[0]
    loop.step(tokens)
    by_block = sb.count_ops(loop, tokens)
    with PlainOpCount() as plain:
        loop.model(tokens[:, :-1])
    assert sum(by_block["forward"].values()) == plain.n
    per = Counter({k: v["forward"] * v["blocks"] for k, v in by_block["per_block"].items()})
    assert sum(per.values()) <= plain.n  # per block: whole blocks only (the remainder of a division dropped)
    assert torch.is_grad_enabled()
