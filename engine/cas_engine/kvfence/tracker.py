"""Prefill side of the KV fence: the write tracker of one prefill rank.

Ownership: the prefill rank's transfer worker owns the writes; the tracker only counts them per
room and generation and answers abort notices. Data flow for one room::

    begin(room, gen)                      -> pins the room's source pages (False: already aborted)
    try_issue(room, gen) before each chunk -> False once aborted: skip the queued chunk
    write_done(room, gen, ok)             -> after each issued chunk completes (ok=False: poisoned)
    seal(room, gen)                       -> no more chunks will be issued (normal completion)
    on_abort(notice)                      -> ReclaimAck now if nothing is outstanding, else the ack
                                             is returned by the write_done() that drains the room

An acknowledgement means "no write of mine for this room and generation can land any more". A
poisoned transfer (a write failed or timed out: it may still land) never acknowledges and keeps
its source pages pinned until :meth:`on_endpoint_closed`. Aborts for rooms this rank never began
are acknowledged (nothing is outstanding) and tombstoned so a late ``begin`` is refused.

Single-threaded per tracker, or guarded by the caller's lock.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from dataclasses import dataclass

from cas_engine.kvfence.messages import AbortNotice, ReclaimAck
from cas_engine.kvfence.metrics import KvFenceMetrics

log = logging.getLogger(__name__)

Key = tuple[int, int]


class _Tomb(enum.Enum):
    ACKED = "acked"  # aborted and acknowledged: begin() refused, abort re-acked
    FINISHED = "finished"  # completed normally: abort acked, begin() refused


@dataclass(slots=True)
class _Room:
    outstanding: int = 0
    aborted: bool = False
    poisoned: bool = False
    sealed: bool = False


class WriteTracker:
    """Counts one prefill rank's in-flight KV writes per room and generation."""

    def __init__(
        self, rank: int, *, metrics: KvFenceMetrics | None = None, tombstone_capacity: int = 65536
    ) -> None:
        self.rank = rank
        self.metrics = metrics if metrics is not None else KvFenceMetrics()
        self._rooms: dict[Key, _Room] = {}
        self._tombs: OrderedDict[Key, _Tomb] = OrderedDict()
        self._tomb_capacity = tombstone_capacity
        self.unknown_aborts = 0
        self.skipped_chunks = 0
        self.poisoned_rooms = 0

    def begin(self, room: int, generation: int) -> bool:
        """Start tracking a room's transfer and pin its source pages; False: do not transfer."""
        key = (room, generation)
        if key in self._tombs or key in self._rooms:
            log.info(
                "rank %s refuses to begin room %s gen %s (already seen)",
                self.rank,
                room,
                generation,
            )
            return False
        self._rooms[key] = _Room()
        self.metrics.pinned_rooms.inc()
        return True

    def try_issue(self, room: int, generation: int) -> bool:
        """Count one chunk write about to be posted; False: skip it (aborted, poisoned, unknown)."""
        state = self._rooms.get((room, generation))
        if state is None or state.aborted or state.poisoned or state.sealed:
            self.skipped_chunks += 1
            self.metrics.skipped_chunks.inc()
            return False
        state.outstanding += 1
        return True

    def write_done(self, room: int, generation: int, *, ok: bool = True) -> ReclaimAck | None:
        """An issued chunk completed (``ok``) or failed/timed out (poisoned); maybe the ack."""
        key = (room, generation)
        state = self._rooms.get(key)
        if state is None or state.outstanding <= 0:
            raise RuntimeError(
                f"write_done for room {room} gen {generation} without an outstanding write"
            )
        state.outstanding -= 1
        if not ok and not state.poisoned:
            state.poisoned = True
            self.poisoned_rooms += 1
            self.metrics.poisoned.inc()
        return self._settle(key, state)

    def seal(self, room: int, generation: int) -> ReclaimAck | None:
        """No further chunk of this room will be issued (its transfer is fully posted)."""
        state = self._rooms.get((room, generation))
        if state is None:
            return None
        state.sealed = True
        return self._settle((room, generation), state)

    def on_abort(self, notice: AbortNotice) -> ReclaimAck | None:
        """Mark the room aborted; the ack if nothing of it is outstanding (never if poisoned)."""
        key = (notice.room, notice.generation)
        state = self._rooms.get(key)
        if state is not None:
            state.aborted = True
            return self._settle(key, state)
        tomb = self._tombs.get(key)
        if tomb is None:
            self.unknown_aborts += 1
            self.metrics.ignored.labels(reason="unknown_room").inc()
            log.info(
                "rank %s: abort for unknown room %s gen %s; acknowledging, tombstoned",
                self.rank,
                notice.room,
                notice.generation,
            )
        self._bury(key, _Tomb.ACKED)
        return self._ack(key)

    def on_endpoint_closed(self) -> list[Key]:
        """The decode endpoint is closed: no write can land; unpin and forget every room."""
        keys = list(self._rooms)
        for key in keys:
            del self._rooms[key]
            self.metrics.pinned_rooms.dec()
            self._bury(key, _Tomb.ACKED)
        return keys

    def is_pinned(self, room: int, generation: int) -> bool:
        """True while the room's source pages must not be freed or reused."""
        return (room, generation) in self._rooms

    def outstanding(self, room: int, generation: int) -> int:
        state = self._rooms.get((room, generation))
        return 0 if state is None else state.outstanding

    @property
    def pinned_rooms(self) -> int:
        return len(self._rooms)

    def _settle(self, key: Key, state: _Room) -> ReclaimAck | None:
        """Drop a drained room (unpin); return the ack if it was aborted and is not poisoned."""
        if state.outstanding > 0 or state.poisoned or not (state.aborted or state.sealed):
            return None
        del self._rooms[key]
        self.metrics.pinned_rooms.dec()
        if state.aborted:
            self._bury(key, _Tomb.ACKED)
            return self._ack(key)
        self._bury(key, _Tomb.FINISHED)
        return None

    def _ack(self, key: Key) -> ReclaimAck:
        return ReclaimAck(room=key[0], generation=key[1], rank=self.rank)

    def _bury(self, key: Key, tomb: _Tomb) -> None:
        self._tombs[key] = tomb
        self._tombs.move_to_end(key)
        while len(self._tombs) > self._tomb_capacity:
            self._tombs.popitem(last=False)
