"""Loop 4's decision (pure): one tick of a canary rollout.

Input: the last `RolloutState` (status.rollout), the rollout spec, and what the fleet tick
saw (`RolloutInputs`: whether the canary's pools are Ready at the current step's size, the
step's analysis, anomaly findings, a user's action). Output: the next state and the events
that explain it. Nothing here does I/O or reads a clock (`now` is an argument).

One tick, in order:
1. `state.adopt(revision)`: a new spec revision starts a canary at step 0 with no traffic;
   the stable one ends it (a revert); an aborted one stays aborted;
2. a user's action (annotation `cas.dev/rollout-action`): abort, promote (every step at
   once), skip (the current step), retry (an aborted canary from its first step);
3. a canary-only anomaly, or a failing analysis at any time of a step, aborts (weight 0);
4. a fleet-wide anomaly (the stable revision's) pauses: no step moves while it lasts;
5. the canary's pools are sized for the step's weight first; traffic moves to that weight
   only once both roles and the router are Ready at that size;
6. a step holds for `pauseSeconds` (one analysis window when absent; at least
   `WINDOW_STEP_SECONDS`, when its first analysis comes) or until promoted; it ends only on a
   passing analysis (an inconclusive one pauses, never promotes);
7. past the last step the canary grows to full size, gets 100%, and the next tick makes it
   the stable revision (the old one then retires through the drain path).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cas_operator.api.models import CanaryStep, RolloutSpec
from cas_operator.rollout.analysis import Analysis, Verdict
from cas_operator.rollout.state import Action, Phase, RolloutState
from cas_operator.types import Event

# After a promotion the Gateway's `-stable` Service changes its selector to the new revision;
# its EndpointSlice (then the Gateway's copy of it) follows only after a moment, and a weight
# moved there at once, with the old routers retiring, met an empty backend: "no available
# server" 503s (the canary e2e test measured 49 of 981 under the parallel suite). The weight
# stays on the `-canary` Service, and the old revision stays, this long (the router's own
# endpoint settle time, doubled).
PROMOTION_SETTLE_SECONDS = 10.0
# Analysis windows are whole multiples of this (scrapes come every 5-15 s), each after the
# weight took effect; so a step holds at least this long, until its first analysis.
WINDOW_STEP_SECONDS = 15


@dataclass(frozen=True)
class RolloutInputs:
    """What the fleet tick saw this tick (see the module docstring)."""

    revision: str  # the spec's revision (the one a canary runs)
    ready_step: int | None = None  # the step whose pool sizes the canary is Ready at
    analysis: Analysis | None = None  # over the window since the weight took effect
    fleet_anomaly: str | None = None  # the stable revision's fleet-wide incident
    canary_anomaly: str | None = None  # the canary revision's own anomaly finding
    action: Action | None = None


@dataclass(frozen=True)
class RolloutDecision:
    state: RolloutState
    events: list[Event] = field(default_factory=list)


def target_weight(steps: list[CanaryStep], step: int) -> int:
    """The canary's weight at `step` (100 past the last step: promotion)."""
    return steps[step].weight if step < len(steps) else 100


def decide(
    state: RolloutState, spec: RolloutSpec, inputs: RolloutInputs, now: float
) -> RolloutDecision:
    """One tick (see the module docstring)."""
    begun = state.adopt(inputs.revision)
    if begun.replaced is not None and now - (begun.promoted_at or now) >= PROMOTION_SETTLE_SECONDS:
        begun = begun.settled()
    events: list[Event] = []
    if begun.canary is not None and begun.canary != state.canary:
        events.append(("Normal", "CanaryStarted", f"revision {begun.canary} starts as a canary"))
    if begun.canary is None and state.canary is not None and begun.phase == Phase.STABLE:
        events.append(("Normal", "CanaryEnded", f"the spec is back at {begun.stable}"))
    acted = _act(begun, spec, inputs.action, now)
    if acted is not None:
        return RolloutDecision(acted.state, events + acted.events)
    if begun.canary is None:
        return RolloutDecision(begun, events)
    stepped = _step(begun, spec, inputs, now)
    if stepped.state.phase == Phase.PAUSED and begun.phase != Phase.PAUSED:
        events.append(("Normal", "RolloutPaused", stepped.state.reason))
    return RolloutDecision(stepped.state, events + stepped.events)


