from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from loadtest.stub_backend import StubBackend, StubConfig

StubFactory = Callable[..., Coroutine[Any, Any, StubBackend]]


@pytest.fixture
async def stub_factory() -> AsyncIterator[StubFactory]:
    """Starts stub OpenAI backends on free ports (real sockets); all closed at the end of the test."""
    started: list[StubBackend] = []

    async def make(**config: Any) -> StubBackend:
        stub = await StubBackend(StubConfig(**config)).start()
        started.append(stub)
        return stub

    yield make
    for stub in started:
        await stub.close()
