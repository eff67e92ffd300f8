"""What a trip is and how it leaves the engine: a retryable 503 or an SSE error event.

Data flow: :class:`~cas_engine.guard.monitor.GuardMonitor` creates one :class:`GuardTrip` per
tripped request; the serving layer (the SGLang patch, or the sim engine) owns the request and
turns the trip into the client-visible outcome with the helpers here:

- non-streaming: HTTP 503 with :func:`error_body` as JSON and ``Retry-After: 0``. The SGLang
  router retries 503 on another worker (503 is in its default retryable set), so the client
  never sees the bad output.
- streaming, after tokens were sent: the router cannot retry a stream that has started (the
  bytes already reached the client). The stream ends with :func:`sse_error_event` (an
  OpenAI-style ``{"error": {...}}`` data event with ``code`` 503 and ``retryable`` true) and
  ``data: [DONE]``. Coding-agent clients treat such an error event as a failed attempt and
  resend the whole request (their usual retry-on-5xx policy), discarding the partial output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

Reason = Literal["low_accept_length", "high_accept_rate"]
Scope = Literal["request", "window"]

RETRYABLE_HTTP_STATUS = 503
ERROR_TYPE = "cas_guard_tripped"
REASONS: tuple[Reason, ...] = ("low_accept_length", "high_accept_rate")


@dataclass(frozen=True, slots=True)
class GuardTrip:
    """One tripped request: why, where in the request, and the statistics at that moment.

    ``scope`` says which statistic crossed the threshold: the whole request so far
    (``request``) or the last ``window`` verify steps (``window``). Values that are undefined
    (no speculative step yet) are NaN.
    """

    request_id: str
    slot: int
    reason: Reason
    scope: Scope
    generated_tokens: int
    verify_steps: int
    accept_length: float
    accept_rate: float
    window_accept_length: float
    window_accept_rate: float

    def message(self) -> str:
        """One line naming the reason and statistics; also the SGLang abort message."""
        return (
            f"{ERROR_TYPE}: reason={self.reason} scope={self.scope} "
            f"generated_tokens={self.generated_tokens} "
            f"accept_length={self.accept_length:.3f} accept_rate={self.accept_rate:.3f}; "
            "retryable, resend the request"
        )

    def log_fields(self) -> dict[str, object]:
        """Fields for the structured trip log line."""
        return asdict(self)


def _json_safe(value: object) -> object:
    if isinstance(value, float) and value != value:  # NaN is not valid JSON
        return None
    return value


def error_body(trip: GuardTrip) -> dict[str, object]:
    """OpenAI-style error object for the 503 body and the SSE error event."""
    details = {k: _json_safe(v) for k, v in trip.log_fields().items()}
    details["retryable"] = True
    return {
        "error": {
            "message": trip.message(),
            "type": ERROR_TYPE,
            "code": RETRYABLE_HTTP_STATUS,
            "param": None,
            "cas_guard": details,
        }
    }


def http_response(trip: GuardTrip) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the non-streaming answer: 503, JSON, ``Retry-After: 0``."""
    headers = {"Content-Type": "application/json", "Retry-After": "0"}
    return RETRYABLE_HTTP_STATUS, headers, json.dumps(error_body(trip)).encode()


def sse_error_event(trip: GuardTrip, *, with_done: bool = True) -> bytes:
    """Final bytes of a started stream: the error data event, then ``data: [DONE]``."""
    event = f"data: {json.dumps(error_body(trip))}\n\n"
    if with_done:
        event += "data: [DONE]\n\n"
    return event.encode()
