# Quick start: `make run` (every service on the embedded default) and `make test` (everything CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install run test check-generated lint typecheck pytest generate bench bench-registry bench-datastore bench-console

# Running the services needs the runtime dependencies only; the tests and checks add the dev ones.
$(BIN)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(BIN)/.installed: $(BIN)/.runtime
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

# `make run ARGS='--directory="--port 9105"'` passes flags on (see `cogment-aux services all --help`).
run: $(BIN)/.runtime
	$(BIN)/cogment-aux services all $(ARGS)

test: install check-generated lint typecheck pytest

check-generated: install
	$(BIN)/python -m shared.protos.generate --check
	$(BIN)/python -m deploy.dashboards --check

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy shared services bench deploy

pytest: install
	$(BIN)/python -m pytest -q

generate: install
	$(BIN)/python -m shared.protos.generate
	$(BIN)/python -m deploy.dashboards

bench: install
	$(BIN)/python bench/directory.py

bench-registry: install
	$(BIN)/python bench/model_registry.py

bench-datastore: install
	$(BIN)/python bench/datastore.py

bench-console: install
	$(BIN)/python bench/console.py
