"""Revision: which engines a fleet runs, and when an operator upgrade may change that.

The revision is a hash of what both roles' engines run: their rendered pod templates (image,
command and args, env, resources, probes, volumes, scheduling, the user's pod labels and
annotations) without the operator's labels (which carry the revision), and the nodes per
instance. A prefill and a decode pod exchange KV and
must run the same engine, so a change to either role makes a new revision for both. Replica
counts, router settings and the operator-side fields of the anomaly guard and rollout are not
rendered into engine pods, so they never make one; an operator version that adds a field it does
not render into the pods changes no revision.

An operator version that renders the same spec differently (a new flag, a changed default)
would still make a new revision, and a new revision rolls the fleet. `choose` keeps the revision
a fleet runs while the user's engine settings are what they were when it was recorded
(`engine_input`: the engine-relevant spec without its defaults; for a status written before it
existed, an unchanged `metadata.generation`), unless `spec.rollout.onOperatorUpgrade` is `Roll`.
New keys are a new revision whatever the policy (`desired.resources.security`: pods take the
keys of one version; the engines cannot take a new key while they run): the keys version the
status recorded differs from the plan's (a status written before `keysVersion` existed changes
nothing: the pods of that time run with the keys the Secret holds).

Data flow: `desired.build.build_plan` renders a draft plan -> `engine_revision`; the status the
last pass wrote (`RevisionRecord.from_status`) -> `choose` -> `Plan.at_revision`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cas_operator.api.models import CodingAgentServingSpec, OperatorUpgradePolicy
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import Manifest, is_operator_key, stable_hash
from cas_operator.desired.resources.pools import pod_templates

ENGINE_SECTIONS = ("model", "engine", "hicache", "pod_metadata")
POOL_EXCLUDED = {"replicas"}
GUARD_ENGINE_FIELDS = {"enabled", "min_generated_tokens", "min_accept_length", "max_accept_rate"}


def _unlabelled(template: Manifest) -> Manifest:
    """The template without the operator's labels (they carry the revision); a user's
    `podMetadata` labels stay: changing them restarts pods, so through a new revision."""
    meta = dict(template.get("metadata", {}))
    labels = meta.get("labels", {})
    meta["labels"] = {k: v for k, v in labels.items() if not is_operator_key(k, "labels")}
    return {**template, "metadata": meta}


def engine_revision(plan: Plan) -> str:
    """The revision of what `plan`'s engines run (its own `revision` does not enter)."""
    content = {
        pool.role: {
            "nodes": pool.shape.nodes,
            "pods": [_unlabelled(t) for t in pod_templates(plan, pool)],
        }
        for pool in plan.pools
    }
    return stable_hash(content)


def engine_input(spec: CodingAgentServingSpec) -> str:
    """A hash of the engine settings the user wrote: the sections rendered into engine pods,
    without replica counts and without any value equal to its default, so a field an operator
    version adds (or a default it changes) leaves it as it was."""

    def dump(section: Any, **kw: Any) -> Any:
        return section.model_dump(mode="json", exclude_defaults=True, **kw)

    data: dict[str, Any] = {k: dump(getattr(spec, k)) for k in ENGINE_SECTIONS}
    data["prefill"] = dump(spec.prefill, exclude=POOL_EXCLUDED)
    data["decode"] = dump(spec.decode, exclude=POOL_EXCLUDED)
    data["guard"] = dump(spec.anomaly_guard, include=GUARD_ENGINE_FIELDS)
    return stable_hash({k: v for k, v in data.items() if v})  # a new, unset section: no change


@dataclass(frozen=True)
class RevisionRecord:
    """What the last pass wrote to the status about the engines: `revision` (what runs),
    `engineInput`, `observedGeneration` and `heldRevision` (a rendered revision held back)."""

    revision: str
    engine_input: str = ""
    observed_generation: int | None = None
    held: str = ""
    keys_version: str = ""  # the keys the recorded revision's pods take ("": not recorded)

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> RevisionRecord | None:
        status = status or {}
        if not status.get("revision"):
            return None
        generation = status.get("observedGeneration")
        return cls(
            revision=str(status["revision"]),
            engine_input=str(status.get("engineInput") or ""),
            observed_generation=int(generation) if generation is not None else None,
            held=str((status.get("heldRevision") or {}).get("revision") or ""),
            keys_version=str(status.get("keysVersion") or ""),
        )


def choose(
    record: RevisionRecord | None,
    *,
    rendered: str,
    engine_input: str,
    generation: int,
    policy: OperatorUpgradePolicy,
    keys_version: str = "",
) -> str:
    """The revision to run: the recorded one while only the operator's rendering changed (the
    user's engine settings and the keys are the same), else `rendered`."""
    if record is None or record.revision == rendered or policy == OperatorUpgradePolicy.ROLL:
        return rendered
    if record.keys_version and keys_version and record.keys_version != keys_version:
        return rendered
    if record.engine_input:
        unchanged = record.engine_input == engine_input
    else:  # written by an operator version before engineInput: trust an unchanged generation
        unchanged = record.observed_generation == generation
    return record.revision if unchanged else rendered
