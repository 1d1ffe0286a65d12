"""The GPU check's dry run on the CPU (benchmarks/gpu_check.py, docs/gpu.md): the program that a lent GPU
runs must not rot where no GPU is.

- `--dry-run` (in this process) passes, lists its checks and writes a record of the right shape: every check
  with its status and figures, the device and versions, the modules it ran; the summary table beside it.
- What each check measured is there: the fp32 comparison's differences and bounds, autocast's dtypes, the
  auction's host reads and its agreement with the CPU, the host syncs of a step against the CPU counter and the
  budget, and the speed harness's words/s, MFU and step times.
- A planted fault (one device weight off by 1e-3 of itself) fails the fp32 comparison of every family and the
  program exits 1; a check that raises fails alone and the others still run; no GPU without --dry-run exits 2.
- `make gpu-check` runs it from the checkout, with the project not installed and fairseq (and the other
  packages the accelerator machines lack) unimportable.
- The fp32 comparison's bound is tests/tolerance.py's rule.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smlp_bench import gpu_check, gpu_support
from tolerance import order_tolerance

REPO = Path(__file__).resolve().parents[1]
RECORD_KEYS = {"question", "dry_run", "device", "machine", "versions", "started_utc", "modules", "seconds", "sizes",
               "checks", "failed", "passed"}
CHECK_KEYS = {"status", "seconds", "failures", "skipped", "summary", "figures"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    rc = gpu_check.main(["--dry-run", "--output-dir", str(out)])
    return rc, json.loads((out / gpu_check.RECORD).read_text()), out


def test_the_dry_run_passes_and_writes_a_record_of_every_check(dry_run):
    rc, record, out = dry_run
    assert rc == 0, {k: v["failures"] for k, v in record["checks"].items()}
    assert set(record) == RECORD_KEYS
    assert record["dry_run"] is True and record["passed"] is True and record["failed"] == []
    assert record["device"]["type"] == "cpu" and record["versions"]["torch"] == torch.__version__
    assert list(record["checks"]) == list(gpu_check.CHECKS)
    for name, check in record["checks"].items():
        assert set(check) == CHECK_KEYS, name
        assert check["status"] == "passed" and check["failures"] == [] and check["seconds"] >= 0, name
        assert check["summary"] and not check["summary"].startswith("(no summary"), name
    assert record["sizes"]["families"] == list(gpu_check.DRY_RUN_FAMILIES)
    for name in ("fp32", "autocast", "host-syncs"):
        figures = " ".join(record["checks"][name]["figures"])
        assert all(f in figures for f in gpu_check.DRY_RUN_FAMILIES), (name, figures)
    assert record["modules"]["smlp"] == str(REPO / "smlp")
    table = (out / gpu_check.TABLE).read_text()
    assert "[dry run]" in table and all(f"| {name} | passed |" in table for name in record["checks"])


def test_the_checks_measured_what_they_claim(dry_run):
    _, record, _ = dry_run
    checks = {k: v["figures"] for k, v in record["checks"].items()}
    auctions = {k: f for k, f in checks["host-syncs"].items() if k.startswith("auction ")}
    assert len(auctions) == 3
    for shape, f in auctions.items():  # one read per auction call; E = 2 needs none
        assert f["same_experts"] and f["as_every_round_checks"] and f["price_max_difference"] <= 1e-6, shape
        assert f["host_reads"] == (0 if shape.endswith("x2") else 1) and f["median_ms"] > 0, shape
    for family, f in checks["fp32"].items():
        assert all(0 <= f[k]["max_difference"] <= f[k]["bound"] and f[k]["bound"] > 0
                   for k in ("logits", "loss", "gradients")), family
    # one sparse layer: the sMoE's and the tMoE's auctions made on the CPU and replayed on the device
    assert checks["fp32"]["sMLP-partial"]["routing_replayed"] == 2 and checks["fp32"]["GShard"]["routing_replayed"] == 0
    for case, f in checks["autocast"].items():
        assert f["logits_dtype"] in ("torch.bfloat16", "torch.float16") and len(f["losses"]) == 2, case
        assert f["router_logits"] == ["torch.float32"], case
    syncs = checks["host-syncs"]
    assert syncs["control"]["count"] == 1
    for family in gpu_check.DRY_RUN_FAMILIES:
        f = syncs[family]
        assert f["forward"]["count"] == f["forward"]["cpu_counter"] and f["backward"]["count"] == 0, family
        assert f["forward"]["limit"] is None or f["forward"]["count"] <= f["forward"]["limit"], family
    assert syncs["sMLP-det"]["forward"]["count"] == 2  # one sparse layer: its auction's check and split sizes


def test_the_timing_harness_produced_numbers(dry_run):
    _, record, _ = dry_run
    speed = record["checks"]["speed"]["figures"]
    assert speed["matmul_flops_per_s"]["bf16"] > 0 and speed["matmul_flops_per_s"]["fp32"] > 0
    for config in ("fair", "gpu-sized"):
        models = {k: v for k, v in speed[config].items() if not k.startswith("_")}
        assert set(models) == {"sMLP-det", "gMLP", "Switch"}
        for name, f in models.items():
            assert f["words_per_s"] > 0 and f["median_step_ms"] > 0 and f["steps_timed"] >= 2, (config, name)
            assert f["train_flops_per_token"] > 0 and 0 < f["mfu"] and f["params"] > 0, (config, name)
            assert f["peak_memory_gib"] is None  # CUDA only
    assert speed["gpu-sized"]["_config"]["dtype"] == "torch.bfloat16"
    assert speed["fair"]["_config"]["dtype"] == "torch.float32"


def test_the_real_configurations_are_the_fair_one_and_a_gpu_sized_one():
    fair, gpu = gpu_support.speed_configs(dry_run=False)
    assert (fair.d_model, fair.d_ffn, fair.seq_len, fair.dense, fair.sparse, fair.experts) == (128, 512, 128, 9, 3, 8)
    assert (gpu.d_model, gpu.seq_len, gpu.experts, gpu.dtype) == (1024, 512, 8, torch.bfloat16)
    layers = {k: (c.dense_layers, c.sparse_layers) for k, c in gpu_support.speed_models(fair).items()}
    assert layers == {"sMLP-det": (9, 3), "gMLP": (12, 0), "Transformer": (7, 0), "Switch": (4, 3),
                      "GShard": (3, 3), "Base": (4, 3), "HASH": (4, 3)}  # the fair benchmark's table


def test_a_planted_fault_fails_every_family_and_exits_non_zero(tmp_path):
    rc = gpu_check.main(["--dry-run", "--output-dir", str(tmp_path), "--only", "fp32", "--plant-fault"])
    record = json.loads((tmp_path / gpu_check.RECORD).read_text())
    assert rc == 1 and record["failed"] == ["fp32"] and record["passed"] is False
    failures = record["checks"]["fp32"]["failures"]
    for family in gpu_check.DRY_RUN_FAMILIES:
        assert any(f.startswith(f"{family}: logits differ") for f in failures), family


def test_a_check_that_raises_fails_alone(tmp_path, monkeypatch):
    def broken(run):
        raise RuntimeError("planted")

    monkeypatch.setitem(gpu_check.RUNNERS, "autocast", broken)
    rc = gpu_check.main(["--dry-run", "--output-dir", str(tmp_path), "--only", "fp32,autocast"])
    record = json.loads((tmp_path / gpu_check.RECORD).read_text())
    assert rc == 1 and record["failed"] == ["autocast"]
    assert record["checks"]["autocast"]["failures"] == ["error: RuntimeError: planted"]
    assert record["checks"]["fp32"]["status"] == "passed"


def test_without_a_gpu_only_the_dry_run_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output-dir", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "no-such-check"])


def test_make_gpu_check_runs_uninstalled_and_without_fairseq(tmp_path):
    """As on an accelerator machine: the project's installed packages and fairseq (with the other packages those
    machines lack) are hidden by a sitecustomize; the Makefile's shim finds the packages in the checkout."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "HIDDEN = ('fairseq', 'fairseq_plugins', 'fvcore', 'deepspeed', 'fairscale', 'scipy', 'matplotlib', "
        "'pyarrow', 'lm_eval')\n"
        "class Hidden:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]\n"
        "sys.meta_path.insert(0, Hidden())\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}",
                          f"GPU_CHECK_ARGS=--dry-run --output-dir {out} --only host-syncs"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads((out / gpu_check.RECORD).read_text())
    assert record["passed"] and list(record["checks"]) == ["host-syncs"]
    assert record["modules"]["smlp_bench"].endswith("build/gpu-check-path/smlp_bench")  # not the installed one
    assert "| host-syncs | passed |" in res.stdout


def test_the_fp32_bound_is_the_suites_rounding_rule():
    x = torch.randn(5, 7) * 3
    assert gpu_support.rounding_bound(x, 64, 5) == pytest.approx(order_tolerance(x, reduction=64, depth=5))
    assert gpu_support.rounding_bound(x, 9, 2, scale=2.0) == pytest.approx(
        order_tolerance(x, reduction=9, depth=2, scale=2.0))
