"""The scheduling controls for one shared server, on the simulated executor and a virtual clock:
vLLM's concurrent-partial-prefill settings, priority inside each step, aging, priority inversion."""

from __future__ import annotations

import pytest

from backends.engine.request import RequestStatus
from backends.engine.scheduler import SchedulerConfig
from tests.backends.conftest import SimRig, prompt
from tests.backends.support import RigFactory, req


def chunks(rig: SimRig) -> dict[str, int]:
    """The next step's plan as {request id: tokens}, without running it."""
    return {s.request_id: len(s.token_ids) for s in rig.engine.schedule().plan.seqs}


def run_step(rig: SimRig) -> dict[str, int]:
    """Schedule, execute and apply one step; returns its plan as {request id: tokens}."""
    sched = rig.engine.schedule()
    plan = {s.request_id: len(s.token_ids) for s in sched.plan.seqs}
    result = rig.executor.execute(sched.plan)
    rig.clock.advance(result.step_time_s)
    for out in rig.engine.finish_step(sched, result):
        rig.outputs.setdefault(out.request_id, []).append(out)
    return plan


# ---- vLLM's partial-prefill settings ----------------------------------------------------------


def test_one_partial_prefill_is_vllms_default_and_limits_nothing(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=1024, max_model_len=4096, num_blocks=512)
    for i in range(3):
        rig.engine.add_request(req(f"s{i}", 100, 4))
    assert chunks(rig) == {"s0": 100, "s1": 100, "s2": 100}


def test_max_num_partial_prefills_caps_the_prefills_of_one_step(sim_rig: RigFactory) -> None:
    rig = sim_rig(
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_blocks=512,
        long_prefill_token_threshold=256,
        max_num_partial_prefills=2,
    )
    for i in range(3):
        rig.engine.add_request(req(f"s{i}", 100, 4))
    assert chunks(rig) == {"s0": 100, "s1": 100}
    assert rig.scheduler.num_waiting == 1


def test_partial_prefills_share_the_step_budget(sim_rig: RigFactory) -> None:
    # Two long prompts, two long slots: each prefill gets at most budget / 2 per step, while one
    # prefill slot (vLLM's default) gives the first prompt the whole budget and the second nothing.
    shared = sim_rig(
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_blocks=512,
        long_prefill_token_threshold=1024,
        max_num_partial_prefills=2,
        max_long_partial_prefills=2,
    )
    single = sim_rig(
        max_num_batched_tokens=1024, max_model_len=4096, num_blocks=512, long_prefill_token_threshold=1024
    )
    for rig in (shared, single):
        rig.engine.add_request(req("a", 3000, 4))
        rig.engine.add_request(req("b", 3000, 4))
    assert chunks(shared) == {"a": 512, "b": 512}
    assert chunks(single) == {"a": 1024}


def test_short_prompts_jump_a_long_one_when_the_long_slots_are_taken(sim_rig: RigFactory) -> None:
    rig = sim_rig(
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_blocks=512,
        long_prefill_token_threshold=256,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
    )
    rig.engine.add_request(req("long_a", 2000, 4))
    run_step(rig)  # long_a holds the one long slot from now on
    rig.engine.add_request(req("long_b", 2000, 4))
    rig.engine.add_request(req("short", 100, 4))
    plan = run_step(rig)
    assert plan == {"long_a": 256, "short": 100}  # long_b waits; the short one behind it went first
    assert rig.scheduler.get("long_b").status == RequestStatus.WAITING  # type: ignore[union-attr]
    while "long_b" not in (plan := run_step(rig)):
        assert "long_a" in plan
    # long_b starts only once long_a's prompt is in: its last chunk went in the step before.
    assert rig.outputs["long_a"][0].num_output_tokens >= 1


def test_long_partial_prefill_limit_holds_under_fcfs_and_priority(sim_rig: RigFactory) -> None:
    for policy in ("fcfs", "priority"):
        rig = sim_rig(
            max_num_batched_tokens=2048,
            max_model_len=4096,
            num_blocks=1024,
            long_prefill_token_threshold=300,
            max_num_partial_prefills=3,
            max_long_partial_prefills=1,
            policy=policy,
        )
        for i in range(4):
            rig.engine.add_request(req(f"long{i}", 1500, 2))
            rig.engine.add_request(req(f"short{i}", 120, 2))
        while rig.engine.has_unfinished():
            sched = rig.engine.schedule()
            prefills = [s for s in sched.plan.seqs if s.is_prefill]
            longs = [s for s in prefills if rig.scheduler.get(s.request_id).num_tokens - s.start_pos > 300]  # type: ignore[union-attr]
            assert len(prefills) <= 3 and len(longs) <= 1, policy
            result = rig.executor.execute(sched.plan)
            rig.clock.advance(result.step_time_s)
            rig.engine.finish_step(sched, result)
        assert rig.blocks.num_free_blocks == 1024


