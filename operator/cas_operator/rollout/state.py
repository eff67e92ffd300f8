"""A canary rollout's durable state (`status.rollout`), and how a new revision starts one.

Ownership: loop 4 (`rollout.decide`, run by the fleet tick) moves the state on the clock and
on its analysis; the reconcile reads it to size the canary and stable pools and to split the
traffic (`desired.traffic`); the pass writes it with the rest of the status. Both start from
`RolloutState.adopt(revision)`, which begins a canary deterministically when the spec's
revision is new (no clock, no I/O), so whichever of the two sees the new revision first, they
agree. The status is the only copy that outlives the process: a restarted operator resumes at
the same step (`from_status`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from cas_operator.types import Status, parse_time, rfc3339


class Phase(StrEnum):
    STABLE = "Stable"  # no canary: the spec's revision serves every request
    PROGRESSING = "Progressing"  # stepping: pools growing, a step holding, the analysis running
    PAUSED = "Paused"  # held until promoted, an inconclusive analysis, a fleet-wide anomaly
    PROMOTING = "Promoting"  # past the last step: the canary grows to full size, then 100%
    ABORTED = "Aborted"  # weight 0, the canary retired; until the spec changes or a retry


class Action(StrEnum):
    """What a user asks for with the annotation `cas.dev/rollout-action` (or `kubectl cas`)."""

    PROMOTE = "promote"  # skip every remaining step: full size, then all traffic
    SKIP = "skip"  # end the current step now (a pause, an inconclusive analysis)
    ABORT = "abort"
    RETRY = "retry"  # an aborted canary starts again at its first step


@dataclass(frozen=True)
class RolloutState:
    """Where a rollout stands. `weight` is the canary's share of requests in effect since
    `step_started` (epoch seconds); `step` indexes `spec.rollout.steps` (== len(steps) while
    promoting); `aborted` is the revision an abort retired, kept so the same spec does not
    start it again."""

    stable: str | None = None
    canary: str | None = None
    phase: Phase = Phase.STABLE
    step: int = 0
    weight: int = 0
    step_started: float | None = None
    reason: str = ""  # why it holds, or what the last transition was
    aborted: str | None = None
    analysis: Status | None = None  # the last analysis, as status shows it
    # Just promoted: the revision it replaced, kept (and the Gateway's weight kept on the
    # `-canary` Service, which already selects the new revision) while the `-stable` Service's
    # endpoints move to the new revision (`PROMOTION_SETTLE_SECONDS`, `desired.traffic`)
    replaced: str | None = None
    promoted_at: float | None = None

    @property
    def active(self) -> bool:
        """A canary runs (its pools exist or are being made)."""
        return self.canary is not None

    def adopt(self, revision: str) -> RolloutState:
        """This state for a spec whose engines are `revision` (no clock): the first revision
        becomes stable; the stable one ends any canary (a revert); an aborted one stays
        aborted; any other new revision starts a canary at its first step with no traffic."""
        if self.stable is None or revision == self.stable:
            if self.canary is None and revision == self.stable and self.replaced is not None:
                return RolloutState(stable=revision, replaced=self.replaced,
                                    promoted_at=self.promoted_at, reason=self.reason)  # fmt: skip
            return RolloutState(stable=revision)
        if revision == self.aborted and self.canary is None:
            return self
        if revision == self.canary:
            return self
        return RolloutState(
            stable=self.stable,
            canary=revision,
            phase=Phase.PROGRESSING,
            reason=f"canary {revision} started: waiting for its pools",
        )

    def abort(self, reason: str) -> RolloutState:
        return RolloutState(
            stable=self.stable,
            phase=Phase.ABORTED,
            reason=reason,
            aborted=self.canary,
            analysis=self.analysis,
        )

    def promoted(self, now: float) -> RolloutState:
        assert self.canary is not None
        return RolloutState(
            stable=self.canary,
            reason=f"promoted {self.canary}",
            replaced=self.stable,
            promoted_at=now,
        )

    def settled(self) -> RolloutState:
        """The promotion's endpoints have settled: the replaced revision may retire."""
        return replace(self, replaced=None, promoted_at=None)

    def at_step(self, step: int, phase: Phase, reason: str) -> RolloutState:
        """Work on `step` (its pools first; traffic moves when they are Ready)."""
        return replace(self, step=step, phase=phase, reason=reason)

    def to_status(self) -> Status:
        """`status.rollout` (the reconcile adds what it derives: pool sizes, the split)."""
        out: Status = {
            "phase": self.phase.value,
            "stableRevision": self.stable,
            "canaryRevision": self.canary,
            "step": self.step if self.canary else None,
            "weight": self.weight,
            "stepStartedAt": rfc3339(self.step_started) if self.step_started else None,
            "reason": self.reason or None,
            "abortedRevision": self.aborted,
            "analysis": self.analysis,
            "replacedRevision": self.replaced,
            "promotedAt": rfc3339(self.promoted_at) if self.promoted_at else None,
        }
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_status(cls, status: Status | None) -> RolloutState | None:
        """The state a status recorded (None: it recorded none)."""
        found: dict[str, Any] = dict((status or {}).get("rollout") or {})
        if "phase" not in found:
            return None
        try:
            phase = Phase(found["phase"])
        except ValueError:
            return None
        return cls(
            stable=found.get("stableRevision"),
            canary=found.get("canaryRevision"),
            phase=phase,
            step=int(found.get("step") or 0),
            weight=int(found.get("weight") or 0),
            step_started=parse_time(found.get("stepStartedAt")),
            reason=str(found.get("reason") or ""),
            aborted=found.get("abortedRevision"),
            analysis=found.get("analysis"),
            replaced=found.get("replacedRevision"),
            promoted_at=parse_time(found.get("promotedAt")),
        )

    @classmethod
    def recorded(cls, status: Status | None) -> RolloutState:
        """The state to resume from: the recorded one, else (a status from before rollouts
        were recorded) the revision the entry Service sent to, else none yet."""
        found = cls.from_status(status)
        if found is not None:
            return found
        serving = (status or {}).get("servingRevision") or (status or {}).get("revision")
        return cls(stable=str(serving)) if serving else cls()
