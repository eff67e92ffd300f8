"""Closure source of the KV fence: confirm that a dead prefill peer can no longer write.

The decode's :class:`~cas_engine.kvfence.ReclaimLedger` keeps a dead peer's aborted rooms
quarantined until ``on_peer_closed`` (the transport confirmed the peer's endpoint closed). This
module produces that confirmation from outside the transfer engine, which exposes no per-peer
connection state: for each peer declared dead it probes the peer's listening endpoints (the
host:port pairs of sockets the WRITER process itself listens on, e.g. SGLang's per-rank KV
manager socket or mooncake's handshake port) on a bounded schedule, and reports the peer closed
only on positive evidence, for every endpoint, that the process that listened there is gone.

Evidence (each needs ``policy.evidence`` consecutive answers per endpoint, default 3)::

    REFUSED          connect() fails with ECONNREFUSED: the peer's kernel answered with a RST,
                     so no socket listens on the port any more.
    NEW_INCARNATION  the listener answers with an incarnation id other than the dead one's:
                     another process owns the port, so the dead one's listener is gone.

NOT evidence (the count restarts at zero): a timeout, an unreachable host or network, a DNS
failure, or an accepted connection (with no or the same incarnation). A hung (SIGSTOP, GC, a
stuck driver call) or partitioned peer looks exactly like that, and such a peer may still have
writes in flight that land once it resumes or the partition heals.

Why a refused connect is evidence, and its limits:

- A process's sockets are closed by the kernel when it exits, however it exits (SIGKILL and OOM
  included): the listener disappears, and the kernel answers the next SYN with a RST. The
  listeners probed here are owned by the writing process for its whole life (SGLang's KV
  manager socket, mooncake's handshake listener), so "listener gone" means "writer gone".
  A listener that is closed early on a graceful shutdown while writes still run breaks this; do
  not probe such a port alone (the sim probes its transfer engine's listener as well).
- RDMA: the queue pairs belong to the process's verbs context; on exit the driver destroys them,
  and a destroyed QP issues no further work requests and no retransmission, so nothing more
  lands once the process is gone (packets already on the wire live for fabric-latency times).
- TCP transports (mooncake's TCP backend): bytes the process had already handed to its kernel
  are still sent by the orphaned socket after exit and copied in by the receiver. They drain in
  the time it takes to transmit one send buffer to a reader that is reading (milliseconds; the
  host is reachable, it just answered the probe). The ``evidence`` x ``interval_s`` window
  between the first refusal and the verdict (1 s by default) covers that; it is an assumption,
  not a proof (see "How a closed endpoint is confirmed" in docs/engine.md).
- Where it is no evidence: a different process listening on the same port (a restarted peer
  reusing the port answers ACCEPTED; hence the incarnation check where the endpoint can state one;
  without it a reused port just keeps the rooms quarantined, never releases them wrongly), a
  listener shared through SO_REUSEPORT (the dead process may still be one of the listeners), and a
  firewall that REJECTs with a RST or ICMP port-unreachable instead of dropping (a forged refusal).

Threads and ownership: one daemon thread per :class:`PeerProber` runs every probe, so the
caller's loop (SGLang's scheduler, the sim's event loop) never blocks on a connect. Callbacks
(``on_closed``, ``on_gave_up``) run on that thread; the caller hands the result to its own
thread (a queue, ``loop.call_soon_threadsafe``) and applies it to the ledger there. A watch that
finds no evidence within ``policy.give_up_s`` is dropped (the rooms stay quarantined and count
against the quarantine budget; the operator drains). Metrics: ``cas_kv_peer_probes_total{outcome}``,
``cas_kv_peer_verdicts_total{verdict}``, ``cas_kv_peers_probing``.
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

INCARNATION_HEADER = "X-Cas-Incarnation"

_UNREACHABLE_ERRNOS = {
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EHOSTDOWN,
    errno.ENETDOWN,
    errno.EADDRNOTAVAIL,
}


class ProbeOutcome(enum.Enum):
    REFUSED = "refused"  # evidence: no listener on the port (RST)
    NEW_INCARNATION = "new_incarnation"  # evidence: another process owns the port
    ACCEPTED = "accepted"  # a listener (the same, or one that states no incarnation)
    TIMEOUT = "timeout"  # no answer: hung, partitioned or overloaded; may still write
    UNREACHABLE = "unreachable"  # host/network unreachable or name not resolved
    ERROR = "error"  # anything else

    @property
    def is_evidence(self) -> bool:
        return self in (ProbeOutcome.REFUSED, ProbeOutcome.NEW_INCARNATION)


Identify = Callable[[socket.socket, "Endpoint", float], "str | None"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A listening endpoint of the writer process; ``incarnation`` is what the dead process
    answered (None: no incarnation check), ``identify`` reads the answer off a connection."""

    host: str
    port: int
    incarnation: str | None = None
    identify: Identify | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def http_incarnation(path: str = "/health", header: str = INCARNATION_HEADER) -> Identify:
    """An :data:`Identify` that sends ``GET path`` and returns the ``header`` value (or None)."""
    wanted = header.lower().encode()

    def identify(sock: socket.socket, ep: Endpoint, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        request = f"GET {path} HTTP/1.0\r\nHost: {ep.host}:{ep.port}\r\nConnection: close\r\n\r\n"
        sock.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        for line in data.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == wanted:
                return value.strip().decode(errors="replace")
        return None

    return identify


def probe(ep: Endpoint, timeout: float = 1.0) -> ProbeOutcome:
    """One probe of ``ep`` (blocking, at most about ``2 * timeout``); see the module docstring."""
    try:
        sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
    except ConnectionRefusedError:
        return ProbeOutcome.REFUSED
    except TimeoutError:
        return ProbeOutcome.TIMEOUT
    except socket.gaierror:
        return ProbeOutcome.UNREACHABLE
    except OSError as exc:
        if exc.errno in _UNREACHABLE_ERRNOS:
            return ProbeOutcome.UNREACHABLE
        return ProbeOutcome.ERROR
    with sock:
        if ep.identify is None or ep.incarnation is None:
            return ProbeOutcome.ACCEPTED
        try:
            answer = ep.identify(sock, ep, timeout)
        except OSError:  # reset, timeout after accept: says nothing about the writer
            return ProbeOutcome.ACCEPTED
    if answer is not None and answer != ep.incarnation:
        return ProbeOutcome.NEW_INCARNATION
    return ProbeOutcome.ACCEPTED


@dataclass(frozen=True, slots=True)
class ProbePolicy:
    """Schedule: every ``interval_s``, ``evidence`` consecutive answers per endpoint, stop
    after ``give_up_s`` (rooms stay quarantined), each connect bounded by ``timeout_s``."""

    interval_s: float = 0.5
    evidence: int = 3
    timeout_s: float = 1.0
    give_up_s: float = 600.0


class PeerProbeMetrics:
    """``cas_kv_peer_*`` metrics; one per registry (``registry=None`` keeps them private)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.probes = Counter(
            "cas_kv_peer_probes",
            "Probes of dead prefill peers' listening endpoints, by outcome",
            ["outcome"],
            registry=reg,
        )
        self.verdicts = Counter(
            "cas_kv_peer_verdicts",
            "Dead peers confirmed closed (their rooms may be reclaimed) or given up on",
            ["verdict"],
            registry=reg,
        )
        self.probing = Gauge(
            "cas_kv_peers_probing", "Dead peers whose endpoints are being probed", registry=reg
        )
        for outcome in ProbeOutcome:
            self.probes.labels(outcome=outcome.value)
        for verdict in ("closed", "gave_up"):
            self.verdicts.labels(verdict=verdict)


ClosedCallback = Callable[[Hashable, str], None]
GaveUpCallback = Callable[[Hashable], None]


@dataclass
class _Watch:
    key: Hashable
    endpoints: tuple[Endpoint, ...]
    on_closed: ClosedCallback
    on_gave_up: GaveUpCallback | None
    started: float
    next_at: float
    counts: list[int] = field(default_factory=list)
    verdicts: list[str | None] = field(default_factory=list)
    probes: int = 0


class PeerProber:
    """Probes dead peers in one background thread; see the module docstring.

    ``watch(key, endpoints, on_closed)`` is non-blocking and thread-safe; ``on_closed(key,
    evidence)`` runs on the prober's thread once every endpoint showed evidence.
    """

    def __init__(
        self,
        policy: ProbePolicy | None = None,
        *,
        metrics: PeerProbeMetrics | None = None,
        probe_fn: Callable[[Endpoint, float], ProbeOutcome] = probe,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy if policy is not None else ProbePolicy()
        self.metrics = metrics if metrics is not None else PeerProbeMetrics()
        self._probe = probe_fn
        self._clock = clock
        self._cond = threading.Condition()
        self._watches: dict[Hashable, _Watch] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(
        self,
        key: Hashable,
        endpoints: Sequence[Endpoint],
        on_closed: ClosedCallback,
        on_gave_up: GaveUpCallback | None = None,
    ) -> bool:
        """Start probing ``endpoints`` for ``key``; False if already watched, none given, or
        the prober is closed. The thread starts on the first watch."""
        if not endpoints:
            log.warning("peer %s: no endpoint to probe; its rooms stay quarantined", key)
            return False
        now = self._clock()
        with self._cond:
            if self._stopped or key in self._watches:
                return False
            n = len(endpoints)
            self._watches[key] = _Watch(
                key, tuple(endpoints), on_closed, on_gave_up, now, now, [0] * n, [None] * n
            )
            self.metrics.probing.set(len(self._watches))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvfence-peer-probe")
                self._thread.daemon = True
                self._thread.start()
            self._cond.notify_all()
        log.info("peer %s declared dead: probing %s", key, ", ".join(map(str, endpoints)))
        return True

    def cancel(self, key: Hashable) -> None:
        with self._cond:
            self._watches.pop(key, None)
            self.metrics.probing.set(len(self._watches))

    def watching(self) -> set[Hashable]:
        with self._cond:
            return set(self._watches)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (pending watches are dropped without a verdict)."""
        with self._cond:
            self._stopped = True
            self._watches.clear()
            self.metrics.probing.set(0)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ---- the probe thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = self._clock()
                due = [w for w in self._watches.values() if w.next_at <= now]
                if not due:
                    wait = min((w.next_at for w in self._watches.values()), default=now + 60.0)
                    self._cond.wait(max(0.001, wait - now))
                    continue
            for w in due:
                try:
                    self._step(w)
                except Exception:  # a callback's bug must not stop every other watch
                    log.exception("peer %s: probe step failed", w.key)
                    with self._cond:
                        w.next_at = self._clock() + self.policy.interval_s

    def _step(self, w: _Watch) -> None:
        """Probe every endpoint of ``w`` still lacking evidence; deliver a verdict if due."""
        p = self.policy
        for i, ep in enumerate(w.endpoints):
            if w.verdicts[i] is not None:
                continue
            outcome = self._probe(ep, p.timeout_s)
            self.metrics.probes.labels(outcome=outcome.value).inc()
            w.counts[i] = w.counts[i] + 1 if outcome.is_evidence else 0
            if w.counts[i] >= p.evidence:
                w.verdicts[i] = outcome.value
            elif not outcome.is_evidence:
                log.debug("peer %s endpoint %s: %s (no evidence)", w.key, ep, outcome.value)
        w.probes += 1
        now = self._clock()
        with self._cond:
            if self._watches.get(w.key) is not w:
                return  # cancelled or closed meanwhile
            done = all(v is not None for v in w.verdicts)
            gave_up = not done and now - w.started >= p.give_up_s
            if done or gave_up:
                del self._watches[w.key]
                self.metrics.probing.set(len(self._watches))
            else:
                w.next_at = now + p.interval_s
        if done:
            evidence = ", ".join(f"{ep}={v}" for ep, v in zip(w.endpoints, w.verdicts, strict=True))
            self.metrics.verdicts.labels(verdict="closed").inc()
            log.warning(
                "peer %s: endpoints confirmed closed after %.2f s (%s); its rooms may be reclaimed",
                w.key,
                now - w.started,
                evidence,
            )
            w.on_closed(w.key, evidence)
        elif gave_up:
            self.metrics.verdicts.labels(verdict="gave_up").inc()
            log.error(
                "peer %s: no evidence of a closed endpoint in %.0f s (%d probes); its rooms stay "
                "quarantined",
                w.key,
                p.give_up_s,
                w.probes,
            )
            if w.on_gave_up is not None:
                w.on_gave_up(w.key)
