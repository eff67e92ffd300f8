"""Strict KV reclaim for SGLang's decode side (pinned SGLang 0.5.23).

What upstream does: an aborted or failed transfer whose prefill ranks may still write is held in
``DecodeTransferQueue._deferred_releases``; ``resolve_deferred_releases`` frees a GPU-resident
entry once every prefill rank acknowledged the abort (``kv_mgr.is_abort_release_safe``) OR once
``deferred_kv_release_timeout`` (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``,
30 s) has passed, which reopens the race for a stalled write (DESIGN.md, Bug 1).

What this adapter changes (minimal, no upstream code copied):

1. ``DecodeTransferQueue.__init__`` is wrapped: after it ran, the queue's timeout becomes
   ``math.inf``, so the deadline ``_defer_release`` computes (``start_time + timeout``) is never
   reached and ``resolve_deferred_releases`` releases device destinations only when drained,
   exactly like it already does for host destinations. The upstream timeout is kept as the
   "overdue" threshold for logging. It refuses to start when deferred release is disabled
   (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0``), since then nothing is held at all.
2. ``DecodeTransferQueue.resolve_deferred_releases`` is wrapped to observe the held entries:
   ``cas_kv_quarantined_rooms``, ``cas_kv_reclaims_total{outcome}``, the reclaim wait
   histogram, a warning per room once it is overdue, and :meth:`StrictReclaimPatch.health`,
   which turns unhealthy when more rooms are held than ``quarantine_budget_rooms``. Each held
   entry is mirrored as a lease of a STRICT :class:`~cas_engine.kvfence.ReclaimLedger` whose
   single "rank" is the prefill peer's incarnation.
3. ``CommonKVManager._handle_node_failure`` (decode, heartbeat thread) is wrapped to report the
   peer dead with the rooms it had at that moment; that releases nothing. Upstream never
   releases a dead peer's held rooms except by the timer, which strict mode removed.
4. ``CommonKVManager.is_abort_release_safe`` also answers True for a room whose dead peer's
   endpoint the transfer engine confirmed closed (``StrictReclaimPatch.on_peer_endpoint_closed``,
   the ledger's ``on_peer_closed`` rule): no write of that process can land any more.
   Rooms bootstrapped after the death belong to a new incarnation and are not released by it.

Before patching, :func:`check_decode_queue` and :func:`check_peer_hooks` verify the SGLang
version, that the methods exist and that their source still contains the lines this reasoning
depends on; any mismatch raises :class:`StrictReclaimError` with the reason, and the launcher
refuses to start (:func:`check_other_targets` adds the prefill targets of
:mod:`cas_engine.sglang.prefill_pin`). :func:`require_deferred_capable_backend` refuses
transfer backends whose KV manager does not defer the release of aborted transfers (read from
SGLang's source; mooncake, nixl and mori do).

Prefill-side source-page pinning lives in :mod:`cas_engine.sglang.prefill_pin`.

5. The confirmation source: mooncake's Python API (0.3.x) exposes no per-peer connection state,
   so when ``_handle_node_failure`` reports a peer dead, the wrapper also snapshots the dead
   peer's per-rank KV manager endpoints (``rank_ip:rank_port`` of ``connection_pool``: the ZMQ
   socket each prefill TP rank's scheduler process binds, the process that owns the transfer
   engine and issues the writes) and a :class:`~cas_engine.kvfence.peer_probe.PeerProber`
   probes them in its own thread: only a refused connect on every rank's port, 3 times in a
   row, counts as "closed" (timeouts, unreachable hosts and accepted connections never do; see
   :mod:`cas_engine.kvfence.peer_probe`). The verdict is queued like the heartbeat's and applied
   on the scheduler thread as :meth:`StrictReclaimPatch.on_peer_endpoint_closed` would, for that
   incarnation only. The launcher's install (``cls=None``) creates the prober; tests pass one.

   If SGLang dropped the cached bootstrap info before the heartbeat's verdict (a failed
   registration: ``invalidate_cached_bootstrap_infos``), the snapshot is empty; the prober
   then watches the rank endpoints the held rooms' receivers bootstrapped against
   (``bootstrap_infos``), remembered per address for the live incarnation.
6. The operator's confirmation: a deleted prefill pod's IP answers nothing, so the prober
   never sees a refusal. The operator lists prefill pods whose containers the kubelet reported
   terminated before the pod object went away (:mod:`cas_engine.kvfence.gone_feed`; never a
   force-deleted pod) in a ConfigMap mounted into decode pods; :class:`GoneFeed` reads it and
   :meth:`StrictReclaimPatch.on_prefill_gone` releases a held room of that bootstrap address
   whose bootstrap completed (``req.time_stats.bootstrap_done_time``, stamped in
   ``DecodePreallocQueue._update_handshake_waiters``) at least ``clock_skew_s`` before the
   pod's containers finished. Why that is safe: the handshake that gave the room its prefill
   ranks happened before that time, when the address still belonged to the gone pod (or an
   earlier one, gone before it); a replacement that reuses the IP starts only after the old
   sandbox is torn down, and never learns the old room's destination. Rooms bootstrapped later,
   or never, stay held. This needs node clocks within ``clock_skew_s`` (10 s; NTP keeps them
   far closer) and no heartbeat verdict, so it also frees rooms of a prefill that ended before
   the heartbeat noticed.

What held rooms block: upstream's ``Scheduler.is_fully_idle`` is False while deferred releases
are pending (scheduler.py:5381), so the idle-only work does not run: the pool leak check is
skipped (scheduler.py:5286-5290), ``/flush_cache``, HiCache attach/detach and a P/D role switch are
refused, and the loop polls without sleeping. That must stay so (a flush would free held pages
under a live write), but it is no longer silent: when held rooms are the only thing keeping
the scheduler busy, ``cas_kv_idle_blocked_by_held_rooms`` is 1 and one warning per episode
names what is blocked.

Held rooms are counted by cause (``cas_kv_quarantined_rooms_by_cause{cause}``):
``awaiting_ack`` (the prefill is alive as far as decode knows: a slow transfer, or a poisoned
send that will never ack) and ``peer_dead`` (the heartbeat declared it dead; waiting for the
prober or the operator). A poisoned send on a live prefill stays held until that prefill ends
(then the operator's confirmation frees it) or the budget makes the operator replace this decode
pod: the damage is bounded by ``quarantine_budget_rooms``. Host (HiCache) destinations keep
upstream's receiver-level drain check and are not released by either confirmation.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from cas_engine.kvfence.gone_feed import (
    GoneFeed,
    GoneFeedError,
    GoneFeedMetrics,
    GonePrefill,
    split_host_port,
)
from cas_engine.kvfence.ledger import Reclaim, ReclaimLedger
from cas_engine.kvfence.messages import ReclaimAck, ReclaimMode
from cas_engine.kvfence.metrics import KvFenceMetrics
from cas_engine.kvfence.peer_probe import Endpoint, PeerProbeMetrics, PeerProber
from cas_engine.sglang.version import SGLangVersionError, require_sglang

log = logging.getLogger(__name__)

DECODE_MODULE = "sglang.srt.disaggregation.decode"
DECODE_CLASS = "DecodeTransferQueue"
ENABLE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"

# Method -> source lines of SGLang 0.5.23 the patch relies on.
FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "__init__": ("self.deferred_kv_release_timeout = (", "self._deferred_releases"),
    "_defer_release": ("deadline = start_time + self.deferred_kv_release_timeout",),
    "resolve_deferred_releases": (
        "is_ready = is_drained or now >= deadline",
        "is_abort_release_safe(",
        "self._deferred_releases = still_held",
    ),
    "_do_release": ("clear_deferred_abort_state(",),
}

# CommonKVManager (decode role): peer failure and the release-safety predicate we extend.
PEER_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "_handle_node_failure": (
        "self.addr_to_rooms_tracker.get(failed_bootstrap_addr, [])",
        "self.update_status(room, KVPoll.Failed)",
    ),
    "is_abort_release_safe": ("return len(acks) >= required_acks",),
}
# DecodePreallocQueue: where the handshake's completion time is stamped (the gone feed reads it).
BOOTSTRAP_CLASS = "DecodePreallocQueue"
BOOTSTRAP_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "_update_handshake_waiters": (
        "elif poll == KVPoll.WaitingForInput:",
        "decode_req.req.time_stats.set_bootstrap_done_time()",
    ),
}
CLOCK_SKEW_S = 10.0  # the most the decode's and the prefill node's clocks may differ
CAUSES = ("awaiting_ack", "peer_dead")
KV_MGR_MODULE = "sglang.srt.disaggregation.common.conn"
KV_MGR_CLASS = "CommonKVManager"

_MARK = "_cas_strict_reclaim"


class StrictReclaimError(RuntimeError):
    """The SGLang in this image is not the one the strict-reclaim patch was written for."""


def strict_env() -> dict[str, str]:
    """Environment the launcher sets before SGLang reads it: deferred release must be on."""
    return {ENABLE_ENV: "1"}


def check_fingerprints(
    cls: type, fingerprints: dict[str, tuple[str, ...]], *, inherited: bool = False
) -> None:
    """Raise :class:`StrictReclaimError` unless ``cls`` has each method and its source lines.

    ``inherited``: the method may come from a base class (looked up through the MRO).
    Wrappers (``functools.wraps``) are looked through, so a patched class still checks.
    """
    for name, lines in fingerprints.items():
        method = getattr(cls, name, None) if inherited else cls.__dict__.get(name)
        if method is None:
            raise StrictReclaimError(
                f"{cls.__name__}.{name} is missing; strict KV reclaim "
                "cannot be applied to this SGLang"
            )
        method = inspect.unwrap(method)
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError) as exc:
            raise StrictReclaimError(
                f"cannot read the source of {cls.__name__}.{name}: {exc}"
            ) from exc
        for line in lines:
            if line not in source:
                raise StrictReclaimError(
                    f"{cls.__name__}.{name} no longer contains {line!r}; the logic the strict "
                    "patch relies on changed, so it would be unsound. Re-check the patch "
                    "against this SGLang version."
                )


def check_decode_queue(cls: type) -> None:
    """Raise :class:`StrictReclaimError` unless ``cls`` has the methods and lines we patch."""
    check_fingerprints(cls, FINGERPRINTS)


def check_peer_hooks(cls: type) -> None:
    """Same for the decode KV manager's peer-failure and release-safety hooks."""
    check_fingerprints(cls, PEER_FINGERPRINTS)


