"""Observe layer over real HTTP on 127.0.0.1: canned Prometheus API answers and /metrics text.

The servers are small stand-ins (the seam is HTTP itself): they answer what Prometheus or an
engine pod would, and can be made slow, broken or absent to exercise the failure paths.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from cas_operator.observe import Observation, PodTarget, PrometheusSource, ScrapeSource
from cas_operator.observe import types as m
from cas_operator.observe.prometheus import promql_string
from cas_operator.observe.scrape import Scrape, parse_exposition, windowed_increase
from cas_operator.observe.types import signals_from

Responder = Callable[[str, dict[str, list[str]]], tuple[int, bytes]]


@dataclass
class Server:
    """A loopback HTTP server whose answers come from `respond(path, query)`."""

    respond: Responder
    delay: float = 0.0
    host: str = "127.0.0.1"
    seen: list[str] = field(default_factory=list)
    port: int = 0
    max_url: int = 8192

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if len(self.path) > server.max_url:  # a proxy's request-line limit
                    self.send_error(414)
                    return
                url = urlparse(self.path)
                self.answer(url.path, parse_qs(url.query))

            def do_POST(self) -> None:  # Prometheus queries are form-encoded POSTs
                length = int(self.headers.get("Content-Length", "0"))
                form = parse_qs(self.rfile.read(length).decode())
                self.answer(urlparse(self.path).path, form)

            def answer(self, path: str, query: dict[str, list[str]]) -> None:
                server.seen.extend(query.get("query", [path]))
                if server.delay:
                    time.sleep(server.delay)
                code, body = server.respond(path, query)
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def serve() -> Iterator[Callable[[Server], Server]]:
    started: list[ThreadingHTTPServer] = []

    def start(server: Server) -> Server:
        httpd = ThreadingHTTPServer((server.host, 0), server.handler())
        httpd.daemon_threads = True
        server.port = httpd.server_address[1]
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        started.append(httpd)
        return server

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def free_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- Prometheus ---------------------------------------------------------------------------


def vector(rows: list[tuple[dict[str, str], float]]) -> bytes:
    result = [{"metric": labels, "value": [1700000000.0, str(v)]} for labels, v in rows]
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": result}}
    ).encode()


def pod(name: str, **extra: str) -> dict[str, str]:
    return {"namespace": "ns", "pod": name, **extra}


def prom_answers(up: dict[str, float], age: dict[str, float]) -> Responder:
    """Canned answers: d0 is corrupted, d1 healthy, p0 is a prefill without guard series."""

    def respond(path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        q = query["query"][0]
        if "timestamp(up" in q:
            return 200, vector([(pod(n), a) for n, a in age.items()])
        if "(up{" in q:
            return 200, vector([(pod(n), v) for n, v in up.items()])
        if "cas_guard_requests_checked_total" in q:
            return 200, vector([(pod("d0"), 1200.0), (pod("d1"), 1100.0)])
        if "cas_guard_trips_total" in q:
            return 200, vector(
                [
                    (pod("d0", reason="low_accept_length"), 30.0),
                    (pod("d0", reason="high_accept_rate"), 1.0),
                    (pod("d1", reason="low_accept_length"), 0.0),
                    (pod("d1", reason="high_accept_rate"), 0.0),
                ]
            )
        if "cas_kv_unhealthy_by_quarantine" in q:
            return 200, vector([(pod("d0"), 0.0), (pod("d1"), 1.0)])
        if "sglang:num_running_reqs" in q:
            return 200, vector([(pod("d0"), 7.0), (pod("p0"), 2.0)])
        if "sglang:num_queue_reqs" in q:
            return 200, vector([(pod("p0"), 9.0), (pod("d1"), float("nan"))])
        if "_queue_reqs|" in q:  # the PD queues, summed in one query
            return 200, vector([(pod("p0"), 3.0)])
        return 200, vector([])

    return respond


TARGETS = [
    PodTarget("d0", "decode", "ns"),
    PodTarget("d1", "decode", "ns"),
    PodTarget("p0", "prefill", "ns"),
]


def test_prometheus_joins_signals_per_pod(serve: Callable[[Server], Server]) -> None:
    """Regression: per-pod values must land on the right pod, trips split by reason, prefill
    pods without guard series read as 'no data' (None), not as zero trips."""
    up = {"d0": 1.0, "d1": 1.0, "p0": 1.0}
    srv = serve(Server(prom_answers(up, {"d0": 3.0, "d1": 4.0, "p0": 2.0})))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(TARGETS, 300)
    assert obs.error is None
    d0, d1, p0 = obs.signals["d0"], obs.signals["d1"], obs.signals["p0"]
    assert (d0.checked, d0.trips_low_accept, d0.trips_high_accept) == (1200.0, 30.0, 1.0)
    assert d0.unhealthy_by_quarantine is False and d1.unhealthy_by_quarantine is True
    assert d0.running == 7.0 and d1.queued is None  # NaN is missing, not a number
    assert p0.checked is None and p0.trips_low_accept is None and p0.queued == 9.0
    assert p0.kv_transfers == 3.0 and d0.kv_transfers is None  # no PD queue series: not PD
    windowed = [q for q in srv.seen if "increase(" in q]
    recent = [q for q in windowed if "[60s]" in q]  # the requests over the short rate window
    assert len(recent) == 1 and "sglang:num_requests_total" in recent[0]
    windowed = [q for q in windowed if q not in recent]
    assert windowed and all("[300s]" in q and 'namespace="ns"' in q for q in windowed)
    assert all('pod=~"d0|d1|p0"' in q for q in srv.seen)


def test_a_fleet_wide_batch_fits_behind_a_proxy(serve: Callable[[Server], Server]) -> None:
    """The anomaly loop asks once per tick for every engine pod of a namespace: 600 pod names
    make a query far longer than the 8 KiB request line proxies allow; queries are POSTed."""
    names = [f"fleet-{i:04d}-decode-2b92302f-7d9c8b6f5-x{i:04d}" for i in range(600)]
    up = {n: 1.0 for n in names}
    srv = serve(Server(prom_answers(up, {n: 1.0 for n in names})))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(
        [PodTarget(n, "decode", "ns") for n in names], 300
    )
    assert obs.error is None and len(obs.signals) == 600
    assert all(s.error is None for s in obs.signals.values())
    assert max(len(q) for q in srv.seen) > srv.max_url


def test_prometheus_target_health_is_explicit(serve: Callable[[Server], Server]) -> None:
    """Regression: a pod Prometheus does not scrape, scrapes as down, or last scraped long
    ago must get an error, never stale or zero numbers that look healthy."""
    srv = serve(Server(prom_answers({"d0": 0.0, "d1": 1.0}, {"d0": 1.0, "d1": 600.0})))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}", stale_seconds=60).observe(TARGETS, 300)
    assert obs.error is None
    assert "down" in str(obs.signals["d0"].error)
    assert "stale" in str(obs.signals["d1"].error)
    assert "no up series" in str(obs.signals["p0"].error)


def assert_outage(obs: Observation, words: str) -> None:
    assert obs.error is not None and words in obs.error, obs.error
    assert {n: s.error is not None for n, s in obs.signals.items()} == {
        "d0": True,
        "d1": True,
        "p0": True,
    }


def test_prometheus_outage_refused() -> None:
    """Regression: Prometheus down must read as 'signal unavailable', not as a quiet fleet."""
    obs = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_seconds=1).observe(
        TARGETS, 300
    )
    assert_outage(obs, "prometheus unavailable")


def test_prometheus_timeout(serve: Callable[[Server], Server]) -> None:
    """Regression: a hung Prometheus must not block the operator's timer past the timeout."""
    srv = serve(Server(prom_answers({}, {}), delay=1.5))
    started = time.monotonic()
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}", timeout_seconds=0.3).observe(
        TARGETS, 300
    )
    assert time.monotonic() - started < 1.2
    assert_outage(obs, "timed out")


