"""The benchmark's own arithmetic (smlp-bench is not run here: benchmarks are not tests).

- the profiler breakdown attributes forward ops to their innermost range and backward autograd
  nodes to the range of the forward op that created them;
- words/s come only from log intervals free of warm-up, validation and the profiled window;
- the FLOP-matched plan is the calculator's.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from smlp.profiling import RANGES, breakdown
from smlp_bench import presets, training


def test_breakdown_attributes_backward_to_the_forward_range():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w_big = torch.randn(512, 512, requires_grad=True)
    w_small = torch.randn(512, 8, requires_grad=True)
    x = torch.randn(256, 512)

    def step():
        with record_function(RANGES["experts"]):
            h = x @ w_big @ w_big               # heavy, forward and backward
            with record_function(RANGES["routing"]):
                r = (h @ w_small).softmax(-1)   # nested: counts for routing only
        loss = (h.sum() + r.sum()) * 1.0        # outside every range: rest
        loss.backward()

    def measured() -> list[str]:
        """The breaches of one profiled step (none when the breakdown attributes it right)."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = prof.events()
        total = sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1e6
        parts = breakdown(events, total)
        mm_forward = sum(e.cpu_time_total for e in events if e.name == "aten::mm" and
                         any(p.name == RANGES["experts"] for p in _ancestors(e))) / 1e6
        mm_backward = sum(e.cpu_time_total for e in events
                          if e.name.startswith("autograd::engine::evaluate_function: MmBackward")) / 1e6
        checks = {  # the heavy matmuls' forward and backward both land in "experts"; routing is small but present
            "experts holds the matmuls": parts["experts"] >= 0.9 * (mm_forward + mm_backward) - 0.9 * parts["routing"],
            "routing small but present": 0 < parts["routing"] < parts["experts"],
            "no all2all or mixing": parts["all2all"] == 0.0 and parts["token_mixing"] == 0.0,
            "the parts add up": abs(sum(parts.values()) - total) < 1e-6 and parts["rest"] >= 0.0,
            "the backward pass profiled": mm_backward > 0.3 * mm_forward,
        }
        return [f"{name}: {parts}" for name, ok in checks.items() if not ok]

    step()
    # the bounds compare profiled times: a step slowed by the other xdist worker's processes may breach one, so
    # one of three steps must meet them all (a wrong attribution breaches them in every step)
    breaches = []
    for _ in range(3):
        if not (found := measured()):
            break
        breaches.append(found)
    else:
        raise AssertionError(f"every profiled step breached: {breaches}")


def _ancestors(event):
    p = event.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def test_words_per_second_skip_warmup_validation_and_the_profiled_window():
    preset = dict(presets.PRESETS["quick"], updates=24, log_interval=2, validate_every=8, profile_steps=2)
    run = training.Run("x", 1, intervals=[{"num_updates": u, "wps": float(u)} for u in range(2, 25, 2)])
    start, count = training.profile_window(preset)
    assert (start, count) == (20, 2)  # 0-based steps 20, 21 = updates 21, 22; update 23 writes the profile
    # dropped: 2 (warm-up), 10 and 18 (after validations at 8 and 16), 22 and 24 (profiled / writing)
    assert training.clean_wps(run, preset) == [4.0, 6.0, 8.0, 12.0, 14.0, 16.0, 20.0]


def test_words_per_second_count_the_tokens_read_also_under_partial_prediction():
    T = presets.TARGET["seq_len"]
    full = {"num_updates": 4, "wps": 1000.0, "bsz": 16.0, "wpb": 16.0 * T}
    scored = T - T // 5  # the 20% routing prefix is read, not scored
    partial = {"num_updates": 4, "wps": 1000.0 * scored / T, "bsz": 16.0, "wpb": 16.0 * scored}  # same speed
    assert training.input_tokens_per_target(full) == 1.0
    assert partial["wps"] * training.input_tokens_per_target(partial) == pytest.approx(1000.0)
    assert training.input_tokens_per_target({"num_updates": 4, "wps": 5.0}) == 1.0


