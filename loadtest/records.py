"""What one request measured, and one run's collection of them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    index: int
    cls: str
    group: str
    tenant: str
    url: str
    planned_prompt_tokens: int
    max_tokens: int | None  # what the request sent as max_tokens (None: none)
    scheduled_s: float  # planned send time, seconds after the run's start
    sent_s: float = 0.0  # actual send time (lateness = sent_s - scheduled_s)
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None  # None on success, else "http_<status>", "connect", "timeout", "cancelled", ...
    detail: str | None = None  # the start of an error body or exception text, for diagnosis
    ttft_s: float | None = None  # send → first token
    e2e_s: float | None = None  # send → end of response
    prompt_tokens: int | None = None  # from the backend's usage when it sent one
    completion_tokens: int = 0  # usage, else the number of content chunks
    # Arrival time of each content chunk, seconds after the run's start (kept out of the JSON).
    token_times: list[float] = field(default_factory=list)
    gateway_class: str | None = None
    gateway_cost: int | None = None
    gateway_queue_ms: float | None = None
    planned_output_tokens: int | None = None  # the output the plan asked for (None: unknown)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.sent_s + self.e2e_s

    def inter_token_gaps(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "class": self.cls,
            "group": self.group,
            "tenant": self.tenant,
            "url": self.url,
            "planned_prompt_tokens": self.planned_prompt_tokens,
            "max_tokens": self.max_tokens,
            "planned_output_tokens": self.planned_output_tokens,
            "scheduled_s": round(self.scheduled_s, 6),
            "sent_s": round(self.sent_s, 6),
            "status": self.status,
            "error": self.error,
            "detail": self.detail,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "e2e_s": None if self.e2e_s is None else round(self.e2e_s, 6),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "chunks": len(self.token_times),
            "gateway_class": self.gateway_class,
            "gateway_cost": self.gateway_cost,
            "gateway_queue_ms": self.gateway_queue_ms,
        }


@dataclass
class RunResult:
    target: str
    base_urls: tuple[str, ...]
    records: list[RequestRecord]
    elapsed_s: float  # run start → last response finished (or was cancelled)
    planned: int  # requests in the plan (bounded by count and duration)
    started_unix: float = 0.0
    # Preemptions the backends counted while this run went (their /metrics, read before and after;
    # only when the load tester knows the backends, i.e. a spawned stack). None: not measured.
    backend_preemptions: float | None = None