@pytest.mark.parametrize(
    ("code", "body", "words"),
    [
        (503, b"overloaded", "HTTP 503"),
        (200, b'{"status":"error","error":"query timed out in expression evaluation"}', "query"),
        (200, b"not json", "up query"),
        (200, b'{"status":"success","data":{"resultType":"matrix","result":[]}}', "vector"),
    ],
)
def test_prometheus_bad_answers_are_outages(
    serve: Callable[[Server], Server], code: int, body: bytes, words: str
) -> None:
    """Regression: error statuses and malformed answers must not be joined as partial data."""
    srv = serve(Server(lambda path, q: (code, body)))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(TARGETS, 300)
    assert_outage(obs, words)


# --- direct scrape ------------------------------------------------------------------------


def exposition(checked: float, low: float, high: float, aborted: float = 0.0) -> str:
    return f"""# HELP cas_guard_requests_checked_total Requests judged
# TYPE cas_guard_requests_checked_total counter
cas_guard_requests_checked_total {checked}
# TYPE cas_guard_trips_total counter
cas_guard_trips_total{{reason="low_accept_length"}} {low}
cas_guard_trips_total{{reason="high_accept_rate"}} {high}
# TYPE sglang:num_aborted_requests_total counter
sglang:num_aborted_requests_total{{model_name="m"}} {aborted}
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m"}} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="m"}} 0.25
# TYPE cas_kv_unhealthy_by_quarantine gauge
cas_kv_unhealthy_by_quarantine 0.0
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def metrics_server(
    serve: Callable[[Server], Server], text: list[str], host: str = "127.0.0.1"
) -> Server:
    """An engine pod's /metrics endpoint serving whatever text[0] holds now."""
    return serve(
        Server(
            lambda path, q: (200, text[0].encode()) if path == "/metrics" else (404, b""), host=host
        )
    )


