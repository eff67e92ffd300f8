"""KV memory of the sim: the decode's slot pool, the prefill's staging pool, expected contents.

Ownership: a decode worker owns one :class:`KvPool` (a numpy array registered with the transfer
engine, so a prefill writes into it remotely) and its free list; the
:class:`~cas_engine.kvfence.ReclaimLedger` decides when an aborted slot may go back to it. A
prefill worker owns a staging :class:`KvPool` (the source of its writes) whose slots are held
until the write completes (the kvfence tracker's "pinned source pages").

A slot holds a digest of the request's KV rather than real KV: ``expected_kv(tokens)`` is a
deterministic function of the prompt tokens, so the decode can check, on arrival and before
every decode step, that the slot still holds its own request's content. A stale write that lands
after the slot was reused shows up as a mismatch (the corruption of the GLM-5 report's bug 1).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import numpy.typing as npt


def expected_kv(tokens: np.ndarray, slot_bytes: int) -> bytes:
    """The ``slot_bytes`` of KV content a prompt's prefill produces (same in every process)."""
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=64).digest()
    reps = -(-slot_bytes // len(digest))
    return (digest * reps)[:slot_bytes]


def corrupt(content: bytes) -> bytes:
    """``content`` with every 7th byte flipped (what a bad write leaves behind)."""
    arr = bytearray(content)
    for i in range(0, len(arr), 7):
        arr[i] ^= 0xFF
    return bytes(arr)


class KvPool:
    """``slots`` x ``slot_bytes`` of contiguous memory with a LIFO free list.

    LIFO like real allocators: the most recently freed slot is handed out first, which is
    what lets a stale write hit the next request.
    """

    def __init__(self, slots: int, slot_bytes: int) -> None:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError("slots and slot_bytes must be > 0")
        self.slot_bytes = slot_bytes
        self.buf = np.zeros((slots, slot_bytes), dtype=np.uint8)
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._available = asyncio.Event()
        self._available.set()
        self.waiting = 0

    @property
    def base_addr(self) -> int:
        return int(self.buf.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def addr(self, slot: int) -> int:
        """Address of ``slot`` (for the transfer engine)."""
        return self.base_addr + slot * self.slot_bytes

    def try_alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    async def alloc(self, timeout: float) -> int | None:
        """A free slot, waiting up to ``timeout`` wall seconds; None on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiting += 1
        try:
            while True:
                slot = self.try_alloc()
                if slot is not None:
                    return slot
                self._available.clear()
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._available.wait(), left)
                except TimeoutError:
                    return None
        finally:
            self.waiting -= 1

    def free(self, slots: tuple[int, ...] | list[int]) -> None:
        """Return ``slots`` to the free list (the caller decided it is safe)."""
        self._free.extend(slots)
        self._available.set()

    def write(self, slot: int, content: bytes) -> None:
        self.buf[slot, :] = np.frombuffer(content, dtype=np.uint8)

    def _row(self, slot: int) -> npt.NDArray[np.uint8]:
        row: npt.NDArray[np.uint8] = self.buf[slot]  # numpy types an int index as Any
        return row

    def read(self, slot: int) -> bytes:
        return self._row(slot).tobytes()

    def holds(self, slot: int, content: bytes) -> bool:
        """True while ``slot`` holds exactly ``content``."""
        return self._row(slot).tobytes() == content