def test_partial_prefill_settings_follow_vllms_defaults_and_validation() -> None:
    # A long prompt is one above 4 % of the context when the threshold is not given (as vLLM).
    assert SchedulerConfig(max_num_partial_prefills=2).long_prefill_token_threshold == 1310
    assert SchedulerConfig().long_prefill_token_threshold == 0
    assert (
        SchedulerConfig(
            max_num_partial_prefills=2, long_prefill_token_threshold=512
        ).long_prefill_token_threshold
        == 512
    )
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match=">= 1"):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(
            max_num_partial_prefills=2, enable_chunked_prefill=False, max_num_batched_tokens=32768
        )
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(long_prefill_token_threshold=40000)
    with pytest.raises(ValueError, match="scope"):
        SchedulerConfig(priority_scope="everywhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aging"):
        SchedulerConfig(priority_aging_s=-1)


# ---- priority inside each step -------------------------------------------------------------------


def _long_prefill_running(rig: SimRig) -> None:
    rig.engine.add_request(req("long", 1500, 4, priority=2))
    assert run_step(rig) == {"long": 512}


def test_a_high_priority_short_prompt_goes_before_a_running_low_priority_long_prefill(
    sim_rig: RigFactory,
) -> None:
    rig = sim_rig(max_num_batched_tokens=512, max_model_len=2048, policy="priority")
    _long_prefill_running(rig)
    rig.engine.add_request(req("short", 100, 4, priority=0))
    # The short prompt is prefilled whole, in a step of its own: the long prefill yields it.
    assert run_step(rig) == {"short": 100}
    # Steps without a higher-priority prefill are the long one's again (the decode goes first).
    assert run_step(rig) == {"short": 1, "long": 511}


def test_a_low_priority_short_prefill_still_shares_the_step(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=512, max_model_len=2048, policy="priority")
    rig.engine.add_request(req("urgent", 300, 4, priority=0))
    rig.engine.add_request(req("small", 60, 4, priority=2))  # below the long threshold (81 tokens)
    rig.engine.add_request(req("long", 1500, 4, priority=2))
    assert chunks(rig) == {"urgent": 300, "small": 60}


def test_a_long_prefill_uses_the_chunk_cap_as_its_threshold_to_yield(sim_rig: RigFactory) -> None:
    rig = sim_rig(
        max_num_batched_tokens=4096,
        max_model_len=8192,
        num_blocks=1024,
        policy="priority",
        long_prefill_token_threshold=512,
    )
    rig.engine.add_request(req("long", 6000, 4, priority=2))
    assert run_step(rig) == {"long": 512}
    rig.engine.add_request(req("chat", 1200, 4, priority=1))
    assert run_step(rig) == {"chat": 512}  # the chat prompt's chunks run without the long one's
    assert run_step(rig) == {"chat": 512}
    assert run_step(rig) == {"chat": 176}
    assert run_step(rig) == {"chat": 1, "long": 512}


def test_vllms_queue_scope_lets_a_running_long_prefill_take_the_step_first(sim_rig: RigFactory) -> None:
    # vLLM v1's priority policy orders only the waiting queue: the running low-priority prefill
    # takes the whole budget and the high-priority short prompt waits for the next step.
    rig = sim_rig(max_num_batched_tokens=512, max_model_len=2048, policy="priority", priority_scope="queue")
    _long_prefill_running(rig)
    rig.engine.add_request(req("short", 100, 4, priority=0))
    assert run_step(rig) == {"long": 512}


def test_higher_priority_decodes_come_first_and_lower_ones_get_the_rest(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=64, max_model_len=2048, policy="priority")
    for i in range(4):
        rig.engine.add_request(req(f"low{i}", 8, 50, priority=3))
    run_step(rig)  # four low-priority requests now decode
    rig.engine.add_request(req("urgent", 62, 4, priority=0))
    plan = run_step(rig)
    assert plan["urgent"] == 62
    assert sum(1 for r in plan if r.startswith("low")) == 2  # the two tokens left over
    assert sum(plan.values()) == 64


def test_equal_priorities_keep_arrival_order_within_a_step(sim_rig: RigFactory) -> None:
    rig = sim_rig(max_num_batched_tokens=150, max_model_len=2048, policy="priority")
    rig.engine.add_request(req("first", 100, 4, priority=1))
    rig.engine.add_request(req("second", 100, 4, priority=1))
    assert chunks(rig) == {"first": 100, "second": 50}


def _saturate_with_high_priority(rig: SimRig, steps: int, low_id: str) -> int | None:
    """Every step, a new high-priority 64-token prompt fills the 64-token budget; returns the step
    at which ``low_id`` first got tokens (None: never)."""
    for step in range(steps):
        rig.engine.add_request(req(f"hi{step}", 64, 1, priority=0))
        if low_id in run_step(rig):
            return step
    return None