def check_bootstrap_stamp(cls: type) -> None:
    """Same for the prealloc queue's stamp of the handshake's completion time."""
    check_fingerprints(cls, BOOTSTRAP_FINGERPRINTS)


def check_other_targets() -> None:
    """Check every target besides the decode queue: KV manager hooks, the handshake stamp and
    the prefill side."""
    from cas_engine.sglang.prefill_pin import check_prefill_targets, load_prefill_targets

    check_peer_hooks(load_kv_manager_class())
    check_bootstrap_stamp(_load_class(DECODE_MODULE, BOOTSTRAP_CLASS))
    check_prefill_targets(load_prefill_targets())


def backend_supports_deferred_release(backend: str) -> bool:
    """Whether SGLang's ``backend`` KV manager holds failed transfers for deferred release.

    Read from the installed source (no import, so it works without torch): a backend whose
    manager does not set ``supports_deferred_decode_kv_release = True`` frees an aborted
    transfer's KV at once, and strict reclaim cannot be enforced on top of it.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise StrictReclaimError("sglang is not installed")
    conn = Path(spec.origin).parent / "srt" / "disaggregation" / backend / "conn.py"
    if not backend.isidentifier() or not conn.is_file():
        raise StrictReclaimError(f"unknown SGLang transfer backend {backend!r}")
    for node in ast.walk(ast.parse(conn.read_text(), filename=str(conn))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "supports_deferred_decode_kv_release" in names and node.value.value is True:
                return True
    return False


def require_deferred_capable_backend(backend: str) -> None:
    """Refuse strict mode on a transfer backend that cannot hold aborted transfers."""
    if not backend_supports_deferred_release(backend):
        raise StrictReclaimError(
            f"--disaggregation-transfer-backend {backend} releases aborted transfers at once; "
            "strict KV reclaim needs a backend with deferred release (mooncake, nixl, mori)"
        )


def import_sglang_module(module_name: str) -> Any:
    """Import an SGLang module; on failure drop the half-imported ``sglang.*`` modules.

    A failed import leaves namespace packages such as ``sglang.srt`` in ``sys.modules`` without
    their parent, which breaks every later ``import sglang...`` in this process.
    """
    before = set(sys.modules)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
        raise StrictReclaimError(f"cannot import {module_name}: {exc}") from exc


def _load_class(module_name: str, cls_name: str) -> type:
    try:
        require_sglang()
    except SGLangVersionError as exc:
        raise StrictReclaimError(str(exc)) from exc
    module = import_sglang_module(module_name)
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise StrictReclaimError(f"{module_name}.{cls_name} not found")
    return cls


def load_decode_queue_class() -> type:
    """Import the pinned SGLang's ``DecodeTransferQueue`` (version-checked)."""
    return _load_class(DECODE_MODULE, DECODE_CLASS)