def _act(
    state: RolloutState, spec: RolloutSpec, action: Action | None, now: float
) -> RolloutDecision | None:
    """A user's action, or None when there is none that applies."""
    steps = spec.steps or []
    if action == Action.RETRY and state.phase == Phase.ABORTED and state.aborted:
        retried = RolloutState(
            stable=state.stable,
            canary=state.aborted,
            phase=Phase.PROGRESSING,
            reason="retried: waiting for the canary's pools",
        )
        return RolloutDecision(retried, [("Normal", "RolloutRetried", f"{state.aborted} again")])
    if state.canary is None or action is None or action == Action.RETRY:
        return None
    if action == Action.ABORT:
        why = "aborted by the user"
        return RolloutDecision(state.abort(why), [("Warning", "RolloutAborted", why)])
    if action == Action.PROMOTE:
        promoting = state.at_step(len(steps), Phase.PROMOTING, "promoted by the user")
        return RolloutDecision(promoting, [("Normal", "RolloutPromote", "every step skipped")])
    nxt = min(state.step + 1, len(steps))
    phase = Phase.PROMOTING if nxt >= len(steps) else Phase.PROGRESSING
    skipped = state.at_step(nxt, phase, f"step {state.step + 1} skipped by the user")
    return RolloutDecision(skipped, [("Normal", "RolloutStepSkipped", skipped.reason)])


def _step(
    state: RolloutState, spec: RolloutSpec, inputs: RolloutInputs, now: float
) -> RolloutDecision:
    """Rules 3-7 for a running canary."""
    steps = spec.steps or []
    if inputs.canary_anomaly is not None:
        why = f"canary anomaly: {inputs.canary_anomaly}"
        return RolloutDecision(state.abort(why), [("Warning", "RolloutAborted", why)])
    analysis = inputs.analysis if state.weight > 0 and state.step_started else None
    if analysis is not None:
        state = replace(state, analysis=analysis.to_status())
        if analysis.verdict == Verdict.FAIL:
            why = f"analysis failed at {state.weight}%: {analysis.reason}"
            return RolloutDecision(state.abort(why), [("Warning", "RolloutAborted", why)])
    if inputs.fleet_anomaly is not None:
        why = f"fleet-wide anomaly: {inputs.fleet_anomaly}"
        return RolloutDecision(replace(state, phase=Phase.PAUSED, reason=why))
    target = target_weight(steps, state.step)
    label = "promotion" if state.step >= len(steps) else f"step {state.step + 1}/{len(steps)}"
    moving = Phase.PROMOTING if state.step >= len(steps) else Phase.PROGRESSING
    if state.weight != target:
        if inputs.ready_step != state.step:
            why = f"{label}: waiting for the canary's pools at {target}%"
            return RolloutDecision(replace(state, phase=moving, reason=why))
        moved = replace(state, weight=target, step_started=now, analysis=None)
        why = f"{label}: {target}% of requests to the canary"
        return RolloutDecision(
            replace(moved, phase=moving, reason=why), [("Normal", "CanaryWeight", why)]
        )
    if state.step >= len(steps):  # all traffic on the canary since the last tick
        event = ("Normal", "RolloutPromoted", f"revision {state.canary} is stable")
        return RolloutDecision(state.promoted(now), [event])
    return _hold(state, steps[state.step], spec, analysis, now, label)


def _hold(
    state: RolloutState,
    step: CanaryStep,
    spec: RolloutSpec,
    analysis: Analysis | None,
    now: float,
    label: str,
) -> RolloutDecision:
    """A step whose weight is in effect: hold, pause, or end it on a passing analysis."""
    held = now - (state.step_started or now)
    if step.pause_until_promoted:
        why = f"{label} at {state.weight}%: paused until promoted"
        return RolloutDecision(replace(state, phase=Phase.PAUSED, reason=why))
    hold = step.pause_seconds if step.pause_seconds is not None else spec.analysis.window_seconds
    hold = max(hold, WINDOW_STEP_SECONDS)  # the first analysis comes one step after the weight
    if held < hold:
        why = f"{label} at {state.weight}%: {held:.0f}s of {hold}s"
        return RolloutDecision(replace(state, phase=Phase.PROGRESSING, reason=why))
    if analysis is None or analysis.verdict != Verdict.PASS:
        why = analysis.reason if analysis is not None else "no analysis yet"
        paused = replace(state, phase=Phase.PAUSED, reason=f"{label}: inconclusive: {why}")
        return RolloutDecision(paused)
    steps = spec.steps or []
    nxt = state.step + 1
    phase = Phase.PROMOTING if nxt >= len(steps) else Phase.PROGRESSING
    why = f"{label} passed its analysis ({analysis.canary_requests:.0f} canary requests)"
    return RolloutDecision(state.at_step(nxt, phase, why), [("Normal", "CanaryStepPassed", why)])