def test_without_aging_a_saturating_high_priority_load_starves_a_low_priority_request(
    sim_rig: RigFactory,
) -> None:
    rig = sim_rig(max_num_batched_tokens=64, max_model_len=2048, policy="priority", priority_aging_s=0)
    rig.engine.add_request(req("low", 32, 2, priority=1))
    assert _saturate_with_high_priority(rig, 300, "low") is None


def test_aging_bounds_how_long_a_low_priority_request_waits(sim_rig: RigFactory) -> None:
    aging = 0.05
    rig = sim_rig(max_num_batched_tokens=64, max_model_len=2048, policy="priority", priority_aging_s=aging)
    rig.engine.add_request(req("low", 32, 2, priority=1))
    assert _saturate_with_high_priority(rig, 300, "low") is not None
    low = rig.scheduler.get("low")
    assert low is not None and low.first_scheduled_time is not None
    step_s = rig.executor.cost_model.step_time(rig.engine.schedule().plan) or 0.01
    # One priority level to climb: promoted after `aging` seconds, served within a step or two.
    assert aging <= low.first_scheduled_time - low.arrival_time <= aging + 3 * step_s


# ---- priority inversion over KV blocks ----------------------------------------------------------


def _inversion_rig(sim_rig: RigFactory, scope: str) -> SimRig:
    # 16 blocks of 16 tokens. The low-priority request holds 11 blocks and grows; the high-priority
    # one needs 8 of the 5 left.
    rig = sim_rig(
        policy="priority", priority_scope=scope, num_blocks=16, max_model_len=256, max_num_batched_tokens=256
    )
    rig.engine.add_request(req("low", 170, 80, priority=5))
    run_step(rig)
    assert rig.blocks.num_blocks_of("low") == 11
    rig.engine.add_request(req("high", 120, 8, priority=0))
    return rig


def test_a_high_priority_request_preempts_a_low_one_holding_the_kv_blocks_it_needs(
    sim_rig: RigFactory,
) -> None:
    rig = _inversion_rig(sim_rig, "step")
    sched = rig.engine.schedule()
    assert [r.request_id for r in sched.preempted] == ["low"]
    assert {s.request_id for s in sched.plan.seqs} == {"high"}
    result = rig.executor.execute(sched.plan)
    rig.clock.advance(result.step_time_s)
    for out in rig.engine.finish_step(sched, result):
        rig.outputs.setdefault(out.request_id, []).append(out)
    rig.run()
    high, low = rig.outputs["high"][-1], rig.outputs["low"][-1]
    assert high.finished and low.finished and low.num_preemptions == 1
    assert rig.scheduler.get("high") is None and rig.blocks.num_free_blocks == 16
    # Recompute after preemption gives the low-priority request exactly its own tokens.
    assert rig.tokens("low") == rig.executor.expected_tokens(prompt(170, salt=sum(b"low")), None, 80)
    first_high = rig.outputs["high"][0].token_times[0]
    last_low = rig.outputs["low"][-1].token_times[-1]
    assert first_high < last_low  # high was not held behind low


def test_vllms_queue_scope_leaves_the_high_priority_request_behind_the_low_one(
    sim_rig: RigFactory,
) -> None:
    rig = _inversion_rig(sim_rig, "queue")
    rig.run()
    assert rig.scheduler.num_preemptions_total == 0
    first_high = rig.outputs["high"][0].token_times[0]
    last_low = rig.outputs["low"][-1].token_times[-1]
    assert first_high >= last_low  # the inversion: high waited for low's KV blocks


def test_a_waiting_request_never_preempts_one_of_equal_priority(sim_rig: RigFactory) -> None:
    rig = sim_rig(policy="priority", num_blocks=16, max_model_len=256, max_num_batched_tokens=256)
    rig.engine.add_request(req("first", 170, 80, priority=1))
    run_step(rig)
    rig.engine.add_request(req("second", 120, 8, priority=1))
    sched = rig.engine.schedule()
    assert sched.preempted == []
    assert {s.request_id for s in sched.plan.seqs} == {"first"}


def test_inversion_preemption_only_happens_when_it_frees_enough(sim_rig: RigFactory) -> None:
    # The low-priority request holds 3 blocks; the high one needs 14 of 16 while a same-priority
    # request holds 11: preempting the low one would not be enough, so nobody is preempted.
    rig = sim_rig(policy="priority", num_blocks=16, max_model_len=256, max_num_batched_tokens=512)
    rig.engine.add_request(req("peer", 170, 20, priority=0))
    rig.engine.add_request(req("low", 40, 20, priority=5))
    run_step(rig)
    rig.engine.add_request(req("high", 220, 4, priority=0))
    sched = rig.engine.schedule()
    assert sched.preempted == []
    assert "high" not in {s.request_id for s in sched.plan.seqs}
