"""The interleaved, resumable benchmark (benchmarks/schedule.py, smlp-bench): schedule, ratios from
runs adjacent in time, resume, curves and publishing, in-process with fake runs (no training)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from smlp_bench import cli, machine, presets, publish, training, verdicts
from smlp_bench import report as report_module
from smlp_bench import schedule as S
from smlp_bench import store as store_module
from smlp_bench.presets import BenchError
from smlp_bench.report import report
from smlp_bench.schedule import initial_schedule, make_plan
from smlp_bench.store import RunStore, atomic_write_json
from smlp_bench.training import execute

KEYS = ["a", "b", "c", "d"]


# ---------------------------------------------------------------- schedule


def test_rounds_rotate_reverse_then_shuffle_with_the_recorded_seed():
    assert S.round_order(KEYS, 0, 7) == KEYS
    assert S.round_order(KEYS, 1, 7) == KEYS[::-1]
    r2, r3 = S.round_order(KEYS, 2, 7), S.round_order(KEYS, 3, 7)
    assert sorted(r2) == sorted(KEYS) and sorted(r3) == sorted(KEYS)
    assert S.round_order(KEYS, 2, 7) == r2  # reproducible from the recorded seed
    # over seeds, the shuffled rounds do not all keep the first model first
    assert {S.round_order(KEYS, 2, s)[0] for s in range(20)} != {"a"}


def test_schedule_brackets_every_training_run_with_reference_probes():
    slots = S.extend_schedule([], S.seed_rounds(KEYS, [1, 2, 3], order_seed=5), reference="a")
    kinds = [s.kind for s in slots]
    assert kinds[0] == kinds[-1] == S.PROBE
    train = [s for s in slots if s.kind == S.TRAIN]
    assert len(train) == 12 and len(slots) == 2 * 12 + 1  # a probe between every two runs, and at both ends
    for s in train:
        before, after = S.adjacent_probes(slots, s.index)
        assert before is not None and after is not None and before.key == after.key == "a"
    assert [s.index for s in slots] == list(range(len(slots)))
    rounds = {r: [s.key for s in train if s.round == r] for r in range(3)}
    assert rounds[0] == KEYS and rounds[1] == KEYS[::-1] and rounds[2] == S.round_order(KEYS, 2, 5)
    assert all(s.seed == s.round + 1 for s in train)
    # every model gets each seed once; run ids are unique
    assert len({s.run_id for s in slots}) == len(slots)


def test_extending_a_schedule_continues_its_probes_and_refuses_a_duplicate_run():
    slots = S.extend_schedule([], S.seed_rounds(KEYS, [1], 0), "a")
    more = S.extend_schedule(slots, S.seed_rounds(["c", "b"], [2], 0, phase=2, first_round=1), "a")
    added = more[len(slots):]
    assert [s.kind for s in added] == [S.TRAIN, S.PROBE, S.TRAIN, S.PROBE]  # the last probe of phase 1 serves
    assert [s.key for s in added if s.kind == S.TRAIN] == ["b", "c"]        # round 1: reversed
    assert all(s.phase == 2 for s in added)
    with pytest.raises(BenchError, match="scheduled twice"):
        S.extend_schedule(slots, S.seed_rounds(["b"], [1], 0), "a")


def test_explicit_rounds_give_each_model_its_own_seeds_in_the_planned_order():
    settings = {"seeds": [], "rounds": [[4, ["g"]], [5, ["g"]], [3, ["a", "b"]], [4, ["a", "b"]]]}
    rounds = S.planned_rounds(settings, ["g", "a", "b"], order_seed=1)
    slots = S.extend_schedule([], rounds, None)
    assert [(s.key, s.seed) for s in slots] == [("g", 4), ("g", 5), *((k, 3) for k in S.round_order(["a", "b"], 2, 1)),
                                                *((k, 4) for k in S.round_order(["a", "b"], 3, 1))]
    assert S.plan_seeds(settings) == [3, 4, 5]
    assert S.planned_rounds({"seeds": 2}, KEYS, 0) == S.seed_rounds(KEYS, [1, 2], 0)  # the plain plan unchanged
    with pytest.raises(BenchError, match="does not have: x"):
        S.planned_rounds({"rounds": [[1, ["a", "x"]]]}, KEYS, 0)


# ---------------------------------------------------------------- ratios from adjacent runs


def _wps_under_drift(slots, speed, load):
    """words/s of every slot: the model's speed x the machine's load factor at that slot."""
    return {s.run_id: speed[s.key] * load(s.index) for s in slots}


def test_speed_ratios_cancel_a_load_drift_that_biases_plain_ratios():
    slots = S.extend_schedule([], S.seed_rounds(KEYS, [1, 2], 3), "a")
    speed = {"a": 1000.0, "b": 1250.0, "c": 800.0, "d": 1000.0}
    load = lambda i: 1.0 / (1 + 0.05 * i)  # noqa: E731  the machine gets busier and busier
    wps = _wps_under_drift(slots, speed, load)
    norms = S.normalized_speeds(slots, wps)
    for key in "bcd":
        r = S.speed_ratio(norms, "a", key)
        true = speed["a"] / speed[key]
        # the adjacent probes see almost the same load: within the drift over one slot (5%)
        assert r["ratio"] == pytest.approx(true, rel=0.03), key
        assert r["lo"] <= true <= r["hi"] and r["pairs"] == 4
        plain = (sum(wps[s.run_id] for s in slots if s.key == "a" and s.kind == S.TRAIN) /
                 sum(wps[s.run_id] for s in slots if s.key == key and s.kind == S.TRAIN))
        assert abs(plain / true - 1) > abs(r["ratio"] / true - 1)  # the plain ratio is biased more
    # a load step over one run and its two probes cancels in that run's normalized speed
    step = {s.run_id: wps[s.run_id] * (0.5 if s.index in (6, 7, 8) else 1.0) for s in slots}
    rid = slots[7].run_id
    assert slots[7].kind == S.TRAIN
    assert S.normalized_speeds(slots, step)[rid]["norm"] == pytest.approx(norms[rid]["norm"], rel=1e-12)


def test_a_run_without_recorded_probes_has_no_ratio_and_one_probe_is_enough():
    slots = S.extend_schedule([], S.seed_rounds(["a", "b"], [1], 0), "a")
    wps = {s.run_id: 100.0 for s in slots}
    del wps[slots[2].run_id]                       # the probe between a and b
    norms = S.normalized_speeds(slots, wps)
    assert norms[slots[3].run_id]["probes"] == [slots[4].run_id]
    del wps[slots[4].run_id]
    norms = S.normalized_speeds(slots, wps)
    assert slots[3].run_id not in norms and S.speed_ratio(norms, "a", "b") is None


# ---------------------------------------------------------------- the store and resume


def _plan(**kw):
    return {"name": "t", "settings": {"seeds": 1, "updates": 4}, "models": KEYS, "nproc": 2, "order_seed": 0,
            "reference": "a", **kw}


def test_store_writes_atomically_and_resume_skips_finished_runs(tmp_path):
    path = tmp_path / "runs.json"
    store = RunStore.open(path, _plan(), resume=False)
    store.slots = S.extend_schedule([], S.seed_rounds(KEYS, [1], 0), "a")
    store.save()
    for slot in store.slots[:5]:
        store.record(slot, {"kind": slot.kind, "wps": 1.0})
    assert [p.name for p in tmp_path.iterdir()] == ["runs.json"]  # the temporary file was renamed
    with pytest.raises(BenchError, match="--resume"):
        RunStore.open(path, _plan(), resume=False)  # never overwrite a benchmark in progress
    with pytest.raises(BenchError, match="planned differently.*order_seed"):
        RunStore.open(path, _plan(order_seed=1), resume=True)
    again = RunStore.open(path, _plan(), resume=True)
    assert [s.run_id for s in again.finished()] == [s.run_id for s in store.slots[:5]]
    # slot 5 (a training run) was interrupted: it is the next one; the probe before it is measured again
    assert store.slots[4].kind == S.PROBE and store.slots[5].kind == S.TRAIN
    assert again.prepare_resume() == [store.slots[4].run_id]
    assert [s.index for s in again.pending()][:2] == [4, 5]
    assert RunStore.load(path).records.keys() == again.records.keys()


def test_a_stop_while_writing_leaves_the_previous_record(tmp_path, monkeypatch):
    path = tmp_path / "runs.json"
    atomic_write_json(path, {"v": 1})

    def crash(src, dst):
        raise KeyboardInterrupt  # stopped between writing the temporary file and renaming it

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}


class _FakeTrainer:
    """Stands in for fairseq-train: records each slot it runs, can be told to stop at one."""

    def __init__(self, stop_at: str | None = None):
        self.ran, self.stop_at = [], stop_at

    def __call__(self, model, data, settings, nproc, seed, out, *, profile=False, updates=None, validate=True,
                 log_interval=None, on_line=None):
        rid = out.name
        if rid == self.stop_at:
            self.stop_at = None
            raise KeyboardInterrupt
        self.ran.append(rid)
        u = updates or settings["updates"]
        intervals = [{"num_updates": float(i), "wps": 1000.0 + (model.key == "b") * 500} for i in range(2, u + 1, 2)]
        final = {"a": 30.0, "b": 20.0, "c": 40.0}[model.key] + seed
        valid = [{"num_updates": float(v), "ppl": final * (1 + 10 / v), "wall": float(v)}
                 for v in range(settings["validate_every"], u + 1, settings["validate_every"])] if validate else []
        return training.Run(model.key, seed, intervals=intervals, valid=valid, seconds=1.0, peak_rss_mb=[1.0, 1.0])


def _bench(tmp_path, trainer, resume=False):
    settings = dict(seeds=1, updates=8, batch_size=2, log_interval=2, validate_every=4, valid_steps=1, warmup=1,
                    lr=1e-3, profile_steps=0, probe_updates=8, target=dict(presets.TARGET),
                    second_phase=dict(top=2, seeds=[2]))
    models = [presets.Model(k, ["--arch", "x"], 10 ** 9, "1", seq_len=presets.TARGET["seq_len"]) for k in "abc"]
    plan = make_plan("long", settings, models, 2, 0, "a")
    store = RunStore.open(tmp_path / "runs.json", plan, resume=resume)
    if not store.slots:
        store.slots = initial_schedule(plan)
    execute(store, {m.key: m for m in models}, tmp_path, log_dir=tmp_path)
    return store


def test_execute_runs_phase_two_for_the_best_and_resumes_after_a_stop(tmp_path, monkeypatch):
    first = _FakeTrainer(stop_at="c.seed1")
    monkeypatch.setattr(training, "run_training", first)
    with pytest.raises(KeyboardInterrupt):
        _bench(tmp_path, first)
    assert first.ran == ["probe000.a", "a.seed1", "probe002.a", "b.seed1", "probe004.a"]
    second = _FakeTrainer()
    monkeypatch.setattr(training, "run_training", second)
    store = _bench(tmp_path, second, resume=True)
    # c (interrupted) starts again, after its probe is measured again; then phase 2: a and b (lowest
    # final perplexity) with seed 2, in reversed order, bracketed by probes
    assert second.ran == ["probe004.a", "c.seed1", "probe006.a", "b.seed2", "probe008.a", "a.seed2", "probe010.a"]
    assert store.extra["phase2"]["models"] == ["a", "b"]
    record = report(store, tmp_path, machine={"cpus": 2, "torch": "x", "cpu_model": "test"}, quiet=True)
    assert record["complete"] and record["runs_recorded"] == 5
    assert record["models"]["b"]["seeds"] == [1, 2] and record["models"]["c"]["seeds"] == [1]
    assert record["ratios"]["smlp_det_wps_over"]["b"] == pytest.approx(1000 / 1500)
    # the partial prediction's routing prefix is not involved here; curves are in tokens and time
    curve = record["models"]["b"]["curves"][0]
    assert curve["tokens"] == [u * 2 * 2 * presets.TARGET["seq_len"] for u in curve["updates"]]
    assert (tmp_path / "figure5.png").exists() and (tmp_path / "results.json").exists()


# ---------------------------------------------------------------- curves


def test_crossings_and_ranking_settlement():
    xa, ya = [1, 2, 3, 4], [10.0, 8.0, 6.0, 5.0]
    xb, yb = [1, 2, 3, 4], [9.0, 8.5, 7.0, 4.0]
    cross = verdicts.crossings(xa, ya, xb, yb)
    assert [c["lower_after"] for c in cross] == ["a", "b"]
    assert 1 < cross[0]["x"] < 2 and 3 < cross[1]["x"] < 4
    assert verdicts.crossings(xa, ya, xa, [y * 2 for y in ya]) == []  # never cross
    hist = verdicts.ranking_history({"a": (xa, ya), "b": (xb, yb)})
    assert [h["ranking"][0] for h in hist] == ["b", "a", "a", "b"]
    assert verdicts.settled_from(hist) == {"x": 4, "index": 3, "points_unchanged": 1, "fraction": 1.0, "tolerance": 0.0}
    # a swap within the tolerance is a tie, not a change: b is 5% above a at x=2 and 3, 20% below at the end
    assert verdicts.settled_from(hist, tol=0.05)["x"] == 4                   # 8.5 vs 8 is within 5%, 7 vs 6 is not
    assert verdicts.settled_from(hist, tol=0.2)["x"] == 1                    # everything within 20%: settled at once
    assert verdicts.settled_from(hist, top=1)["x"] == 4


# ---------------------------------------------------------------- publishing a partial run


def _synthetic_long_record(complete: bool) -> dict:
    models = {}
    for i, key in enumerate(["smlp_det", "switch", "hash", "transformer"]):
        finals = [100.0 + 10 * i + s for s in ((0, 2) if key in ("smlp_det", "switch") else (0,))]
        curves = [{"seed": s + 1, "updates": [50, 100, 150], "tokens": [t * 4096 for t in (50, 100, 150)],
                   "time": [10.0 * (1 + i), 20.0 * (1 + i), 30.0 * (1 + i)], "wall": [1, 2, 3],
                   "ppl": [f * 3, f * 1.5, f]} for s, f in enumerate(finals)]
        models[key] = {"name": presets.NAMES[key], "layers": "9+3", "curves": curves,
                       "valid_ppl": sum(finals) / len(finals),
                       "valid_ppl_std": 1.4 if len(finals) > 1 else 0.0, "valid_ppl_per_seed": finals,
                       "seeds": [c["seed"] for c in curves]}
    rec = {"kind": "preset", "preset": "long", "complete": complete, "runs_recorded": 6, "runs_scheduled": 7,
           "models": models, "settings": {"updates": 150, "batch_size": 16}, "target": presets.LONG_TARGET,
           "nproc": 2, "seconds": 600.0,
           "ratios": {"reference": "smlp_det", "smlp_det_wps_over_range": {
               "switch": {"ratio": 0.9, "lo": 0.85, "hi": 0.95, "pairs": 2, "std": 0.0}}}}
    rec["analysis"] = verdicts.analyse_curves(models)
    rec["verdicts"] = {"smlp_det": verdicts.verdict(models, rec["analysis"])}
    return rec


def test_publish_a_partial_long_record_rewrites_only_its_sections(tmp_path):
    page = tmp_path / publish.PAGE  # docs/benchmarks.md, as in the repository
    main = json.loads((Path(__file__).parents[1] / publish.FIGURE_DIR / "results.json").read_text())
    docs = tmp_path / publish.FIGURE_DIR
    docs.mkdir(parents=True)
    page.write_text(f"intro\n{publish.TABLE_START}\nOLD-MAIN\n{publish.TABLE_END}\ntail\n")  # no long section yet
    (docs / "results.json").write_text(json.dumps(main))
    run = tmp_path / "long"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_synthetic_long_record(complete=False)))
    readme = tmp_path / "README.md"
    readme.write_text(f"# r\n{publish.README_LONG_START}\nOLD-LONG\n{publish.README_LONG_END}\n"
                      f"{publish.README_CLAIMS_START}\nOLD-CLAIMS\n{publish.README_CLAIMS_END}\nend\n")
    done = publish.publish([run / "results.json"], page, docs, readme=readme)
    text = page.read_text()
    # README's summary: the same verdict as the page, its figure linked from the repository root, the
    # claims summary untouched (no experiment recorded)
    short = readme.read_text()
    assert "OLD-LONG" not in short and "OLD-CLAIMS" in short and short.endswith("end\n")
    assert "**Does sMLP-deterministic beat the best Transformer-MoE at this scale? yes.**" in short
    assert "](docs/benchmark/long/figure5.png)" in short and "](docs/benchmarks.md)" in short
    assert "PARTIAL: 6 of 7 runs recorded" in short and "0.61M tokens per run" in short
    assert done[-1].startswith("README.md") and len(done) == 3
    done = done[:2]
    assert len(done) == 2 and text.startswith("intro\n") and text.endswith("tail\n") and "OLD-" not in text
    # figures are linked relative to the page (docs/benchmarks.md -> docs/benchmark/...)
    assert "](benchmark/figure5.png)" in text and "](benchmark/long/figure5.png)" in text
    # the long section was added, with its heading, right after the benchmark table
    assert text.index(publish.TABLE_END) < text.index(publish.LONG_HEADING) \
        < text.index(publish.LONG_START) < text.index(publish.LONG_END) < text.index("tail")
    assert "PARTIAL: 6 of 7 runs recorded" in text
    # 100 against 110 for Switch, beyond the seeds' spread
    assert "**Does sMLP-deterministic beat the best Transformer-MoE at this scale? yes.**" in text
    # the benchmark table's perplexity target now comes from the end of the long preset
    assert "at the end of the long preset (0.61M tokens, PARTIAL)" in text
    assert "after 60 updates" not in text and "equal updates" not in text
    assert (docs / "long" / "results.json").exists()


def test_an_experiment_runs_reports_its_claims_and_publishes_them(tmp_path, monkeypatch):
    """`smlp-bench --experiment figure7-routing` end to end with a stand-in for fairseq-train, then
    `--publish` of its JSON into the claims table."""
    finals = {"smlp_det": 60.0, "smlp_partial": 64.0, "smlp_leaky": 40.0}

    def fake(model, data, settings, nproc, seed, out, *, profile=False, updates=None, validate=True,
             log_interval=None, on_line=None):
        u = updates or settings["updates"]
        intervals = [{"num_updates": float(i), "wps": 5000.0} for i in range(2, u + 1, 2)]
        valid = [{"num_updates": float(v), "ppl": finals[model.key] * (1 + 25 / v), "wall": float(v)}
                 for v in range(settings["validate_every"], u + 1, settings["validate_every"])] if validate else []
        return training.Run(model.key, seed, intervals=intervals, valid=valid, seconds=1.0, peak_rss_mb=[1.0])

    data = tmp_path / "data"
    data.mkdir()
    (data / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(96)))
    monkeypatch.setattr(training, "run_training", fake)
    monkeypatch.setattr(machine, "matmul_peak", lambda n: {"total": 1e11, "per_rank": [5e10] * n})
    out = tmp_path / "fig7"
    assert cli.main(["--experiment", "figure7-routing", "--output-dir", str(out), "--data", str(data)]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["kind"] == "experiment" and record["complete"] and (out / "figure.png").exists()
    assert record["causal"] == {"smlp_det": True, "smlp_partial": True, "smlp_leaky": False}
    # one seed each and no seed spread given: the verdict rule has nothing to weigh the gap against
    assert record["claims"][0]["holds"] == "undecided" and "46.7" in record["claims"][0]["here"]  # 40 x (1 + 25/150)
    # the causality row comes from the check the experiment ran on each trained configuration
    assert record["causality_check"]["smlp_leaky"]["passes"] is False
    assert record["causality_check"]["smlp_det"]["passes"] and record["causality_check"]["smlp_partial"]["passes"]
    assert record["claims"][1]["holds"] == "yes"
    # the leaky model's flags name its routing explicitly
    assert "--smoe-routing leaky-full-sequence" in record["models"]["smlp_leaky"]["fairseq_flags"]
    page = tmp_path / "benchmarks.md"
    page.write_text(f"a\n{publish.CLAIMS_START}\nOLD\n{publish.CLAIMS_END}\nb\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# r\n{publish.README_CLAIMS_START}\nOLD\n{publish.README_CLAIMS_END}\n")
    publish.publish([out / "results.json"], page, tmp_path / "docs", readme=readme)
    text = page.read_text()
    assert "| claim | paper | here | holds? |" in text and "OLD" not in text and "figure7-routing" in text
    claims = text[text.index(publish.CLAIMS_START):text.index(publish.CLAIMS_END)]
    assert claims.split("\n", 1)[1] in readme.read_text()  # README's claims table is the page's
    assert (tmp_path / "docs" / "experiments" / "figure7-routing" / "figure.png").exists()


def test_publish_cli_writes_docs_benchmarks_page_and_the_page_is_the_json(tmp_path, monkeypatch, capsys):
    """`smlp-bench --publish`, run from a checkout's root, rewrites docs/benchmarks.md (not README.md), and
    the repository's page holds exactly what publishing its own docs/benchmark/results.json gives: the
    generated section was not edited by hand, and its figure link resolves from the page."""
    repo = Path(__file__).parents[1]
    page, figures = tmp_path / publish.PAGE, tmp_path / publish.FIGURE_DIR
    shutil.copytree(repo / publish.FIGURE_DIR, figures)
    shutil.copy2(repo / publish.PAGE, page)
    (tmp_path / "README.md").write_text(f"readme\n{publish.TABLE_START}\nuntouched\n{publish.TABLE_END}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--publish", str(figures / "results.json")]) == 0
    assert "benchmarks.md benchmark table" in capsys.readouterr().out
    assert page.read_text() == (repo / publish.PAGE).read_text()
    assert "untouched" in (tmp_path / "README.md").read_text()
    link = re.search(r"\]\((benchmark/[^)]+\.png)\)", page.read_text()).group(1)
    assert (repo / "docs" / link).is_file()
    # README's generated summaries (long preset's verdict, claims table) are what publishing gives too
    shutil.copy2(repo / "README.md", tmp_path / "README.md")
    (tmp_path / "README.md").write_text(re.sub(r"(<!-- smlp-bench-readme-\w+:start -->\n).*?(<!-- smlp-bench-readme)",
                                                r"\1STALE\n\2", (repo / "README.md").read_text(), flags=re.S))
    assert cli.main(["--publish", str(figures / "results.json")]) == 0
    assert (tmp_path / "README.md").read_text() == (repo / "README.md").read_text()
    assert "smlp-bench-readme-fair:start -->\n" in (repo / "README.md").read_text()
    # a checkout without the page: a clear error, nothing written
    page.unlink()
    assert cli.main(["--publish", str(figures / "results.json")]) == 1
    assert "cannot publish" in capsys.readouterr().err and not page.exists()


@pytest.mark.parametrize("leak, holds", [(160.0, "yes"), (167.5, "no: tied with the best causal routing"),
                                         (175.0, "no"), (None, "undecided")])
def test_figure7_claim_uses_the_one_verdict_rule(leak, holds):
    """The leaky router 'reaches the lowest perplexity' only when its mean log perplexity is below the best
    causal routing's (170 here) by more than twice the standard error from the seed spread (sd 1% of log
    perplexity, 2 seeds each: 2 SE = 2%): 160 is, 167.5 is a tie, 175 is above; without a seed spread the
    verdict is undecided, never a fixed band."""
    from smlp_bench import experiments as X

    spread = None if leak is None else {"sd": 0.01, "df": 3}
    leak = leak or 160.0
    models = {k: {"name": k, "valid_ppl": v, "valid_ppl_per_seed": [v * 0.99, v / 0.99]} for k, v in
              (("smlp_det", 170.0), ("smlp_partial", 178.0), ("smlp_leaky", leak))}
    rec = {"models": models, "nproc": 2, "settings": {"batch_size": 16, "updates": 150, "target": X.EXP_TARGET},
           "seed_spread": spread}
    assert X.figure7_claims(rec)[0]["holds"] == holds


def test_a_fair_record_with_only_its_sweep_publishes_rates_and_no_answer(tmp_path):
    """After the learning-rate sweep and before the deciding runs: the page shows the rates and no perplexity
    table; README keeps 'Not published yet' and says the sweep has finished (the record in the repository)."""
    from smlp_bench import publish as P

    repo = Path(__file__).parents[1]
    record = json.loads((repo / "docs/benchmark/fair/results.json").read_text())
    # the record as the sweep's end leaves it (the repository's may hold later stages by now)
    record["stages"] = {k: v for k, v in record["stages"].items() if k == "lr-sweep"}
    record["families"], record["stages_complete"] = {}, {"lr-sweep": True, "deciding": False}
    page = P.render_fair(record, {})
    assert "| model | rates tried: ppl |" in page and "| model | layers | lr | valid ppl" not in page
    assert "no family's perplexity is published yet" in page
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{P.README_FAIR_START}\nold\n{P.README_FAIR_END}\n")
    P._publish_readme(readme, None, [], tmp_path / "docs/benchmark", tmp_path / "docs/benchmarks.md", record)
    text = readme.read_text()
    assert "Not published yet" in text and "learning-rate sweep has finished" in text


# ---------------------------------------------------------------- the speed benchmark across widths


def _flag(model, name: str) -> int:
    return int(model.flags[model.flags.index(name) + 1])


class _WidthTrainer:
    """Stands in for fairseq-train in the speed benchmark: words/s known from the model, its width, the ranks and the
    round (a load shared by the round's runs); Switch logs dropped routing slots, the other MoEs only their loads."""

    BASE = {"smlp_det": 900.0, "gmlp": 1000.0, "switch": 1200.0, "hash": 1100.0}
    LOAD = {1: 1.0, 2: 0.6}  # round 2 ran on a busier machine: every ratio from the same round cancels it

    def __init__(self, stop_at: tuple | None = None):
        self.trained, self.stop_at = [], stop_at

    def wps(self, key: str, width: int, nproc: int, seed: int) -> float:
        # sMLP-det gains 10% per doubling of the width against the others, and scales worse than gMLP
        return self.BASE[key] * 128 / width * (width / 128) ** (0.14 if key == "smlp_det" else 0.0) * \
            nproc ** (0.9 if key == "gmlp" else 0.8) * self.LOAD[seed]

    def __call__(self, model, data, settings, nproc, seed, out, *, profile=False, updates=None, validate=True,
                 log_interval=None, on_line=None, code=None):
        width = _flag(model, "--decoder-embed-dim")
        if (model.key, width, nproc) == self.stop_at:
            self.stop_at = None
            raise KeyboardInterrupt
        self.trained.append((model.key, width, _flag(model, "--decoder-ffn-embed-dim"), nproc, seed))
        routing = {"switch": {"drop_1_ffn": 0.1, "drop_3_ffn": 0.3, "load_1_ffn": 1.3}, "hash": {"load_1_ffn": 1.1},
                   "smlp_det": {"load_1_smoe": 1.0, "load_3_tmoe": 1.2}}.get(model.key, {})
        intervals = [{"num_updates": float(u), "wps": self.wps(model.key, width, nproc, seed), "bsz": 16.0,
                      "wpb": 16.0 * 128, **routing} for u in range(10, (updates or settings["updates"]) + 1, 10)]
        if model.key == "switch":
            intervals[0]["drop_1_ffn"] = 0.9  # the warm-up interval drops more: not a measured one
        return training.Run(model.key, seed, intervals=intervals, seconds=1.0, peak_rss_mb=[1.0] * nproc)


def test_speed_across_widths_records_each_width_and_publishes_its_section(tmp_path, monkeypatch, capsys):
    """`smlp-bench speed --widths 128,256` (issue 53) with a stand-in for fairseq-train: every width trains the fair
    configuration at d_model = D, d_ffn = 4D with the calculator's FLOP matches, on 1 process and 2 ranks, each ratio
    from the same round; Switch's row says the share of tokens its experts processed; a stop resumes side by side
    (a side not started yet starts with --resume); --then-publish writes the width section and its figure and leaves
    the D=128 section as it was."""
    from smlp_bench import speed_pages

    trainer = _WidthTrainer(stop_at=("hash", 256, 1))
    monkeypatch.setattr(training, "run_training", trainer)
    monkeypatch.setattr(machine, "matmul_peak", lambda n: {"total": 1e11, "per_rank": [5e10] * n})
    monkeypatch.setattr(machine, "code_identity", lambda: {"commit": "c0ffee0", "dirty": False})
    monkeypatch.setattr(report_module, "plot", lambda *a, **k: None)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(96)))
    page = tmp_path / publish.PAGE
    page.parent.mkdir()
    page.write_text(f"a\n{speed_pages.START}\nD=128 as published\n{speed_pages.END}\nb\n"
                    f"{speed_pages.WIDTHS_START}\nnot measured yet\n{speed_pages.WIDTHS_END}\nc\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "widths"
    argv = ["speed", "--widths", "128,256", "--models", "smlp_det,gmlp,switch,hash", "--updates", "25", "--rounds",
            "2", "--output-dir", str(out), "--data", str(data), "--then-publish"]
    assert cli.main(argv) == 130  # stopped in the first side of D=256
    assert (out / "d128" / "nproc2" / "runs.json").exists() and not (out / "d256" / "nproc2").exists()
    assert cli.main([*argv, "--resume"]) == 0
    assert len(trainer.trained) == len(set(trainer.trained)) == 2 * 2 * 4 * 2  # widths x sides x models x rounds
    vocab = training.vocab_size(data)
    for width in (128, 256):
        ran = {k: (d, f) for k, d, f, _, _ in trainer.trained if d == width}
        assert set(ran) == {"smlp_det", "gmlp", "switch", "hash"} and ran["smlp_det"] == (width, 4 * width)
    kind, record = store_module.read_record(out / "speed.json")  # as tests/test_records.py reads a committed one
    assert kind == "speed" and record["complete"] and list(record["widths"]) == ["128", "256"]
    for width, r in record["widths"].items():
        assert r["settings"]["target"] == dict(presets.LONG_TARGET, experts=8, d_model=int(width), d_ffn=4 * int(width))
        assert list(r["sides"]) == ["1", "2"]
    side = record["widths"]["256"]["sides"]["2"]
    w = trainer.wps
    over = w("smlp_det", 256, 2, 1) / w("gmlp", 256, 2, 1)  # the same in both rounds: the round's load cancels
    assert side["models"]["smlp_det"]["gMLP"] == pytest.approx({"ratio": over, "lo": over, "hi": over, "rounds": 2})
    assert side["models"]["switch"]["gMLP"]["ratio"] == pytest.approx(1.2 * 2 ** -0.1)
    kept = {k: m["tokens_kept"] for k, m in side["models"].items()}
    assert kept == {"smlp_det": 1.0, "gmlp": None, "switch": pytest.approx(0.8), "hash": 1.0}
    # the page: the width section from the record, its figure beside the page's other figures; D=128's untouched
    text = page.read_text()
    assert "D=128 as published" in text and "not measured yet" not in text and text.endswith("\nc\n")
    section = text[text.index(speed_pages.WIDTHS_START):text.index(speed_pages.WIDTHS_END)]
    assert section == f"{speed_pages.WIDTHS_START}\n{speed_pages.markdown(record, 'benchmark/speed/widths.png')}\n"
    assert "Measured by `smlp-bench speed --widths 128,256` at commit c0ffee0" in section
    assert "](benchmark/speed/widths.png)" in section and (tmp_path / "docs/benchmark/speed/widths.png").is_file()
    trend = [w("smlp_det", d, 2, 1) / w("gmlp", d, 2, 1) for d in (128, 256)]
    assert (f"- sMLP-det's words/s over gMLP's, 2 processes: {trend[0]:.3f}x [{trend[0]:.2f}-{trend[0]:.2f}] at "
            f"D=128, {trend[1]:.3f}x [{trend[1]:.2f}-{trend[1]:.2f}] at D=256.") in section
    planned = {m.key: m.train_flops_per_token for m in presets.plan_models(
        vocab, 2, ["smlp_det", "switch"], dict(presets.LONG_TARGET, experts=8, d_model=256, d_ffn=1024))[0]}
    switch = w("switch", 256, 2, 1)
    assert (f"| 256 | 2 | Switch | {planned['switch'] / planned['smlp_det']:.3f} | {0.8 * switch:,.0f} "
            f"[{0.6 * switch:,.0f}-{switch:,.0f}] | {1.2 * 2 ** -0.1:.3f}x") in section
    assert section.count("| 80.0% |") == 4 and section.count("| 100.0% |") == 8  # Switch; sMLP-det and HASH
    assert "| D=256 | 0.87 | 0.93 | 0.87 | 0.87 |" in section  # 2^-0.2, 2^-0.1: words/s on 2 ranks / 2 x on 1
    # issue 53's goals where measured (D=128 on 2 ranks here): sMLP-det's same-round ratio, and README's sentence
    assert side["models"]["hash"]["smlp_det_over"]["ratio"] == pytest.approx(w("smlp_det", 256, 2, 1)
                                                                            / w("hash", 256, 2, 1))
    goals = [t for t in record["targets"] if t["target"].startswith("issue 53")]
    assert [(t["target"], t["goal"], t["met"]) for t in goals] == [
        ("issue 53, D=128: sMLP-det words/s over gMLP, 2 process(es)", ">= 0.85x", trend[0] >= 0.85)]
    assert goals[0]["measured"] == pytest.approx(trend[0]) and f"| {trend[0]:.3f} [" in section
    one = [w("smlp_det", d, 1, 1) / w("gmlp", d, 1, 1) for d in (128, 256)]
    assert speed_pages.widths_sentence(record) == (
        f"Across widths (D=128, 256, FLOP-matched at each) sMLP-det trains at {one[0]:.2f}x, {one[1]:.2f}x gMLP's "
        f"words/s on one process and {trend[0]:.2f}x, {trend[1]:.2f}x on 2 CPU ranks; Switch stays faster by "
        "dropping tokens past its capacity (it keeps 80%, 80% of them) "
        "([benchmarks.md](docs/benchmarks.md#speed-across-widths-issue-53)).")
    # reported again from the finished stores: nothing trains, no matmul peak of another hour joins the stores
    stores = {p: p.read_text() for p in out.glob("d*/nproc*/runs.json")}
    monkeypatch.setattr(machine, "matmul_peak", lambda n: pytest.fail("a peak measured with no run to train"))
    assert cli.main([*argv, "--resume"]) == 0 and len(trainer.trained) == 2 * 2 * 4 * 2
    assert {p: p.read_text() for p in stores} == stores and speed_pages.markdown(
        store_module.read_record(out / "speed.json")[1], "benchmark/speed/widths.png") in page.read_text()
    # a record of several widths has no before/after table
    assert cli.main(["speed", "--publish", str(out / "speed.json"), "--before", str(out / "speed.json")]) == 1
    assert "holds several widths" in capsys.readouterr().err


def test_the_committed_speed_records_publish_the_page_as_it_is(tmp_path):
    """The speed sections of docs/benchmarks.md are what publishing the committed records gives: issue 47's pair
    (written before issue 53: no token shares, one width) as the page shows them, and the width section from its
    record once there is one, and no figure at all before."""
    from smlp_bench import speed_pages

    repo = Path(__file__).parents[1]
    page = tmp_path / publish.PAGE
    page.parent.mkdir()
    shutil.copy2(repo / publish.PAGE, page)
    issue47 = repo / "docs/benchmark/speed/issue47"
    speed_pages.publish(issue47 / "after/speed.json", page, before=issue47 / "before/speed.json")
    widths = repo / "docs/benchmark/speed/widths/speed.json"
    if widths.exists():
        speed_pages.publish(widths, page)
    assert page.read_text() == (repo / publish.PAGE).read_text()
    text = page.read_text()
    section = text[text.index(speed_pages.WIDTHS_START):text.index(speed_pages.WIDTHS_END)]
    assert widths.exists() or ("Measured by" not in section and "|" not in section and "![" not in section)
