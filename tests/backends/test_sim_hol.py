"""Head-of-line blocking reproduced on the virtual clock with the default (H100, 8B) cost model.

A 28,000-token prompt arrives, then a short chat request 0.1 s later, while another short
request is already decoding. Chunked prefill off: the long prompt is prefilled in one ~0.95 s
step, so the newcomer's first token and the running request's next token both wait for it.
Chunked prefill on with a per-request chunk cap: the long prompt is spread over many short
steps and the short requests slip into the next one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from backends.engine.request import EngineRequest
from tests.backends.conftest import SimRig, prompt

LONG_PROMPT = 28_000


def run_scenario(sim_rig: Callable[..., SimRig], *, chunked: bool) -> tuple[float, float, float]:
    rig = sim_rig(
        max_model_len=32_768,
        max_num_batched_tokens=8192 if chunked else 32_768,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=512 if chunked else 0,
        num_blocks=4096,
        with_text=False,
    )
    arrivals = [
        (0.0, EngineRequest("decoding", prompt(200, salt=1), 400)),
        (0.05, EngineRequest("long", prompt(LONG_PROMPT, salt=2), 16)),
        (0.15, EngineRequest("short", prompt(60, salt=3), 16)),
    ]
    requests = {r.request_id: r for _, r in arrivals}
    rig.drive(arrivals)
    short = requests["short"]
    assert short.first_token_time is not None
    ttft_short = short.first_token_time - short.arrival_time
    times = [t for out in rig.outputs["decoding"] for t in out.token_times]
    worst_itl = max(b - a for a, b in itertools.pairwise(times))
    long = requests["long"]
    assert long.first_token_time is not None
    return ttft_short, worst_itl, long.first_token_time - long.arrival_time


def test_short_ttft_beside_28k_prompt_is_many_times_worse_without_chunked_prefill(
    sim_rig: Callable[..., SimRig],
) -> None:
    ttft_off, itl_off, long_ttft_off = run_scenario(sim_rig, chunked=False)
    ttft_on, itl_on, long_ttft_on = run_scenario(sim_rig, chunked=True)
    # Off: the short request waits out the whole ~0.95 s prefill step.
    assert 0.6 < ttft_off < 1.2
    assert ttft_off > 10 * ttft_on
    # The running decode stalls for the same step.
    assert itl_off > 0.6
    assert itl_off > 10 * itl_on
    # Chunking is not free for the long request itself (more, smaller steps), but it finishes.
    assert long_ttft_on > long_ttft_off * 0.9


def one_server_ttft(sim_rig: Callable[..., SimRig], *, threshold: int, scope: str) -> tuple[float, float]:
    """A low-priority 28k prompt is mid-prefill when a high-priority short prompt arrives (chunked
    prefill on, vLLM's 8192-token budget): (short request's TTFT, long request's TTFT)."""
    rig = sim_rig(
        max_model_len=32_768,
        max_num_batched_tokens=8192,
        long_prefill_token_threshold=threshold,
        policy="priority",
        priority_scope=scope,
        num_blocks=4096,
        with_text=False,
    )
    arrivals = [
        (0.0, EngineRequest("long", prompt(LONG_PROMPT, salt=2), 16, priority=2)),
        (0.1, EngineRequest("short", prompt(300, salt=3), 16, priority=0)),
    ]
    requests = {r.request_id: r for _, r in arrivals}
    rig.drive(arrivals)
    ttft = {k: r.first_token_time - r.arrival_time for k, r in requests.items() if r.first_token_time}
    return ttft["short"], ttft["long"]


def test_on_one_server_the_chunk_cap_and_step_priority_keep_a_short_prompt_fast(
    sim_rig: Callable[..., SimRig],
) -> None:
    vllm, _ = one_server_ttft(sim_rig, threshold=0, scope="queue")
    step_only, _ = one_server_ttft(sim_rig, threshold=0, scope="step")
    cap_only, _ = one_server_ttft(sim_rig, threshold=512, scope="queue")
    both, long_ttft = one_server_ttft(sim_rig, threshold=512, scope="step")
    # vLLM's order: the running long prefill takes every 8192-token step until its prompt is in.
    assert vllm > 0.5
    # Step priority alone: the short prompt joins the next step, but that step is still ~8k tokens.
    assert 0.1 < step_only < vllm / 2
    # The chunk cap bounds every step; with step priority the short prompt also goes first.
    assert cap_only < 0.1 and both <= cap_only
    assert both < vllm / 10
    assert long_ttft < 5.0  # the long prompt still finishes its prefill
