"""One level-based, idempotent reconcile of a CodingAgentServing.

Called from create, update, resume and a timer (handlers.py). It reads like the steps it takes:
1. parse and validate the spec; plan it (pure);
2. build every child manifest (pure);
3. apply them with server-side apply, in dependency tiers, each tier concurrently, skipping
   (outside full passes) workloads whose spec-hash already matches; while an operator upgrade
   is held (`Plan.held`), workloads that exist only get their replica counts; an object under
   a child's name that this resource does not control is never written (`ownership.apply_owned`:
   `Degraded: ChildNotOwned` naming it);
4. observe the workloads; once the current revision is Ready, point the entry Service at it
   alone, then retire each older revision when its engines are idle (router first out of
   the entry point, then its children deleted: `retire_stale`);
5. compute the status (pure) and hand back only what changed.
Per-child failures are collected, never abort the pass, and end up in the Degraded condition.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.api.models import RolloutStrategy, SecuritySpec, parse_spec
from cas_operator.autoscale.controller import STATUS_KEY, AutoState
from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.signals import shape_in_status, with_shape
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec, Plan
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.network import network_policy_names
from cas_operator.desired.resources.traffic import (
    build_traffic,
    route_weights,
    track_service_name,
)
from cas_operator.desired.revision import RevisionRecord
from cas_operator.desired.traffic import (
    MODE_GATEWAY,
    MODE_SERVICE,
    Split,
    single_revision,
    split_for,
)
from cas_operator.kube import REVISIONED_KINDS, KindNotInstalled, Kube, NamespaceTerminating
from cas_operator.reconcile.keys import ensure_keys, forget_copy
from cas_operator.reconcile.ownership import (
    NotOwned,
    apply_owned,
    controller_uid,
    delete_owned,
    foreign_account,
    remember_observed,
)
from cas_operator.reconcile.status import (
    ObservedWorkload,
    Problem,
    RolloutView,
    Status,
    compute_status,
    invalid_status,
    is_true,
)
from cas_operator.rollout.state import RolloutState
from cas_operator.scaledown.decide import (
    PoolFloor,
    RetirePolicy,
    RevisionLoad,
    RevisionRetire,
    replicas_to_apply,
    retire_revision,
)
from cas_operator.types import Manifest, rfc3339

log = logging.getLogger(__name__)
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")
# Problems a spec pass is retried for (kopf's backoff): a refusal may pass, an object in the
# way may be removed.
RETRIED_REASONS = frozenset({c.REASON_APPLY_FAILED, c.REASON_NOT_OWNED})
# Shared by all reconciles: bounds the operator's concurrent API writes.
_APPLY_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="apply")


@dataclass
class Outcome:
    """What one pass produced: the desired status, events to emit, and the spec error if any."""

    status: Status
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    invalid: InvalidSpec | None = None
    applied: int = 0
    failed: int = 0  # children not applied: refused, not answered, or someone else's


@dataclass(frozen=True)
class Measured:
    """What the fleet tick measured and decided (None: nothing yet): the load for the planner,
    Auto mode's replicas, and the status sections it owns (`anomaly`, `draining`,
    `autoscaler`), which the pass writes together with the conditions derived from them;
    and the scale-down loop's `floors`, which bound how far a pass lowers a workload."""

    observed: ObservedSignals | None = None
    auto_replicas: tuple[int, int] | None = None
    sections: Status | None = None
    floors: tuple[PoolFloor, ...] = ()  # how far each pool may shrink (scale-down loop)
    older: tuple[RevisionLoad, ...] = ()  # older revisions' engine work (their retire)
    rollout: RolloutState | None = None  # loop 4's state (status.rollout), None: not run yet

    @property
    def anomaly(self) -> dict[str, Any] | None:
        """`status.anomaly`, which the conditions fold in."""
        found: dict[str, Any] | None = (self.sections or {}).get("anomaly")
        return found

    @classmethod
    def kept_in(cls, status: Status) -> Measured:
        """What a resource's status kept of the last findings, before this process measured
        it (a restarted operator keeps Auto's replicas instead of jumping back to the
        planner's, the request shape its routers' limits are sized for instead of rolling them
        to the declared one, and the conditions keep their anomaly evidence)."""
        state = AutoState.from_status(status.get(STATUS_KEY))
        anomaly = status.get("anomaly")
        shape = shape_in_status(status)
        return cls(
            observed=with_shape(ObservedSignals(), shape) if shape else None,
            auto_replicas=state.replicas if state else None,
            sections={"anomaly": anomaly} if anomaly is not None else None,
            rollout=RolloutState.from_status(status),
        )


