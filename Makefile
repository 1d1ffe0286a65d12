# One entry point for a fresh machine: `make test` creates .venv, installs, runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The suite in 2 pytest-xdist workers: multi-process tests wait on collectives, SLURM and timeouts, and the
# other worker's tests use that time (tests/conftest.py gives a worker a file's tests, and all SLURM tests).
TEST_WORKERS ?= 2

.PHONY: install demo lint test test-fast bench bench-quick gpu-check fair clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first (CPU wheel, pinned), then build fairseq and deepspeed against it without isolation.
	$(PY) -m pip install torch==2.13.0 cython==3.3.1 numpy==2.4.6 setuptools wheel
	$(PY) -m pip install --no-build-isolation -e '.[test,hf]'
	$(PY) -c "import torch, fairseq; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

# The main job: demo corpus -> sMLP tiny on 2 expert-parallel CPU workers -> zero-shot COPA/PIQA.
DEMO_ARGS ?=
demo: install
	$(VENV)/bin/smlp-demo $(DEMO_ARGS)

# ruff: lint and import order, configured in pyproject.toml ([tool.ruff]); .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# Benchmarks write figures (JSON, PNG, markdown) under results/; they are not tests.
BENCH_ARGS ?=
bench: install
	$(VENV)/bin/smlp-bench --output-dir results/bench $(BENCH_ARGS)

bench-quick: install
	$(VENV)/bin/smlp-bench --quick --output-dir results/bench-quick $(BENCH_ARGS)

# The GPU check (docs/gpu.md) on one CUDA GPU, or on the CPU with GPU_CHECK_ARGS=--dry-run. It needs a python with
# torch and numpy only, not the install (the accelerator machines have no fairseq): the project's packages resolve
# from this checkout, their installed names linked in build/gpu-check-path (smlp_bench -> benchmarks/, ...).
GPU_CHECK_ARGS ?=
GPU_PYTHON ?= $(or $(wildcard $(PY)),$(shell for p in $(PYTHON) python; do $$p -c 'import torch' >/dev/null 2>&1 && { echo $$p; break; }; done),$(PYTHON))
GPU_CHECK_PATH := build/gpu-check-path
gpu-check:
	mkdir -p $(GPU_CHECK_PATH)
	ln -sfn $(CURDIR)/benchmarks $(GPU_CHECK_PATH)/smlp_bench
	ln -sfn $(CURDIR)/eval $(GPU_CHECK_PATH)/smlp_eval
	ln -sfn $(CURDIR)/launch $(GPU_CHECK_PATH)/smlp_launch
	PYTHONPATH="$(CURDIR):$(CURDIR)/$(GPU_CHECK_PATH)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m smlp_bench.gpu_check $(GPU_CHECK_ARGS)

# The deciding comparison (docs/benchmarks.md): lr-sweep, deciding, experts, experts-seeds, smoe-experts, resumed
# where its committed store stopped; each finished run is committed. Each stage runs the code of the commit it started
# at, from a worktree under results/fair-work/code/ with this environment (benchmarks/pinned.py): commits to main
# never stop it.
# FAIR_ARGS="--stages width" adds the opt-in stage.
# FAIR_CORPUS=kernel-docs runs the comparison on the corpus read once (stores in docs/benchmark/fair-docs/).
FAIR_ARGS ?=
FAIR_CORPUS ?= demo
FAIR_STORES := $(if $(filter demo,$(FAIR_CORPUS)),docs/benchmark/fair/lr-sweep,docs/benchmark/fair-docs/rate)
fair: install
	$(VENV)/bin/smlp-bench --fair --corpus $(FAIR_CORPUS) --commit-store \
		$$(test -e $(FAIR_STORES)/runs.json && echo --resume) $(FAIR_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
