"""Prefill/decode KV hand-off of the sim: bootstrap rendezvous, transfers, the KV fence.

Protocol for one request (the router sends the same body, with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room``, to a prefill and a decode worker at once)::

    decode                                   prefill (bootstrap server on bootstrap_port)
    alloc slot; ledger.track(room)
    POST /sim/kv/dest {room, generation, ---> dest of the room (waits until the prefill
         session, addr, nbytes, notify}       request has "computed" its KV)
                                              tracker.begin/try_issue; [stall fault]
                                     <------- transfer engine WRITE into the decode's slot
                                              tracker.write_done/seal
    /sim/kv/done {room, generation, ok} <---- POST notify
    ledger.transfer_done; check slot == expected_kv(prompt); decode

    budget exceeded before done: ledger.abort(room) -> free per mode (Immediate: now)
    POST /sim/kv/abort {notice}  ----------> tracker.on_abort; answers with the ack once no
                                              write of the room can land any more
    ledger.on_ack(ack) -> free the slot (Strict / Upstream); Upstream also frees on its timer

    prefill dead (no ack; its bootstrap /health fails HEARTBEAT_DEAD_AFTER times in a row):
    ledger.on_peer_dead(rank) -> nothing freed; PeerProber probes the prefill's bootstrap
    listener (incarnation check) and its transfer engine's listener; on confirmed closure
    (refused, or a new incarnation, 3x each) -> ledger.on_peer_closed(rank) -> free the slots

    prefill pod confirmed gone by the operator (kvfence.gone_feed, ``--cas-prefill-gone-file``):
    rooms of that bootstrap address whose dest was answered at least the clock skew before the
    pod's containers finished -> ledger.on_room_closed -> free the slots (as the SGLang adapter)

Each prefill incarnation is one ledger "rank" on the decode (a fresh id once it is declared
dead); the prefill's ack is mapped back to the rank its room was tracked with. The first
``/sim/kv/dest`` answer binds the rank to the prefill's incarnation and names its transfer
session (the endpoints to probe); later dests carry that incarnation and another process at the
address refuses them (409). A ``/health``, dest or abort answer from another incarnation declares
the rank dead at once (a restarted prefill never acks for its predecessor); the prober decides.
The prober runs in its own thread; its verdict reaches the ledger via
``loop.call_soon_threadsafe``.

Transfers use mooncake's TransferEngine over TCP (``P2PHANDSHAKE``: the session id is the
decode's ``host:rpc_port``, no metadata server); :class:`HttpTransport` is the fallback where
mooncake is not installed (same semantics, bytes carried in an HTTP body).

Ownership: :class:`DecodeKv` owns the decode pool's free list and the ledger; :class:`PrefillKv`
owns the staging pool, the write tracker and the per-room rendezvous. Both run on the worker's
event loop (single-threaded), so the ledger and the tracker need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np

from cas_engine.kvfence import AbortNotice, ReclaimAck, ReclaimLedger, WriteTracker
from cas_engine.kvfence.gone_feed import GonePrefill, normalise_host
from cas_engine.kvfence.peer_probe import (
    INCARNATION_HEADER,
    Endpoint,
    PeerProber,
    http_incarnation,
)
from cas_engine.sim.faults import Faults
from cas_engine.sim.kvpool import KvPool, corrupt, expected_kv

log = logging.getLogger("cas_engine.sim.pd")

PREFILL_RANK = 0
HANDSHAKE_MEMORY = 65536  # rooms whose handshake time is kept (oldest dropped)
HEARTBEAT_INTERVAL_S = 0.5  # decode -> prefill bootstrap /health while rooms wait on its ack
HEARTBEAT_TIMEOUT_S = 1.0
HEARTBEAT_DEAD_AFTER = 3  # consecutive failures: the prefill is declared dead (as SGLang's)
TRANSPORT_ENV = "CAS_SIM_KV_TRANSPORT"
_MAX_ROOMS = 65536


class Transport(Protocol):
    """Writes bytes from local registered memory into a peer's registered memory."""

    session_id: str

    def register(self, pool: KvPool) -> None: ...

    async def write(self, session: str, src: int, dst: int, nbytes: int) -> bool: ...