def plan_for(
    name: str,
    namespace: str,
    raw_spec: dict[str, Any],
    measured: Measured = Measured(),
    *,
    recorded: RevisionRecord | None = None,
    generation: int = 0,
    limits: OperatorLimits = OperatorLimits(),
    keys_version: str = "",
) -> Plan:
    """Step 1: parse + validate + plan; raises InvalidSpec naming every bad field."""
    return plan_raw(
        name,
        namespace,
        raw_spec,
        measured.observed,
        measured.auto_replicas,
        recorded=recorded,
        generation=generation,
        limits=limits,
        keys_version=keys_version,
    )


def security_of(raw_spec: dict[str, Any]) -> SecuritySpec | None:
    """The spec's `security` for the keys step (None when the spec does not parse: the plan
    refuses it, naming the fields)."""
    try:
        return parse_spec(raw_spec).security
    except ValidationError:
        return None


def observe(kube: Kube, namespace: str, name: str) -> list[ObservedWorkload]:
    """Step 4a: the workloads (all revisions) and routers of this resource."""
    selector = {c.LABEL_NAME: name, c.LABEL_MANAGED_BY: c.MANAGED_BY}
    found = []
    for kind in WORKLOAD_KINDS:
        for obj in kube.list(kind, namespace, selector):
            obj.setdefault("kind", kind)
            found.append(ObservedWorkload.from_object(obj))
    return found


def owned_workloads(
    observed: list[ObservedWorkload], namespace: str, owner_uid: str
) -> list[ObservedWorkload]:
    """The workloads the resource of `owner_uid` controls (one labelled like ours but made by
    someone else is not the pass's to count, scale or delete); each is remembered as owned,
    so its applies need no GET (`ownership.apply_owned`)."""
    ours = [w for w in observed if w.owned_by(owner_uid)]
    remember_observed((w.kind, namespace, w.name, w.uid, w.owner_uid) for w in ours)
    return ours


def gate_scale_down(
    manifests: list[dict[str, Any]], observed: list[ObservedWorkload], floors: tuple[PoolFloor, ...]
) -> None:
    """Step 2b: a workload's replica count goes down only as far as the scale-down loop has
    released instances (its ReplicaSet or LWS then removes exactly those); up at once."""
    seen = {(w.kind, w.name): w for w in observed}
    found_floors = {(f.revision, f.role): f for f in floors}
    for m in manifests:
        found = (
            seen.get((m["kind"], m["metadata"]["name"])) if m["kind"] in WORKLOAD_KINDS else None
        )
        if found is None or found.role == c.ROLE_ROUTER:
            continue
        desired = int(m["spec"]["replicas"])
        floor = found_floors.get((found.revision, found.role))
        m["spec"]["replicas"] = replicas_to_apply(desired, found.replicas, floor)


def apply_tier(manifest: dict[str, Any]) -> int:
    """Dependency tier: identity, config, Services, PDBs (0) -> pools and RoleBindings (1) ->
    router (2). A RoleBinding waits for its Role: an operator without the `bind` verb may bind
    only a Role the API server can read (escalation check), else it answers 404."""
    if manifest["kind"] == "RoleBinding":
        return 1
    if manifest["metadata"]["labels"].get(c.LABEL_ROLE) == c.ROLE_ROUTER:
        return 2 if manifest["kind"] == "Deployment" else 0
    return 1 if manifest["kind"] in WORKLOAD_KINDS else 0


@dataclass(frozen=True)
class ApplyResult:
    """One child's apply: the problem it hit, or the workload as the server answered it."""

    problem: Problem | None = None
    workload: ObservedWorkload | None = None


