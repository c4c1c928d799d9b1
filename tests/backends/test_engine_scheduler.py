"""Scheduler behaviour on the simulated executor and a virtual clock (no torch, no HTTP)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from backends.engine.kv_cache import BlockManager
from backends.engine.request import EngineRequest, RequestStatus
from backends.engine.scheduler import Scheduler, SchedulerConfig
from backends.engine.types import SamplingParams
from tests.backends.conftest import SimRig, make_sim_rig, prompt
from tests.backends.support import RigFactory, req, salt
from tests.support import examples


def test_running_requests_are_served_before_waiting_ones(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=64, max_model_len=512)
    rig.engine.add_request(req("a", 40, 8))
    rig.step()  # a: prefill 40, first token
    rig.engine.add_request(req("b", 100, 8))
    plan = rig.engine.schedule().plan
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert len(plan.seqs[0].token_ids) == 1  # a decodes
    assert len(plan.seqs[1].token_ids) == 63  # b gets the rest of the budget as a chunk
    assert plan.num_tokens == 64


def test_decodes_and_prefill_chunks_share_a_step_with_chunk_cap(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=512, long_prefill_token_threshold=64, max_model_len=1024)
    rig.engine.add_request(req("short", 10, 50))
    rig.step()
    rig.engine.add_request(req("long", 900, 4))
    chunks: list[int] = []
    while True:
        sched = rig.engine.schedule()
        by_id = {s.request_id: s for s in sched.plan.seqs}
        assert len(by_id["short"].token_ids) == 1  # the decode is in every step
        chunks.append(len(by_id["long"].token_ids))
        result = rig.executor.execute(sched.plan)
        rig.engine.finish_step(sched, result)
        if by_id["long"].sample:
            break
    assert chunks == [64] * 14 + [900 - 64 * 14]


def test_chunked_prefill_off_prefills_whole_prompt_in_one_step(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    rig.engine.add_request(req("short", 10, 50))
    rig.step()
    rig.engine.add_request(req("long", 900, 4))
    plan = rig.engine.schedule().plan
    by_id = {s.request_id: s for s in plan.seqs}
    assert len(by_id["long"].token_ids) == 900
    assert by_id["long"].sample
    assert len(by_id["short"].token_ids) == 1


def test_chunked_prefill_off_head_waits_for_a_step_with_room(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    for i in range(4):
        rig.engine.add_request(req(f"d{i}", 10, 100))
    rig.step()
    rig.engine.add_request(req("long", 1021, 1))  # needs 1021 tokens; 4 decodes leave 1020
    rig.engine.add_request(req("small", 5, 1))  # FCFS: stuck behind the head
    plan = rig.engine.schedule().plan
    assert {s.request_id for s in plan.seqs} == {"d0", "d1", "d2", "d3"}


def test_max_num_seqs_caps_the_batch(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_seqs=3)
    for i in range(5):
        rig.engine.add_request(req(f"r{i}", 8, 4))
    plan = rig.engine.schedule().plan
    assert len(plan.seqs) == 3
    assert rig.scheduler.num_waiting == 2


def test_priority_policy_runs_lower_value_first_then_arrival(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_seqs=1, policy="priority")
    for rid, prio in [("p3", 3), ("p1a", 1), ("p2", 2), ("p1b", 1), ("p0", 0)]:
        rig.engine.add_request(req(rid, 8, 2, priority=prio))
    finished: list[str] = []
    while rig.engine.has_unfinished():
        finished += [o.request_id for o in rig.step() if o.finished]
    assert finished == ["p0", "p1a", "p1b", "p2", "p3"]


def test_fcfs_rejects_nonzero_priority(sim_rig: RigFactory) -> None:
    rig = sim_rig()
    with pytest.raises(ValueError, match="priority"):
        rig.engine.add_request(req("x", 8, 2, priority=1))


def _fill_until_preemption(rig: SimRig) -> list[EngineRequest]:
    preempted: list[EngineRequest] = []
    for _ in range(10_000):
        if not rig.engine.has_unfinished():
            break
        sched = rig.engine.schedule()
        preempted += sched.preempted
        if preempted:
            return preempted
        result = rig.executor.execute(sched.plan)
        rig.clock.advance(result.step_time_s)
        rig.engine.finish_step(sched, result)
    return preempted


def test_priority_preemption_picks_lowest_priority_then_newest(sim_rig: RigFactory) -> None:
    # 8 blocks of 16 = 128 tokens; four requests of 16-token prompts grow until blocks run out.
    rig = sim_rig(policy="priority", num_blocks=8, max_model_len=128)
    rig.engine.add_request(req("hi", 16, 100, priority=0))
    rig.engine.add_request(req("low_old", 16, 100, priority=5))
    rig.engine.add_request(req("low_new", 16, 100, priority=5))
    rig.engine.add_request(req("mid", 16, 100, priority=2))
    preempted = _fill_until_preemption(rig)
    assert preempted[0].request_id == "low_new"


def test_fcfs_preemption_picks_newest(sim_rig: RigFactory) -> None:
    rig = sim_rig(num_blocks=8, max_model_len=128)
    for rid in ("first", "second", "third"):
        rig.engine.add_request(req(rid, 16, 100))
    preempted = _fill_until_preemption(rig)
    assert preempted[0].request_id == "third"
    assert preempted[0].status == RequestStatus.PREEMPTED
    assert rig.blocks.num_blocks_of("third") == 0


def test_preemption_by_recompute_resumes_with_identical_tokens(sim_rig: RigFactory) -> None:
    # A tight cache forces repeated preemption; a roomy one runs the same requests uninterrupted.
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        rig = sim_rig(num_blocks=num_blocks, max_model_len=256, max_num_batched_tokens=64)
        for i in range(6):
            rig.engine.add_request(req(f"r{i}", 30 + 7 * i, 120, sampling=SamplingParams(seed=i)))
        rig.run()
        assert rig.blocks.num_free_blocks == num_blocks
        return {f"r{i}": rig.tokens(f"r{i}") for i in range(6)}, rig.scheduler.num_preemptions_total

    tight, preemptions = run(num_blocks=24)
    roomy, none = run(num_blocks=1024)
    assert preemptions > 0 and none == 0
    assert tight == roomy
    executor = make_sim_rig().executor
    assert roomy["r3"] == executor.expected_tokens(prompt(51, salt=salt("r3")), 3, 120)


def test_no_blocks_leak_after_finish_abort_and_preemption(sim_rig: RigFactory) -> None:
    rig = sim_rig(num_blocks=20, max_model_len=200, max_num_batched_tokens=96)
    for i in range(10):
        rig.engine.add_request(req(f"r{i}", 20 + i, 60 + 10 * i))
    steps = 0
    while rig.engine.has_unfinished():
        rig.step()
        steps += 1
        if steps == 5:
            assert rig.engine.abort("r7")
            assert not rig.engine.abort("r7")
            rig.engine.abort("r9")  # maybe still waiting
        used = sum(rig.blocks.num_blocks_of(r) for r in rig.blocks.owners())
        assert used == rig.blocks.num_used_blocks
    assert rig.scheduler.num_preemptions_total > 0
    assert rig.blocks.num_free_blocks == 20
    assert rig.blocks.owners() == []
    assert rig.scheduler.num_running == rig.scheduler.num_waiting == 0


def test_abort_while_waiting_and_while_running(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_seqs=1)
    rig.engine.add_request(req("run", 40, 50))
    rig.engine.add_request(req("wait", 40, 50))
    rig.step()
    assert rig.blocks.num_blocks_of("run") > 0
    assert rig.engine.abort("wait")
    assert rig.engine.abort("run")
    assert rig.blocks.num_free_blocks == rig.blocks.num_blocks
    assert not rig.engine.has_unfinished()
    assert rig.step() == []


def test_eos_stops_unless_ignore_eos(sim_rig: RigFactory) -> None:
    rig = sim_rig(eos_after=3)
    rig.engine.add_request(req("stops", 8, 20))
    rig.engine.add_request(req("ignores", 8, 20, ignore_eos=True))
    rig.run()
    stops, ignores = rig.outputs["stops"][-1], rig.outputs["ignores"][-1]
    assert (stops.finish_reason, stops.num_output_tokens) == ("stop", 4)  # EOS counts as a token
    assert rig.tokens("stops")[-1] == rig.executor.eos_token_id
    assert "<|endoftext|>" not in rig.text("stops")
    assert (ignores.finish_reason, ignores.num_output_tokens) == ("length", 20)


def test_max_tokens_and_context_length(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_model_len=64)
    rig.engine.add_request(req("a", 10, 5))
    rig.run()
    assert rig.outputs["a"][-1].finish_reason == "length"
    assert rig.outputs["a"][-1].num_output_tokens == 5
    with pytest.raises(ValueError, match="max_model_len"):
        rig.engine.add_request(req("too_long", 60, 5))
    with pytest.raises(ValueError, match="empty"):
        rig.engine.add_request(EngineRequest("empty", [], 5))
    with pytest.raises(ValueError, match="token ids"):
        rig.engine.add_request(EngineRequest("bad", [10**7], 5))


def test_stop_string_truncates_and_frees(sim_rig: RigFactory) -> None:
    probe = sim_rig()
    probe.engine.add_request(req("x", 12, 30))
    probe.run()
    full = probe.text("x")
    words = full.split(" ")
    stop = " " + words[8]  # a word in the middle (words[0] is the empty string before the first space)
    cut = full.index(stop)

    rig = sim_rig()
    rig.engine.add_request(req("x", 12, 30, stop=("never-there", stop)))
    rig.run()
    last = rig.outputs["x"][-1]
    assert rig.text("x") == full[:cut]
    assert last.finish_reason == "stop"
    assert last.num_output_tokens < 30
    assert rig.blocks.num_free_blocks == rig.blocks.num_blocks


def test_stop_string_spanning_tokens_is_never_partly_streamed(sim_rig: RigFactory) -> None:
    probe = sim_rig()
    probe.engine.add_request(req("x", 12, 30))
    probe.run()
    full = probe.text("x")
    words = full.split(" ")
    # The end of one word and the start of the next: matches only once both tokens are out.
    stop = words[5][-2:] + " " + words[6][:2]
    final = full[: full.index(stop)]
    rig = sim_rig()
    rig.engine.add_request(req("x", 12, 30, stop=(stop,)))
    rig.run()
    assert rig.text("x") == final
    streamed = ""
    for out in rig.outputs["x"]:
        streamed += out.text
        assert final.startswith(streamed), "streamed text that the stop string later cut"


def test_scheduler_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=1024, max_model_len=4096, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KV cache holds"):
        Scheduler(SchedulerConfig(max_model_len=4096), BlockManager(10, 16), None)


# ---- invariants under random workloads ---------------------------------------------------------

_request = st.tuples(
    st.integers(1, 120),  # prompt tokens
    st.integers(1, 40),  # max tokens
    st.integers(0, 3),  # priority
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request, min_size=1, max_size=16),
    budget=st.integers(16, 200),
    max_seqs=st.integers(1, 8),
    num_blocks=st.integers(10, 40),
    block_size=st.sampled_from([4, 8, 16]),
    chunked=st.booleans(),
    threshold=st.sampled_from([0, 8, 32]),
    partial=st.sampled_from([(1, 1), (2, 1), (3, 1), (3, 2)]),
    policy=st.sampled_from(["fcfs", "priority", "priority-queue"]),
    aging=st.sampled_from([0.0, 0.01, 10.0]),
)
def test_invariants_hold_under_random_workloads(
    requests: list[tuple[int, int, int, int, int | None]],
    budget: int,
    max_seqs: int,
    num_blocks: int,
    block_size: int,
    chunked: bool,
    threshold: int,
    partial: tuple[int, int],
    policy: str,
    aging: float,
) -> None:
    max_model_len = 160
    if num_blocks * block_size < max_model_len:
        num_blocks = -(-max_model_len // block_size)
    if not chunked:
        budget = max(budget, max_model_len)
        partial = (1, 1)  # concurrent partial prefills need chunked prefill
    max_partial, max_long = partial
    policy, _, scope = policy.partition("-")
    rig = make_sim_rig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_long,
        policy=policy,
        priority_scope=scope or "step",
        priority_aging_s=aging,
        block_size=block_size,
        num_blocks=num_blocks,
        with_text=False,
    )
    reqs: dict[str, tuple[int, int, int, int, int | None]] = {}
    for i, (n_prompt, max_tokens, prio, arrive, abort_at) in enumerate(requests):
        max_tokens = min(max_tokens, max_model_len - n_prompt)
        reqs[f"r{i}"] = (n_prompt, max_tokens, prio if policy == "priority" else 0, arrive, abort_at)
    aborted: set[str] = set()
    step = 0
    while step < 5000:
        for rid, (n_prompt, max_tokens, prio, arrive, abort_at) in reqs.items():
            if arrive == step:
                rig.engine.add_request(
                    EngineRequest(rid, prompt(n_prompt, salt=int(rid[1:])), max_tokens, priority=prio)
                )
            if abort_at == step and rig.engine.abort(rid):
                aborted.add(rid)
        if step > 12 and not rig.engine.has_unfinished():
            break
        sched = rig.engine.schedule()
        plan = sched.plan
        assert plan.num_tokens <= budget
        assert len(plan.seqs) <= max_seqs
        assert rig.scheduler.num_running <= max_seqs
        seen_blocks: set[int] = set()
        for owner in rig.blocks.owners():
            table = set(rig.blocks.block_table(owner))
            assert not table & seen_blocks, "a block is owned twice"
            seen_blocks |= table
        assert len(seen_blocks) == rig.blocks.num_used_blocks <= num_blocks
        long_threshold = rig.scheduler.config.long_prefill_token_threshold
        prefills = longs = 0
        for seq in plan.seqs:
            r = rig.scheduler.get(seq.request_id)
            assert r is not None and r.status == RequestStatus.RUNNING
            assert len(seq.block_table) * block_size >= seq.start_pos + len(seq.token_ids)
            assert list(seq.token_ids) == r.all_token_ids[seq.start_pos : seq.start_pos + len(seq.token_ids)]
            if chunked and long_threshold:
                assert len(seq.token_ids) <= long_threshold
            if seq.start_pos == 0 or len(seq.token_ids) > 1:  # prefill work
                prefills += 1
                longs += r.num_tokens - seq.start_pos > long_threshold
        if max_partial > 1:
            assert prefills <= max_partial and longs <= max_long
            if not chunked and seq.start_pos == 0:
                assert seq.sample, "an unchunked prefill must cover the whole sequence"
        result = rig.executor.execute(plan)
        rig.clock.advance(result.step_time_s)
        for out in rig.engine.finish_step(sched, result):
            rig.outputs.setdefault(out.request_id, []).append(out)
        step += 1
    assert not rig.engine.has_unfinished()
    assert rig.blocks.num_free_blocks == num_blocks
    event(f"preempted: {rig.scheduler.num_preemptions_total > 0}")
    for rid, (n_prompt, max_tokens, _, _, _) in reqs.items():
        if rid in aborted:
            continue
        # Completed requests produced exactly their deterministic tokens, preempted or not.
        assert rig.tokens(rid) == rig.executor.expected_tokens(
            prompt(n_prompt, salt=int(rid[1:])), None, max_tokens
        )
