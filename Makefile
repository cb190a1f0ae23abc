# Fresh machine: `make demo` trains the demo model; `make test` runs the test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-torch-min lint bench clean

$(BIN)/tetrad: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# --no-compile: no bytecode for every installed module up front (torch and transformers hold
	# thousands); Python writes it for the modules a process imports, on first import
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $@

demo: $(BIN)/tetrad
	rm -rf runs/demo  # the demo starts over (tetrad train refuses to overwrite a run)
	$(BIN)/tetrad train --run-dir runs/demo --tensorboard
	$(BIN)/tetrad generate runs/demo --prompt "def " --max-new-tokens 120

# Bytecode: the install writes none (--no-compile), so each test process would compile torch's
# modules from source again wherever the environment sets PYTHONDONTWRITEBYTECODE (a fresh clone's
# suite then spent 3.1 s instead of 1.7 s on every `import torch, tetrad`, in every process). An
# empty value lets Python write the .pyc of the modules the tests import, once, into .venv.
test test-torch-min: export PYTHONDONTWRITEBYTECODE :=

# One pytest worker per core (pytest-xdist): most tests are one process and would leave a core
# idle; the multi-rank tests' ranks share the cores either way. worksteal: an idle worker takes
# tests queued on the other, so the long tests at the end of a file do not leave a core idle.
test: lint
	$(BIN)/pytest -q --durations=15 -n auto --dist worksteal

# The tests of the private torch APIs (tetrad/torch_private.py and the pipeline stages built on
# them) on the lowest torch pyproject.toml admits, the GPU images' 2.11, in a second environment.
# torch 2.11 for CPUs alone is not in the default package index: pip takes the CUDA build (about
# 4.6 GB with its libraries), which runs these tests on the CPU as well.
TORCH_MIN := 2.11.0
MIN_TESTS := tests/test_torch_private.py tests/test_pipeline.py tests/test_pipeline_memory.py \
	tests/test_masters.py tests/test_zero.py
test-torch-min:
	$(PYTHON) -m venv .venv-min
	.venv-min/bin/pip install --quiet --no-compile torch==$(TORCH_MIN)
	.venv-min/bin/pip install --quiet --no-compile -e '.[dev]'
	.venv-min/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH_MIN)')"
	.venv-min/bin/pytest -q -n auto $(MIN_TESTS)

lint: $(BIN)/tetrad
	$(BIN)/ruff format --check tetrad tests benchmarks
	$(BIN)/ruff check tetrad tests benchmarks

clean:
	rm -rf $(VENV) .venv-min runs *.egg-info
