"""The deciding benchmark (`smlp-bench --fair`, benchmarks/fair.py) end to end with a stand-in for
fairseq-train whose final perplexity is a known function of the family, the learning rate, the seed,
the width and the expert count: the sweep must choose each family's best rate (widening past an edge),
every later run must train at its family's rate on seeds the sweep did not use (seeds 2-5 for the
primary pair, fixed in advance), the primary verdict must follow the Welch t rule, the store must be
committed as runs finish, and a stopped benchmark must resume run by run. The pinned runs (a stage
executes its own commit's code whatever the checkout holds since) are tested with real trainings in
tests/test_fair_pinned.py."""
from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest

from smlp_bench import cli, fair, machine, report, store, training
from smlp_bench import verdicts as V

# the stand-in's optimum rate per family: sMLP-det's above the first sweep (widened twice, to the bound),
# gMLP's below it and at the lower bound (widened once, still at the edge), the others inside it
OPTIMUM = {"smlp_det": 1.2e-2, "gmlp": 1e-3}
BASE = {"smlp_det": 80.8, "smlp_partial": 74.0, "gmlp": 90.0, "transformer": 86.0, "gshard": 84.0, "switch": 84.5,
        "base": 86.0, "hash": 81.0}
SEED_FACTOR = {1: 1.0, 2: 1.0, 3: 1.012, 4: 1.006, 5: 0.994}


def family_of(key: str) -> str:
    return re.sub(r"(_s\d+)?_e\d+$", "", key.split("@")[0])


def final(key: str, lr: float, seed: int, d_model: int) -> float:
    family = family_of(key)
    base = BASE.get(family, 90.0)
    e = re.search(r"_e(\d+)$", key)
    if e:  # more experts help both, sMLP-det a bit more
        base *= 1 - (0.03 if family == "smlp_det" else 0.02) * math.log2(int(e.group(1)) / 8)
    if d_model == 256:
        base *= 0.8 if family != "smlp_det" else 0.85
    off = math.log2(lr / OPTIMUM.get(family, 4e-3))
    return base * (1 + 0.05 * off * off) * SEED_FACTOR[seed]