def test_scrape_windowed_increase_across_scrapes(serve: Callable[[Server], Server]) -> None:
    """Regression: rates need two scrapes; the first must say 'no data', later ones must give
    the increase within the window only, with gauges taken from the latest scrape."""
    text = [exposition(100, 0, 0)]
    srv = metrics_server(serve, text)
    clock = Clock()
    source = ScrapeSource(clock=clock)
    target = [PodTarget("d0", "decode", "ns", "127.0.0.1", srv.port)]
    first = source.observe(target, 60).signals["d0"]
    assert first.error is None and first.checked is None and first.running == 5.0
    for t, body in ((1030.0, exposition(400, 3, 1, 2)), (1090.0, exposition(1000, 9, 1, 2))):
        clock.t, text[0] = t, body
        last = source.observe(target, 60).signals["d0"]
    # window 60 s at t=1090 holds the samples at 1030 and 1090 only
    assert (last.checked, last.trips_low_accept, last.trips_high_accept) == (600.0, 6.0, 0.0)
    assert last.aborted == 0.0 and last.queued == 2.0 and last.token_usage == 0.25
    assert last.unhealthy_by_quarantine is False


def test_counter_reset_counts_from_zero() -> None:
    """Regression: an engine restart drops its counters; the increase must not go negative."""
    samples = [
        Scrape(0, {"c": 100.0}, {}),
        Scrape(5, {"c": 150.0}, {}),
        Scrape(10, {"c": 20.0}, {}),
    ]
    assert windowed_increase(samples, "c", 60) == 70.0
    assert windowed_increase(samples[:1], "c", 60) is None


def test_a_counter_series_born_in_the_window_counts_from_zero() -> None:
    """Regression (issue 18): labelled counters are created by their first event. The router's
    first burst of 429s made its `status_code="429"` series appear with 26 in one scrape, and
    the increase (two samples carrying the key) read nothing, so status showed no refusals.
    A scrape of the same process that lacked the series read zero."""
    samples = [
        Scrape(0, {"responses": 4.0}, {}),
        Scrape(5, {"responses": 30.0, "responses_429": 26.0}, {}),
        Scrape(10, {"responses": 31.0, "responses_429": 26.0}, {}),
    ]
    assert windowed_increase(samples, "responses_429", 60) == 26.0
    assert windowed_increase(samples[:1], "responses", 60) is None
    assert windowed_increase(samples[:1] + samples[:1], "responses_429", 60) is None


