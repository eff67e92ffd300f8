"""The closure source of the KV fence (cas_engine.kvfence.peer_probe) and its wiring.

Guards: a prober that takes a timeout, an unreachable host, an accepted connection or a stopped
(SIGSTOP) peer as proof that a dead prefill can no longer write (its slots would be reused while
a write may still land), one that never confirms a peer that really exited (its slots would stay
quarantined forever), and wiring that stops handing the confirmation to the ledger: in the sim's
decode (real processes, mooncake over TCP) and in the SGLang adapter (real SGLang 0.5.23 code).
Unit tests use real loopback sockets; every test is bounded well under 30 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.kvfence.peer_probe import (
    Endpoint,
    PeerProbeMetrics,
    PeerProber,
    ProbeOutcome,
    ProbePolicy,
    http_incarnation,
    probe,
)

pytestmark = pytest.mark.timeout(60)

FAST = ProbePolicy(interval_s=0.02, evidence=3, timeout_s=0.3, give_up_s=1.0)
HOST = "127.0.0.1"


class Verdicts:
    """Collects the prober's callbacks (they run on its thread)."""

    def __init__(self) -> None:
        self.closed: list[tuple[Any, str]] = []
        self.gave_up: list[Any] = []
        self.done = threading.Event()

    def on_closed(self, key: Any, evidence: str) -> None:
        self.closed.append((key, evidence))
        self.done.set()

    def on_gave_up(self, key: Any) -> None:
        self.gave_up.append(key)
        self.done.set()


def make_prober(
    policy: ProbePolicy = FAST, probe_fn: Callable[[Endpoint, float], ProbeOutcome] = probe
) -> tuple[PeerProber, CollectorRegistry]:
    reg = CollectorRegistry()
    return PeerProber(policy, metrics=PeerProbeMetrics(reg), probe_fn=probe_fn), reg


def probes(reg: CollectorRegistry, outcome: str) -> float:
    return reg.get_sample_value("cas_kv_peer_probes_total", {"outcome": outcome}) or 0.0


def run_watch(
    endpoints: list[Endpoint],
    policy: ProbePolicy = FAST,
    probe_fn: Callable[[Endpoint, float], ProbeOutcome] = probe,
) -> tuple[Verdicts, CollectorRegistry]:
    prober, reg = make_prober(policy, probe_fn)
    v = Verdicts()
    try:
        assert prober.watch("peer", endpoints, v.on_closed, v.on_gave_up)
        assert v.done.wait(policy.give_up_s + 10)
    finally:
        prober.close()
    return v, reg


