"""The engine pod's preStop hook: wait until this engine has no request in flight, bounded.

Kubernetes runs it when the pod is deleted (a scale-down, a rollout retiring a revision, an
eviction by a drain or by the anomaly loop), before the engine gets SIGTERM, inside the pod's
`terminationGracePeriodSeconds` (the operator sets that to the grace plus a shutdown margin).
The routers drop a deleted pod within seconds, so after that nothing new arrives and what is in
flight finishes here instead of being cut.

Data flow: the engine's own `/metrics` on localhost -> `in_flight` (pure: the sum of SGLang's
request gauges, srt/observability/metrics_collector.py:365-380 running, waiting and grammar
queue; :583-607 the PD queues: prefill bootstrap and in-flight KV sends, decode prealloc,
transfer and host receive) -> `DrainWait.step` (pure: idle for `settle` seconds in a row, or the
grace spent) -> exit. It always exits 0: a failed hook must never keep the pod from stopping.

Run: `python3 -m cas_engine.prestop --port 8000 --grace 600`. An LWS worker pod (no server
of its own) runs it with `--host <its leader>`: it holds its own shutdown while the leader, which
needs the worker's GPUs for every request, still drains.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

IN_FLIGHT_GAUGES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_grammar_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_decode_host_receive_queue_reqs",
)
DEFAULT_SETTLE_S = 5.0  # longer than the routers take to drop a deleted pod
POLL_S = 1.0


def in_flight(metrics_text: str) -> int | None:
    """Requests in flight in one `/metrics` scrape (every TP rank's samples summed), or None
    when it has none of the gauges (not an SGLang engine, or not up yet)."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        if family.name in IN_FLIGHT_GAUGES:
            seen = True
            total += sum(sample.value for sample in family.samples)
    return round(total) if seen else None


@dataclass(frozen=True)
class Verdict:
    """One step of the wait: `done` and why (`idle`, `grace spent`, `engine gone`)."""

    done: bool
    reason: str = ""


@dataclass
class DrainWait:
    """Idle (nothing in flight) for `settle_s` in a row ends the wait; so does `grace_s` since
    the start, and an engine that no longer answers (nothing left to wait for)."""

    grace_s: float
    settle_s: float = DEFAULT_SETTLE_S
    started: float = 0.0
    idle_since: float | None = None

    def step(self, now: float, count: int | None, reachable: bool) -> Verdict:
        if not reachable:
            return Verdict(True, "engine gone")
        if count:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if self.idle_since is not None and now - self.idle_since >= self.settle_s:
            return Verdict(True, "idle")
        if now - self.started >= self.grace_s:
            return Verdict(True, f"grace spent with {count} in flight")
        return Verdict(False)


def scrape(url: str, timeout: float = 2.0) -> str | None:
    """The text of `url`, or None when the engine does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text: str = resp.read().decode()
            return text
    except OSError:
        return None


def wait_drained(
    fetch: Callable[[], str | None],
    wait: DrainWait,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> Verdict:
    """Poll `fetch` until `wait` is done; the act half around `DrainWait.step`."""
    wait.started = clock()
    while True:
        text = fetch()
        verdict = wait.step(
            clock(), in_flight(text) if text is not None else None, text is not None
        )
        if verdict.done:
            return verdict
        sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cas_engine.prestop", description=__doc__)
    parser.add_argument(
        "--host", default="127.0.0.1", help="the engine (an LWS worker: its group's leader)"
    )
    parser.add_argument("--port", type=int, default=8000, help="the engine's HTTP port")
    parser.add_argument("--grace", type=float, required=True, help="most seconds to wait")
    parser.add_argument("--settle", type=float, default=DEFAULT_SETTLE_S)
    args = parser.parse_args(argv)
    started = time.monotonic()
    url = f"http://{args.host}:{args.port}/metrics"
    verdict = wait_drained(lambda: scrape(url), DrainWait(args.grace, args.settle))
    print(f"preStop: {verdict.reason} after {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
