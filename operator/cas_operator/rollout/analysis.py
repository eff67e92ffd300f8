"""A canary step's analysis (pure): the canary revision against the stable one, over a window.

Data flow: the fleet tick observes both revisions' engine and router pods over the window
since the step's weight took effect (`rollout.act`) -> `RevisionMetrics.of` per revision ->
`analyse(canary, stable, spec)` -> an `Analysis` with one `GateResult` per gate and a verdict:
- Fail: some gate's canary count is significantly above its limit (one-sided Poisson test at
  `ALPHA`; a few requests can already fail a canary that is clearly bad), or a latency is over
  its limit with enough requests on both sides;
- Inconclusive: too few canary requests for a verdict (`minRequests`), or metrics missing;
- Pass: every gate passed, or cannot apply to this fleet.
A gate that cannot apply is NotApplicable, never Inconclusive: the quality-gate gates
(`gateTrips`, `anomalyRate`) without speculative decoding, where the engines' quality gate has
nothing to judge and exports no series (`desired.resources.engine_args.cas_args`); an
Inconclusive there held every step of such a fleet paused forever.
Rate gates compare with `ratio x` the stable revision's rate, never below a floor (a stable
revision with no gate trips must not make one trip a failure); without enough stable requests
the floor alone is the limit. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from cas_operator.api import constants as c
from cas_operator.api.models import AnalysisSpec
from cas_operator.observe.histogram import histogram_quantile, merged_buckets
from cas_operator.observe.types import PodSignals
from cas_operator.stats import exceeds
from cas_operator.types import Status

ALPHA = 0.01  # significance of a failing rate gate
ERROR_FLOOR = 0.01  # a router 5xx share at or below this never fails a canary
KV_FAILURE_FLOOR = 0.001


class Verdict(StrEnum):
    PASS = "Pass"
    FAIL = "Fail"
    INCONCLUSIVE = "Inconclusive"
    NOT_APPLICABLE = "NotApplicable"


@dataclass(frozen=True)
class MeasuredPod:
    """One pod of a revision as the window measured it (`signals` None: not measured)."""

    name: str
    role: str  # prefill | decode | router
    signals: PodSignals | None


def _sum(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass(frozen=True)
class RevisionMetrics:
    """One revision's engines and routers over the window."""

    revision: str
    requests: float | None  # finished requests: the decode pods' (each PD request ends on one)
    checked: float | None  # requests the quality gate judged
    trips: float | None
    kv_failures: float | None  # failed KV transfers and bootstraps, both roles
    responses: float | None  # the routers' answers
    errors_5xx: float | None
    ttft: tuple[tuple[float, float], ...]  # merged decode TTFT buckets
    itl: tuple[tuple[float, float], ...]
    unmeasured: tuple[str, ...] = ()  # engine pods without data

    @classmethod
    def of(cls, revision: str, pods: Sequence[MeasuredPod]) -> RevisionMetrics:
        def good(role: str) -> list[PodSignals]:
            return [
                p.signals
                for p in pods
                if p.role == role and p.signals is not None and p.signals.error is None
            ]

        decode, prefill, routers = good(c.ROLE_DECODE), good(c.ROLE_PREFILL), good(c.ROLE_ROUTER)
        engines = decode + prefill
        responses = _sum([s.responses for s in routers])
        errors = _sum([s.errors_5xx for s in routers])
        requests = _sum([s.requests for s in decode])
        # SGLang's failure counters have labels: no series until the first failure
        kv_failures = _sum([s.kv_failures for s in engines])
        unmeasured = tuple(
            sorted(
                p.name
                for p in pods
                if p.role != c.ROLE_ROUTER and (p.signals is None or p.signals.error is not None)
            )
        )
        return cls(
            revision=revision,
            requests=requests,
            checked=_sum([s.checked for s in decode]),
            trips=_sum([s.trips for s in decode]),
            kv_failures=kv_failures if kv_failures is not None or requests is None else 0.0,
            responses=responses,
            # a router that answered but never failed exports no 5xx series
            errors_5xx=errors if errors is not None or responses is None else 0.0,
            ttft=tuple(merged_buckets(decode)),
            itl=tuple(merged_buckets(decode, itl=True)),
            unmeasured=unmeasured,
        )

    def ttft_p90(self) -> float | None:
        return histogram_quantile(0.9, self.ttft)

    def itl_p50(self) -> float | None:
        return histogram_quantile(0.5, self.itl)

    def itl_requests(self) -> float:
        """Requests behind the ITL histogram (it counts tokens, the gate needs requests)."""
        return (self.requests or 0.0) if self.count(self.itl) > 0 else 0.0

    @staticmethod
    def count(buckets: Sequence[tuple[float, float]]) -> float:
        return buckets[-1][1] if buckets else 0.0


