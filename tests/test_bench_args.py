"""smlp-bench tried with a new user's mistakes (issue 53): every command that works (preset, experiment, fair, speed,
chaos, breakdown, gpu-check) checks its arguments before any work: the one line `smlp-bench: error: ...` on stderr
comes before the demo corpus is built, before any folder is made and before any model is planned or run. In this
process, with the work itself replaced by a stand-in that fails the test if it is reached."""
from __future__ import annotations

import pytest

import smlp_launch.data
from smlp_bench import cli, gpu_check
from smlp_bench.micro import step_breakdown

# argv, what the line must say (the offending value, and what is valid where there is a list)
BAD = [
    (["chaos", "--kills", "-1"], "--kills -1: give at least 1"),
    (["chaos", "--updates", "6", "--save-every", "4"], "--updates 6 --save-every 4"),
    (["speed", "--models", "nope"], "--models: unknown nope; valid: smlp_det, smlp_det_expert"),
    (["speed", "--code", "deadbeef"], "commit deadbeef is not in the repository"),
    (["speed", "--widths", "0"], "--widths 0: give positive integers"),
    (["speed", "--widths", "128,100"], "100 is not a multiple of the 8 experts"),
    (["speed", "--rounds", "0"], "--seeds 0: give at least 1"),
    (["speed", "--updates", "3"], "--updates 3: a run needs at least"),
    (["speed", "--nproc", "0,2"], "--nproc 0,2: give positive integers"),
    (["speed", "--before", "b.json"], "--before BEFORE_JSON goes with --publish"),
    (["fair", "--stages", "nope"], "--stages: unknown nope; valid: lr-sweep, deciding"),
    (["fair", "--nproc", "0"], "--nproc 0"),
    (["preset", "--models", "nope"], "--models: unknown nope; valid: smlp_det, smlp_partial"),
    (["preset", "--seeds", "0"], "--seeds 0: give at least 1"),
    (["preset", "--quick", "--updates", "3"], "--updates 3: give at least 16"),
    (["preset", "--nproc", "1"], "--nproc 1: expert parallelism needs at least 2 ranks"),
    (["preset", "--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    (["preset", "--data", "nowhere"], "--data nowhere is not a fairseq data-bin"),
    (["experiment", "figure7-routing", "--nproc", "1"], "--nproc 1"),
    (["experiment", "nope"], "invalid choice: 'nope'"),
    (["breakdown", "--families", "nope"], "--families: unknown nope; valid: smlp_det, gmlp"),
    (["breakdown", "--steps", "0"], "--steps 0: give at least 1"),
    (["breakdown", "--ranks", "0"], "--ranks 0: give positive integers"),
    (["gpu-check", "--only", "nope"], "--only: unknown nope; valid: fp32"),
    (["gpu-check", "--time-budget", "0"], "--time-budget 0"),
]


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_refused_in_one_line_before_any_work(argv, says, tmp_path, monkeypatch, capsys):
    def work(*args, **kwargs):
        raise AssertionError(f"smlp-bench {' '.join(argv)}: work began before its arguments were checked")

    monkeypatch.chdir(tmp_path)  # the commands' default folders (results/...) are relative: none may appear
    monkeypatch.setattr(smlp_launch.data, "prepare_data", work)  # the demo corpus (training.prepare)
    monkeypatch.setattr(step_breakdown, "configs", work)  # the breakdown's models
    monkeypatch.setattr(gpu_check, "_checks", work)
    out = ["--out", str(tmp_path / "out" / "record.json")] if argv[0] == "breakdown" else \
        ["--output-dir", str(tmp_path / "out")]
    try:
        rc = cli.main([*argv, *out])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    captured = capsys.readouterr()
    assert rc in (1, 2), captured
    assert captured.err.startswith("smlp-bench: error: ") and captured.err.count("\n") == 1, captured.err
    assert says in captured.err, captured.err
    assert not captured.out and not list(tmp_path.iterdir())
    if "--code" in argv:  # the speed command pins no stage: its --code is a commit to run the models from
        assert "(--code COMMIT)" in captured.err and "resum" not in captured.err and "stage" not in captured.err


def test_a_started_measurement_is_continued_only_with_resume(tmp_path, monkeypatch, capsys):
    """The store checks come before the work too: a speed measurement's folder holding a started side without
    --resume, and --resume where nothing was started, are refused at once (before: after the corpus was built)."""
    def work(*args, **kwargs):
        raise AssertionError("work began before the arguments were checked")

    monkeypatch.setattr(smlp_launch.data, "prepare_data", work)
    out = tmp_path / "speed"
    assert cli.main(["speed", "--output-dir", str(out), "--resume"]) == 1
    assert "--resume: no measurement" in capsys.readouterr().err and not out.exists()
    for side, widths in (("nproc2", "128"), ("d256/nproc2", "128,256")):  # one width; several: a folder each
        (out / side).mkdir(parents=True)
        (out / side / "runs.json").write_text("{}")
        assert cli.main(["speed", "--output-dir", str(out), "--widths", widths]) == 1
        assert f"holds a started benchmark ({side}/runs.json); pass --resume" in capsys.readouterr().err
