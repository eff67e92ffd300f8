"""KV byte transports of the race harness: mooncake's transfer engine over TCP, or shared memory.

Ownership: the decode process owns the KV pool (``DecodePool``: a numpy array of
``pages x words`` uint64 that remote writers fill); each prefill rank owns a source pool of the
same page size and a ``PageWriter`` that copies its source pages into decode pages. Both sides
are built from a :class:`PoolSpec` that the decode side publishes (it is picklable, so it can be
sent to the prefill processes).

- ``Transport.MOONCAKE``: ``mooncake.engine.TransferEngine`` with the P2P handshake and the TCP
  protocol on 127.0.0.1; the decode pool and every source pool are registered memory and a chunk
  is one ``batch_transfer_sync_write``. Needs the Debian packages libibverbs1 and libnuma1.
- ``Transport.SHM``: ``multiprocessing.shared_memory``; a chunk is a numpy copy into the shared
  pool. The fallback where mooncake cannot load; the fence logic above it is identical.

Imports of mooncake are lazy (only the MOONCAKE path loads it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

LOOPBACK = "127.0.0.1"


class Transport(enum.Enum):
    MOONCAKE = "mooncake"
    SHM = "shm"


def mooncake_available() -> tuple[bool, str]:
    """Whether mooncake's transfer engine loads here; the reason when it does not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError for missing libibverbs/libnuma, or no wheel
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


@dataclass(frozen=True)
class PoolSpec:
    """What a prefill rank needs to reach the decode pool."""

    transport: Transport
    pages: int
    words: int
    target: str = ""  # mooncake session id "127.0.0.1:port"
    base_addr: int = 0  # mooncake: address of the registered decode pool
    shm_name: str = ""  # shm: name of the shared pool

    @property
    def page_bytes(self) -> int:
        return self.words * 8


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake TransferEngine.initialize returned {rc}")
    return engine


def _register(engine: Any, array: np.ndarray) -> None:
    rc = engine.register_memory(array.ctypes.data, array.nbytes)
    if rc != 0:
        raise RuntimeError(f"mooncake register_memory returned {rc}")


class DecodePool:
    """The decode side's KV pool; ``view[page]`` is one page of ``words`` uint64."""

    def __init__(self, transport: Transport, pages: int, words: int) -> None:
        self._engine: Any = None
        self._shm: shared_memory.SharedMemory | None = None
        if transport is Transport.MOONCAKE:
            self.view = np.zeros((pages, words), dtype=np.uint64)
            self._engine = _mooncake_engine()
            _register(self._engine, self.view)
            self.spec = PoolSpec(
                transport,
                pages,
                words,
                target=f"{LOOPBACK}:{self._engine.get_rpc_port()}",
                base_addr=self.view.ctypes.data,
            )
        else:
            self._shm = shared_memory.SharedMemory(create=True, size=pages * words * 8)
            self.view = np.ndarray((pages, words), dtype=np.uint64, buffer=self._shm.buf)
            self.view[:] = 0
            self.spec = PoolSpec(transport, pages, words, shm_name=self._shm.name)

    def close(self) -> None:
        if self._shm is not None:
            del self.view
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        if self._engine is not None:
            self._engine.unregister_memory(self.view.ctypes.data)
            self._engine = None


class PageWriter:
    """A prefill rank's source pool and the copy of its pages into decode pages."""

    def __init__(self, spec: PoolSpec, source_pages: int) -> None:
        self.spec = spec
        self.source = np.zeros((source_pages, spec.words), dtype=np.uint64)
        self._engine: Any = None
        self._shm: shared_memory.SharedMemory | None = None
        if spec.transport is Transport.MOONCAKE:
            self._engine = _mooncake_engine()
            _register(self._engine, self.source)
        else:
            self._shm = shared_memory.SharedMemory(name=spec.shm_name)
            self._dest = np.ndarray((spec.pages, spec.words), dtype=np.uint64, buffer=self._shm.buf)

    def write(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        """Copy each source page into the matching decode page; False when the transfer failed."""
        if self._engine is None:
            self._dest[dst_pages] = self.source[src_pages]
            return True
        nbytes = self.spec.page_bytes
        src = [self.source.ctypes.data + p * nbytes for p in src_pages]
        dst = [self.spec.base_addr + p * nbytes for p in dst_pages]
        rc: int = self._engine.batch_transfer_sync_write(
            self.spec.target, src, dst, [nbytes] * len(src)
        )
        return rc == 0

    def close(self) -> None:
        if self._shm is not None:
            del self._dest
            self._shm.close()
            self._shm = None
        self._engine = None