@dataclass(frozen=True)
class GateResult:
    """One gate: its verdict and the numbers behind it, as status and events show them."""

    name: str
    verdict: Verdict
    canary: str
    limit: str

    def to_status(self) -> Status:
        return {
            "name": self.name,
            "verdict": self.verdict.value,
            "canary": self.canary,
            "limit": self.limit,
        }

    def line(self) -> str:
        return f"{self.name} {self.verdict.value.lower()}: canary {self.canary}, limit {self.limit}"


@dataclass(frozen=True)
class Analysis:
    verdict: Verdict
    window_seconds: float
    canary_requests: float
    gates: tuple[GateResult, ...]
    reason: str

    def to_status(self) -> Status:
        return {
            "verdict": self.verdict.value,
            "windowSeconds": round(self.window_seconds),
            "canaryRequests": round(self.canary_requests),
            "reason": self.reason,
            "gates": [g.to_status() for g in self.gates],
        }


NO_QUALITY_GATE = "no speculative decoding: the quality gate judges no request"


def not_applicable(name: str, why: str) -> GateResult:
    return GateResult(name, Verdict.NOT_APPLICABLE, "n/a", why)


def _pct(value: float) -> str:
    return f"{value:.2%}"


def rate_gate(
    name: str,
    counts: tuple[float | None, float | None],
    stable: tuple[float | None, float | None],
    *,
    ratio: float,
    floor: float,
    min_requests: int,
) -> GateResult:
    """`counts` = (events, trials) of the canary, `stable` the same of the stable revision:
    fails when the canary's events are significantly above max(ratio x stable rate, floor)."""
    events, trials = counts
    if events is None or trials is None:
        return GateResult(name, Verdict.INCONCLUSIVE, "not measured", "n/a")
    s_events, s_trials = stable
    base = None
    if s_events is not None and s_trials is not None and s_trials >= min_requests:
        base = s_events / s_trials
    limit = floor if base is None else max(ratio * base, floor)
    why = f"<= {_pct(limit)}" + (f" ({ratio:g} x stable {_pct(base)})" if base else " (floor)")
    seen = f"{events:g}/{trials:g}" + (f" ({_pct(events / trials)})" if trials else "")
    if trials > 0 and exceeds(events, trials, limit, ALPHA):
        return GateResult(name, Verdict.FAIL, seen, why)
    if trials < min_requests:
        return GateResult(name, Verdict.INCONCLUSIVE, seen, f"{why}; {min_requests} needed")
    return GateResult(name, Verdict.PASS, seen, why)


def latency_gate(
    name: str,
    canary: tuple[float | None, float],
    stable: tuple[float | None, float],
    *,
    ratio: float | None,
    cap: float | None,
    min_requests: int,
) -> GateResult:
    """A latency quantile (seconds, with its observation count) against `ratio x` the stable
    revision's, and against an absolute `cap`; judged only with `min_requests` on each side."""
    value, count = canary
    base, base_count = stable
    if value is None or count < min_requests:
        seen = "n/a" if value is None else f"{value:.3g}s"
        return GateResult(name, Verdict.INCONCLUSIVE, f"{seen} ({count:g} observed)", "n/a")
    limits = []
    if cap is not None:
        limits.append(cap)
    if ratio is not None and base is not None and base_count >= min_requests:
        limits.append(ratio * base)
    if not limits:
        return GateResult(name, Verdict.INCONCLUSIVE, f"{value:.3g}s", "stable not measured")
    limit = min(limits)
    verdict = Verdict.FAIL if value > limit else Verdict.PASS
    return GateResult(name, verdict, f"{value:.3g}s", f"<= {limit:.3g}s")