def closed_port() -> int:
    """A loopback port whose listener existed and is closed now (nothing listens)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        s.listen(1)
        return int(s.getsockname()[1])


@contextlib.contextmanager
def accepting_listener() -> Iterator[int]:
    """A live listener that accepts and closes every connection (a peer that is alive)."""
    srv = socket.socket()
    srv.bind((HOST, 0))
    srv.listen(64)
    srv.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = srv.accept()
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join(2)
        srv.close()


@contextlib.contextmanager
def incarnation_server(incarnation: str) -> Iterator[int]:
    """An HTTP listener answering ``/health`` with ``X-Cas-Incarnation: incarnation``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("X-Cas-Incarnation", incarnation)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer((HOST, 0), Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


# ---- unit tests against real loopback sockets ---------------------------------------------------


def test_live_listener_is_never_confirmed_closed() -> None:
    """guards: an accepted connection is no evidence; a live peer's rooms are never released."""
    with accepting_listener() as port:
        v, reg = run_watch([Endpoint(HOST, port)])
    assert v.closed == [] and v.gave_up == ["peer"]
    assert probes(reg, "accepted") >= 10 and probes(reg, "refused") == 0
    assert reg.get_sample_value("cas_kv_peer_verdicts_total", {"verdict": "gave_up"}) == 1


def test_closed_listener_is_confirmed_after_exactly_n_refusals() -> None:
    """guards: a listener gone with its process is confirmed closed, after N refusals in a row."""
    v, reg = run_watch([Endpoint(HOST, closed_port())])
    assert v.gave_up == [] and len(v.closed) == 1
    assert "refused" in v.closed[0][1]
    assert probes(reg, "refused") == FAST.evidence
    assert reg.get_sample_value("cas_kv_peer_verdicts_total", {"verdict": "closed"}) == 1


def test_any_non_evidence_restarts_the_count() -> None:
    """guards: refusals interrupted by an accept (the port came back) do not add up."""
    seq = iter([ProbeOutcome.REFUSED, ProbeOutcome.REFUSED, ProbeOutcome.ACCEPTED])

    def fake(ep: Endpoint, timeout: float) -> ProbeOutcome:
        return next(seq, ProbeOutcome.REFUSED)

    v, reg = run_watch([Endpoint(HOST, 1)], probe_fn=fake)
    assert len(v.closed) == 1
    assert probes(reg, "refused") == 2 + FAST.evidence  # 2 wasted, then 3 in a row


@pytest.mark.parametrize(
    "outcome", [ProbeOutcome.TIMEOUT, ProbeOutcome.UNREACHABLE, ProbeOutcome.ERROR]
)
def test_timeouts_and_unreachable_hosts_are_no_evidence(outcome: ProbeOutcome) -> None:
    """guards: a hung or partitioned peer (timeouts, no route) may still have writes in flight."""
    v, reg = run_watch([Endpoint(HOST, 1)], probe_fn=lambda ep, t: outcome)
    assert v.closed == [] and v.gave_up == ["peer"]
    assert probes(reg, outcome.value) >= 10


def test_every_endpoint_needs_evidence() -> None:
    """guards: one rank's closed port does not release rooms another live rank may write."""
    with accepting_listener() as live:
        v, _ = run_watch([Endpoint(HOST, closed_port()), Endpoint(HOST, live)])
    assert v.closed == [] and v.gave_up == ["peer"]


def test_new_incarnation_on_the_port_is_evidence_same_is_not() -> None:
    """guards: a restarted peer answering with another incarnation proves the dead one's
    listener gone; the same incarnation answering is a live peer and releases nothing."""
    ident = http_incarnation("/health")
    with incarnation_server("inc-B") as port:
        v, reg = run_watch([Endpoint(HOST, port, "inc-A", ident)])
        assert len(v.closed) == 1 and "new_incarnation" in v.closed[0][1]
        assert probes(reg, "new_incarnation") == FAST.evidence
        v, reg = run_watch([Endpoint(HOST, port, "inc-B", ident)])
        assert v.closed == [] and v.gave_up == ["peer"]
        assert probes(reg, "accepted") >= 5


LISTENER_SCRIPT = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("X-Cas-Incarnation", "inc-A")
        self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def test_stopped_process_holding_the_listener_is_never_closed_killed_one_is() -> None:
    """guards: a SIGSTOPped peer (its kernel still accepts, it answers nothing) is no evidence,
    with or without the incarnation check; once SIGKILLed, the same endpoints confirm closed."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER_SCRIPT], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        eps = [Endpoint(HOST, port), Endpoint(HOST, port, "inc-A", http_incarnation())]
        assert probe(eps[1], 1.0) is ProbeOutcome.ACCEPTED  # alive, same incarnation
        os.kill(proc.pid, signal.SIGSTOP)
        policy = ProbePolicy(interval_s=0.05, evidence=3, timeout_s=0.2, give_up_s=2.0)
        v, reg = run_watch(eps, policy)
        assert v.closed == [] and v.gave_up == ["peer"]
        assert probes(reg, "refused") == 0 and probes(reg, "new_incarnation") == 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        v, reg = run_watch(eps, policy)
        assert len(v.closed) == 1 and v.gave_up == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_watch_is_idempotent_and_close_stops_the_thread() -> None:
    prober, _ = make_prober(ProbePolicy(interval_s=0.05, give_up_s=30.0))
    with accepting_listener() as port:
        v = Verdicts()
        assert prober.watch("k", [Endpoint(HOST, port)], v.on_closed)
        assert not prober.watch("k", [Endpoint(HOST, port)], v.on_closed)
        assert not prober.watch("other", [], v.on_closed)  # nothing to probe: never closed
        assert prober.watching() == {"k"}
        prober.close()
        assert prober.watching() == set() and v.closed == []
        assert not prober.watch("k2", [Endpoint(HOST, port)], v.on_closed)


# ---- real processes: sim prefill (mooncake TCP writer) and sim decode (the ledger) -------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def _stats(url: str) -> dict[str, Any]:
    return dict(json.loads(_get(f"{url}/sim/stats"))["stats"])


def _metric(url: str, name: str, labels: str = "") -> float:
    for line in _get(f"{url}/metrics").splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def _post(url: str, body: dict[str, Any], timeout: float) -> None:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s")


class PdPair:
    """One sim prefill whose KV write stalls (600 s) and one Strict sim decode (1 s budget),
    as separate processes on loopback; the decode aborts the request and quarantines its slot."""

    def __init__(self, log_dir: Path, decode_args: tuple[str, ...] = ()) -> None:
        self.log_dir = log_dir
        self.bport = free_port()
        self.purl = f"http://{HOST}:{free_port()}"
        self.durl = f"http://{HOST}:{free_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill = self._spawn("prefill", self.purl, ["--sim-fault", "kv_write_stall=1:600"])
        self._spawn("decode", self.durl, ["--sim-prefill-budget", "1", *decode_args])

    def _spawn(self, mode: str, url: str, extra: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "GLOG_minloglevel": "2", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "cas_engine.sim", "--disaggregation-mode", mode]
        cmd += ["--host", HOST, "--port", url.rsplit(":", 1)[1], "--sim-speedup", "1"]
        cmd += ["--sim-kv-reclaim", "Strict", "--log-level", "warning", *extra]
        if mode == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(self.bport)]
        with open(self.log_dir / f"{mode}{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def restart_prefill(self) -> None:
        """A new prefill process (no faults) on the same HTTP and bootstrap ports."""
        self.prefill = self._spawn("prefill", self.purl, [])
        _wait(lambda: _ok(f"{self.purl}/health"), 20, "restarted prefill ready")

    def request(self, room: int, prefill_timeout: float = 30) -> None:
        """One request sent to both workers (the prefill's in the background)."""
        body = {
            "text": "def f(x): return x",
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": HOST,
            "bootstrap_port": self.bport,
            "bootstrap_room": room,
        }
        threading.Thread(
            target=_post, args=(f"{self.purl}/generate", body, prefill_timeout), daemon=True
        ).start()
        _post(f"{self.durl}/generate", body, 15)

    def ready(self) -> None:
        for url in (self.purl, self.durl):
            _wait(lambda u=url: _ok(f"{u}/health"), 20, f"{url} ready")  # type: ignore[misc]

    def quarantine_one_room(self) -> None:
        """One request; the prefill's write stalls, the decode aborts the room at 1 s."""
        self.request(4242)
        _wait(lambda: _stats(self.purl)["stalled_writes"] == 1, 5, "prefill write stalled")
        _wait(lambda: _stats(self.durl)["kv_quarantined_slots"] == 1, 5, "slot quarantined")

    def quarantined(self) -> int:
        return int(_stats(self.durl)["kv_quarantined_slots"])

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()  # SIGKILL ends a stopped process too
            p.wait(5)


def _ok(url: str) -> bool:
    try:
        _get(url)
    except OSError:
        return False
    return True


@pytest.fixture
def pd_pair(tmp_path: Path) -> Iterator[PdPair]:
    pair = PdPair(tmp_path)
    try:
        pair.ready()
        yield pair
    finally:
        pair.stop()


PEER_CLOSED = ("cas_kv_reclaims_total", '{outcome="peer_closed"}')


def test_sim_killed_prefill_releases_quarantined_slots_after_the_probe(pd_pair: PdPair) -> None:
    """guards: decode holds an aborted room's slot while the prefill's write is stalled; the
    prefill is SIGKILLed; heartbeat declares it dead, the prober sees its listeners refuse, and
    the slot is released (outcome peer_closed). Fails without the wiring: the slot stays held."""
    pd_pair.quarantine_one_room()
    os.kill(pd_pair.prefill.pid, signal.SIGKILL)
    t_release = _wait(lambda: pd_pair.quarantined() == 0, 20, "release after SIGKILL")
    transport = _stats(pd_pair.durl)["kv_transport"]
    print(f"SIGKILL -> slot released: {t_release:.2f} s ({transport})")
    assert _metric(pd_pair.durl, *PEER_CLOSED) == 1
    assert _metric(pd_pair.durl, "cas_kv_peer_probes_total", '{outcome="refused"}') >= 3
    assert _stats(pd_pair.durl)["kv_free_slots"] == 512


def test_sim_stopped_prefill_keeps_slots_quarantined(pd_pair: PdPair) -> None:
    """guards: a SIGSTOPped prefill (hung: it may resume and write) is declared dead and probed,
    but its listeners still accept, so the slot stays quarantined; SIGKILL then releases it."""
    pd_pair.quarantine_one_room()
    os.kill(pd_pair.prefill.pid, signal.SIGSTOP)
    accepted = ("cas_kv_peer_probes_total", '{outcome="accepted"}')
    _wait(lambda: _metric(pd_pair.durl, *accepted) >= 4, 20, "probing the stopped prefill")
    assert pd_pair.quarantined() == 1
    assert _metric(pd_pair.durl, *PEER_CLOSED) == 0
    os.kill(pd_pair.prefill.pid, signal.SIGKILL)  # positive control: now it is gone
    _wait(lambda: pd_pair.quarantined() == 0, 15, "release after SIGKILL")
    assert _metric(pd_pair.durl, *PEER_CLOSED) == 1


# ---- the SGLang adapter (real SGLang 0.5.23 functions, compiled on CPU) --------------------------


def probed_sglang_world() -> tuple[Any, CollectorRegistry, PeerProber, Any, Any]:
    """The real SGLang decode world (test_sglang_reclaim) under the strict patch with a fast
    prober: (world, registry, prober, transfer queue, KV manager)."""
    real = pytest.importorskip("tests.engine.test_sglang_reclaim")
    from cas_engine.kvfence import KvFenceMetrics
    from cas_engine.sglang import reclaim

    world = real.build_world()
    reg = CollectorRegistry()
    prober = PeerProber(FAST, metrics=PeerProbeMetrics(reg))
    reclaim.install_strict_reclaim(
        world.queue_cls,
        kv_mgr_cls=world.mgr_cls,
        metrics=KvFenceMetrics(reg),
        clock=world.clock.monotonic,
        prober=prober,
    )
    return world, reg, prober, real.make_queue(world), real.make_kv_mgr(world)


def test_sglang_dead_peer_rank_endpoints_probed_and_released() -> None:
    """guards: SGLang's heartbeat reports the prefill dead (real _handle_node_failure); the
    adapter probes the dead peer's rank endpoint (rank_ip:rank_port) in the prober's thread and
    the held room is released on the scheduler thread once it refuses, not before; a live
    rank endpoint keeps it held."""
    real = pytest.importorskip("tests.engine.test_sglang_reclaim")

    for alive in (True, False):
        world, reg, prober, q, mgr = probed_sglang_world()
        with accepting_listener() as live:
            port = live if alive else closed_port()
            mgr.connection_pool = {f"{real.PREFILL_ADDR}_0": [{"rank_ip": HOST, "rank_port": port}]}
            real.bootstrap_room(world, mgr, 11)
            real.abort_room(world, q, mgr, room=11, ranks=1)
            q.resolve_deferred_releases()
            mgr._handle_node_failure(real.PREFILL_ADDR)
            q.resolve_deferred_releases()  # applies the verdict; the probe runs elsewhere
            deadline = time.monotonic() + (1.0 if alive else 5.0)
            while time.monotonic() < deadline and not world.released:
                time.sleep(0.02)
                q.resolve_deferred_releases()
        prober.close()
        if alive:
            assert world.released == [] and probes(reg, "accepted") >= 3
        else:
            assert world.released == [11] and probes(reg, "refused") == FAST.evidence
            assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "peer_closed"}) == 1