@pytest.fixture
def fake_training(monkeypatch):
    calls = []

    def fake(model, data, settings, nproc, seed, out, *, profile=False, updates=None, validate=True,
             log_interval=None, on_line=None, code=None):
        cmd = training.train_command(model, data, settings, nproc, seed, out, updates=updates, validate=validate)
        lr = float(cmd[cmd.index("--lr") + 1])
        d_model = int(cmd[cmd.index("--decoder-embed-dim") + 1])
        calls.append({"key": model.key, "seed": seed, "lr": lr, "d_model": d_model, "validate": validate,
                      "cmd": cmd, "stage": Path(out).parent.parent.name})
        u = updates or settings["updates"]
        intervals = [{"num_updates": float(i), "wps": 5000.0} for i in range(2, u + 1, 2)]
        end = final(model.key, lr, seed, d_model)
        valid = []
        if validate:
            for v in range(settings["validate_every"], u + 1, settings["validate_every"]):
                p = end * (1 + 25 / v) / (1 + 25 / u)
                valid.append({"num_updates": float(v), "ppl": p, "suffix_ppl": p * 0.9, "greedy_routing_ppl": p * 1.05,
                              "trained_routing_ppl": p * 0.99, "load_greedy_3_tmoe": 2.5, "wall": float(v)})
        return training.Run(model.key, seed, intervals=intervals, valid=valid, seconds=1.0, peak_rss_mb=[1.0],
                            log=str(Path(out) / "train.log"))  # where run_training writes it

    monkeypatch.setattr(training, "run_training", fake)
    monkeypatch.setattr(machine, "matmul_peak", lambda n: {"total": 1e11, "per_rank": [5e10] * n})
    monkeypatch.setattr(machine, "code_identity", lambda: {"commit": "c0ffee", "dirty": False})
    monkeypatch.setattr(fair, "code_identity", lambda: {"commit": "c0ffee", "dirty": False})
    monkeypatch.setattr(report, "plot", lambda *a, **k: None)  # the stages' Figure 5 (the fair figures are drawn)
    monkeypatch.setattr(store.os, "fsync", lambda fd: None)  # runs.json's durability is not what is tested here
    return calls


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(96)))
    return d


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_the_fair_benchmark_sweeps_decides_and_resumes(tmp_path, data, fake_training, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t"), _git(repo, "config", "user.name", "t")
    (repo / "other.txt").write_text("someone's work in progress\n")
    _git(repo, "add", "other.txt")  # staged, not ours: --commit-store must leave it out of its commits
    out = repo / "docs" / "fair"
    # this checkout's code (--no-pin: the stand-in trains nothing; tests/test_fair_pinned.py runs pinned stages),
    # every stage (width only when named)
    args = ["--fair", "--output-dir", str(out), "--work-dir", str(tmp_path / "work"), "--data", str(data),
            "--commit-store", "--no-pin", "--stages", "lr-sweep,deciding,experts,width,experts-seeds,smoe-experts"]
    # a stop in the middle of the deciding stage (Ctrl-C, a session's end) ...
    real = training.run_training
    deciding_runs = []

    def stop_in_deciding(model, data, settings, nproc, seed, out_dir, **kw):
        if "deciding" in str(out_dir) and kw.get("validate", True):
            deciding_runs.append(model.key)
            if len(deciding_runs) == 5:
                raise KeyboardInterrupt
        return real(model, data, settings, nproc, seed, out_dir, **kw)

    monkeypatch.setattr(training, "run_training", stop_in_deciding)
    assert cli.main(args) == 130
    before = len(fake_training)
    # the store of every finished run is committed, and nothing else
    log = _git(repo, "log", "--format=%s")
    assert "fair benchmark, stage lr-sweep: a run finished" in log and "stage deciding: a run finished" in log
    assert _git(repo, "ls-files", "docs/fair/lr-sweep").split() == [f"docs/fair/lr-sweep/{name}" for name in
                                                                    ("results.json", "runs.json", "table.md")]
    assert _git(repo, "diff", "--cached", "--name-only").split() == ["other.txt"]
    work = str(tmp_path / "work" / "lr-sweep" / "runs")  # the runs' logs go to the work folder, not the store
    assert all(work in c["cmd"][c["cmd"].index("--log-dir") + 1] for c in fake_training if c["stage"] == "lr-sweep")
    # ... and the committed store names them relative to it (no machine's paths in the repository)
    logs = [r["log"] for r in json.loads((out / "lr-sweep" / "runs.json").read_text())["records"].values()]
    assert logs and all(log == f"runs/{Path(log).parent.name}/train.log" for log in logs)
    # ... a resume from other code that decides perplexity is refused, naming the files ...
    monkeypatch.setattr(fair, "code_identity", lambda: {"commit": "beef", "dirty": False})
    monkeypatch.setattr(fair, "perplexity_changes", lambda a, b: ["smlp/moe.py"])
    with _raises_bench_error("smlp/moe.py"):
        fair.main(cli.parse_args([*args, "--resume"]), data, 96)
    monkeypatch.setattr(fair, "code_identity", lambda: {"commit": "c0ffee", "dirty": False})
    monkeypatch.setattr(fair, "perplexity_changes", lambda a, b: [] if a == b else ["smlp/moe.py"])
    # ... and continues with --resume: finished runs are kept, the interrupted one starts again
    assert cli.main([*args, "--resume"]) == 0
    trained = [c for c in fake_training if c["validate"]]
    ids = [(c["stage"], c["key"], c["seed"]) for c in trained]
    assert len(ids) == len(set(ids))  # no run trained twice (the interrupted one stopped before it trained)
    rec = json.loads((out / "results.json").read_text())
    assert rec["complete"] and rec["kind"] == "fair"

    # 1. the sweep: 3 rates a factor 2 apart, seed 1, no speed probes, widened past an edge within the bounds
    sweep = [c for c in fake_training if c["stage"] == "lr-sweep"]
    assert all(c["validate"] and c["seed"] == fair.SWEEP_SEED for c in sweep)
    rates = rec["rates"]
    assert set(rates["smlp_det"]["tried"]) == {"0.002", "0.004", "0.008", "0.016", "0.032"}
    assert rates["smlp_det"]["chosen"] == pytest.approx(1.6e-2) and rates["smlp_det"]["bracketed"]
    assert set(rates["gmlp"]["tried"]) == {"0.001", "0.002", "0.004", "0.008"}
    assert rates["gmlp"]["chosen"] == pytest.approx(1e-3) and not rates["gmlp"]["bracketed"]
    assert all(c["chosen"] == pytest.approx(4e-3) for f, c in rates.items() if f not in OPTIMUM)
    assert rec["best_moe"] == "hash" and (out / "lr_sweep.png").is_file()

    # 2. every later run at its family's rate, on seeds the sweep did not use, 8 experts, the diagnostics logged
    for c in trained:
        if c["stage"] != "lr-sweep" and "@lr" not in c["key"]:
            assert c["lr"] == pytest.approx(rates[family_of(c["key"])]["chosen"]), c["key"]
            assert c["seed"] != fair.SWEEP_SEED
    deciding = [c for c in trained if c["stage"] == "deciding"]
    assert {(c["key"], c["seed"]) for c in deciding} == {(f, s) for f in fair.FAMILIES for s in fair.DECIDING_SEEDS} \
        | {(k, s) for k in ("smlp_det", "hash") for s in (4, 5)}  # the primary pair's seeds, fixed in advance
    flags = " ".join(next(c["cmd"] for c in deciding if c["key"] == "smlp_det"))
    for flag in ("--valid-suffix-from 26", "--valid-trained-routing", "--valid-greedy-routing", "--num-experts 8"):
        assert flag in flags
    assert any(not c["validate"] for c in fake_training if c["stage"] == "deciding")  # speed probes here

    # 2b. issue 51's runs, each model its own seeds in the order fixed in advance: gMLP seeds 4-5, the trend's points
    # seeds 3-5; then sMLP-det with 4 sMoE experts (--smoe-experts) at 32 and 8 tMoE experts, seeds 2-5; then the
    # rates at 32 experts, seed 1
    order = [(c["key"], c["seed"]) for c in trained if c["stage"] == "experts-seeds"]
    trend = ["smlp_det_e2", "hash_e2", "smlp_det_e32", "hash_e32"]
    assert order[:2] == [("gmlp", 4), ("gmlp", 5)]
    assert [sorted(order[2 + 4 * i:6 + 4 * i]) for i in range(3)] == [sorted((k, s) for k in trend) for s in (3, 4, 5)]
    order = [(c["key"], c["seed"]) for c in trained if c["stage"] == "smoe-experts"]
    assert order[:8] == [(f"smlp_det_s4_e{e}", s) for e in (32, 8) for s in (2, 3, 4, 5)]
    assert sorted(order[8:]) == sorted((f"{k}_e32@lr{rates[k]['chosen'] * f:g}", 1) for k in ("smlp_det", "hash")
                                       for f in (0.5, 1, 2))
    for c in trained:
        if c["stage"] == "smoe-experts":
            flags = " ".join(c["cmd"])
            assert ("--smoe-experts 4" in flags) == ("_s4_" in c["key"]), c["key"]
            experts = re.search(r"_e(\d+)", c["key"]).group(1)
            assert f"--num-experts {experts}" in flags
            if "@lr" in c["key"]:
                assert c["lr"] == pytest.approx(float(c["key"].split("@lr")[1]))

    # 3. the primary verdict by the Welch t rule (each side its own spread), and the secondary ones
    v = rec["verdicts"]
    assert v["rule"] == V.T_RULE and v["best_moe"] == "hash"
    p = v["primary"]
    assert (p["model"], p["against"], p["metric"]) == ("smlp_det", "hash", "ppl") and p["seeds"] == [4, 4]
    assert p["verdict"] == "tie" and p["ci_pct"][0] < 0 < p["ci_pct"][1]
    assert p["text"].endswith(f"no difference larger than {p['bound_pct']:.1%} at this budget")
    assert p["df"] == pytest.approx(6)  # equal spreads and 4 seeds a side: Welch's df is 2 x (4 - 1)
    assert rec["seed_spread"]["smlp_det"]["df"] == 3 and rec["seed_spread"]["base"]["df"] == 1
    ratio = final("smlp_det", 1.6e-2, 2, 128) / final("hash", 4e-3, 2, 128)
    assert p["ratio"] == pytest.approx(ratio)
    sec = {(c["model"], c["against"], c["metric"]): c for c in v["secondary"]}
    assert sec[("smlp_det", "base", "ppl")]["verdict"] == "better"
    gm = sec[("smlp_det", "gmlp", "ppl")]  # gMLP loses but its rate is at the sweep's edge: not called worse
    assert gm["verdict"] == "undecided" and "edge of the sweep" in gm["why_undecided"]
    assert ("smlp_partial", "hash", "suffix_ppl") in sec and ("smlp_partial", "hash", "ppl") not in sec
    assert ("smlp_partial", "smlp_det", "suffix_ppl") in sec  # sMLP-det on the same positions beside it
    assert "ratios" not in rec and all("wps" not in f for f in rec["families"].values())  # no speed here
    assert "verdicts" not in json.loads((out / "deciding" / "results.json").read_text())  # one rule, one place
    assert not any(c["metric"] in ("trained_routing_ppl", "greedy_routing_ppl") for c in v["secondary"])
    assert v["diagnostics"]["base"]["greedy_routing_ppl"] > v["diagnostics"]["base"]["ppl"]

    # 4. width and experts, trends against the best MoE
    w = rec["width"]
    assert [pt["d_model"] for pt in w["points"]] == [128, 256] and w["best_moe"] == "hash"
    assert (out / "width.png").is_file() and (out / "experts.png").is_file()
    rows = {r["row"]: r for r in rec["experts"]["rows"]}
    assert sorted(int(e) for e in rows["smlp_det"]["points"]) == [2, 8, 32]
    assert sorted(int(e) for e in rows["smoe4"]["points"]) == [8, 32]
    # every seed of every stage pooled under its key: the trend's points 2-5, gMLP's seeds 2-5 in the secondary
    for row, e in (("smlp_det", "2"), ("smlp_det", "32"), ("best", "2"), ("best", "32"), ("smoe4", "8")):
        assert sorted(rows[row]["points"][e]["seeds"]) == [2, 3, 4, 5], (row, e)
    assert rec["families"]["gmlp"]["seeds"] == [2, 3, 4, 5] and rec["experts_complete"]
    assert sec[("smlp_det", "gmlp", "ppl")]["seeds"] == [4, 4] and "pooling_problems" not in rec
    cmp = {(c["experts"], c["model"], c["against"]): c for c in rec["experts"]["comparisons"]}
    assert set(cmp) == {(2, "smlp_det_e2", "hash_e2"), (8, "smlp_det", "hash"), (32, "smlp_det_e32", "hash_e32"),
                        (8, "smlp_det_s4_e8", "hash"), (32, "smlp_det_s4_e32", "hash_e32"),
                        (8, "smlp_det_s4_e8", "smlp_det"), (32, "smlp_det_s4_e32", "smlp_det_e32")}
    c = cmp[(32, "smlp_det_e32", "hash_e32")]
    assert c["seeds"] == [4, 4] and not c["borrowed"]
    assert c["ratio"] == pytest.approx(math.exp(statistics.mean(
        math.log(final("smlp_det_e32", 1.6e-2, s, 128) / final("hash_e32", 4e-3, s, 128)) for s in (2, 3, 4, 5))))
    # the rate at 32 experts: half, once and twice each side's sweep's rate, seed 1; the stand-in's optima keep them
    check = {r["family"]: r for r in rec["rate_check"]}
    assert set(check) == {"smlp_det", "hash"} and all(r["chosen_is_best"] and r["complete"] for r in check.values())
    assert list(check["hash"]["tried"]) == ["0.002", "0.004", "0.008"]
    assert "speed-up" not in (out / "deciding" / "table.md").read_text()

    # 5. --publish puts the answers in the page and README, from the store in place
    from smlp_bench import fair_pages, publish

    docs = repo / "docs"
    page = docs / "benchmarks.md"
    page.write_text(f"# b\n{publish.FAIR_START}\nOLD\n{publish.FAIR_END}\n{publish.CLAIMS_START}\nOLD\n"
                    f"{publish.CLAIMS_END}\n")
    readme = repo / "README.md"
    readme.write_text(f"# r\n{publish.README_FAIR_START}\nOLD\n{publish.README_FAIR_END}\n")
    publish.publish([out / "results.json"], page, docs, experiment_order=[], readme=readme)
    text, summary = page.read_text(), readme.read_text()
    assert "OLD" not in text and "OLD" not in summary
    assert ("- **Does sMLP-deterministic beat the best Transformer-MoE (HASH Layers) at matched FLOPs? a tie, no "
            "difference larger than") in text
    assert "- Secondary, sMLP-deterministic against Base Layers on all positions: yes" in text
    assert "| sMLP-deterministic | 9+3 | 0.016 |" in text and "| gMLP | 12 | 0.001 (edge) |" in text
    assert "Rule: " + V.T_RULE in text and fair_pages.SCALE_NOTE in text and fair_pages.BASE_NOTE in text
    answer = summary.split(publish.README_FAIR_START)[1]
    assert answer.startswith("\n**Does sMLP-deterministic beat the best Transformer-MoE at matched FLOPs? a tie, no")
    assert "for HASH Layers" in answer and "Against dense gMLP (secondary): undecided" in answer
    assert "As experts are added, sMLP-det against HASH Layers at 500 updates: 2 experts" in answer
    # the order is published as the snapshot it is, with sMLP-det's own trend and its 2-expert point against gMLP
    assert "**The order is a 500-update snapshot on a corpus read 1.4 times, not a settled one.**" in text
    assert "sMLP-deterministic (32 experts) against HASH Layers (32 experts) at 100 / 250 / 350 / 500 updates" in text
    assert "- sMLP-det itself at this budget: " in text and "At 2 experts against dense gMLP: " in text
    assert "With 4 sMoE experts (32 channels each) at 32 tMoE experts" in answer
    assert "| 32 | " in text and "| sMLP-det with 4 sMoE experts against the tie | - |" in text
    assert "The paper reports no expert sweep for sMLP" in text and "Is the sweep's rate still right" in text
    for name in ("lr_sweep.png", "width.png", "experts.png"):
        assert f"](fair/{name})" in text, name

    # a finished benchmark resumed again trains nothing
    n = len(fake_training)
    assert cli.main([*args, "--resume"]) == 0 and len(fake_training) == n
    assert before < n


def _raises_bench_error(match: str):
    from smlp_bench.presets import BenchError

    return pytest.raises(BenchError, match=match)


def test_the_sweep_widens_only_past_an_edge_and_within_bounds():
    tried = {"a": {2e-3: 10.0, 4e-3: 9.0, 8e-3: 9.5}, "b": {2e-3: 9.0, 4e-3: 9.5, 8e-3: 10.0},
             "c": {2e-3: 10.0, 4e-3: 9.5, 8e-3: 9.0}, "d": {4e-3: 10.0, 8e-3: 9.5, 1.6e-2: 9.0}}
    got = fair.choose_rates(tried, {"c": fair.WIDEN})
    assert got["a"]["next"] is None and got["a"]["bracketed"]
    assert got["b"]["next"] == pytest.approx(1e-3) and not got["b"]["bracketed"]
    assert got["c"]["next"] is None and not got["c"]["bracketed"]  # widened the most times allowed already
    assert got["d"]["next"] == pytest.approx(3.2e-2)
    assert fair.choose_rates({"e": {1e-3: 1.0, 2e-3: 2.0}}, {})["e"]["next"] is None  # at the lower bound
    assert fair.choose_rates({"f": {1.6e-2: 2.0, 3.2e-2: 1.0}}, {})["f"]["next"] is None  # at the upper bound


def test_the_t_rule_is_welch_with_each_sides_own_spread_against_a_hand_computed_case():
    # log perplexities a = 0, 0.02, 0.04 and b = 0.1, 0.16: sample variances 0.0004 and 0.0018, so
    # se^2 = 0.0004/3 + 0.0018/2 = 0.00103333, se = 0.0321455, Welch df = se^4 / ((0.0004/3)^2/2 + 0.0009^2/1)
    # = 1.30393; t(0.975, 1.30393) = 7.46242; diff = 0.02 - 0.13 = -0.11
    a, b = [math.exp(x) for x in (0.0, 0.02, 0.04)], [math.exp(x) for x in (0.1, 0.16)]
    c = V.t_compare(a, b)
    assert c["se"] == pytest.approx(0.0321455, rel=1e-5) and c["df"] == pytest.approx(1.3039349, rel=1e-6)
    assert c["t_crit"] == pytest.approx(7.4624171, rel=1e-6) and c["log_diff"] == pytest.approx(-0.11)
    assert c["ci_log"] == pytest.approx([-0.11 - 7.4624171 * 0.0321455, -0.11 + 7.4624171 * 0.0321455], rel=1e-5)
    assert c["verdict"] == "tie"
    # the same interval as another implementation's Welch test
    from scipy.stats import ttest_ind

    ref = ttest_ind([0.0, 0.02, 0.04], [0.1, 0.16], equal_var=False).confidence_interval(0.95)
    assert c["ci_log"] == pytest.approx([ref.low, ref.high], rel=1e-9)
    # a pooled spread would have narrowed the noisy side: here the quiet side (a) has 3 seeds, the noisy (b) 2;
    # the pooled interval (df 3) is the narrower, and Welch keeps b's own spread
    pooled = V.pooled_log_sd([a, b])
    pooled_half = 3.182446305 * pooled["sd"] * math.sqrt(1 / 3 + 1 / 2)  # t(0.975, 3), tables
    assert pooled_half < c["ci_log"][1] - c["log_diff"]
    # a clear gap with tight seeds is decided; one seed a side is undecided unless a spread is borrowed
    assert V.t_compare([97.0, 97.1, 96.9], [100.0, 100.2, 99.8])["verdict"] == "better"
    assert V.t_compare([103.0, 103.1], [100.0, 100.1])["verdict"] == "worse"
    one = V.t_compare([97.0], [100.0, 100.5])
    assert one["verdict"] == "undecided" and "one seed" in one["why_undecided"]
    lent = V.t_compare([97.0], [100.0], {"sd": 0.01, "df": 3}, {"sd": 0.01, "df": 3})
    assert lent["borrowed"] == ["a", "b"] and lent["df"] == pytest.approx(6) and lent["verdict"] == "tie"
    with pytest.raises(ValueError, match="perplexities on both sides"):
        V.t_compare([], [100.0])


def test_the_seed_rule_of_the_other_benchmarks_pools_the_seed_spread():
    spread = V.pooled_log_sd([[100.0, 102.0], [90.0, 91.0], [80.0]])
    assert spread["df"] == 2
    logs = [math.log(100), math.log(102), math.log(90), math.log(91)]
    ss = (logs[0] - logs[1]) ** 2 / 2 + (logs[2] - logs[3]) ** 2 / 2
    assert spread["sd"] == pytest.approx(math.sqrt(ss / 2))
    sd = 0.01
    # 2 seeds each: SE = sd; a 3% gap is beyond 2 SE, a 1% gap is not
    assert V.compare([97.0, 97.0], [100.0, 100.0], sd)["verdict"] == "better"
    assert V.compare([103.0, 103.0], [100.0, 100.0], sd)["verdict"] == "worse"
    assert V.compare([99.0, 99.0], [100.0, 100.0], sd)["verdict"] == "tie"
    # one seed on a side widens the SE: the same 3% gap becomes a tie against 1 x 1 seeds at sd 2.5%
    assert V.compare([97.0], [100.0], 0.025)["verdict"] == "tie"
    assert V.compare([97.0], [100.0], None)["verdict"] == "undecided"
    with pytest.raises(ValueError, match="perplexities on both sides"):
        V.compare([], [100.0], sd)


def test_the_rate_check_says_when_a_familys_best_rate_lies_past_its_sweeps_against_its_seed_spread():
    """At 32 experts: a family whose best of its three rates is the highest, and one whose sweep's rate stays best.
    The gain and the seed spread (sd of log perplexity over the 32-expert seeds) against hand-computed values; the
    page's sentence says which side of the spread the gain lies on, and nothing for the family that stays."""
    from smlp_bench import fair_pages as FP
    from smlp_bench import fair_report as FR

    def model(*ppl):
        return {"valid_ppl_per_seed": list(ppl)}

    pooled = {"hash_e32@lr0.002": model(79.5), "hash_e32@lr0.004": model(71.4), "hash_e32@lr0.008": model(70.9),
              "hash_e32": model(71.2, 71.2, 72.2, 73.0),
              "smlp_det_e32@lr0.004": model(69.1), "smlp_det_e32@lr0.008": model(67.8),
              "smlp_det_e32@lr0.016": model(70.4), "smlp_det_e32": model(69.2, 70.1, 73.8, 69.2)}
    rows = {r["family"]: r for r in FR.rate_check(pooled, {"hash": {"chosen": 0.004}, "smlp_det": {"chosen": 0.008}})}
    h = rows["hash"]
    assert h["best"] == 0.008 and h["best_at_edge"] and not h["chosen_is_best"] and h["complete"]
    assert h["gain"] == pytest.approx(70.9 / 71.4 - 1)
    assert h["seed_sd"] == pytest.approx(statistics.stdev(math.log(v) for v in (71.2, 71.2, 72.2, 73.0)))
    text = FP.rate_sentence(h)
    assert text.startswith("HASH Layers does best at 0.008: 70.9 against 71.4 at its sweep's rate (-0.7%, seed 1 "
                           "alone; a higher rate than 0.008 was not tried).") and "within that spread" in text
    assert "1.2% (sd of log perplexity)" in text and "about 0.7% pessimistic" in text
    assert rows["smlp_det"]["chosen_is_best"] and FP.rate_sentence(rows["smlp_det"]) == ""
    pooled["hash_e32@lr0.008"] = model(60.0)  # a gain past the spread: the comparisons lean against HASH
    far = FP.rate_sentence(FR.rate_check(pooled, {"hash": {"chosen": 0.004}})[0])
    assert "the gain exceeds that spread" in far and "(-16.0%," in far
    lines = FP.render_experts({"best_moe": "hash", "rows": [], "comparisons": []}, [h], None)
    assert lines[-1] == text and lines[-2] == ""


def test_a_same_seed_rerun_replaces_the_seed_it_reran_and_is_compared_at_the_printed_precision():
    from smlp_bench import fair_report as FR

    def model(seeds, ppls, flags="--arch smlp_lm"):
        return {"fairseq_flags": flags, "lr": 0.008, "seeds": seeds, "valid_ppl_per_seed": ppls,
                "curves": [{"seed": s, "updates": [500], "ppl": [p]} for s, p in zip(seeds, ppls)]}

    records = {"experts": {"models": {"a": model([2], [60.04]), "b": model([2], [70.0])}},
               "experts-seeds": {"models": {"a": model([3, 4], [61.0, 62.0]), "b": model([3], [71.0])}},
               "same-seed": {"models": {"a": model([2], [60.01]), "b": model([2], [70.2], flags="--arch other")}}}
    pooled, problems = FR.pooled_models(records)
    assert pooled["a"]["seeds"] == [2, 3, 4] and pooled["a"]["valid_ppl_per_seed"] == [60.01, 61.0, 62.0]
    assert FR.at_update(pooled["a"], 500) == {2: 60.01, 3: 61.0, 4: 62.0} and pooled["a"]["rerun_seeds"] == [2]
    # a rerun of another model under the key is not used, and said
    assert pooled["b"]["valid_ppl_per_seed"] == [70.0, 71.0] and problems == [
        "b: the same-seed rerun trained another model under this key; not used"]
    checks = FR.same_seed_checks(records, {"experts": "7dbbd46", "same-seed": "caaf5bf"})
    assert [(c["key"], c["seed"], c["stage"], c["commit"], c["rerun_commit"], c["equal"]) for c in checks] == [
        ("a", 2, "experts", "7dbbd46", "caaf5bf", True), ("b", 2, "experts", "7dbbd46", "caaf5bf", False)]


def test_a_stage_report_is_published_to_the_readme_and_page_in_its_own_commit(tmp_path, capsys):
    """After a stage's report is committed, the benchmark rewrites what README.md and docs/benchmarks.md publish of
    it and commits those two files alone: a checkout never holds a record whose pages say something older (a stage
    report committed beside a README saying 'rate 9 of 10 runs' failed the page-is-the-record test). With either
    file edited and not committed, nothing is written and the command to publish is said."""
    from smlp_bench import budget_report as BR
    from smlp_bench import publish

    repo, root = Path(__file__).parents[1], tmp_path / "repo"
    shutil.copytree(repo / publish.FIGURE_DIR, root / publish.FIGURE_DIR)
    page = repo.joinpath(publish.PAGE).read_text()
    start, end = page.index(BR.DOCS_START) + len(BR.DOCS_START), page.index(BR.DOCS_END)
    root.joinpath(publish.PAGE).write_text(page[:start] + "\nSTALE\n" + page[end:])
    readme = repo.joinpath("README.md").read_text()
    stale = re.sub(r"(<!-- smlp-bench-readme-fair:start -->\n).*?(<!-- smlp-bench-readme-fair:end)",
                   r"\1STALE\n\2", readme, flags=re.S)
    assert stale != readme
    (root / "README.md").write_text(stale)
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@t"), _git(root, "config", "user.name", "t")
    _git(root, "add", "README.md", publish.PAGE)
    _git(root, "commit", "-q", "-m", "start")
    (root / "other.txt").write_text("someone's work in progress\n")
    _git(root, "add", "other.txt")
    out = root / publish.FIGURE_DIR / "fair-docs"
    # a record outside the repository's docs/benchmark/ is not published
    assert not fair.republish(tmp_path / "elsewhere", "rate", root=root)
    # an uncommitted edit of README: nothing written, nothing committed, the command said
    (root / "README.md").write_text(stale + "my note\n")
    assert not fair.republish(out, "rate", root=root)
    assert "uncommitted changes" in capsys.readouterr().out and (root / "README.md").read_text() == stale + "my note\n"
    assert _git(root, "log", "--format=%s").split("\n")[0] == "start"
    (root / "README.md").write_text(stale)
    assert fair.republish(out, "rate", root=root)
    assert (root / "README.md").read_text() == readme  # what publishing the committed record gives
    assert root.joinpath(publish.PAGE).read_text() == page
    assert _git(root, "log", "-1", "--format=%s").strip() == "fair benchmark: published after stage rate"
    assert sorted(_git(root, "show", "--name-only", "--format=", "HEAD").split()) == ["README.md", str(publish.PAGE)]
    assert _git(root, "diff", "--cached", "--name-only").split() == ["other.txt"]