def test_the_routers_refusals_are_their_429_answers() -> None:
    """sglang-router 0.3.2 counts its rate limiter's 429s in `smg_http_responses_total`
    (measured); they are refusals, not errors."""
    text = (
        'smg_http_responses_total{status_code="200",error_code=""} 3\n'
        'smg_http_responses_total{status_code="429",error_code=""} 8\n'
        'smg_http_responses_total{status_code="503",error_code=""} 1\n'
    )
    scrape = parse_exposition(text, 0.0)
    assert (scrape.counters["responses"], scrape.counters["responses_429"]) == (12.0, 8.0)
    assert scrape.counters["responses_5xx"] == 1.0
    assert signals_from(scrape.counters, {}, has_guard=False).refused == 8.0


def test_scrape_failures_are_explicit(serve: Callable[[Server], Server]) -> None:
    """Regression: a refused, slow, garbled or IP-less pod gets an error, never stale numbers."""
    good = metrics_server(serve, [exposition(1, 0, 0)])
    slow = serve(Server(lambda p, q: (200, exposition(1, 0, 0).encode()), delay=1.5))
    garbled = serve(Server(lambda p, q: (200, b'cas_guard_trips_total{reason="x 1\n')))
    targets = [
        PodTarget("ok", "decode", "ns", "127.0.0.1", good.port),
        PodTarget("refused", "decode", "ns", "127.0.0.1", free_port()),
        PodTarget("slow", "decode", "ns", "127.0.0.1", slow.port),
        PodTarget("garbled", "decode", "ns", "127.0.0.1", garbled.port),
        PodTarget("pending", "decode", "ns", None),
    ]
    started = time.monotonic()
    obs = ScrapeSource(timeout_seconds=0.3).observe(targets, 60)
    assert time.monotonic() - started < 1.2, "scrapes must run concurrently with a timeout"
    errors = {n: s.error for n, s in obs.signals.items()}
    assert errors["ok"] is None and obs.error is None
    assert "scrape failed" in str(errors["refused"])
    assert "timed out" in str(errors["slow"])
    assert "unparsable" in str(errors["garbled"])
    assert "no IP" in str(errors["pending"])


def test_scrape_total_outage_is_source_error() -> None:
    """Regression: when no pod answers, the observation itself must carry the error."""
    targets = [PodTarget(f"d{i}", "decode", "ns", "127.0.0.1", free_port()) for i in range(2)]
    obs = ScrapeSource(timeout_seconds=0.3).observe(targets, 60)
    assert obs.error is not None and "no pod could be scraped" in obs.error


def test_replaced_pod_with_same_name_starts_a_new_history(
    serve: Callable[[Server], Server],
) -> None:
    """Regression: a pod recreated under its old name (new IP) must not inherit old samples,
    or its first window would mix two engines' counters."""
    text = [exposition(100, 0, 0)]
    srv = metrics_server(serve, text)
    clock = Clock()
    source = ScrapeSource(clock=clock)
    source.observe([PodTarget("d0", "decode", "ns", "127.0.0.1", srv.port)], 60)
    clock.t, text[0] = 1010.0, exposition(500, 5, 0)
    other = metrics_server(serve, text, host="127.0.0.2")
    moved = PodTarget("d0", "decode", "ns", "127.0.0.2", other.port)
    signals = source.observe([moved], 60).signals["d0"]
    assert signals.error is None and signals.checked is None


def test_parse_sums_series_and_keeps_trip_reasons() -> None:
    """Regression: several model_name series must be combined, and trip reasons kept apart."""
    text = exposition(10, 2, 3) + 'sglang:num_running_reqs{model_name="other"} 4.0\n'
    scrape = parse_exposition(text, 0.0)
    assert scrape.counters["low_accept_length"] == 2.0
    assert scrape.counters["high_accept_rate"] == 3.0
    assert scrape.gauges["sglang:num_running_reqs"] == 9.0


