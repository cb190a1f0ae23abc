# Fresh machine: `make demo` trains the demo model; `make test` runs the test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench clean

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

# One pytest worker per core (pytest-xdist): most tests are one process and would leave a core
# idle; the multi-rank tests' ranks share the cores either way. worksteal: an idle worker takes
# tests queued on the other, so the long tests at the end of a file do not leave a core idle.
test: lint
	$(BIN)/pytest -q --durations=15 -n auto --dist worksteal

lint: $(BIN)/tetrad
	$(BIN)/ruff format --check tetrad tests benchmarks
	$(BIN)/ruff check tetrad tests benchmarks

clean:
	rm -rf $(VENV) runs *.egg-info