def test_sglang_dead_peer_whose_bootstrap_info_was_dropped_is_still_probed() -> None:
    """guards: SGLang drops a receiver's cached bootstrap info when a registration fails
    (invalidate_cached_bootstrap_infos, common/conn.py:2688); when that happens before the
    heartbeat's verdict, the real _handle_node_failure finds no rank endpoint, so no probe
    started and the room stayed held even after the prefill's process was long gone. The
    adapter now probes the endpoints the held room's receiver bootstrapped against."""
    real = pytest.importorskip("tests.engine.test_sglang_reclaim")

    world, reg, prober, q, mgr = probed_sglang_world()
    port = closed_port()
    real.bootstrap_room(world, mgr, 11)
    real.abort_room(world, q, mgr, room=11, ranks=1)
    held = q._deferred_releases[0][0]
    held.kv_receiver.bootstrap_infos = [{"rank_ip": HOST, "rank_port": port}]
    q.resolve_deferred_releases()
    mgr.connection_pool = {}  # the cached bootstrap info was invalidated first
    mgr._handle_node_failure(real.PREFILL_ADDR)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not world.released:
        time.sleep(0.02)
        q.resolve_deferred_releases()
    prober.close()
    assert world.released == [11] and probes(reg, "refused") == FAST.evidence


