"""Wire-level types of the KV fence: reclaim modes, abort notices and acknowledgements.

Data flow: the decode side's :class:`~cas_engine.kvfence.ledger.ReclaimLedger` creates an
:class:`AbortNotice` when it aborts a room; the transport delivers it to every prefill rank of the
room; each rank's :class:`~cas_engine.kvfence.tracker.WriteTracker` answers with a
:class:`ReclaimAck` once none of its writes for that room and generation can land any more; the
transport carries the ack back to the ledger. The messages are immutable values with a stable
dict form (``to_dict`` / ``from_dict``) so any transport (ZMQ, a pipe, a queue) can carry them.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class ReclaimMode(enum.Enum):
    """When the decode side may hand an aborted room's KV slots to a new request.

    IMMEDIATE: at once (no fix; reproduces the race).
    UPSTREAM: on an acknowledgement, or when the timer expires without one (SGLang 0.5.23's
        deferred release with its 30 s timeout; the timer reopens the race for stalled writes).
    STRICT: only on an acknowledgement from every prefill rank of the room's generation, or on the
        transport's confirmation that a dead peer's endpoint is closed. Never on a timer.
    """

    IMMEDIATE = "Immediate"
    UPSTREAM = "Upstream"
    STRICT = "Strict"

    @classmethod
    def parse(cls, text: str) -> ReclaimMode:
        """Accept the CRD spelling (``Strict``) or the enum name (``STRICT``), any case."""
        for mode in cls:
            if text.lower() in (mode.value.lower(), mode.name.lower()):
                return mode
        raise ValueError(f"unknown reclaim mode {text!r}; expected one of {[m.value for m in cls]}")


@dataclass(frozen=True, slots=True)
class AbortNotice:
    """Decode -> prefill: room ``room`` at ``generation`` is aborted; stop writing into it.

    ``rank`` is the prefill rank the notice is addressed to (``-1``: every rank of the room).
    """

    room: int
    generation: int
    rank: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "abort", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AbortNotice:
        return cls(
            room=int(data["room"]),
            generation=int(data["generation"]),
            rank=int(data.get("rank", -1)),
        )


@dataclass(frozen=True, slots=True)
class ReclaimAck:
    """Prefill rank ``rank`` -> decode: none of my writes for ``room``/``generation`` can land."""

    room: int
    generation: int
    rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ack", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReclaimAck:
        return cls(
            room=int(data["room"]), generation=int(data["generation"]), rank=int(data["rank"])
        )