def test_plan_is_flop_matched_by_the_calculator():
    models, matching = presets.plan_models(vocab_size=4000, nproc=2, keys=list(presets.MODEL_ORDER))
    by = {m.key: m for m in models}
    assert [m.key for m in models] == list(presets.MODEL_ORDER)
    target = by["smlp_det"].fwd_flops_per_seq
    for key in ("transformer", "gmlp", "switch", "base", "hash"):
        assert abs(by[key].fwd_flops_per_seq / target - 1) <= presets.MATCH_TOLERANCE, key
    assert by["transformer"].layers == by["fairseq_transformer_lm"].layers
    assert by["base"].layers == by["fairseq_base_layers"].layers
    assert by["fairseq_base_layers"].fwd_flops_per_seq < by["base"].fwd_flops_per_seq  # no attention in BaseLayer
    assert by["smlp_det"].train_flops_per_token == 3 * target / presets.TARGET["seq_len"]
    assert "--base-layers" in by["fairseq_base_layers"].flags and not by["fairseq_base_layers"].ours


def test_speed_record_gives_both_sides_ratios_from_the_same_rounds_and_the_scaling(tmp_path):
    """smlp_bench.speed without probes (issue 47: it printed "-" for every ratio): every ratio is the median over
    rounds of the same round's words/s ratio, with its range; the fastest Transformer-MoE is the one with the most
    words/s; the scaling is words/s on 2 ranks over 2 x on 1 process; --publish rewrites exactly its section."""
    from smlp_bench import speed, speed_pages

    def side(nproc, wps):  # a report's models: words/s per seed (round); seeds listed out of order on purpose
        return {"complete": True, "machine": {"cpu": "x"}, "settings": {"updates": 40, "seeds": 3}, "seconds": 1.0,
                "nproc": nproc, "models": {k: {"wps": sum(w) / 3, "wps_per_seed": w, "seeds": [1, 2, 3], "name": k,
                                               "breakdown": None} for k, w in wps.items()}}

    two = speed.analyse(side(2, {"smlp_det": [90.0, 80.0, 100.0], "smlp_det_expert": [45.0, 80.0, 50.0],
                                  "gmlp": [100.0, 100.0, 100.0], "switch": [100.0, 80.0, 50.0],
                                  "hash": [90.0, 100.0, 125.0]}))
    one = speed.analyse(side(1, {"smlp_det": [50.0, 48.0, 52.0], "gmlp": [52.0, 50.0, 60.0],
                                  "hash": [55.0, 55.0, 55.0]}))
    assert two["fastest_moe"] == "hash" and one["fastest_moe"] == "hash"  # medians 100 > switch's 80
    det, expert = two["rows"]
    assert det["gMLP"] == {"ratio": 0.9, "lo": 0.8, "hi": 1.0, "rounds": 3}
    assert det["fastest Transformer-MoE"] == pytest.approx({"ratio": 0.8, "lo": 0.8, "hi": 1.0, "rounds": 3})
    assert expert["gMLP"] == {"ratio": 0.5, "lo": 0.45, "hi": 0.8, "rounds": 3}
    assert (det["wps"], det["wps_range"]) == (90.0, [80.0, 100.0])
    assert [r["model"] for r in one["rows"]] == ["smlp_det"]
    assert one["rows"][0]["gMLP"]["ratio"] == pytest.approx(48 / 50)  # rounds: 50/52, 48/50, 52/60
    out = speed.combine({2: two, 1: one})
    assert out["scaling"]["smlp_det"] == pytest.approx(90 / (2 * 50)) and out["scaling"]["gmlp"] == 100 / (2 * 52)
    # 0.8 < 1; 0.9 < 0.92; 0.96 >= 0.95; scaling 0.90 against gMLP's 0.96: 6 points below
    assert [t["met"] for t in out["targets"]] == [False, False, True, False]
    assert out["targets"][3]["measured"] == pytest.approx(1 / 1.04 - 0.9)
    (tmp_path / "s.json").write_text(__import__("json").dumps(out))
    page = tmp_path / "page.md"
    page.write_text(f"before\n{speed_pages.START}\nold\n{speed_pages.END}\nafter\n")
    speed_pages.publish(tmp_path / "s.json", page)
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| 2 | smlp_det_expert | 50 [45-80] | 0.500x [0.45-0.80] | 0.500x [0.40-0.80] (hash) | - |" in text
    assert "| 1 | smlp_det | 50 [48-52] |" in text and "| **no** |" in text and "no probes" in text
    # before/after (--publish AFTER --before BEFORE): the same benchmark on the code before a change
    was = speed.combine({1: speed.analyse(side(1, {"smlp_det": [40.0, 45.0, 44.0], "gmlp": [50.0, 50.0, 55.0]}))})
    (tmp_path / "b.json").write_text(__import__("json").dumps(dict(was, code={"commit": "aaaaaaa1234"})))
    (tmp_path / "s.json").write_text(__import__("json").dumps(dict(out, code={"commit": "bbbbbbb5678"})))
    speed_pages.publish(tmp_path / "s.json", page, before=tmp_path / "b.json")
    text = page.read_text()
    assert "at commit bbbbbbb" in text and "Before (commit aaaaaaa) and after (commit bbbbbbb)" in text
    # 1 process, sMLP-det: medians 44 -> 50; over gMLP in the same rounds 40/50, 45/50, 44/55 -> 0.8 [0.80-0.90]
    assert "| 1 | sMLP-deterministic | 44 [40-45] | 50 [48-52] | 1.136x | 0.800x [0.80-0.90] -> 0.960x [0.87-0.96] |" \
        in text
    assert "| 1 | gMLP | 50 [50-55] | 52 [50-60] | 1.040x |  |" in text and "| 2 |" not in text.split("Before")[1]


