"""The kernel-docs comparison (`smlp-bench fair --corpus kernel-docs`, benchmarks/fair.py KERNEL_DOCS) end to end with
tests/test_fair.py's stand-in for fairseq-train: the rate stage tries each family's demo rate, half and twice (one
more rate past an edge, no more), the deciding and experts stages train seeds 2-5 at the chosen rates for 1500
updates, the answer gives every pair's Welch verdict at 500, 1000 and 1500 updates, and a stage refuses a data folder
other than the one it was planned on."""
from __future__ import annotations

import json

import pytest

from smlp_bench import budget_report, cli, fair, publish
from smlp_bench import verdicts as V
from test_fair import data, fake_training, final  # noqa: F401 (fixtures)


def _manifest(folder, fingerprint: str) -> None:
    (folder / "manifest.json").write_text(json.dumps({"fingerprint": fingerprint, "params": {"corpus": "kernel-docs"}}))


def test_the_kernel_docs_comparison_rates_decides_at_every_budget_and_keeps_its_data(
        tmp_path, data, fake_training):  # noqa: F811 (the fixtures imported above)
    _manifest(data, "f" * 64)
    out = tmp_path / "fair-docs"
    args = ["fair", "--corpus", "kernel-docs", "--output-dir", str(out), "--work-dir", str(tmp_path / "work"),
            "--data", str(data), "--no-pin"]
    assert cli.main(args) == 0
    trained = [c for c in fake_training if c["validate"]]
    rate = [c for c in trained if c["stage"] == "rate"]
    # the demo sweep's rate, half and twice, seed 1, 1000 updates, validated every 100
    for c in rate:
        assert c["seed"] == 1 and c["cmd"][c["cmd"].index("--max-update") + 1] == "1000"
        assert c["cmd"][c["cmd"].index("--validate-interval-updates") + 1] == "100"
    rec = json.loads((out / "results.json").read_text())
    tried = {f: sorted(float(r) for r in c["tried"]) for f, c in rec["rates"].items()}
    # gMLP's optimum (1e-3) lies below its three rates: one more (0.004), still at the edge, no further
    assert tried["gmlp"] == pytest.approx([4e-3, 8e-3, 1.6e-2, 3.2e-2]) and not rec["rates"]["gmlp"]["bracketed"]
    # sMLP-det's (0.012) above 0.008: 0.016 at the edge, one more (0.032) brackets it
    assert tried["smlp_det"] == pytest.approx([4e-3, 8e-3, 1.6e-2, 3.2e-2]) and rec["rates"]["smlp_det"]["bracketed"]
    assert tried["hash"] == pytest.approx([2e-3, 4e-3, 8e-3]) and rec["rates"]["hash"]["chosen"] == 4e-3
    # deciding and experts: seeds 2-5 each at the chosen rate, 1500 updates, 8 and 32 experts
    later = [c for c in trained if c["stage"] != "rate"]
    assert sorted((c["stage"], c["key"], c["seed"]) for c in later) == sorted(
        [("deciding", k, s) for k in fair.DOCS_FAMILIES for s in (2, 3, 4, 5)]
        + [("experts", f"{k}_e32", s) for k in ("smlp_det", "hash") for s in (2, 3, 4, 5)])
    for c in later:
        family = c["key"].partition("_e")[0]
        assert c["lr"] == pytest.approx(rec["rates"][family]["chosen"])
        assert c["cmd"][c["cmd"].index("--max-update") + 1] == "1500"
        if family != "gmlp":
            assert c["cmd"][c["cmd"].index("--num-experts") + 1] == ("32" if c["stage"] == "experts" else "8")
    # every pair at every budget, by the Welch rule on that budget's per-seed perplexities
    assert rec["complete"] and [p["a"] + "/" + p["b"] for p in rec["pairs"]] == [
        f"{a}/{b}" for a, b, _ in budget_report.PAIRS]
    primary = rec["pairs"][0]
    for u in ("500", "1000", "1500"):
        a = [primary["at"][u]["seeds_a"][str(s)] for s in (2, 3, 4, 5)]
        b = [primary["at"][u]["seeds_b"][str(s)] for s in (2, 3, 4, 5)]
        p = final("smlp_det", rec["rates"]["smlp_det"]["chosen"], 2, 128) * (1 + 25 / int(u)) / (1 + 25 / 1500)
        assert a[0] == pytest.approx(p)  # the stand-in's seed-2 value at that budget
        assert primary["at"][u]["ci_pct"] == pytest.approx(V.t_compare(a, b)["ci_pct"])
        assert rec["per_seed"]["smlp_det"]["ppl"][u]["2"] == pytest.approx(p)
    assert [g["tokens"] for g in primary["gap"]] == [u * 16 * 128 * 2 for u in range(100, 1501, 100)]
    assert (out / "gap.png").is_file() and (out / "rates.png").is_file()
    # gMLP's rate is at the edge of those tried: it is never called worse
    gmlp = rec["pairs"][1]["at"]["1500"]
    assert gmlp["ratio"] < 1 and gmlp["verdict"] == "undecided" and "edge" in gmlp["why_undecided"]
    # published: the page's section (every pair at every budget, each seed, the rates) and README's answer
    docs = tmp_path / "docs"
    page, readme = docs / "benchmarks.md", tmp_path / "README.md"
    docs.mkdir()
    page.write_text(f"# b\n{budget_report.DOCS_START}\nOLD\n{budget_report.DOCS_END}\n")
    readme.write_text(f"# r\n{publish.README_FAIR_START}\nOLD\n{publish.README_FAIR_END}\n")
    publish.publish([out / "results.json"], page, docs, readme=readme)
    text, answer = page.read_text(), readme.read_text()
    assert "OLD" not in text and "| pair | 500 updates | 1000 updates | 1500 updates |" in text
    row = next(line for line in text.splitlines() if line.startswith("| sMLP-det against HASH Layers, 8 experts"))
    c = primary["at"]["1500"]
    assert row.endswith(f"| {c['ratio'] - 1:+.1%} [{c['ci_pct'][0]:+.1%}, {c['ci_pct'][1]:+.1%}]: tie |")
    lr = rec["rates"]["smlp_det"]["chosen"]
    assert f"| sMLP-deterministic | {lr:g} | " in text and "![the relative gap" in text
    assert (docs / "fair-docs" / "gap.png").is_file() and (docs / "fair-docs" / "results.json").is_file()
    assert "best Transformer-MoE at matched FLOPs? a tie.**" in answer and "At 32 experts: " in answer
    # the stand-in's curves keep each pair's ratio along training: every gap is unchanged at 1500, and both say so
    assert all(p["motion"]["direction"] == "unchanged" for p in rec["pairs"])
    assert "Still moving at 1500 updates?" in text and "), unchanged\n" in text
    assert "At 1500 updates the gap was steady: " in answer and "not a settled order" not in answer
    # one checkout ran every stage (--no-pin): one commit, nothing differs between the stages that pairs cross
    commits = rec["stage_commits"]
    assert list(commits) == ["rate", "deciding", "experts"] and len(set(commits.values())) == 1
    assert rec["code_between"] == {"deciding..experts": []} and "that differ between them: none differ." in text
    assert "![each pair's relative gap against tokens read, with its 95% interval](docs/fair-docs/gap.png)" in answer
    # before the deciding stage has finished, README keeps the demo corpus's answer and says how far this one is
    partial = {**rec, "stages_complete": {"rate": True, "deciding": False, "experts": False},
               "progress": {"rate": [10, 10], "deciding": [5, 12], "experts": [0, None]}}
    assert budget_report.render_docs_summary(partial, "p.md") is None
    experts_running = {**partial, "stages_complete": {"rate": True, "deciding": True, "experts": False},
                       "progress": {"rate": [10, 10], "deciding": [12, 12], "experts": [4, 8]}}
    assert ". At 32 experts (so far: the experts stage has run 4 of 8 runs): sMLP-deterministic, 32 experts " in (
        budget_report.render_docs_summary(experts_running, "p.md"))
    body = publish.readme_answer(None, partial, docs, page, tmp_path)
    assert "is running (rate done, deciding 5 of 12 runs, experts to come)" in body
    # a stage resumed on another data folder is refused in one line naming both fingerprints
    _manifest(data, "e" * 64)
    (out / "experts" / "results.json").unlink()  # the stage is then not finished
    with pytest.raises(fair.BenchError, match="planned on data fingerprint ffffffffffff .* has eeeeeeeeeeee"):
        fair.main(cli.parse_args([*args, "--resume"]), data, 96)