def _apply_one(kube: Kube, manifest: dict[str, Any], replicas_only: bool = False) -> ApplyResult:
    """Apply one child; a workload comes back as the server answered it (saves a LIST).
    `replicas_only`: patch just `spec.replicas` of an existing workload (a held template)."""
    key = (manifest["kind"], manifest["metadata"]["name"])
    namespace = manifest["metadata"]["namespace"]
    try:
        if replicas_only:
            patch = {"spec": {"replicas": manifest["spec"]["replicas"]}}
            answer = kube.patch(key[0], namespace, key[1], patch)
        elif why := foreign_account(kube, manifest):
            return ApplyResult(Problem(c.REASON_NOT_OWNED, f"{key[0]} {key[1]} not applied: {why}"))
        else:
            answer = apply_owned(kube, manifest)
    except NotOwned as exc:
        log.warning("not applying %s %s/%s: %s", key[0], namespace, key[1], exc)
        return ApplyResult(Problem(c.REASON_NOT_OWNED, str(exc)))
    except KindNotInstalled as exc:
        return ApplyResult(
            Problem(
                c.REASON_LWS_MISSING,
                f"{exc.kind} API ({c.LWS_API_VERSION}) is not installed: multi-node instances "
                f"need the LeaderWorkerSet controller ({key[1]} not created)",
            )
        )
    except NamespaceTerminating:  # the resource goes with its namespace: not a fault
        log.debug("not applying %s %s: its namespace is being deleted", *key)
        return ApplyResult()
    except Exception as exc:
        where = f"{key[0]} {namespace}/{key[1]}"
        log.warning("apply of %s failed: %s", where, exc)
        return ApplyResult(Problem(c.REASON_APPLY_FAILED, f"{key[0]} {key[1]}: {exc}"))
    if key[0] not in WORKLOAD_KINDS or not isinstance(answer, dict):
        return ApplyResult()
    return ApplyResult(workload=ObservedWorkload.from_object({**answer, "kind": key[0]}))


@dataclass
class Applied:
    """What `apply_children` did: children applied, problems, workloads as the server answered."""

    count: int
    problems: list[Problem]
    workloads: list[ObservedWorkload]


