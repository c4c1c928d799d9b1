# Two commands matter: `make run` (tokengate on embedded defaults) and `make test` (the tests; the
# soak runs, whole stacks under load for seconds each, are `make test-soak`, which CI runs too).
# `make unit` is the developer's shortcut: lint, types and the tests not marked slow.
# `make compose-test` runs compose.yaml for real (a container engine; .ci/run runs it after `make test`),
# `make real-test` runs the gateway in front of real engines (.ci/run runs it too).
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?=

.PHONY: protos setup run test test-soak test-long lint typecheck unit demo bench clean deploy-tools compose-test real-test

setup:
	bash scripts/bootstrap.sh

run: setup
	$(BIN)/tokengate serve --log-format text $(if $(CONFIG),--config $(CONFIG),)

# gateway/extproc/wire_pb2.py(i) from wire.proto (the part of Envoy's ext_proc protocol tokengate speaks).
protos: setup
	$(BIN)/python -m pip install -q 'grpcio-tools>=1.85'
	$(BIN)/python -m grpc_tools.protoc -I gateway/extproc --python_out=gateway/extproc --pyi_out=gateway/extproc gateway/extproc/wire.proto

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: lint typecheck
	$(BIN)/pytest -q -m "not slow and not soak"

test: lint typecheck deploy-tools
	$(BIN)/pytest -q -m "not soak"

# Whole stacks under load, a benchmark harness or a browser for seconds each (marker `soak`): what
# `make test` leaves out to stay quick; CI runs them after it.
test-soak: setup deploy-tools
	$(BIN)/pytest -q -m soak

# The exploration: property tests with fresh random seeds and ten times the examples, exhaustive
# tests over a wider scope (tests/support.py, LONG), the soak runs too. `make test` runs the same
# examples every time.
test-long: lint typecheck deploy-tools
	TOKENGATE_TEST_LONG=1 $(BIN)/pytest -q

# podman (or docker) + podman-compose for `compose config`, kubectl for `kubectl kustomize`.
deploy-tools: setup
	bash scripts/container_setup.sh --tools-only

# Builds the images, brings compose.yaml up, tests it, tears it down (~1 min with the images
# cached, ~4 min on a fresh machine). scripts/container_setup.sh sets up Podman where no Docker runs.
compose-test: setup
	bash scripts/container_setup.sh
	TOKENGATE_COMPOSE_TEST=1 $(BIN)/pytest -q -s -m compose tests/deploy

# tokengate in front of real third-party engines (tests/engines: llama.cpp's server and vLLM's CPU
# build), each from its own venv under .real/ (scripts/real_engines_setup.sh: a cold machine builds
# llama-cpp-python once, ~10 min, and installs vLLM, ~2.5 min; warm, seconds).
real-test: setup
	bash scripts/real_engines_setup.sh
	TOKENGATE_REAL_TEST=1 $(BIN)/pytest -q -m engine tests/engines

demo: setup
	$(BIN)/tokengate demo

bench: setup
	$(BIN)/python -m loadtest.bench.overhead

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