def test_a_rate_stage_still_running_shows_its_rates_so_far_unchosen():
    record = {"models": {"gmlp@lr0.008": {"valid_ppl": 67.7}, "gmlp@lr0.016": {"valid_ppl": 65.2},
                         "gmlp@lr0.032": {"valid_ppl": None}, "hash@lr0.004": {"valid_ppl": 70.0}}}
    got = budget_report.rates_so_far(record)
    assert got["gmlp"] == {"tried": {"0.008": 67.7, "0.016": 65.2}, "chosen": 0.016, "bracketed": None,
                           "partial": True}
    assert got["hash"]["chosen"] == 0.004 and set(got) == {"gmlp", "hash"}


def _curves(per_seed: dict[int, tuple[float, float]]) -> dict:
    """A model validated at 1400 and 1500 updates: seed -> (perplexity at 1400, at 1500)."""
    return {"curves": [{"seed": s, "updates": [1400, 1500], "tokens": [0, 0], "ppl": list(v)}
                       for s, v in per_seed.items()]}


def test_a_gaps_motion_over_the_last_100_updates_is_the_hand_computed_one():
    import math
    a, b = _curves({2: (60.0, 57.0), 3: (62.0, 58.0)}), _curves({2: (63.0, 58.5), 3: (64.0, 59.5)})
    m = budget_report.motion({"a": a, "b": b}, "a", "b", 1500)
    gap_1500, gap_1400 = math.sqrt(57 * 58 / (58.5 * 59.5)) - 1, math.sqrt(60 * 62 / (63 * 64)) - 1
    assert m["last_100"] == pytest.approx(gap_1500 - gap_1400) and m["last_100"] == pytest.approx(0.014043, abs=1e-6)
    # both seeds closed on b (57/58.5 above 60/63, 58/59.5 above 62/64); -2.54% closing 1.40 points a step: ~181
    assert m["direction"] == "toward zero" and (m["seeds_same_way"], m["seeds_paired"]) == (2, 2)
    assert m["updates_to_zero"] == 180
    words = budget_report.motion_words(m)
    assert words.startswith("+1.4 points over the last 100 updates (2 of 2 seeds the same way), toward zero: at "
                            "that pace it closes in about 180 more updates")
    # the other way round: the gap widens, one seed of two with it; no pace to zero
    a, b = _curves({2: (63.0, 61.0), 3: (64.0, 60.5)}), _curves({2: (60.0, 57.0), 3: (62.0, 59.0)})
    m = budget_report.motion({"a": a, "b": b}, "a", "b", 1500)  # +4.1% -> +4.8%: seed 2 widens, seed 3 closes
    assert m["direction"] == "away from zero" and m["updates_to_zero"] is None and m["seeds_same_way"] == 1
    # within the printed precision (0.1 points) the gap is unchanged, whichever way the rounding leans
    m = budget_report.motion({"a": _curves({2: (60.0, 58.52)}), "b": _curves({2: (63.0, 61.45)})}, "a", "b", 1500)
    assert m["direction"] == "unchanged" and budget_report.motion_words(m).endswith("), unchanged")


def test_the_code_each_stage_ran_and_what_differs_between_crossed_stages_is_stated():
    record = {"stage_commits": {"rate": "c1aa701", "deciding": "970dc94", "experts": "0b7bbae"},
              "code_between": {"deciding..experts": ["launch/binarize.py", "launch/local.py"]}}
    text = budget_report.code_sentence(record)
    assert text.startswith("Code: each stage's runs executed one commit (rate c1aa701, deciding 970dc94, experts "
                           "0b7bbae). The pairs across the deciding and experts stages compare 970dc94 with 0b7bbae;")
    assert text.endswith("that differ between them: `launch/binarize.py`, `launch/local.py`.")
    assert budget_report.code_sentence({**record, "code_between": {"deciding..experts": None}}).endswith(
        "git could not tell which.")
    assert budget_report.code_sentence({}) is None