def test_a_pods_pd_queues_are_summed_as_kv_transfers_in_flight() -> None:
    """A pod whose KV a peer has not taken yet is not idle (the scale-down loop's rule)."""
    text = exposition(10, 0, 0) + (
        "sglang:num_prefill_bootstrap_queue_reqs 1.0\nsglang:num_prefill_inflight_queue_reqs 2.0\n"
    )
    scrape = parse_exposition(text, 0.0)
    assert signals_from(scrape.counters, scrape.gauges, has_guard=True).kv_transfers == 3.0


def test_pod_names_are_escaped_for_promql_strings() -> None:
    """Regression: real Prometheus rejected `pod=~"decode\\-0"` (HTTP 400: `\\-` is not a
    valid escape in a PromQL string); regex escapes must be doubled inside the literal."""
    assert promql_string(re.escape("decode-0.x")) == "decode\\\\-0\\\\.x"
    assert promql_string('a"b') == 'a\\"b'


# --- TTFT histogram (the autoscaler's latency signal) --------------------------------------


def ttft_exposition(fast: float, slow: float) -> str:
    """A TTFT histogram: `fast` requests under 1 s, `slow` between 4 s and 8 s."""
    total = fast + slow
    return f"""# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {fast}
sglang:time_to_first_token_seconds_bucket{{le="4.0",model_name="m"}} {fast}
sglang:time_to_first_token_seconds_bucket{{le="8.0",model_name="m"}} {total}
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {total}
sglang:time_to_first_token_seconds_count{{model_name="m"}} {total}
sglang:time_to_first_token_seconds_sum{{model_name="m"}} {fast * 0.5 + slow * 6}
"""


def test_scrape_ttft_buckets_are_windowed_per_bound(serve: Callable[[Server], Server]) -> None:
    """Regression: the operator measured no latency at all, so Auto's TTFT rules never fired
    outside the simulator. Buckets keep their bound and count as windowed increases."""
    text = [ttft_exposition(10, 0)]
    srv = metrics_server(serve, text)
    clock = Clock()
    source = ScrapeSource(clock=clock)
    target = [PodTarget("d0", "decode", "ns", "127.0.0.1", srv.port)]
    assert source.observe(target, 60).signals["d0"].ttft_buckets is None  # one scrape: no rate
    clock.t, text[0] = 1060.0, ttft_exposition(19, 1)
    signals = source.observe(target, 60).signals["d0"]
    assert signals.ttft_buckets == ((1.0, 9.0), (4.0, 9.0), (8.0, 10.0), (math.inf, 10.0))