def drift(seen: ObservedWorkload, manifest: dict[str, Any], held: bool = False) -> str:
    """How an observed workload differs from its manifest ("" when it does not): its template
    (spec-hash; not while `held`) or its replicas. Either side may have moved: someone edited
    or scaled the workload, or our own desired state changed (a spec edit, an Auto step) and
    the watch-fed copy has not caught up with the apply yet; so the text states the facts."""
    want: str = manifest["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
    if seen.spec_hash != want and not held:
        return f"template differs (spec-hash {seen.spec_hash} observed, {want} desired)"
    replicas = manifest["spec"].get("replicas", seen.replicas)
    if seen.replicas != replicas:
        return f"replicas differ ({seen.replicas} observed, {replicas} desired)"
    return ""


def apply_children(
    kube: Kube,
    manifests: list[dict[str, Any]],
    observed: list[ObservedWorkload],
    full: bool,
    apply_missing: bool = True,
    held: bool = False,
) -> Applied:
    """Step 3: apply tier by tier, each tier's children concurrently (a tier waits for the one
    before). Without `full`, only workloads whose spec-hash or replicas differ from the
    observed ones (someone edited or scaled them), and (with `apply_missing`) those not
    observed at all. `held` (an operator upgrade held back): an observed workload's template
    is left as it runs, only a replica count that differs is patched, full pass or not."""
    current = {(w.kind, w.name): w for w in observed}

    def seen(m: dict[str, Any]) -> ObservedWorkload | None:
        return (
            current.get((m["kind"], m["metadata"]["name"])) if m["kind"] in WORKLOAD_KINDS else None
        )

    def why_stale(m: dict[str, Any]) -> str:
        """Why a refresh re-applies `m` ("" = it does not)."""
        if m["kind"] not in WORKLOAD_KINDS:
            return ""
        found = seen(m)
        return ("missing" if apply_missing else "") if found is None else drift(found, m, held)

    todo = []
    for m in manifests:
        if full and not (held and seen(m) is not None):
            todo.append(m)
        elif why := why_stale(m):
            log.info("re-applying %s %s: %s", m["kind"], m["metadata"]["name"], why)
            todo.append(m)
    problems: list[Problem] = []
    workloads: list[ObservedWorkload] = []

    def act(m: dict[str, Any]) -> ApplyResult:
        return _apply_one(kube, m, replicas_only=held and seen(m) is not None)

    for tier in sorted({apply_tier(m) for m in todo}):
        batch = [m for m in todo if apply_tier(m) == tier]
        for result in _APPLY_POOL.map(act, batch):
            problems += [result.problem] if result.problem is not None else []
            workloads += [result.workload] if result.workload is not None else []
    return Applied(len(todo) - len(problems), problems, workloads)


def merged(
    observed: list[ObservedWorkload], fresh: list[ObservedWorkload]
) -> list[ObservedWorkload]:
    """`observed` with each workload in `fresh` (the server's latest answer) replacing its
    older copy."""
    newer = {(w.kind, w.name) for w in fresh}
    return [w for w in observed if (w.kind, w.name) not in newer] + fresh


def entry_revision(
    plan: Plan, observed: list[ObservedWorkload], previous: Status | None
) -> str | None:
    """The revision whose routers the entry Service sends to while this pass applies: the
    current one when nothing older runs; during a roll, the one that served before (None, all
    of them, when the status predates `servingRevision`). `retire_stale` moves it to the
    current revision once that is Ready."""
    stale = {w.revision for w in observed if w.revision != plan.revision}
    if not stale:
        return plan.revision
    before = (previous or {}).get("servingRevision")
    return str(before) if before == plan.revision or before in stale else None


def point_entry(manifests: list[dict[str, Any]], plan: Plan, revision: str | None) -> Manifest:
    """Step 2c: the entry Service's selector names `revision` (or every revision: None)."""
    entry = next(
        m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == plan.name
    )
    selector = entry["spec"]["selector"]
    selector.pop(c.LABEL_REVISION, None)
    if revision is not None:
        selector[c.LABEL_REVISION] = revision
    return entry


@dataclass
class Retired:
    """What `retire_stale` did: events, how each older revision's retire is going."""

    events: list[tuple[str, str, str]] = field(default_factory=list)
    progress: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()  # revisions whose children were deleted


def retire_stale(
    kube: Kube,
    plan: Plan,
    observed: list[ObservedWorkload],
    older: tuple[RevisionLoad, ...],
    now: float,
    keep: frozenset[str] | None = None,
    *,
    owner_uid: str,
) -> Retired:
    """Step 4b, once the current revision is Ready and the entry Service sends only to it:
    each older revision's workloads are marked out of the entry point
    (`cas.dev/retiring-since`); after `min_wait_seconds` (kube-proxy has dropped the old
    routers) its router Deployment is deleted: a router pod stops accepting on SIGTERM,
    finishes what it proxies and closes its clients' kept-alive connections, so they reconnect
    to the new one; the rest goes once its engines are idle (`older`: the fleet tick's
    reading) or the drain grace is over (`scaledown.decide.retire_revision`), and never before
    the router's pods are gone: a router in its preStop sleep still takes requests on its
    clients' kept-alive connections, and with its engines deleted it answered them 503 ("no
    prefill workers", seen in e2e/tests/test_keys_rotation.py)."""
    out = Retired()
    policy = RetirePolicy(max_wait_seconds=plan.spec.engine.drain_seconds)
    work = {load.revision: load.work for load in older}
    keep = frozenset({plan.revision}) if keep is None else keep
    for revision in sorted({w.revision for w in observed if w.revision not in keep}):
        workloads = [w for w in observed if w.revision == revision]
        marked = [w.retiring_since for w in workloads if w.retiring_since is not None]
        since = min(marked) if marked else None
        if since is None:
            since = now
            mark = {"metadata": {"annotations": {c.ANNOTATION_RETIRING_SINCE: rfc3339(now)}}}
            for w in workloads:
                kube.patch(w.kind, plan.namespace, w.name, mark)
        step = retire_revision(since, work.get(revision), now, policy)
        router = next((w for w in workloads if w.role == c.ROLE_ROUTER), None)
        if step.delete and (router is not None or routers_left(kube, plan, revision)):
            step = RevisionRetire(False, f"its routers finish first ({step.progress})")
        if not step.delete:
            waited = now - since
            if (
                router is not None
                and waited >= policy.min_wait_seconds
                and (waited >= GATEWAY_WAIT_MAX_SECONDS or gateway_caught_up(kube, plan))
            ):
                kube.delete("Deployment", plan.namespace, router.name, uid=router.uid)
                out.events.append(
                    ("Normal", "RouterRetired", f"revision {revision}'s router draining")
                )
            out.progress += (f"retiring {revision}: {step.progress}",)
            continue
        selector = {c.LABEL_NAME: plan.name, c.LABEL_REVISION: revision}
        for kind in REVISIONED_KINDS:
            for obj in kube.list(kind, plan.namespace, selector):
                if controller_uid(obj) == owner_uid:  # never another's, whatever its labels
                    meta = obj["metadata"]
                    kube.delete(kind, plan.namespace, meta["name"], uid=meta.get("uid"))
        why = f"revision {revision} retired, {'/'.join(sorted(keep))} kept ({step.progress})"
        out.events.append(("Normal", "RevisionRetired", why))
        out.deleted += (revision,)
    delete_unused_keys(kube, plan, observed, out.deleted, owner_uid)
    return out


# How long a retiring revision's routers wait for the Gateway to report the HTTPRoute's
# current generation before they go anyway (a parent whose controller never reports).
GATEWAY_WAIT_MAX_SECONDS = 120.0


def gateway_caught_up(kube: Kube, plan: Plan) -> bool:
    """Whether every Gateway the fleet's HTTPRoute is attached to reports having read its
    current generation (`status.parents[].conditions[].observedGeneration`, Gateway API), so
    that it no longer routes by older weights to a retiring revision's routers; True without
    `spec.gateway`. Under the parallel suite Traefik sent requests to the old routers for
    15 s after the weights left them, and their shutdown answered 502 (test_canary.py)."""
    gateway = plan.spec.gateway
    if gateway is None:
        return True
    route = kube.get("HTTPRoute", plan.namespace, gateway.http_route or plan.name)
    if route is None:
        return True  # nothing routes by it
    generation = (route.get("metadata") or {}).get("generation")
    parents = (route.get("status") or {}).get("parents") or []
    if generation is None or not parents:
        return False
    return all(
        any(
            int(cond.get("observedGeneration", -1)) >= generation
            for cond in parent.get("conditions") or []
        )
        for parent in parents
    )


def routers_left(kube: Kube, plan: Plan, revision: str) -> bool:
    """Whether router pods of `revision` still exist (terminating ones included)."""
    selector = {c.LABEL_NAME: plan.name, c.LABEL_ROLE: c.ROLE_ROUTER, c.LABEL_REVISION: revision}
    return bool(kube.list("Pod", plan.namespace, selector))


def delete_unused_keys(
    kube: Kube,
    plan: Plan,
    observed: list[ObservedWorkload],
    retired: tuple[str, ...],
    owner_uid: str,
) -> None:
    """The keys copies only the `retired` revisions took go with them (the old keys then live
    nowhere but in pods on their way out), each only when it is this resource's; a failed
    delete is retried at the next retire."""
    gone = {w.keys_version for w in observed if w.revision in retired and w.keys_version}
    kept = {w.keys_version for w in observed if w.revision not in retired} | {plan.keys_version}
    for version in sorted(gone - kept):
        name = c.keys_copy_name(plan.name, version)
        try:
            delete_owned(kube, "Secret", plan.namespace, name, owner_uid)
        except Exception as exc:
            log.warning("keys copy %s of %s: %s", version, plan.name, exc)
            continue
        forget_copy(plan.namespace, plan.name, version)


def said_once(
    plan: Plan, recorded: RevisionRecord | None, previous: Status
) -> list[tuple[str, str, str]]:
    """Events for news the status did not carry yet: a new rendering of the engines held back,
    spec warnings (pod metadata the operator dropped)."""
    events = []
    if plan.held and (recorded is None or recorded.held != plan.rendered_revision):
        events.append(
            (
                "Normal",
                c.REASON_OPERATOR_UPGRADE_HELD,
                f"this operator version renders the engine pods of revision {plan.revision} "
                f"differently (revision {plan.rendered_revision}); they keep running as they "
                "are. Set spec.rollout.onOperatorUpgrade: Roll to roll them, or change the spec.",
            )
        )
    if plan.warnings and list(plan.warnings) != previous.get("warnings"):
        events.append(("Warning", c.REASON_SPEC_WARNING, "; ".join(plan.warnings)))
    return events


def reconcile(
    kube: Kube,
    *,
    name: str,
    namespace: str,
    uid: str,
    generation: int,
    raw_spec: dict[str, Any],
    full_apply: bool,
    observed: list[ObservedWorkload] | None = None,
    measured: Measured = Measured(),
    apply_missing: bool = True,
    previous: Status | None = None,
    limits: OperatorLimits = OperatorLimits(),
    now: float | None = None,
) -> Outcome:
    """One pass; see the module docstring for the steps. `measured` is the fleet tick's last
    finding: the load feeds the planner and Auto mode, its `status.anomaly` is folded into the
    conditions, and its status sections are returned with them (one writer). `observed` is
    the caller's watch-fed copy of the workloads (saves the LISTs: what this pass applies is
    taken from the server's answers); without it a full pass lists after applying, others
    before. `apply_missing=False` leaves workloads absent from `observed` alone (the caller
    knows its copy may not have caught up with its own recent apply). `previous` is the status
    the last pass wrote: what runs (`desired.revision.choose` holds it across an operator
    upgrade) and what was said already; `limits` the operator's own bounds; `now` the wall
    clock (retire marks)."""
    now = time.time() if now is None else now
    recorded = RevisionRecord.from_status(previous)
    owner = Owner(name, namespace, uid)
    keys = ensure_keys(
        kube,
        owner,
        security_of(raw_spec),
        recorded.keys_version if recorded else "",
        recheck=full_apply,
    )
    try:
        plan = plan_for(
            name,
            namespace,
            raw_spec,
            measured,
            recorded=recorded,
            generation=generation,
            limits=limits,
            keys_version=keys.version,
        )
    except InvalidSpec as exc:
        return Outcome(status=invalid_status(str(exc), generation), invalid=exc)
    keys_problem = keys.problem
    watched = observed is not None
    if observed is None:  # a held plan and a scale-down must know what exists before applying
        observed = observe(kube, namespace, name)
    observed = owned_workloads(observed, namespace, uid)
    if plan.spec.rollout.strategy == RolloutStrategy.CANARY:
        context = PassContext(kube, owner, plan, observed, watched, full_apply, apply_missing)
        return reconcile_canary(
            context,
            measured=measured,
            previous=previous or {},
            recorded=recorded,
            generation=generation,
            problems=[keys_problem] if keys_problem else [],
            now=now,
        )
    manifests = build_all(owner, plan)
    gate_scale_down(manifests, observed, measured.floors)
    entry = entry_revision(plan, observed, previous)
    point_entry(manifests, plan, entry)
    manifests += build_traffic(owner, plan, single_revision(plan, entry))
    applied = apply_children(kube, manifests, observed, full_apply, apply_missing, plan.held)
    problems = applied.problems + ([keys_problem] if keys_problem else [])
    if full_apply:
        problems += remove_optional_children(kube, plan, previous or {}, owner_uid=uid)
    if watched:
        observed = merged(observed, applied.workloads)
    elif applied.count or full_apply:
        observed = owned_workloads(observe(kube, namespace, name), namespace, uid)
    status = compute_status(plan, observed, problems, generation, measured.anomaly, entry=entry)
    events = said_once(plan, recorded, previous or {})

    if is_true(status, c.COND_READY) and any(w.revision != plan.revision for w in observed):
        if entry != plan.revision:  # the new revision serves: the entry moves to it alone
            entry_children = [point_entry(manifests, plan, plan.revision)]
            entry_children += build_traffic(owner, plan, single_revision(plan, plan.revision))
            moved = [_apply_one(kube, child).problem for child in entry_children]
            problems += [p for p in moved if p is not None]
            entry = plan.revision if not any(moved) else entry
        retired = Retired()
        if entry == plan.revision:
            retired = retire_stale(kube, plan, observed, measured.older, now, owner_uid=uid)
        events += retired.events
        observed = [w for w in observed if w.revision not in retired.deleted]
        status = compute_status(
            plan,
            observed,
            problems,
            generation,
            measured.anomaly,
            entry=entry,
            retiring=retired.progress,
        )
    rolling = RolloutState(stable=entry or plan.revision).to_status()
    rolling["traffic"] = traffic_objects(plan)
    return Outcome(
        status={**status, "rollout": rolling, **tick_sections(measured)},
        events=events,
        applied=applied.count,
        failed=sum(p.reason in RETRIED_REASONS for p in problems),
    )


def tick_sections(measured: Measured) -> Status:
    """The status sections the fleet tick owns (the rollout's is the pass's to write, with
    what the pass derives from it)."""
    return {k: v for k, v in (measured.sections or {}).items() if k != "rollout"}


@dataclass(frozen=True)
class PassContext:
    """What every step of one pass works on: the client, the owner, the plan, the workloads as
    observed (watch-fed or listed) and how the pass applies."""

    kube: Kube
    owner: Owner
    plan: Plan
    observed: list[ObservedWorkload]
    watched: bool
    full_apply: bool
    apply_missing: bool


def reconcile_canary(
    ctx: PassContext,
    *,
    measured: Measured,
    previous: Status,
    recorded: RevisionRecord | None,
    generation: int,
    problems: list[Problem],
    now: float,
) -> Outcome:
    """A Canary fleet's pass: the rollout state (loop 4's, else the status's) adopts the
    spec's revision; `desired.traffic.split_for` sizes the canary and the stable revision and
    splits the traffic; the current revision is built at its sizes (none of it when aborted),
    the stable revision's workloads get their replica counts, the traffic objects their
    weights; every revision the split does not keep retires through the drain path."""
    kube, plan, observed = ctx.kube, ctx.plan, ctx.observed
    state = (measured.rollout or RolloutState.recorded(previous)).adopt(plan.revision)
    others = frozenset(w.revision for w in observed) - {plan.revision, state.stable}
    split = split_for(plan, state, others)
    sized = plan.sized(
        split.current_sizes.prefill, split.current_sizes.decode, split.current_sizes.routers
    )
    manifests = build_all(ctx.owner, sized)
    if not split.build_current:  # aborted: nothing of this revision, the rest as usual
        manifests = [m for m in manifests if c.LABEL_REVISION not in m["metadata"]["labels"]]
    routing = [point_entry(manifests, sized, split.entry), *build_traffic(ctx.owner, sized, split)]
    manifests = [m for m in manifests if m not in routing]
    resized = stable_replicas(split, observed)
    gate_scale_down(manifests + resized, observed, measured.floors)
    applied = apply_children(
        kube, manifests, observed, ctx.full_apply, ctx.apply_missing, sized.held
    )
    problems = problems + applied.problems + patch_replicas(kube, plan.namespace, resized)
    if ctx.full_apply or routing_moves(split, previous):
        problems += [p for m in routing if (p := _apply_one(kube, m).problem) is not None]
    problems += set_route_weights(kube, sized, split)
    if ctx.full_apply:
        problems += remove_optional_children(kube, plan, previous, owner_uid=ctx.owner.uid)
    observed = (
        merged(observed, applied.workloads)
        if ctx.watched
        else owned_workloads(
            observe(kube, plan.namespace, plan.name), plan.namespace, ctx.owner.uid
        )
    )
    retired = retire_stale(
        kube, sized, observed, measured.older, now, keep=split.keep, owner_uid=ctx.owner.uid
    )
    observed = [w for w in observed if w.revision not in retired.deleted]
    status = compute_status(
        sized,
        observed,
        problems,
        generation,
        measured.anomaly,
        entry=split.stable,
        retiring=retired.progress,
        rollout=RolloutView(state, split, traffic_objects(plan)),
    )
    events = said_once(plan, recorded, previous) + retired.events
    return Outcome(
        status={**status, **tick_sections(measured)},
        events=events,
        applied=applied.count,
        failed=sum(p.reason in RETRIED_REASONS for p in problems),
    )


def routing_moves(split: Split, previous: Status) -> bool:
    """Whether the entry Service and the traffic objects must be applied on this pass: while a
    canary runs (its weight moves between passes; a pass is cheap next to a request sent to the
    wrong revision), and whenever what they route to differs from what the last pass recorded
    (a promotion, an abort, the end of a canary)."""
    if split.canary is not None or split.settling:
        return True
    before = previous.get("rollout") or {}
    if before.get("replacedRevision"):  # the pass after a promotion settled
        return True
    return (before.get("stableRevision"), before.get("canaryRevision")) != (split.stable, None) or (
        previous.get("servingRevision") != split.entry
    )


def stable_replicas(split: Split, observed: list[ObservedWorkload]) -> list[Manifest]:
    """Replica counts for the stable revision's workloads while it is not the spec's (their
    templates stay as they run): the split's sizes, as `spec.replicas` merge patches."""
    sizes = split.stable_sizes
    if sizes is None or split.stable == split.current:
        return []
    wanted = {c.ROLE_PREFILL: sizes.prefill, c.ROLE_DECODE: sizes.decode}
    wanted[c.ROLE_ROUTER] = sizes.routers
    return [
        {"kind": w.kind, "metadata": {"name": w.name}, "spec": {"replicas": wanted[w.role]}}
        for w in observed
        if w.revision == split.stable and w.role in wanted
    ]


def patch_replicas(kube: Kube, namespace: str, patches: list[Manifest]) -> list[Problem]:
    """Merge-patch the replica counts of workloads that exist (see `stable_replicas`)."""
    problems = []
    for patch in patches:
        kind, name = patch["kind"], patch["metadata"]["name"]
        try:
            kube.patch(kind, namespace, name, {"spec": patch["spec"]})
        except Exception as exc:
            problems.append(Problem(c.REASON_APPLY_FAILED, f"{kind} {name} replicas: {exc}"))
    return problems


def set_route_weights(kube: Kube, plan: Plan, split: Split) -> list[Problem]:
    """`gateway.httpRoute`: the user's HTTPRoute gets the split's weights on its backendRefs
    to `<name>-stable` and `<name>-canary` (read, then written with its resourceVersion as a
    precondition; nothing else of it changes)."""
    gateway = plan.spec.gateway
    if gateway is None or gateway.http_route is None:
        return []
    weight = split.route_weight
    where = f"HTTPRoute {gateway.http_route}"
    try:
        route = kube.get("HTTPRoute", plan.namespace, gateway.http_route)
        if route is None:
            return [Problem(c.REASON_APPLY_FAILED, f"{where} not found (spec.gateway.httpRoute)")]
        patched = route_weights(route, plan.name, weight)
        if (
            patched is not None
            and kube.replace("HTTPRoute", plan.namespace, gateway.http_route, patched) is None
        ):
            return [Problem(c.REASON_APPLY_FAILED, f"{where} changed while its weights were set")]
    except ValueError as exc:
        return [Problem(c.REASON_INVALID_ROUTE, str(exc))]
    except Exception as exc:
        return [Problem(c.REASON_APPLY_FAILED, f"{where}: {exc}")]
    return []


def traffic_objects(plan: Plan) -> Status:
    """`status.rollout.traffic`'s record of the traffic objects this spec has: the mode, and
    the HTTPRoute (the operator's own or the user's). The next full pass removes those a
    spec change dropped (`remove_optional_children`)."""
    gateway = plan.spec.gateway
    if gateway is None:
        return {"mode": MODE_SERVICE}
    route = {"name": gateway.http_route or plan.name, "owned": gateway.http_route is None}
    return {"mode": MODE_GATEWAY, "httpRoute": route}


def remove_optional_children(
    kube: Kube, plan: Plan, previous: Status, *, owner_uid: str
) -> list[Problem]:
    """Children a spec field turned off go: the NetworkPolicies
    (`security.networkPolicy.enabled: false`), and the traffic objects the last pass recorded
    (`traffic_objects`) that this spec no longer has (no `spec.gateway`; a user's HTTPRoute
    instead of the operator's). An object of that name this resource does not control stays."""
    gone: list[tuple[str, str]] = []
    if not plan.spec.security.network_policy.enabled:
        gone += [("NetworkPolicy", name) for name in network_policy_names(plan.name)]
    had = ((previous.get("rollout") or {}).get("traffic")) or {}
    gateway = plan.spec.gateway
    if had.get("mode") == MODE_GATEWAY and gateway is None:
        gone += [("Service", track_service_name(plan.name, t)) for t in ("stable", "canary")]
    if (had.get("httpRoute") or {}).get("owned") and (gateway is None or gateway.http_route):
        gone.append(("HTTPRoute", plan.name))
    problems = []
    for kind, name in gone:
        try:
            delete_owned(kube, kind, plan.namespace, name, owner_uid)
        except Exception as exc:
            problems.append(Problem(c.REASON_APPLY_FAILED, f"{kind} {name}: {exc}"))
    return problems
