"""Anomaly decisions (pure): per-pod windowed signals in, drains and Degraded out.

Data flow: the observe layer measures `PodSignals` per engine pod over the guard's window; the
caller joins them with what it sees on the pods (`PodView`: role, Ready, serving label, the
`cas.dev/draining-since` annotation) and calls `decide(...)` once per timer tick with the clock
value `now` and the previous tick's `GuardState`. Nothing here does I/O or reads a clock; the
caller owns the state between ticks (losing it only delays a decision: the hysteresis restarts,
and drains in progress are re-read from the pods' annotations).

Rules, in order:
1. A pod whose signals are missing, stale or too thin (fewer checked requests than the floor) is
   never acted on; a fleet whose coverage is too low is reported as "signal unavailable".
2. A pod is *hot* when its trip rate significantly exceeds `podAnomalyRateThreshold` AND one
   tail (low accept length = corrupted KV, high accept rate = repetition) is an outlier against
   the leave-one-out baseline of its pool; or when the engine reports unhealthy-by-quarantine.
3. When most pods with data are elevated together, it is a fleet incident: Degraded, no drains.
4. A pod is drained after `enter_observations` hot ticks not broken by `exit_observations`
   clear ticks (Schmitt trigger: ticks in between hold the streak), subject to the action
   (Observe drains nothing), the pool floor (never the last serving instance), the circuit
   breaker (`maxDrainingPercent` of the pool's desired count: instances draining, not Ready or
   missing all count), a per-pool cooldown and a budget of drains per hour
   (`maxReplacementsPerHour`). The last drain per pool and the drains of the last hour are
   what `GuardState.restored` reads back from `status.anomaly`, so a restart resets neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec, GuardAction
from cas_operator.observe.types import PodSignals, PodView
from cas_operator.stats import exceeds
from cas_operator.types import parse_time, rfc3339

REASON_LOW_ACCEPT = "low_accept_length"
REASON_HIGH_ACCEPT = "high_accept_rate"
REASON_QUARANTINE = "kv_quarantine"
ROLES = c.POOL_ROLES


@dataclass(frozen=True)
class Policy:
    """Tuning that is not in the CRD; defaults are what the operator runs with."""

    min_checked: float = 50.0  # checked requests in the window before a pod is judged
    alpha: float = 1e-3  # significance of "exceeds" tests (Poisson upper tail)
    exit_alpha: float = 0.05  # a pod is clear only when not even this significant...
    exit_ratio: float = 0.5  # ...against exit_ratio * threshold
    outlier_factor: float = 3.0  # a tail must be this many times its pool baseline
    enter_observations: int = 2
    exit_observations: int = 3
    fleet_fraction: float = 0.5  # more than this share of judged pods elevated = incident
    fleet_exit_fraction: float = 0.25
    fleet_min_pods: int = 2
    min_coverage: float = 0.5  # share of serving pods with data needed to act at all
    cooldown_seconds: float = 60.0  # per pool, between two drain starts
    min_serving: int = 1  # floor per pool: serving pods left after a drain
    budget_window_seconds: float = 3600.0  # maxReplacementsPerHour counts drains this recent


@dataclass(frozen=True)
class GuardState:
    """What one tick hands to the next (in memory; see the module docstring)."""

    hot_streak: dict[str, int] = field(default_factory=dict)
    clear_streak: dict[str, int] = field(default_factory=dict)
    degraded: bool = False
    fleet_hot: int = 0
    fleet_clear: int = 0
    last_drain: dict[str, float] = field(default_factory=dict)  # role -> time of last drain
    recent_drains: tuple[float, ...] = ()  # drain starts of the budget window, any pool

    @classmethod
    def restored(cls, anomaly: Mapping[str, Any] | None) -> GuardState:
        """The durable part of a state, from `status.anomaly` (`drain_record` wrote it)."""
        anomaly = anomaly or {}
        last = {
            role: t
            for role, at in (anomaly.get("lastDrain") or {}).items()
            if (t := parse_time(at)) is not None
        }
        parsed = (parse_time(at) for at in anomaly.get("recentDrains") or [])
        recent = tuple(t for t in parsed if t is not None)
        return cls(last_drain=last, recent_drains=recent)

    def drain_record(self) -> dict[str, Any]:
        """`status.anomaly.lastDrain` and `.recentDrains` (what `restored` reads)."""
        return {
            "lastDrain": {role: rfc3339(t) for role, t in sorted(self.last_drain.items())},
            "recentDrains": [rfc3339(t) for t in self.recent_drains],
        }


@dataclass(frozen=True)
class Verdict:
    """How one pod was judged on this tick."""

    name: str
    role: str
    state: str  # hot | elevated | clear | holding | insufficient | unavailable | draining
    rate: float | None
    reason: str


@dataclass(frozen=True)
class DrainOrder:
    name: str
    role: str
    reason: str


@dataclass
class AnomalyDecision:
    """The tick's outcome; `events` are (type, reason, message) for the custom resource."""

    verdicts: dict[str, Verdict]
    drains: list[DrainOrder]
    blocked: dict[str, str]  # pod -> why a wanted drain did not happen
    degraded: str | None  # message while a fleet incident holds
    unavailable: str | None  # message while the signal is unavailable
    pool_rate: dict[str, float | None]
    events: list[tuple[str, str, str]]
    state: GuardState


