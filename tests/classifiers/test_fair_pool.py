"""FairPool: threads shared fairly among keys (classifiers.fair_pool's rule).

Each test runs one thread whose first job waits on a gate, so every later submission is queued
before anything else runs: the order jobs then run in is the rule's alone, not the scheduler's.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from classifiers.fair_pool import FairPool

WAIT = 10.0


class Recorder:
    """Jobs are labels; running one records it (the first, ``"gate"``, waits to be let go)."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self._lock = threading.Lock()

    def run(self, label: str) -> str:
        if label == "gate":
            self.started.set()
            assert self.gate.wait(WAIT)
        else:
            with self._lock:
                self.order.append(label)
        return label.upper()


@pytest.fixture
def pool() -> Iterator[FairPool]:
    p = FairPool(1, name="test-fair")
    yield p
    p.shutdown()


def blocked(pool: FairPool, rec: Recorder) -> concurrent.futures.Future[list[str]]:
    """Occupy the pool's one thread until ``rec.gate`` is set."""
    future = pool.submit("gate", rec.run, ["gate"], [1])
    assert rec.started.wait(WAIT)
    return future


def submit(
    pool: FairPool, rec: Recorder, key: str, labels: list[str], weight: int = 10
) -> concurrent.futures.Future[list[str]]:
    return pool.submit(key, rec.run, labels, [weight] * len(labels))


def test_a_newcomers_job_runs_next_not_after_a_backlogged_tenants_queue(pool: FairPool) -> None:
    rec = Recorder()
    blocked(pool, rec)
    flood = [submit(pool, rec, "a", [f"a{i}.{j}" for j in range(3)]) for i in range(4)]
    late = submit(pool, rec, "b", ["b0"])
    rec.gate.set()
    assert late.result(WAIT) == ["B0"]
    for f in flood:
        f.result(WAIT)
    # b waited for one of a's jobs (a was backlogged first, at the same virtual time), not twelve
    assert rec.order.index("b0") == 1
    assert [x for x in rec.order if x.startswith("a")] == [f"a{i}.{j}" for i in range(4) for j in range(3)]


def test_backlogged_keys_share_the_threads_by_weight_not_by_request_count(pool: FairPool) -> None:
    rec = Recorder()
    blocked(pool, rec)
    submit(pool, rec, "heavy", [f"h{i}" for i in range(4)], weight=30)
    light = [submit(pool, rec, "light", [f"l{i}"], weight=10) for i in range(8)]
    rec.gate.set()
    for f in light:
        f.result(WAIT)
    # per 30 characters handed to heavy, light gets three jobs of 10
    assert rec.order[:8] == ["h0", "l0", "l1", "l2", "h1", "l3", "l4", "l5"]


def test_an_idle_tenant_banks_no_credit_while_it_is_away(pool: FairPool) -> None:
    rec = Recorder()
    # "early" runs alone for a while: ten jobs, its tag far ahead of a key that was never seen
    submit(pool, rec, "early", [f"e{i}" for i in range(10)]).result(WAIT)
    blocked(pool, rec)
    submit(pool, rec, "busy", [f"x{i}" for i in range(4)])
    back = submit(pool, rec, "early", [f"r{i}" for i in range(4)])
    rec.gate.set()
    back.result(WAIT)
    # "early" comes back at the pool's virtual time: it alternates with busy, no run of its own
    assert rec.order[10:] == ["x0", "r0", "x1", "r1", "x2", "r2", "x3", "r3"]


def test_a_keys_batches_run_in_arrival_order_and_results_come_back_in_job_order(pool: FairPool) -> None:
    rec = Recorder()
    blocked(pool, rec)
    first = submit(pool, rec, "a", ["p", "q"])
    second = submit(pool, rec, "a", ["r"])
    rec.gate.set()
    assert first.result(WAIT) == ["P", "Q"]
    assert second.result(WAIT) == ["R"]
    assert rec.order == ["p", "q", "r"]