def load_kv_manager_class() -> type:
    """Import the pinned SGLang's ``CommonKVManager`` (version-checked)."""
    return _load_class(KV_MGR_MODULE, KV_MGR_CLASS)


@dataclass
class _Held:
    """One held deferred-release entry mirrored as a ledger lease (ranks: {peer incarnation})."""

    key: int  # ledger room id (unique per held entry)
    generation: int
    peer: int
    mgr_room: tuple[int, Any]  # (id(kv_mgr), bootstrap_room): what is_abort_release_safe sees
    addr: tuple[str, int] | None = None  # the prefill's bootstrap (host, port), normalised
    bootstrapped_at: float | None = None  # wall clock of the handshake's completion, if any
    closed: bool = False  # released by the peer's confirmed endpoint close


@dataclass(frozen=True)
class _PeerEvent:
    """A peer event queued by any thread, applied on the scheduler thread (``prepare``).

    ``dead``: heartbeat verdict (rooms and rank endpoints at that moment); ``closed``: outside
    confirmation for every dead incarnation at ``addr``; ``probed``: the prober confirmed the
    incarnation ``peer`` closed; ``gone``: the operator confirmed the prefill pod at ``addr``
    ended at ``finished_at``."""

    kind: str
    addr: str
    rooms: frozenset[Any] = frozenset()
    endpoints: tuple[Endpoint, ...] = ()
    peer: int = 0
    gone: GonePrefill | None = None


