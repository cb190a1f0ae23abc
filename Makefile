# Fresh machine: `make demo` trains the demo model; `make test` runs the test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/tetrad: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/tetrad
	rm -rf runs/demo  # the demo starts over (tetrad train refuses to overwrite a run)
	$(BIN)/tetrad train --run-dir runs/demo --tensorboard
	$(BIN)/tetrad generate runs/demo --prompt "def " --max-new-tokens 120

test: lint
	$(BIN)/pytest -q --durations=15

lint: $(BIN)/tetrad
	$(BIN)/ruff format --check tetrad tests benchmarks
	$(BIN)/ruff check tetrad tests benchmarks

clean:
	rm -rf $(VENV) runs *.egg-info
