# Two commands matter: `make run` (tokengate on embedded defaults) and `make test` (everything).
# `make unit` is the developer's shortcut: lint, types and the tests not marked slow.
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?=

.PHONY: setup run test lint typecheck unit demo bench clean

setup:
	bash scripts/bootstrap.sh

run: setup
	$(BIN)/tokengate serve --log-format text $(if $(CONFIG),--config $(CONFIG),)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: lint typecheck
	$(BIN)/pytest -q -m "not slow"

test: lint typecheck
	$(BIN)/pytest -q

demo: setup
	$(BIN)/tokengate demo

bench: setup
	$(BIN)/python -m loadtest.bench.overhead

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