def test_a_cancelled_batch_drops_the_jobs_it_has_not_started(pool: FairPool) -> None:
    rec = Recorder()
    blocked(pool, rec)
    gone = submit(pool, rec, "a", ["a0", "a1", "a2"])
    kept = submit(pool, rec, "b", ["b0"])
    assert gone.cancel()
    rec.gate.set()
    assert kept.result(WAIT) == ["B0"]
    assert rec.order == ["b0"]
    assert pool.backlog() == {}


def test_a_job_that_raises_fails_its_batch_and_no_other() -> None:
    pool = FairPool(1)
    ran: list[int] = []

    def job(n: int) -> int:
        ran.append(n)
        if n == 1:
            raise ValueError("bad text")
        return n

    try:
        failing = pool.submit("a", job, [0, 1, 2], [1, 1, 1])
        with pytest.raises(ValueError, match="bad text"):
            failing.result(WAIT)
        assert pool.submit("b", job, [5], [1]).result(WAIT) == [5]
        assert 2 not in ran  # the failed batch's later jobs are moot, not run
    finally:
        pool.shutdown()


def test_backlog_counts_the_characters_waiting_per_tenant(pool: FairPool) -> None:
    rec = Recorder()
    blocked(pool, rec)
    submit(pool, rec, "a", ["a0", "a1"], weight=7)
    submit(pool, rec, "b", ["b0"], weight=5)
    assert pool.backlog() == {"a": 14, "b": 5}
    rec.gate.set()


def test_shutdown_cancels_what_waits_and_lets_the_running_job_finish() -> None:
    pool = FairPool(1)
    rec = Recorder()
    running = blocked(pool, rec)
    waiting = submit(pool, rec, "a", ["a0"])
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    assert waiting.cancelled() or not waiting.done()
    rec.gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive()
    assert running.result(0) == ["GATE"]
    assert waiting.cancelled()
    assert rec.order == []
    with pytest.raises(RuntimeError, match="shut down"):
        submit(pool, rec, "a", ["late"])
    pool.shutdown()  # idempotent


def test_threads_start_on_demand_up_to_the_size_and_run_concurrently() -> None:
    pool = FairPool(2, name="test-fair-two")
    both = threading.Barrier(2, timeout=WAIT)
    run: Callable[[int], int] = lambda n: (both.wait(), n)[1]  # noqa: E731  # each waits for the other
    try:
        assert pool.submit("a", run, [1, 2], [1, 1]).result(WAIT) == [1, 2]
    finally:
        pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-fair-two")]


def test_an_empty_batch_is_done_at_once_and_weights_must_match_jobs(pool: FairPool) -> None:
    assert pool.submit("a", str, [], []).result(0) == []
    with pytest.raises(ValueError, match="one weight per job"):
        pool.submit("a", str, [1, 2], [1])
    with pytest.raises(ValueError, match="at least 1"):
        FairPool(0)


def test_under_many_keys_and_cancellations_every_kept_batch_completes_and_nothing_is_left() -> None:
    import random

    rng = random.Random(5)
    pool = FairPool(4, name="test-fair-stress")
    try:
        batches: list[tuple[list[int], concurrent.futures.Future[list[int]]]] = []
        for _ in range(400):
            jobs = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
            future = pool.submit(
                f"k{rng.randrange(50)}", lambda n: n * 2, jobs, [rng.randrange(1, 100) for _ in jobs]
            )
            batches.append((jobs, future))
            if rng.random() < 0.2:
                future.cancel()
        for jobs, future in batches:
            if future.cancelled():
                continue
            assert future.result(WAIT) == [n * 2 for n in jobs]
        assert pool.backlog() == {}
        # Every key's entry goes once it has nothing waiting or running (a thread settles a batch's
        # future a moment before it marks the job done).
        deadline = time.monotonic() + WAIT
        while pool._keys and time.monotonic() < deadline:
            time.sleep(0.01)
        with pool._cond:
            assert pool._keys == {} and pool._ready == []
    finally:
        pool.shutdown()