def test_prometheus_ttft_buckets_join_per_pod(serve: Callable[[Server], Server]) -> None:
    """Regression: the PromQL path asks for TTFT bucket increases by pod and `le`."""
    answers = prom_answers({"d0": 1.0, "d1": 1.0, "p0": 1.0}, {"d0": 1.0, "d1": 1.0, "p0": 1.0})

    def respond(path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        if "time_to_first_token_seconds_bucket" in query["query"][0]:
            rows = [(pod("d0", le=le), v) for le, v in (("1.0", 3.0), ("+Inf", 4.0))]
            return 200, vector(rows)
        return answers(path, query)

    srv = serve(Server(respond))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(TARGETS, 60)
    assert obs.signals["d0"].ttft_buckets == ((1.0, 3.0), (math.inf, 4.0))
    assert obs.signals["d1"].ttft_buckets is None  # no series: unknown, not zero
    (q,) = [q for q in srv.seen if "time_to_first_token" in q]
    assert "le)" in q and "[60s]" in q


def test_prometheus_itl_buckets_join_per_pod(serve: Callable[[Server], Server]) -> None:
    """The PromQL path asks for inter-token latency bucket increases by pod and `le`, as for
    TTFT (issue 15: ITL was not measured at all)."""
    answers = prom_answers({"d0": 1.0, "d1": 1.0, "p0": 1.0}, {"d0": 1.0, "d1": 1.0, "p0": 1.0})

    def respond(path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        if "inter_token_latency_seconds_bucket" in query["query"][0]:
            return 200, vector([(pod("d1", le=le), v) for le, v in (("0.05", 7.0), ("+Inf", 9.0))])
        return answers(path, query)

    srv = serve(Server(respond))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(TARGETS, 60)
    assert obs.signals["d1"].itl_buckets == ((0.05, 7.0), (math.inf, 9.0))
    assert obs.signals["d0"].itl_buckets is None and obs.signals["d1"].ttft_buckets is None


def test_scrape_keeps_ttft_and_itl_buckets_apart() -> None:
    text = exposition(10, 0, 0) + (
        'sglang:inter_token_latency_seconds_bucket{le="0.05"} 4.0\n'
        'sglang:inter_token_latency_seconds_bucket{le="+Inf"} 5.0\n'
        'sglang:time_to_first_token_seconds_bucket{le="+Inf"} 2.0\n'
    )
    scrape = parse_exposition(text, 0.0)
    signals = signals_from(scrape.counters, scrape.gauges, has_guard=True)
    assert signals.itl_buckets == ((0.05, 4.0), (math.inf, 5.0))
    assert signals.ttft_buckets == ((math.inf, 2.0),)


REQUESTS_ONLY = """# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{model_name="m"}} {n}
"""


def test_scrape_counts_the_recent_requests_over_the_short_rate_window(
    serve: Callable[[Server], Server],
) -> None:
    """Regression (issue 39): the trend and the variation the planner reads need a rate
    counted over a short window (`RATE_WINDOW_S`, 60 s): over the 300-s anomaly window
    consecutive readings overlap for 5 minutes. The scrape source counts `recent_requests` over
    the last 60 s of its history and `requests` over the whole window; a window shorter than
    60 s counts both over itself."""
    text = [REQUESTS_ONLY.format(n=0)]
    srv = metrics_server(serve, text)
    clock = Clock()
    source = ScrapeSource(clock=clock)
    target = [PodTarget("d0", "decode", "ns", "127.0.0.1", srv.port)]
    for t, n in ((1000.0, 0), (1100.0, 100), (1200.0, 200), (1260.0, 500)):
        clock.t, text[0] = t, REQUESTS_ONLY.format(n=n)
        last = source.observe(target, 300).signals["d0"]
    assert last.requests == 500.0 and last.recent_requests == 300.0
    assert m.rate_window(300) == 60.0 and m.rate_window(30) == 30.0
    clock.t, text[0] = 1280.0, REQUESTS_ONLY.format(n=520)
    short = source.observe(target, 30).signals["d0"]
    assert short.requests == short.recent_requests == 20.0


def test_prometheus_asks_for_the_recent_requests_over_the_short_rate_window(
    serve: Callable[[Server], Server],
) -> None:
    """The PromQL source asks for `sglang:num_requests_total` over the anomaly window and over
    the short rate window (`rate_window`), and joins the second per pod as `recent_requests`."""

    def respond(path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        q = query["query"][0]
        if "timestamp(up" in q:
            return 200, vector([(pod("d0"), 2.0)])
        if "(up{" in q:
            return 200, vector([(pod("d0"), 1.0)])
        if "sglang:num_requests_total" in q and "[60s]" in q:
            return 200, vector([(pod("d0"), 30.0)])
        if "sglang:num_requests_total" in q and "[300s]" in q:
            return 200, vector([(pod("d0"), 120.0)])
        return 200, vector([])

    srv = serve(Server(respond))
    obs = PrometheusSource(f"http://127.0.0.1:{srv.port}").observe(TARGETS[:1], 300)
    d0 = obs.signals["d0"]
    assert d0.requests == 120.0 and d0.recent_requests == 30.0