def test_sim_decode_releases_a_hung_prefills_room_once_the_operator_confirms_its_end(
    tmp_path: Path,
) -> None:
    """guards: a hung prefill (SIGSTOP: its ports still accept, so no probe ever confirms) held
    the decode's slot forever. The operator's feed (the file a mounted ConfigMap gives decode)
    naming that bootstrap address with an end after the room's handshake releases it; an entry
    for another address does not."""
    feed = tmp_path / "prefills.json"
    pair = PdPair(tmp_path, ("--cas-prefill-gone-file", str(feed), "--sim-gone-clock-skew", "0.2"))
    try:
        pair.ready()
        pair.quarantine_one_room()
        os.kill(pair.prefill.pid, signal.SIGSTOP)

        def write(port: int) -> None:
            at = datetime.now(UTC).isoformat()
            doc = {"version": 1, "prefills": [
                {"bootstrap": f"{HOST}:{port}", "finishedAt": at, "pod": "t/p", "uid": str(port)}
            ]}  # fmt: skip
            tmp = feed.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, feed)

        time.sleep(1.0)  # the handshake is now older than the skew
        write(pair.bport + 1)
        time.sleep(4.0)  # two feed polls
        assert pair.quarantined() == 1
        write(pair.bport)
        _wait(lambda: pair.quarantined() == 0, 10, "release on the operator's confirmation")
        assert _metric(pair.durl, "cas_kv_reclaims_total", '{outcome="prefill_gone"}') == 1
        assert _metric(pair.durl, *PEER_CLOSED) == 0
        assert _metric(pair.durl, "cas_kv_prefill_gone_entries", "") == 1
    finally:
        pair.stop()


def test_sim_restarted_prefill_on_the_same_ports_releases_the_dead_ones_slots(
    pd_pair: PdPair,
) -> None:
    """guards: the prefill is SIGKILLed and restarted on the same ports at once (a container
    restart in the same pod). The new process must not ack for the old one's room; the decode
    declares the old incarnation dead and the prober confirms it (the bootstrap port answers
    a new incarnation, the old transfer engine port refuses): the slot comes back; the new
    incarnation then serves a request normally."""
    pd_pair.quarantine_one_room()
    os.kill(pd_pair.prefill.pid, signal.SIGKILL)
    pd_pair.prefill.wait(5)
    pd_pair.restart_prefill()
    _wait(lambda: pd_pair.quarantined() == 0, 20, "release after the restart")
    assert _metric(pd_pair.durl, *PEER_CLOSED) == 1
    assert _metric(pd_pair.durl, "cas_kv_reclaims_total", '{outcome="acked"}') == 0
    finished = _stats(pd_pair.durl)["finished"]
    pd_pair.request(4243)
    _wait(lambda: _stats(pd_pair.durl)["finished"] == finished + 1, 10, "request on new one")
    assert _stats(pd_pair.durl)["kv_corrupted"] == 0
