# Two entry points for people: `make synth` (plan + synthesize the default environment) and `make test`.
# Everything else is set up on demand from this repository's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENV ?= dev

.PHONY: synth test lint typecheck unit bench clean

$(BIN)/kvfleet: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

venv: $(BIN)/kvfleet

synth: $(BIN)/kvfleet
	$(BIN)/kvfleet plan environments/$(ENV).yaml

lint: $(BIN)/kvfleet
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/kvfleet
	$(BIN)/mypy sizing stacks

unit: $(BIN)/kvfleet
	$(BIN)/pytest -q

test: lint typecheck unit

bench: $(BIN)/kvfleet
	$(BIN)/pytest benchmarks --benchmark-only --benchmark-enable -p no:cacheprovider
	$(BIN)/python benchmarks/cli_startup.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache cdk.out