def _judged(pod: PodView, policy: Policy) -> PodSignals | None:
    """The pod's signals if it can be judged on trip rates (enough checked requests)."""
    s = pod.signals
    if s is None or s.error is not None or s.checked is None or s.trips is None:
        return None
    return s if s.checked >= policy.min_checked else None


def _baseline(pool: list[PodView], skip: str, policy: Policy) -> tuple[float, float] | None:
    """Leave-one-out pooled (low, high) trip rates of the pool; None with no other data."""
    checked = low = high = 0.0
    for other in pool:
        s = _judged(other, policy)
        if other.name == skip or s is None or s.checked is None:
            continue
        checked += s.checked
        low += s.trips_low_accept or 0.0
        high += s.trips_high_accept or 0.0
    return (low / checked, high / checked) if checked > 0 else None


def _outlier_tail(s: PodSignals, base: tuple[float, float] | None, policy: Policy) -> str | None:
    """The tail in which the pod stands out from its pool (None: it does not)."""
    assert s.checked is not None
    for reason, count, base_rate in (
        (REASON_LOW_ACCEPT, s.trips_low_accept or 0.0, base[0] if base else None),
        (REASON_HIGH_ACCEPT, s.trips_high_accept or 0.0, base[1] if base else None),
    ):
        if base_rate is None:  # no peer data: the threshold test alone decides
            if count > 0:
                return reason
            continue
        floor = max(base_rate, 1e-6)
        if count / s.checked >= policy.outlier_factor * base_rate and exceeds(
            count, s.checked, floor, policy.alpha
        ):
            return reason
    return None


def judge_pod(pod: PodView, pool: list[PodView], spec: AnomalyGuardSpec, policy: Policy) -> Verdict:
    """Classify one in-rotation pod on this tick's data (see the module docstring, rules 1-2)."""
    s = pod.signals
    if s is None or s.error is not None:
        why = s.error if s is not None and s.error else "no metrics for this pod"
        return Verdict(pod.name, pod.role, "unavailable", None, why)
    if s.unhealthy_by_quarantine:
        return Verdict(pod.name, pod.role, "hot", None, REASON_QUARANTINE)
    judged = _judged(pod, policy)
    if judged is None or judged.checked is None or judged.trips is None:
        checked = 0.0 if s.checked is None else s.checked
        return Verdict(pod.name, pod.role, "insufficient", None, f"{checked:g} checked requests")
    checked, trips = judged.checked, judged.trips
    rate = trips / checked
    threshold = spec.pod_anomaly_rate_threshold
    if exceeds(trips, checked, threshold, policy.alpha):
        tail = _outlier_tail(judged, _baseline(pool, pod.name, policy), policy)
        if tail is not None:
            return Verdict(pod.name, pod.role, "hot", rate, tail)
        return Verdict(pod.name, pod.role, "elevated", rate, "like its pool")
    if exceeds(trips, checked, threshold * policy.exit_ratio, policy.exit_alpha):
        return Verdict(pod.name, pod.role, "holding", rate, "between exit and enter levels")
    return Verdict(pod.name, pod.role, "clear", rate, "within threshold")