@dataclass
class StrictReclaimPatch:
    """State of an installed patch: what it observed in the last resolve pass.

    Held entries are mirrored in a STRICT :class:`~cas_engine.kvfence.ReclaimLedger`, one lease
    per entry whose only "rank" is the prefill peer's incarnation: upstream's per-rank acks
    release an entry (recorded as the lease's ack); a peer declared dead (heartbeat) releases
    nothing; the transfer engine's confirmation that the dead peer's endpoint is closed
    (:meth:`on_peer_endpoint_closed`) releases the leases of that incarnation, which the
    patched ``is_abort_release_safe`` then reports as safe. Peer events may come from any
    thread; they are queued and applied on the scheduler thread at the next resolve pass.
    """

    quarantine_budget_rooms: int | None
    metrics: KvFenceMetrics
    rooms_gauge: Gauge
    clock: Callable[[], float] = time.monotonic
    held_rooms: int = 0
    overdue_rooms: int = 0
    ledger: ReclaimLedger | None = None
    _warned: set[int] = field(default_factory=set)
    _held: dict[int, _Held] = field(default_factory=dict)  # id(decode_req) -> lease mirror
    _by_key: dict[int, int] = field(default_factory=dict)  # ledger room -> id(decode_req)
    _next_key: int = 0
    _peer_ids: dict[str, int] = field(default_factory=dict)  # addr -> current incarnation
    _dead: dict[int, tuple[str, set[Any]]] = field(default_factory=dict)  # id -> addr, rooms
    _closed_ids: set[int] = field(default_factory=set)
    _safe: set[tuple[int, Any]] = field(default_factory=set)  # released by endpoint close
    _events: deque[_PeerEvent] = field(default_factory=deque)
    prober: PeerProber | None = None  # confirms a dead peer's endpoints closed (None: never)
    cause_gauge: Gauge | None = None  # held rooms by cause
    idle_gauge: Gauge | None = None  # 1 while held rooms alone keep the scheduler out of idle
    idle_blocked: bool = False
    feed: GoneFeed | None = None  # the operator's confirmations; started on the first resolve
    wall_clock: Callable[[], float] = time.time
    perf_clock: Callable[[], float] = time.perf_counter  # SGLang's time_stats clock
    clock_skew_s: float = CLOCK_SKEW_S
    _gone: dict[tuple[str, int], float] = field(default_factory=dict)  # addr -> latest finish
    # addr -> rank endpoints of the live incarnation, as its held rooms' receivers knew them:
    # SGLang drops its cached bootstrap info on a failed registration
    # (CommonKVReceiver.invalidate_cached_bootstrap_infos, common/conn.py:2688), so the
    # heartbeat's snapshot may hold none
    _known_endpoints: dict[str, set[Endpoint]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ledger is None:
            self.ledger = ReclaimLedger(
                mode=ReclaimMode.STRICT, metrics=self.metrics, clock=self.clock
            )

    def health(self) -> tuple[bool, str]:
        """False while more rooms are held than the budget allows (the operator drains)."""
        budget = self.quarantine_budget_rooms
        if budget is None or self.held_rooms <= budget:
            return True, ""
        return False, (
            f"KV quarantine: {self.held_rooms} aborted rooms held awaiting prefill "
            f"abort acks (budget {budget}, {self.overdue_rooms} past the upstream "
            "timeout); reuse is not provably safe, drain this pod"
        )

    # ---- peer events (any thread) --------------------------------------------------------------

    def on_peer_dead(
        self,
        bootstrap_addr: str,
        rooms: frozenset[Any] = frozenset(),
        endpoints: tuple[Endpoint, ...] = (),
    ) -> None:
        """The heartbeat declared the prefill at ``bootstrap_addr`` dead; releases nothing.
        ``endpoints``: its ranks' listening sockets, probed (if a prober is set) for closure."""
        self._events.append(_PeerEvent("dead", bootstrap_addr, rooms, endpoints))

    def on_peer_endpoint_closed(self, bootstrap_addr: str) -> None:
        """The transfer engine confirmed the dead peer's endpoint closed: no write can land."""
        self._events.append(_PeerEvent("closed", bootstrap_addr))

    def on_prefill_gone(self, gone: GonePrefill) -> None:
        """The operator confirmed the prefill pod at ``gone``'s address ended (any thread)."""
        self._events.append(_PeerEvent("gone", f"{gone.host}:{gone.port}", gone=gone))

    def is_closed_safe(self, kv_mgr: Any, room: Any) -> bool:
        """Whether an endpoint close already proved ``room`` of ``kv_mgr`` safe to release."""
        return (id(kv_mgr), room) in self._safe

    # ---- scheduler thread ----------------------------------------------------------------------

    def prepare(self, queue: Any) -> None:
        """Before upstream's resolve: apply queued peer events, mirror new held entries.

        Events first: an entry held since the peer's death is attributed by its room (in the
        death-time snapshot: the dead incarnation; otherwise the live one), not by arrival order.
        """
        if self.feed is not None:
            self.feed.start()  # idempotent; only decode schedulers resolve deferred releases
        while self._events:
            ev = self._events.popleft()
            if ev.gone is not None:
                self._apply_gone(ev.gone)
            elif ev.kind == "dead":
                self._apply_dead(ev.addr, ev.rooms, ev.endpoints)
            elif ev.kind == "probed":
                self._close_incarnation(ev.peer)
            else:
                self._apply_closed(ev.addr)
        for entry in queue._deferred_releases:
            if id(entry[0]) not in self._held:
                self._track(entry[0])

    def observe(self, queue: Any, before: list[tuple[Any, ...]]) -> None:
        """Account releases and held rooms after one ``resolve_deferred_releases`` pass."""
        assert self.ledger is not None
        now = self.clock()
        held = queue._deferred_releases
        held_ids = {id(entry[0]) for entry in held}
        for entry in before:
            if id(entry[0]) in held_ids:
                continue
            self._warned.discard(id(entry[0]))
            mirror = self._held.pop(id(entry[0]), None)
            if mirror is None:
                continue
            self._by_key.pop(mirror.key, None)
            self._safe.discard(mirror.mgr_room)
            if not mirror.closed:
                self.ledger.on_ack(ReclaimAck(mirror.key, mirror.generation, mirror.peer))
        overdue_s = getattr(queue, "_cas_upstream_timeout_s", math.inf)
        overdue = [e for e in held if now - e[1] >= overdue_s]
        for entry in overdue:
            if id(entry[0]) not in self._warned:
                self._warned.add(id(entry[0]))
                log.warning(
                    "strict KV reclaim: room %s still held %.0f s after abort, waiting "
                    "for every prefill rank's ack (upstream would release it now)",
                    getattr(entry[0].req, "bootstrap_room", "?"),
                    now - entry[1],
                )
        self.held_rooms, self.overdue_rooms = len(held), len(overdue)
        self.rooms_gauge.set(len(held))
        if self.cause_gauge is not None:
            counts = dict.fromkeys(CAUSES, 0)
            for entry in held:
                mirror = self._held.get(id(entry[0]))
                dead = mirror is not None and mirror.peer in self._dead
                counts["peer_dead" if dead else "awaiting_ack"] += 1
            for cause, n in counts.items():
                self.cause_gauge.labels(cause=cause).set(n)
        self._observe_idle(queue)

    def _observe_idle(self, queue: Any) -> None:
        """Whether held rooms alone keep SGLang's scheduler from idle (see the module doc)."""
        scheduler = getattr(queue, "scheduler", None)
        check = getattr(scheduler, "is_fully_idle", None)
        blocked = False
        if queue._deferred_releases and callable(check):
            held, queue._deferred_releases = queue._deferred_releases, []
            try:
                blocked = bool(check())
            finally:
                queue._deferred_releases = held
        if blocked and not self.idle_blocked:
            log.warning(
                "strict KV reclaim: %d held rooms are all that keeps this decode busy; until "
                "they are released the idle-only work stays off: no pool leak check, "
                "/flush_cache and HiCache attach/detach and role switches are refused, and "
                "the scheduler polls without sleeping",
                len(queue._deferred_releases),
            )
        self.idle_blocked = blocked
        if self.idle_gauge is not None:
            self.idle_gauge.set(1.0 if blocked else 0.0)
        self.metrics.unhealthy.set(0.0 if self.health()[0] else 1.0)

    def _peer(self, addr: str) -> int:
        if addr not in self._peer_ids:
            self._peer_ids[addr] = self._new_id()
        return self._peer_ids[addr]

    def _new_id(self) -> int:
        self._next_key += 1
        return self._next_key

    def _track(self, decode_req: Any) -> None:
        assert self.ledger is not None
        receiver = decode_req.kv_receiver
        addr = str(getattr(receiver, "bootstrap_addr", ""))
        room = decode_req.req.bootstrap_room
        peer = self._peer(addr)
        for dead_id, (dead_addr, rooms) in self._dead.items():
            if dead_addr == addr and room in rooms:
                peer = dead_id  # bootstrapped before the peer died: that incarnation wrote it
        endpoints = receiver_endpoints(receiver)
        if peer in self._dead:  # its death came with no endpoint (bootstrap info invalidated
            self._watch_dead(addr, peer, endpoints)  # before the heartbeat): probe the room's
        else:
            self._known_endpoints.setdefault(addr, set()).update(endpoints)
        key = self._new_id()
        lease = self.ledger.track(key, (), (peer,))
        self.ledger.abort(key)
        mirror = _Held(
            key,
            lease.generation,
            peer,
            (id(getattr(receiver, "kv_mgr", None)), room),
            addr=_parse_addr(addr),
            bootstrapped_at=self._bootstrapped_at(decode_req),
        )
        self._held[id(decode_req)] = mirror
        self._by_key[key] = id(decode_req)
        if peer in self._closed_ids:
            self._mark_closed(self.ledger.on_peer_closed(peer))
        if not mirror.closed and self._gone_covers(mirror):
            self._close_room(mirror)

    def _bootstrapped_at(self, decode_req: Any) -> float | None:
        """Wall-clock time SGLang stamped the room's handshake done (None: it never was)."""
        stamp = getattr(getattr(decode_req.req, "time_stats", None), "bootstrap_done_time", 0.0)
        if not isinstance(stamp, (int, float)) or stamp <= 0.0:
            return None
        return self.wall_clock() - (self.perf_clock() - float(stamp))

    def _gone_covers(self, mirror: _Held) -> bool:
        """Whether a confirmed end of the room's prefill came after its handshake (+ skew)."""
        if mirror.addr is None or mirror.bootstrapped_at is None:
            return False
        finished = self._gone.get(mirror.addr)
        return finished is not None and mirror.bootstrapped_at <= finished - self.clock_skew_s

    def _apply_gone(self, gone: GonePrefill) -> None:
        addr = (gone.host, gone.port)
        self._gone[addr] = max(self._gone.get(addr, gone.finished_at), gone.finished_at)
        freed = 0
        for mirror in list(self._held.values()):
            if mirror.addr == addr and not mirror.closed and self._gone_covers(mirror):
                self._close_room(mirror)
                freed += 1
        log.warning(
            "strict KV reclaim: the operator confirmed prefill %s (%s) ended; %d held rooms "
            "bootstrapped before it are released",
            f"{gone.host}:{gone.port}",
            gone.pod or "?",
            freed,
        )

    def _close_room(self, mirror: _Held) -> None:
        assert self.ledger is not None
        self._mark_closed(self.ledger.on_room_closed(mirror.key, mirror.generation))

    def _apply_dead(
        self, addr: str, rooms: frozenset[Any], endpoints: tuple[Endpoint, ...] = ()
    ) -> None:
        assert self.ledger is not None
        old = self._peer(addr)
        tracked = {
            h.mgr_room[1] for h in self._held.values() if h.peer == old
        }  # held rooms of this incarnation count as its rooms too
        self._dead[old] = (addr, set(rooms) | tracked)
        self._peer_ids[addr] = self._new_id()  # a restarted peer is a new incarnation
        self.ledger.on_peer_dead(old)
        known = self._known_endpoints.pop(addr, set())
        self._watch_dead(addr, old, endpoints or tuple(sorted(known, key=str)))

    def _watch_dead(self, addr: str, peer: int, endpoints: tuple[Endpoint, ...]) -> None:
        """Probe dead incarnation ``peer``'s rank endpoints (no-op if watched or none known)."""
        if self.prober is None or not endpoints:
            return
        events = self._events  # deque.append is thread-safe: the prober thread queues

        def probed(key: Any, evidence: str) -> None:
            events.append(_PeerEvent("probed", addr, peer=peer))

        self.prober.watch(("sglang-prefill", addr, peer), endpoints, probed)

    def _close_incarnation(self, peer: int) -> None:
        """The prober confirmed incarnation ``peer`` closed: release its held rooms."""
        assert self.ledger is not None
        if peer in self._dead and peer not in self._closed_ids:
            self._closed_ids.add(peer)
            self._mark_closed(self.ledger.on_peer_closed(peer))

    def _apply_closed(self, addr: str) -> None:
        assert self.ledger is not None
        dead_ids = [i for i, (a, _) in self._dead.items() if a == addr]
        if not dead_ids:  # closed without a heartbeat verdict: still proof for its leases
            self._apply_dead(addr, frozenset())
            dead_ids = [i for i, (a, _) in self._dead.items() if a == addr]
        for peer in dead_ids:
            self._close_incarnation(peer)

    def _mark_closed(self, reclaims: list[Reclaim]) -> None:
        for reclaim in reclaims:
            req_id = self._by_key.get(reclaim.room)
            mirror = self._held.get(req_id) if req_id is not None else None
            if mirror is not None:
                mirror.closed = True
                self._safe.add(mirror.mgr_room)


def install_strict_reclaim(
    cls: type | None = None,
    *,
    kv_mgr_cls: type | None = None,
    quarantine_budget_rooms: int | None = None,
    metrics: KvFenceMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    prober: PeerProber | None = None,
    gone_file: Path | None = None,
    wall_clock: Callable[[], float] = time.time,
    perf_clock: Callable[[], float] = time.perf_counter,
) -> StrictReclaimPatch:
    """Patch ``cls`` (default: the pinned SGLang's DecodeTransferQueue). Idempotent.

    ``kv_mgr_cls`` (default: SGLang's CommonKVManager when ``cls`` is loaded here too) gets the
    peer hooks: ``_handle_node_failure`` reports the dead peer, ``is_abort_release_safe`` also
    answers True for rooms proven safe by the peer's confirmed endpoint close. ``prober``
    (default with ``cls=None``: a new :class:`PeerProber` on ``metrics``' registry) probes a
    dead peer's rank endpoints and confirms the close. ``gone_file``: the operator's feed of
    prefill pods confirmed gone (read from the first resolve pass on, every 2 s).
    """
    load_real = cls is None
    if cls is None:
        cls = load_decode_queue_class()
        kv_mgr_cls = kv_mgr_cls if kv_mgr_cls is not None else load_kv_manager_class()
    existing = cls.__dict__.get(_MARK)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    check_decode_queue(cls)
    if kv_mgr_cls is not None:
        check_peer_hooks(kv_mgr_cls)
    metrics = metrics if metrics is not None else KvFenceMetrics()
    if prober is None and load_real:
        prober = PeerProber(metrics=PeerProbeMetrics(metrics.registry))
    patch = StrictReclaimPatch(
        quarantine_budget_rooms=quarantine_budget_rooms,
        metrics=metrics,
        clock=clock,
        rooms_gauge=Gauge(
            "cas_kv_quarantined_rooms",
            "SGLang decode requests held for deferred KV release",
            registry=metrics.registry,
        ),
        prober=prober,
        cause_gauge=Gauge(
            "cas_kv_quarantined_rooms_by_cause",
            "Held decode requests by why they are held: awaiting_ack (prefill alive as far as "
            "decode knows) or peer_dead (declared dead, its end not yet confirmed)",
            ["cause"],
            registry=metrics.registry,
        ),
        idle_gauge=Gauge(
            "cas_kv_idle_blocked_by_held_rooms",
            "1 while held decode requests are the only work keeping SGLang's scheduler out of "
            "idle (leak checks skipped; flush_cache, HiCache attach/detach refused)",
            registry=metrics.registry,
        ),
        wall_clock=wall_clock,
        perf_clock=perf_clock,
    )
    if gone_file is not None:
        patch.feed = GoneFeed(
            gone_file, patch.on_prefill_gone, metrics=GoneFeedMetrics(metrics.registry)
        )
    _wrap_init(cls)
    _wrap_resolve(cls, patch)
    if kv_mgr_cls is not None:
        _wrap_peer_hooks(kv_mgr_cls, patch)
    setattr(cls, _MARK, patch)
    log.info("strict KV reclaim installed on %s.%s", cls.__module__, cls.__name__)
    return patch


def _wrap_init(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not self.enable_deferred_kv_release:
            raise StrictReclaimError(
                f"strict KV reclaim needs {ENABLE_ENV}=1 (deferred release is off, so aborted "
                "transfers would free their KV at once)"
            )
        self._cas_upstream_timeout_s = self.deferred_kv_release_timeout
        self.deferred_kv_release_timeout = math.inf

    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_resolve(cls: type, patch: StrictReclaimPatch) -> None:
    original = cls.resolve_deferred_releases  # type: ignore[attr-defined]

    @functools.wraps(original)
    def resolve_deferred_releases(self: Any) -> None:
        patch.prepare(self)
        before = list(self._deferred_releases)
        original(self)
        patch.observe(self, before)

    cls.resolve_deferred_releases = resolve_deferred_releases  # type: ignore[attr-defined]


def _wrap_peer_hooks(cls: type, patch: StrictReclaimPatch) -> None:
    if getattr(cls, _MARK + "_peer", None) is patch:
        return
    node_failure = cls._handle_node_failure  # type: ignore[attr-defined]
    release_safe = cls.is_abort_release_safe  # type: ignore[attr-defined]

    @functools.wraps(node_failure)
    def _handle_node_failure(self: Any, failed_bootstrap_addr: str) -> Any:
        with self.connection_lock:  # upstream pops the rooms and rank endpoints; keep a copy
            rooms = frozenset(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, ()))
            endpoints = rank_endpoints(self.connection_pool, failed_bootstrap_addr)
        result = node_failure(self, failed_bootstrap_addr)
        patch.on_peer_dead(failed_bootstrap_addr, rooms, endpoints)
        return result

    @functools.wraps(release_safe)
    def is_abort_release_safe(self: Any, bootstrap_room: int, required_acks: int) -> bool:
        if release_safe(self, bootstrap_room, required_acks):
            return True
        return patch.is_closed_safe(self, bootstrap_room)

    cls._handle_node_failure = _handle_node_failure  # type: ignore[attr-defined]
    cls.is_abort_release_safe = is_abort_release_safe  # type: ignore[attr-defined]
    setattr(cls, _MARK + "_peer", patch)


def _parse_addr(addr: str) -> tuple[str, int] | None:
    try:
        return split_host_port(addr)
    except GoneFeedError:
        return None


def receiver_endpoints(receiver: Any) -> tuple[Endpoint, ...]:
    """The prefill rank endpoints a decode receiver bootstrapped against (none if it never
    got bootstrap info)."""
    out: dict[tuple[str, int], Endpoint] = {}
    for info in getattr(receiver, "bootstrap_infos", None) or ():
        if isinstance(info, dict) and info.get("rank_ip") and info.get("rank_port"):
            ip, port = str(info["rank_ip"]), int(info["rank_port"])
            out.setdefault((ip, port), Endpoint(ip, port))
    return tuple(out.values())


def rank_endpoints(connection_pool: dict[str, Any], bootstrap_addr: str) -> tuple[Endpoint, ...]:
    """The listening KV-manager endpoints (``rank_ip:rank_port``) of every prefill rank cached
    under ``bootstrap_addr`` (same key match as upstream's ``_handle_node_failure``)."""
    seen: dict[tuple[str, int], Endpoint] = {}
    for key, infos in connection_pool.items():
        if not str(key).startswith(bootstrap_addr):
            continue
        for info in infos or ():
            ip, port = info.get("rank_ip"), info.get("rank_port")
            if ip and port:
                seen.setdefault((str(ip), int(port)), Endpoint(str(ip), int(port)))
    return tuple(seen.values())


def apply_env_defaults(environ: dict[str, str] | None = None) -> None:
    """Set :func:`strict_env` in ``environ`` (default ``os.environ``) unless set otherwise."""
    env = os.environ if environ is None else environ
    for key, value in strict_env().items():
        env.setdefault(key, value)
