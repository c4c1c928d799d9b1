"""tests/deploy: the container images, compose.yaml, the Kubernetes overlays and the examples.

The tests marked ``compose`` build the images and run the whole stack with a container engine;
they take minutes, so ``make test`` leaves them out and ``make compose-test`` (run by .ci/run after
``make test``) runs them. Everything else here is fast and runs in ``make test``.
"""

from __future__ import annotations

import os

import pytest

COMPOSE_ENV = "TOKENGATE_COMPOSE_TEST"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "compose: runs compose.yaml with a container engine (make compose-test)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(COMPOSE_ENV) == "1":
        return
    keep = [i for i in items if i.get_closest_marker("compose") is None]
    dropped = [i for i in items if i.get_closest_marker("compose") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