def _fleet_incident(
    verdicts: list[Verdict], state: GuardState, policy: Policy
) -> tuple[GuardState, str | None]:
    """Rule 3 with its own hysteresis; returns the new state and the Degraded message."""
    judged = [v for v in verdicts if v.state in ("hot", "elevated", "holding", "clear")]
    up = [v for v in verdicts if v.state in ("hot", "elevated")]
    share = len(up) / len(judged) if judged else 0.0
    incident = len(up) >= policy.fleet_min_pods and share > policy.fleet_fraction
    calm = share <= policy.fleet_exit_fraction
    hot = state.fleet_hot + 1 if incident else (0 if calm else state.fleet_hot)
    clear = state.fleet_clear + 1 if calm else 0
    degraded = state.degraded
    if not degraded and hot >= policy.enter_observations:
        degraded = True
    elif degraded and clear >= policy.exit_observations:
        degraded = False
    new = replace(state, degraded=degraded, fleet_hot=hot, fleet_clear=clear)
    if not degraded:
        return new, None
    return new, f"fleet-wide anomaly: {len(up)} of {len(judged)} judged pods above threshold"


def _streaks(verdicts: list[Verdict], state: GuardState, policy: Policy) -> GuardState:
    """Rule 4's Schmitt trigger per pod; pods no longer seen are forgotten."""
    hot: dict[str, int] = {}
    clear: dict[str, int] = {}
    for v in verdicts:
        h, k = state.hot_streak.get(v.name, 0), state.clear_streak.get(v.name, 0)
        if v.state == "hot":
            h, k = h + 1, 0
        elif v.state == "clear":
            k += 1
            if k >= policy.exit_observations:
                h = 0
        # elevated / holding / insufficient / unavailable: hold both
        if h:
            hot[v.name] = h
        if k and h:
            clear[v.name] = k
    return replace(state, hot_streak=hot, clear_streak=clear)