def test_speed_code_plans_the_models_with_the_pinned_commit(tmp_path):
    """`--code COMMIT` (before/after with one harness): the models are planned by the commit's own code, in a
    worktree of it (benchmarks/pinned.py); for this checkout's HEAD, the same models as planned here, the
    variants added on 2 ranks as for this checkout's plan. The worktree is removed again."""
    import subprocess

    from smlp_bench import machine, pinned, speed

    head = subprocess.run(["git", "-C", str(machine.CODE_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    code = pinned.checkout(head.stdout.strip(), tmp_path, machine.CODE_ROOT)
    try:
        keys = ("smlp_det", "smlp_det_expert", "hash")
        here = speed.models(4000, 2, keys)
        there = speed.models(4000, 2, keys, code)
        assert [m.key for m in there] == ["smlp_det", "smlp_det_expert", "hash"]
        assert [m.as_dict() for m in there] == [m.as_dict() for m in here]
        assert "--smoe-parallel" in there[1].flags and code.root.is_relative_to(tmp_path)
    finally:
        subprocess.run(["git", "-C", str(machine.CODE_ROOT), "worktree", "remove", "--force", str(code.root)],
                       capture_output=True)


def test_speed_refuses_a_run_too_short_to_measure_and_accepts_the_shortest_that_measures(capsys):
    """`--updates N` below the minimum left no log interval to read words/s from ("nan words/s", then an
    IndexError in the report): refused with the minimum, which itself leaves one clean interval."""
    from smlp_bench import speed, training

    low = speed.min_updates()
    s = speed.settings(low, 1)

    def clean(updates):
        run = training.Run("m", 1, intervals=[{"num_updates": float(u), "wps": 1000.0}
                                              for u in range(s["log_interval"], updates + 1, s["log_interval"])])
        return training.clean_wps(run, dict(s, updates=updates))

    assert clean(low) and not clean(low - 1)
    with pytest.raises(SystemExit):
        speed.main(["--updates", str(low - 1)])
    assert f"at least {low} updates" in capsys.readouterr().err


def test_a_run_records_the_cpu_time_the_hypervisor_took():
    """The steal share between two /proc/stat readings (hand-computed), None when unknown; a run whose machine lost
    more than 2% of its CPU time to other guests says so on its progress line and keeps the share in its record."""
    from smlp_bench import machine

    assert machine.steal_share((100, 10_000), (130, 10_600)) == 30 / 600
    assert machine.steal_share(None, (1, 2)) is None and machine.steal_share((5, 10), (5, 10)) is None
    now = machine.cpu_ticks()
    if now is not None:  # Linux: steal <= total, and both only grow
        later = machine.cpu_ticks()
        assert 0 <= now[0] <= now[1] and later[0] >= now[0] and later[1] >= now[1]
    run = training.Run("m", 1, steal=0.05)
    assert "the hypervisor took 5% of the CPU time" in training._stolen(run)
    assert training._stolen(training.Run("m", 1, steal=0.01)) == training._stolen(training.Run("m", 1)) == ""
    slot = training.S.Slot(index=0, kind=training.S.TRAIN, key="m", seed=1, phase=1, round=0)
    rec = training.run_record(slot, run, {"target": {"seq_len": 8}, "batch_size": 1, "log_interval": 1,
                                          "validate_every": 100, "updates": 4, "profile_steps": 0}, 1)
    assert rec["cpu_steal"] == 0.05


def test_a_run_records_the_share_of_tokens_its_experts_processed():
    """Switch and GShard log the share of routing slots each MoE layer dropped past capacity (`drop_<layer>`, from
    the counts summed over ranks: fairseq_plugins/criterion.py); a run's record keeps 1 - their mean over the layers
    per log interval, and over the intervals its words/s come from (not the warm-up's); 1.0 for routers that keep
    every token (their loads logged, no drop), None for a model without experts."""
    import torch
    from fairseq.logging import metrics

    from fairseq_plugins.criterion import SMLPLanguageModelLoss

    logged = {"loss": torch.tensor(1.0), "ntokens": 8, "sample_size": 8, "moe_count": 2,
              **{f"moe_load_{i}_ffn": torch.tensor([6.0, 2.0]) for i in (1, 3)},
              "moe_drop_1_ffn": torch.tensor(2.0), "moe_slots_1_ffn": 10,   # 20% of layer 1's slots dropped
              "moe_drop_3_ffn": torch.tensor(4.0), "moe_slots_3_ffn": 10}   # 40% of layer 3's
    with metrics.aggregate(new_root=True) as agg:
        SMLPLanguageModelLoss.reduce_metrics([logged])
        line = {k: float(v) for k, v in agg.get_smoothed_values().items()}
    assert training.tokens_kept(line) == pytest.approx(0.7)
    assert training.tokens_kept({"load_1_smoe": 1.0, "load_cv_1_smoe": 0.0, "wps": 5.0}) == 1.0
    assert training.tokens_kept({"wps": 5.0, "loss": 3.0}) is None
    preset = {"target": {"seq_len": 8}, "batch_size": 1, "log_interval": 2, "validate_every": 100, "updates": 12,
              "profile_steps": 0}
    drops = {2: 0.9, 4: 0.1, 6: 0.3, 8: 0.1, 10: 0.3, 12: 0.9}  # updates 1-2: warm-up; 11-12: the end's window
    run = training.Run("switch", 1, intervals=[{"num_updates": float(u), "wps": 100.0, "drop_1_ffn": d}
                                                for u, d in drops.items()])
    slot = training.S.Slot(index=0, kind=training.S.TRAIN, key="switch", seed=1, phase=1, round=0)
    rec = training.run_record(slot, run, preset, 1, code=SimpleNamespace(identity=lambda: {}))
    assert rec["tokens_kept"] == pytest.approx(0.8)
    assert [f["tokens_kept"] for f in rec["intervals"]] == pytest.approx([1 - d for d in drops.values()])
    dense = training.run_record(slot, training.Run("gmlp", 1, intervals=[{"num_updates": 4.0, "wps": 1.0}]), preset, 1,
                                code=SimpleNamespace(identity=lambda: {}))
    assert dense["tokens_kept"] is None and "tokens_kept" not in dense["intervals"][0]
