import sys
from pathlib import Path

import pytest

from loadtest.processes import ProcessGroup, StartupError, free_port, wait_ready


def test_child_starts_answers_and_is_stopped(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.stub_backend", str(port)]
    with ProcessGroup() as group:
        child = group.start("stub", argv, tmp_path / "stub.log")
        wait_ready([(child, [f"http://127.0.0.1:{port}/health"])], timeout_s=30)
        assert child.exited() is None
    assert child.exited() is not None  # stopped when the block was left


def test_children_are_stopped_when_the_block_fails(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.stub_backend", str(port)]
    with pytest.raises(RuntimeError), ProcessGroup() as group:
        child = group.start("stub", argv, tmp_path / "stub.log")
        wait_ready([(child, [f"http://127.0.0.1:{port}/health"])], timeout_s=30)
        raise RuntimeError("boom")
    assert child.exited() is not None


def test_a_child_that_dies_at_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('bad flag --frobnicate'); sys.exit(3)"]
    with ProcessGroup() as group:
        child = group.start("broken", argv, tmp_path / "broken.log")
        with pytest.raises(StartupError) as err:
            wait_ready([(child, ["http://127.0.0.1:9/health"])], timeout_s=30)
    assert "exited with status 3" in str(err.value) and "bad flag --frobnicate" in str(err.value)