def drain_capacity(pool_size: int, max_draining_percent: int) -> int:
    """Pods of a pool that may be draining at once (at least one when the percent is > 0)."""
    if max_draining_percent <= 0 or pool_size <= 0:
        return 0
    return max(1, pool_size * max_draining_percent // 100)


def _select_drains(
    pods: list[PodView],
    verdicts: dict[str, Verdict],
    state: GuardState,
    spec: AnomalyGuardSpec,
    now: float,
    policy: Policy,
    desired: Mapping[str, int],
) -> tuple[list[DrainOrder], dict[str, str], GuardState]:
    """Rule 4's gates, per pool, worst pods (longest streak) first."""
    drains: list[DrainOrder] = []
    blocked: dict[str, str] = {}
    last = dict(state.last_drain)
    recent = [t for t in state.recent_drains if now - t < policy.budget_window_seconds]
    for role in ROLES:
        pool = [p for p in pods if p.role == role]
        wanted = sorted(
            (
                p
                for p in pool
                if p.in_rotation and state.hot_streak.get(p.name, 0) >= policy.enter_observations
            ),
            key=lambda p: (-state.hot_streak.get(p.name, 0), p.name),
        )
        serving = sum(1 for p in pool if p.in_rotation and p.ready)
        size = max(len(pool), desired.get(role, 0))
        unavailable = size - serving  # draining, not Ready, or not there (being replaced)
        cap = drain_capacity(size, spec.max_draining_percent)
        for pod in wanted:
            why = _gate(spec, serving, unavailable, cap, last.get(role), now, policy)
            if why is None and len(recent) >= spec.max_replacements_per_hour:
                why = (
                    f"replacement budget: {len(recent)} drains in the last hour, "
                    f"maxReplacementsPerHour is {spec.max_replacements_per_hour}"
                )
            if why is not None:
                blocked[pod.name] = why
                continue
            drains.append(DrainOrder(pod.name, role, verdicts[pod.name].reason))
            serving -= 1 if pod.ready else 0
            unavailable += 1 if pod.ready else 0
            last[role] = now
            recent.append(now)
    return drains, blocked, replace(state, last_drain=last, recent_drains=tuple(recent))


def _gate(
    spec: AnomalyGuardSpec,
    serving: int,
    unavailable: int,
    cap: int,
    last: float | None,
    now: float,
    policy: Policy,
) -> str | None:
    """Why a drain may not start now, or None when it may."""
    if spec.action == GuardAction.OBSERVE:
        return "action is Observe"
    if serving - 1 < policy.min_serving:
        return f"floor: would leave fewer than {policy.min_serving} serving"
    if unavailable >= cap:
        return (
            f"circuit breaker: {unavailable} unavailable (draining, not Ready or missing), "
            f"maxDrainingPercent allows {cap}"
        )
    if last is not None and now - last < policy.cooldown_seconds:
        return f"cooldown: last drain {now - last:.0f}s ago"
    return None


def _pool_rates(pods: list[PodView], policy: Policy) -> dict[str, float | None]:
    """Pooled trip rate per role over pods with enough data (None: no such pod)."""
    out: dict[str, float | None] = {}
    for role in ROLES:
        checked = trips = 0.0
        for p in pods:
            s = _judged(p, policy) if p.role == role else None
            if s is not None and s.checked is not None and s.trips is not None:
                checked, trips = checked + s.checked, trips + s.trips
        out[role] = trips / checked if checked else None
    return out


def _coverage_problem(pods: list[PodView], verdicts: list[Verdict], policy: Policy) -> str | None:
    live = [p for p in pods if p.in_rotation]
    missing = [v for v in verdicts if v.state == "unavailable"]
    if not live:
        return None
    if (len(live) - len(missing)) / len(live) < policy.min_coverage:
        first = missing[0].reason if missing else ""
        return f"anomaly signal unavailable for {len(missing)} of {len(live)} pods ({first})"
    return None


def decide(
    spec: AnomalyGuardSpec,
    pods: list[PodView],
    state: GuardState,
    now: float,
    policy: Policy | None = None,
    desired: Mapping[str, int] | None = None,
) -> AnomalyDecision:
    """One tick: judge every in-rotation pod, update hysteresis, pick drains (or none).
    `desired`: each pool's desired instance count (missing ones count as unavailable)."""
    policy = policy or Policy()
    verdicts = [
        judge_pod(p, [q for q in pods if q.role == p.role and q.in_rotation], spec, policy)
        if p.in_rotation
        else Verdict(p.name, p.role, "draining", None, "out of rotation")
        for p in pods
    ]
    by_name = {v.name: v for v in verdicts}
    was_degraded = state.degraded
    state, degraded = _fleet_incident(verdicts, state, policy)
    state = _streaks([v for v in verdicts if v.state != "draining"], state, policy)
    unavailable = _coverage_problem(pods, verdicts, policy)
    events: list[tuple[str, str, str]] = []
    drains: list[DrainOrder] = []
    blocked: dict[str, str] = {}
    if degraded is not None or unavailable is not None:
        why = "fleet-wide incident" if degraded is not None else "signal unavailable"
        blocked = {n: why for n, h in state.hot_streak.items() if h >= policy.enter_observations}
    elif spec.enabled:
        drains, blocked, state = _select_drains(
            pods, by_name, state, spec, now, policy, desired or {}
        )
    for order in drains:
        events.append(("Warning", "DrainingPod", f"{order.role} pod {order.name}: {order.reason}"))
    for name, why in sorted(blocked.items()):  # once, when the pod first becomes wanted
        if state.hot_streak.get(name) == policy.enter_observations:
            events.append(("Warning", "DrainBlocked", f"pod {name} is anomalous, kept: {why}"))
    if state.degraded != was_degraded:
        events.append(
            ("Warning", "FleetWideAnomaly", str(degraded))
            if degraded is not None
            else ("Normal", "FleetRecovered", "fleet-wide anomaly cleared")
        )
    return AnomalyDecision(
        verdicts=by_name,
        drains=drains,
        blocked=blocked,
        degraded=degraded,
        unavailable=unavailable,
        pool_rate=_pool_rates(pods, policy),
        events=events,
        state=state,
    )
