"""What pricing answers: a request's `Cost` in tokens, or `InvalidRequest` for a body it refuses."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Cost:
    prefill: int
    decode: int
    # The output limit of one sequence that the reservation covers for every sequence of the request
    # (within each prompt's context): what a gateway may send as max_tokens when the client set none.
    per_choice: int = field(default=0, compare=False)  # a property of the request, not of its cost
    # Priced on an estimate (pricing.estimate_above_chars): the exact cost, being counted off the
    # loop; None when the prices are exact. Whoever keeps the estimate cancels it when done with it.
    exact: asyncio.Future[Cost] | None = field(default=None, compare=False, repr=False)

    @property
    def total(self) -> int:
        return self.prefill + self.decode


class InvalidRequest(Exception):
    """A malformed or unservable body; the gateway turns it into an OpenAI-style 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"InvalidRequest({self.message!r}, param={self.param!r}, code={self.code!r})"
