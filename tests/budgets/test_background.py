"""budgets.background.BackgroundTask: the one start/stop helper of every background loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from budgets.background import BackgroundTask
from tests.budgets.support import eventually

log = logging.getLogger("tests.background")


async def test_stop_cancels_the_body_and_returns_once_it_has_ended() -> None:
    ran, ended = asyncio.Event(), asyncio.Event()

    async def body() -> None:
        ran.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    task = BackgroundTask("t", body, log)
    task.start()
    await ran.wait()
    assert task.running
    await task.stop()
    assert ended.is_set() and not task.running


async def test_start_while_running_keeps_one_task_and_stop_is_idempotent() -> None:
    starts = 0

    async def body() -> None:
        nonlocal starts
        starts += 1
        await asyncio.Event().wait()

    task = BackgroundTask("t", body, log)
    await task.stop()  # never started: nothing to do
    task.start()
    task.start()
    await eventually(lambda: starts > 0)
    await asyncio.sleep(0)
    assert starts == 1
    await task.stop()
    await task.stop()
    assert not task.running


async def test_a_body_that_crashes_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        raise RuntimeError("boom")

    task = BackgroundTask("crashy", body, log)
    with caplog.at_level(logging.ERROR, logger="tests.background"):
        task.start()
        await eventually(lambda: not task.running)
        await eventually(lambda: bool(caplog.records))
    (record,) = caplog.records
    assert "crashy died" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    await task.stop()  # the crash was logged once; stopping does not raise it again


async def test_a_body_that_returns_unasked_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        return None

    task = BackgroundTask("quitter", body, log)
    with caplog.at_level(logging.ERROR, logger="tests.background"):
        task.start()
        await eventually(lambda: bool(caplog.records))
    assert "quitter ended on its own" in caplog.records[0].getMessage()


async def test_stopping_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        await asyncio.Event().wait()

    task = BackgroundTask("quiet", body, log)
    with caplog.at_level(logging.DEBUG, logger="tests.background"):
        task.start()
        await asyncio.sleep(0)
        await task.stop()
    assert caplog.records == []


async def test_a_crashed_body_can_be_started_again() -> None:
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("first run fails")
        await asyncio.Event().wait()

    task = BackgroundTask("again", body, log)
    task.start()
    await eventually(lambda: runs == 1 and not task.running)
    task.start()
    await eventually(lambda: runs == 2)
    assert task.running
    await task.stop()


async def test_a_caller_cancelled_while_stopping_stays_cancelled() -> None:
    # A body that needs time to wind down; the caller of stop() is cancelled meanwhile. Awaiting the
    # task under suppress(CancelledError) would swallow the caller's own cancellation.
    winding_down, release = asyncio.Event(), asyncio.Event()

    async def body() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            winding_down.set()
            await release.wait()
            raise

    task = BackgroundTask("slow", body, log)
    task.start()
    await asyncio.sleep(0)
    stopper = asyncio.create_task(task.stop())
    await winding_down.wait()
    stopper.cancel()
    await asyncio.wait((stopper,))
    assert stopper.cancelled()
    release.set()