def analyse(
    canary: RevisionMetrics,
    stable: RevisionMetrics,
    spec: AnalysisSpec,
    *,
    window_seconds: float,
    trip_floor: float,
    quality_gate: bool = True,
) -> Analysis:
    """The verdict of one window (see the module docstring); `trip_floor` is the anomaly
    guard's per-pod threshold, the lowest gate-trip limit; `quality_gate`: whether the
    canary's engines run the quality gate (speculative decoding), else its gates do not apply."""
    n = spec.min_requests
    trips = (
        rate_gate(
            "gateTrips",
            (canary.trips, canary.checked),
            (stable.trips, stable.checked),
            ratio=spec.max_gate_trip_ratio,
            floor=trip_floor,
            min_requests=n,
        )
        if quality_gate
        else not_applicable("gateTrips", NO_QUALITY_GATE)
    )
    gates = [
        trips,
        rate_gate(
            "routerErrors",
            (canary.errors_5xx, canary.responses),
            (stable.errors_5xx, stable.responses),
            ratio=spec.max_error_ratio,
            floor=ERROR_FLOOR,
            min_requests=n,
        ),
        rate_gate(
            "kvTransferFailures",
            (canary.kv_failures, canary.requests),
            (stable.kv_failures, stable.requests),
            ratio=spec.max_kv_transfer_failure_ratio,
            floor=KV_FAILURE_FLOOR,
            min_requests=n,
        ),
        latency_gate(
            "ttftP90",
            (canary.ttft_p90(), canary.count(canary.ttft)),
            (stable.ttft_p90(), stable.count(stable.ttft)),
            ratio=spec.max_ttft_ratio,
            cap=spec.max_ttft_seconds,
            min_requests=n,
        ),
        latency_gate(
            "itlP50",
            (canary.itl_p50(), canary.itl_requests()),
            (stable.itl_p50(), stable.itl_requests()),
            ratio=spec.max_itl_ratio,
            cap=None,
            min_requests=n,
        ),
    ]
    if spec.max_anomaly_rate is not None and not quality_gate:
        gates.append(not_applicable("anomalyRate", NO_QUALITY_GATE))
    elif spec.max_anomaly_rate is not None:
        gates.append(
            rate_gate(
                "anomalyRate",
                (canary.trips, canary.checked),
                (None, None),
                ratio=1.0,
                floor=spec.max_anomaly_rate,
                min_requests=n,
            )
        )
    return _verdict(canary, tuple(gates), window_seconds, n)


def _verdict(
    canary: RevisionMetrics, gates: tuple[GateResult, ...], window: float, min_requests: int
) -> Analysis:
    requests = canary.requests or 0.0
    failed = [g for g in gates if g.verdict == Verdict.FAIL]
    if failed:
        reason = "; ".join(g.line() for g in failed)
        return Analysis(Verdict.FAIL, window, requests, gates, reason)
    if canary.unmeasured:
        reason = f"metrics missing for {', '.join(canary.unmeasured)}"
        return Analysis(Verdict.INCONCLUSIVE, window, requests, gates, reason)
    if requests < min_requests:
        reason = f"{requests:g} canary requests in {window:.0f}s, {min_requests} needed"
        return Analysis(Verdict.INCONCLUSIVE, window, requests, gates, reason)
    open_gates = [g.name for g in gates if g.verdict == Verdict.INCONCLUSIVE]
    if open_gates:
        reason = f"no verdict yet from {', '.join(open_gates)}"
        return Analysis(Verdict.INCONCLUSIVE, window, requests, gates, reason)
    moot = [g.name for g in gates if g.verdict == Verdict.NOT_APPLICABLE]
    reason = "every gate passed" + (f" ({', '.join(moot)} not applicable)" if moot else "")
    return Analysis(Verdict.PASS, window, requests, gates, reason)