class MooncakeTransport:
    """mooncake TransferEngine over TCP; the write runs in a thread (it blocks)."""

    def __init__(self, host: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize failed: {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, pool: KvPool) -> None:
        rc = self._engine.register_memory(pool.base_addr, pool.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory failed: {rc}")

    async def write(self, session: str, src: int, dst: int, nbytes: int) -> bool:
        loop = asyncio.get_running_loop()
        rc: int = await loop.run_in_executor(
            None, self._engine.transfer_sync_write, session, src, dst, nbytes
        )
        return rc == 0


class HttpTransport:
    """Fallback without mooncake: bytes travel to ``{session}/sim/kv/write`` (the decode URL)."""

    def __init__(self, self_url: str, http: Callable[[], aiohttp.ClientSession]) -> None:
        self.session_id = self_url
        self._http = http
        self._pools: list[KvPool] = []

    def register(self, pool: KvPool) -> None:
        self._pools.append(pool)

    def local_write(self, dst: int, data: bytes) -> None:
        """Apply a remote write to the registered pool holding ``dst``."""
        for pool in self._pools:
            if pool.base_addr <= dst < pool.base_addr + pool.nbytes:
                off = dst - pool.base_addr
                pool.buf.reshape(-1)[off : off + len(data)] = np.frombuffer(data, dtype=np.uint8)
                return
        raise ValueError("address outside registered memory")

    async def write(self, session: str, src: int, dst: int, nbytes: int) -> bool:
        data = _read_local(self._pools, src, nbytes)
        async with self._http().post(
            f"{session}/sim/kv/write", data=data, headers={"X-Sim-Addr": str(dst)}
        ) as resp:
            return resp.status == 200


def _read_local(pools: list[KvPool], addr: int, nbytes: int) -> bytes:
    for pool in pools:
        if pool.base_addr <= addr < pool.base_addr + pool.nbytes:
            off = addr - pool.base_addr
            return pool.buf.reshape(-1)[off : off + nbytes].tobytes()
    raise ValueError("address outside registered memory")


def make_transport(
    host: str, self_url: str, http: Callable[[], aiohttp.ClientSession]
) -> Transport:
    """mooncake when importable, else the HTTP fallback (forced by CAS_SIM_KV_TRANSPORT=http)."""
    if os.environ.get(TRANSPORT_ENV, "").lower() == "http":
        return HttpTransport(self_url, http)
    try:
        return MooncakeTransport(host)
    except ImportError:
        log.warning("mooncake not installed: KV transfers use the HTTP fallback")
        return HttpTransport(self_url, http)


@dataclass(slots=True)
class _Peer:
    """One prefill incarnation at a bootstrap host:port as the decode sees it: its ledger rank,
    its incarnation id (from its first ``/sim/kv/dest`` answer) and the endpoints to probe."""

    rank: int
    incarnation: str | None = None
    endpoints: tuple[Endpoint, ...] = ()
    failures: int = 0


def peer_endpoints(host: str, port: int, answer: dict[str, Any]) -> tuple[Endpoint, ...]:
    """Probe targets of a prefill from its dest answer: the bootstrap listener (with the
    incarnation check) and its transfer engine's listener (mooncake ``host:rpc_port``, or the
    worker URL for the HTTP fallback). Both live as long as the prefill process."""
    inc = answer.get("incarnation")
    if not isinstance(inc, str):
        return ()
    ident = http_incarnation("/health")
    eps = [Endpoint(host, port, inc, ident)]
    session = str(answer.get("session", ""))
    if session.startswith("http://"):
        h, _, p = session.removeprefix("http://").rstrip("/").rpartition(":")
        eps.append(Endpoint(h, int(p), inc, ident))
    elif ":" in session:
        h, _, p = session.rpartition(":")
        eps.append(Endpoint(h, int(p)))
    return tuple(eps)


@dataclass(frozen=True, slots=True)
class Dest:
    """Where the prefill writes a room's KV, and whom it tells."""

    room: int
    generation: int
    session: str
    addr: int
    nbytes: int
    notify: str


class DecodeKv:
    """Decode side: slot allocation, rendezvous with the prefill, fence, content checks."""

    def __init__(
        self,
        *,
        pool: KvPool,
        transport: Transport,
        ledger: ReclaimLedger,
        http: Callable[[], aiohttp.ClientSession],
        self_url: str,
        prober: PeerProber | None = None,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.ledger = ledger
        self.prober = prober
        self._http = http
        self._self_url = self_url
        self._done: dict[int, asyncio.Future[int | None]] = {}
        self.transfer_queue = 0
        self.bg: set[asyncio.Task[None]] = set()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._rank_addr: dict[int, tuple[str, int]] = {}
        self._next_rank = PREFILL_RANK
        self._rank_inc: dict[int, str] = {}  # rank -> the incarnation it stands for
        self._heartbeat: asyncio.Task[None] | None = None
        # (room, generation) -> wall time its dest was answered (the handshake), bounded
        self._handshake_at: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._gone: dict[tuple[str, int], float] = {}  # bootstrap addr -> latest confirmed end
        self.gone_clock_skew_s = 10.0

    async def acquire(self, room: int, host: str, port: int, timeout: float) -> int | None:
        """Allocate a slot for ``room``, track it and register it with the prefill."""
        slot = await self.pool.alloc(timeout)
        if slot is None:
            return None
        peer = self._peer(host, port)
        try:
            lease = self.ledger.track(room, [slot], [peer.rank])
        except ValueError:
            self.pool.free([slot])
            raise
        self._done[room] = asyncio.get_running_loop().create_future()
        dest = {
            "room": room,
            "generation": lease.generation,
            "session": self.transport.session_id,
            "addr": self.pool.addr(slot),
            "nbytes": self.pool.slot_bytes,
            "notify": self._self_url,
            "incarnation": peer.incarnation,  # the prefill refuses (409) if it is another one
        }
        answer: Any = None
        try:
            async with self._http().post(f"http://{host}:{port}/sim/kv/dest", json=dest) as r:
                answer = await r.json() if r.status in (200, 409) else None
                r.raise_for_status()
            self._learn(host, port, peer, answer if isinstance(answer, dict) else {}, bind=True)
            self._handshake_at[(room, lease.generation)] = time.time()
            while len(self._handshake_at) > HANDSHAKE_MEMORY:
                self._handshake_at.popitem(last=False)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(answer, dict):
                self._learn(host, port, peer, answer)  # 409: a restarted prefill answered
            log.warning("room %s: bootstrap registration failed: %s", room, exc)
            self._done.pop(room, None)
            self._abort_now(room)
            return None
        return slot

    async def wait_done(self, room: int, timeout: float) -> int | None:
        """The prefill's cached-token count once it reported the room's transfer complete
        within ``timeout``; None on timeout or a failed transfer."""
        fut = self._done[room]
        self.transfer_queue += 1
        try:
            cached = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            cached = None
        finally:
            self.transfer_queue -= 1
            self._done.pop(room, None)
        if cached is not None:
            self.ledger.transfer_done(room)
        return cached

    def on_done(self, room: int, generation: int, ok: bool, cached_tokens: int = 0) -> None:
        """The prefill's transfer notification (HTTP ``/sim/kv/done``)."""
        lease = self.ledger.lease(room)
        fut = self._done.get(room)
        if lease is None or lease.generation != generation or fut is None or fut.done():
            return
        fut.set_result(cached_tokens if ok else None)

    def finish(self, room: int) -> None:
        """Normal end of a room whose transfer completed: its slot goes back at once."""
        self.pool.free(self.ledger.finish(room).slots)

    def abort(self, room: int, host: str, port: int) -> None:
        """Abort ``room`` (budget missed, client gone, guard trip before transfer)."""
        lease = self.ledger.lease(room)
        rank = min(lease.ranks) if lease is not None else PREFILL_RANK
        notice = self._abort_now(room)
        if notice is not None:
            self._release_gone(notice.room, notice.generation)
        if notice is not None and self.ledger.is_quarantined(notice.room, notice.generation):
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._send_abort(notice, host, port, rank))
            self.bg.add(task)
            task.add_done_callback(self.bg.discard)
            if self._heartbeat is None or self._heartbeat.done():
                self._heartbeat = loop.create_task(self._heartbeat_loop())

    async def close(self) -> None:
        """Stop the heartbeat and the prober thread (the worker is shutting down)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self.prober is not None:
            self.prober.close(timeout=0)

    def poll(self) -> None:
        """Periodic tick: Upstream's timer releases."""
        for reclaim in self.ledger.poll():
            self.pool.free(reclaim.slots)

    def _abort_now(self, room: int) -> AbortNotice | None:
        ab = self.ledger.abort(room)
        for reclaim in ab.released:
            self.pool.free(reclaim.slots)
        return ab.notice

    async def _send_abort(self, notice: AbortNotice, host: str, port: int, rank: int) -> None:
        """Deliver the notice; the prefill answers with the ack once no write can land.
        Stops once the room left quarantine (acked, or its dead peer's endpoint closed)."""
        for _ in range(600):  # bounded: 600 attempts of up to 60 s each
            if not self.ledger.is_quarantined(notice.room, notice.generation):
                return
            peer = self._peers.get((host, port))
            try:
                async with self._http().post(
                    f"http://{host}:{port}/sim/kv/abort",
                    json={**notice.to_dict(), "session": self.transport.session_id},
                    timeout=aiohttp.ClientTimeout(total=60),
                ) as r:
                    body: dict[str, Any] = await r.json()
                if peer is not None and peer.rank == rank:
                    self._learn(host, port, peer, body)
                inc, bound = body.get("incarnation"), self._rank_inc.get(rank)
                if inc is not None and bound is not None and inc != bound:
                    return  # another process acks for the dead writer: the prober decides
                if body.get("ack"):
                    ack = ReclaimAck.from_dict(body["ack"])
                    ack = ReclaimAck(room=ack.room, generation=ack.generation, rank=rank)
                    for reclaim in self.ledger.on_ack(ack):
                        self.pool.free(reclaim.slots)
                    return
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.info("abort notice for room %s not delivered yet: %s", notice.room, exc)
                await asyncio.sleep(0.5)

    # ---- the operator's confirmation: prefill pods gone for good ------------------------------

    def on_prefill_gone(self, gone: GonePrefill) -> None:
        """The operator confirmed the prefill pod at ``gone``'s address ended (event loop)."""
        addr = (gone.host, gone.port)
        self._gone[addr] = max(self._gone.get(addr, gone.finished_at), gone.finished_at)
        freed = sum(self._release_gone(lease.room, lease.generation)
                    for lease in self.ledger.quarantined())  # fmt: skip
        log.warning("prefill %s:%s (%s) confirmed gone: %d held rooms released",
                    gone.host, gone.port, gone.pod or "?", freed)  # fmt: skip

    def _release_gone(self, room: int, generation: int) -> int:
        """Release a held room whose prefill's confirmed end came after its handshake."""
        at = self._handshake_at.get((room, generation))
        lease = next((q for q in self.ledger.quarantined()
                      if (q.room, q.generation) == (room, generation)), None)  # fmt: skip
        if at is None or lease is None:
            return 0
        for rank in lease.pending:
            host, port = self._rank_addr.get(rank, ("", 0))
            finished = self._gone.get((normalise_host(host), port))
            if finished is None or at > finished - self.gone_clock_skew_s:
                return 0
        released = self.ledger.on_room_closed(room, generation)
        for reclaim in released:
            self.pool.free(reclaim.slots)
        self._handshake_at.pop((room, generation), None)
        return len(released)

    # ---- dead prefills: heartbeat verdict, then the prober's confirmation ----------------------

    def _peer(self, host: str, port: int) -> _Peer:
        peer = self._peers.get((host, port))
        if peer is None:
            peer = self._peers[(host, port)] = _Peer(self._new_rank(host, port))
        return peer

    def _learn(
        self, host: str, port: int, peer: _Peer, answer: dict[str, Any], bind: bool = False
    ) -> None:
        """``bind`` (a dest answer): bind ``peer``'s rank to the incarnation that first answered
        and to its endpoints. Any answer from a different incarnation at the same address means
        the rank's process is gone or replaced: declare it dead (nothing is released; the
        prober confirms)."""
        inc = answer.get("incarnation")
        if not isinstance(inc, str) or self._peers.get((host, port)) is not peer:
            return
        if peer.incarnation is None:
            if not bind:
                return
            peer.incarnation = self._rank_inc[peer.rank] = inc
            peer.endpoints = peer_endpoints(host, port, answer)
        elif inc != peer.incarnation:
            log.warning(
                "prefill %s:%s answers as incarnation %s, not %s (rank %s)",
                host,
                port,
                inc,
                peer.incarnation,
                peer.rank,
            )
            self._declare_dead((host, port), peer)

    def _new_rank(self, host: str, port: int) -> int:
        rank = self._next_rank
        self._next_rank += 1
        self._rank_addr[rank] = (host, port)
        return rank

    async def _heartbeat_loop(self) -> None:
        """While aborted rooms wait on a live rank's ack, check that prefill's bootstrap
        ``/health``; HEARTBEAT_DEAD_AFTER failures in a row declare it dead. Ends when
        nothing waits (restarted by the next abort)."""
        while True:
            waiting: set[int] = set()
            for lease in self.ledger.quarantined():
                waiting |= lease.pending
            if not waiting:
                return
            peers = [(addr, peer) for addr, peer in self._peers.items() if peer.rank in waiting]
            await asyncio.gather(*(self._check(addr, peer) for addr, peer in peers))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _check(self, addr: tuple[str, int], peer: _Peer) -> None:
        try:
            async with self._http().get(
                f"http://{addr[0]}:{addr[1]}/health",
                timeout=aiohttp.ClientTimeout(total=HEARTBEAT_TIMEOUT_S),
            ) as r:
                ok = r.status == 200
                self._learn(*addr, peer, {"incarnation": r.headers.get(INCARNATION_HEADER)})
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        peer.failures = 0 if ok else peer.failures + 1
        if peer.failures >= HEARTBEAT_DEAD_AFTER and self._peers.get(addr) is peer:
            self._declare_dead(addr, peer)

    def _declare_dead(self, addr: tuple[str, int], peer: _Peer) -> None:
        """Heartbeat verdict: nothing is released; later rooms at ``addr`` get a new rank; the
        prober confirms (or never confirms) that the dead incarnation can no longer write."""
        self.ledger.on_peer_dead(peer.rank)
        self._peers[addr] = _Peer(self._new_rank(*addr))
        if self.prober is None:
            return
        loop = asyncio.get_running_loop()

        def closed(key: Any, evidence: str) -> None:  # prober thread -> event loop
            loop.call_soon_threadsafe(self._on_peer_closed, int(key), evidence)

        self.prober.watch(peer.rank, peer.endpoints, closed)

    def _on_peer_closed(self, rank: int, evidence: str) -> None:
        released = self.ledger.on_peer_closed(rank)
        for reclaim in released:
            self.pool.free(reclaim.slots)
        log.warning(
            "prefill %s (rank %s) confirmed closed (%s): %d quarantined rooms released",
            self._rank_addr.get(rank),
            rank,
            evidence,
            len(released),
        )


class PrefillKv:
    """Prefill side: rendezvous per room, staged writes under the write tracker."""

    def __init__(
        self,
        *,
        staging: KvPool,
        transport: Transport,
        tracker: WriteTracker,
        http: Callable[[], aiohttp.ClientSession],
        faults: Faults,
        wall: Callable[[float], float],
        rng: np.random.Generator,
    ) -> None:
        self.staging = staging
        self.transport = transport
        self.tracker = tracker
        self._http = http
        self._faults = faults
        self._wall = wall
        self._rng = rng
        self._dests: OrderedDict[int, asyncio.Future[Dest | None]] = OrderedDict()
        self._acks: dict[tuple[int, int], asyncio.Future[ReclaimAck]] = {}
        self._fence_gen: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._gen_counter = 0
        self.inflight = 0
        self.bootstrap_queue = 0
        self.stalled_writes = 0

    def _dest_future(self, room: int) -> asyncio.Future[Dest | None]:
        fut = self._dests.get(room)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._dests[room] = fut
            while len(self._dests) > _MAX_ROOMS:
                self._dests.popitem(last=False)
        return fut

    def on_dest(self, data: dict[str, Any]) -> None:
        """A decode registered where the room's KV goes (bootstrap ``/sim/kv/dest``)."""
        dest = Dest(
            room=int(data["room"]),
            generation=int(data["generation"]),
            session=str(data["session"]),
            addr=int(data["addr"]),
            nbytes=int(data["nbytes"]),
            notify=str(data["notify"]),
        )
        fut = self._dest_future(dest.room)
        if not fut.done():
            fut.set_result(dest)

    async def transfer(
        self, room: int, tokens: np.ndarray, timeout: float, cached_tokens: int = 0
    ) -> bool:
        """Send the room's KV to its decode; False when no decode registered in time."""
        self.bootstrap_queue += 1
        try:
            dest = await asyncio.wait_for(asyncio.shield(self._dest_future(room)), timeout)
        except TimeoutError:
            return False
        finally:
            self.bootstrap_queue -= 1
            self._dests.pop(room, None)
        if dest is None:
            return False  # the decode aborted the room before it was computed
        gen = self._local_gen(dest.session, dest.generation)
        if not self.tracker.begin(room, gen):
            return False  # aborted before we began: nothing may be written
        ok = True
        if self.tracker.try_issue(room, gen):
            ok = await self._write(dest, expected_kv(tokens, dest.nbytes))
            self._deliver(self.tracker.write_done(room, gen, ok=ok))
        self.tracker.seal(room, gen)
        await self._notify(dest, ok, cached_tokens)
        return ok

    async def _write(self, dest: Dest, content: bytes) -> bool:
        """One issued write: [stall], then the transfer engine write from a staging slot."""
        f = self._faults
        if f.corruption_rate and self._rng.random() < f.corruption_rate:
            content = corrupt(content)
        slot = await self.staging.alloc(timeout=60.0)
        if slot is None:
            return False
        self.inflight += 1
        try:
            self.staging.write(slot, content[: self.staging.slot_bytes])
            if f.kv_write_stall_rate and self._rng.random() < f.kv_write_stall_rate:
                self.stalled_writes += 1
                await asyncio.sleep(self._wall(f.kv_write_stall_s))
            return await self.transport.write(
                dest.session,
                self.staging.addr(slot),
                dest.addr,
                min(dest.nbytes, self.staging.slot_bytes),
            )
        except Exception as exc:  # a failed write may still land: the tracker poisons the room
            log.warning("room %s: KV write failed: %s", dest.room, exc)
            return False
        finally:
            self.inflight -= 1
            self.staging.free([slot])

    async def _notify(self, dest: Dest, ok: bool, cached_tokens: int) -> None:
        body = {
            "room": dest.room,
            "generation": dest.generation,
            "ok": ok,
            "cached_tokens": cached_tokens,
        }
        try:
            async with self._http().post(f"{dest.notify}/sim/kv/done", json=body) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("room %s: done notification failed: %s", dest.room, exc)

    def _local_gen(self, session: str, generation: int) -> int:
        """Tracker generation of a decode's (session, generation): decode ledgers number
        their generations independently, so a router retry of the same room on another decode
        must not collide with the first attempt's tombstone."""
        key = (session, generation)
        gen = self._fence_gen.get(key)
        if gen is None:
            self._gen_counter += 1
            gen = self._fence_gen[key] = self._gen_counter
            while len(self._fence_gen) > _MAX_ROOMS:
                self._fence_gen.popitem(last=False)
        return gen

    def _deliver(self, ack: ReclaimAck | None) -> None:
        if ack is None:
            return
        fut = self._acks.pop((ack.room, ack.generation), None)
        if fut is not None and not fut.done():
            fut.set_result(ack)

    async def on_abort(self, data: dict[str, Any], timeout: float) -> ReclaimAck | None:
        """An abort notice; returns the ack as soon as no write of the room can land."""
        remote = AbortNotice.from_dict(data)
        local = self._local_gen(str(data.get("session", "")), remote.generation)
        notice = AbortNotice(room=remote.room, generation=local)
        fut = self._dest_future(notice.room)
        if not fut.done():
            fut.set_result(None)  # a prefill still waiting for this room's dest stops waiting
        ack = self.tracker.on_abort(notice)
        if ack is None:
            key = (notice.room, notice.generation)
            waiter = self._acks.setdefault(key, asyncio.get_running_loop().create_future())
            try:
                ack = await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except TimeoutError:
                return None
        return ReclaimAck(room=ack.room, generation=remote.generation, rank=ack.rank)
