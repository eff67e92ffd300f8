"""The unit tests' fakes, defined once: the API (`MemoryKube` for workloads, `MemoryPods` for
pods), a canned metrics source and a recording router registry.

Each fakes only the calls of `cas_operator.kube.Kube`, `observe.types.MetricsSource` and
`routers.Routers` that the code under test makes, with the API server's semantics where they
matter (RFC 7386 merge patches, workloads that report ready, a PodDisruptionBudget that refuses
an eviction). The real ones are exercised in e2e/tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from cas_operator.kube import KindNotInstalled, NotTheSameObject
from cas_operator.observe.types import Observation, PodSignals, PodTarget

Manifest = dict[str, Any]
HEALTHY = PodSignals(checked=2000, trips_low_accept=0, trips_high_accept=1, running=3)


def merge(target: Manifest, patch: Manifest) -> None:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            merge(target.setdefault(key, {}), value)
        else:
            target[key] = value


def _matches(obj: Manifest, selector: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


class MemoryKube:
    """Workloads and other children keyed by (kind, name): apply, list, delete, and status
    patches of the owner; Secrets by create (409: None) and read by name, their `stringData`
    as the server stores it. Applied workloads report ready (unless `ready=False`); without
    `lws` the LeaderWorkerSet kind is not served. An applied object gets a uid once; `apply`
    and `delete` honour a uid precondition, `replace` the resourceVersion one. Records applies,
    creates, replaces, merge patches, deletes, GETs, LISTs and status patches."""

    def __init__(self, *, lws: bool = True, ready: bool = True) -> None:
        self.objects: dict[tuple[str, str], Manifest] = {}
        self.applies: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str]] = []
        self.lists = 0
        self.status_patches: list[Manifest] = []
        self.patches: list[tuple[str, str]] = []
        self.created: list[tuple[str, str]] = []
        self.replaced: list[tuple[str, str]] = []
        self.gets: list[tuple[str, str]] = []
        self.lws, self.ready = lws, ready
        self._uids = 0

    def apply(self, manifest: Manifest, uid: str | None = None) -> Manifest:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind == "LeaderWorkerSet" and not self.lws:
            raise KindNotInstalled(kind)
        before = self.objects.get((kind, name))
        stored = None if before is None else before["metadata"].get("uid")
        if uid is not None and uid != stored:
            raise NotTheSameObject(kind, name)
        if stored is None:
            self._uids += 1
            stored = f"obj-{self._uids}"
        meta = {**(before or {}).get("metadata", {}), **manifest["metadata"], "uid": stored}
        generation = 1  # as the API server: bumped only by a change of the spec
        if before is not None:
            changed = before.get("spec") != manifest.get("spec")
            generation = int(before["metadata"].get("generation", 1)) + changed
        obj = {**manifest, "metadata": {**meta, "generation": generation}}
        replicas = manifest.get("spec", {}).get("replicas", 0)
        obj["status"] = {"observedGeneration": generation,
                         "readyReplicas": replicas if self.ready else 0}  # fmt: skip
        if kind == "HTTPRoute":  # its status is the Gateway controller's, kept by an apply
            obj["status"] = (before or {}).get("status", {})
        self.objects[(kind, name)] = obj
        self.applies.append((kind, name))
        return obj

    def create(self, kind: str, namespace: str, manifest: Manifest) -> Manifest | None:
        key = (kind, manifest["metadata"]["name"])
        if key in self.objects:
            return None
        made = copy.deepcopy(manifest)
        if "uid" not in made["metadata"]:  # the API server gives every object one
            self._uids += 1
            made["metadata"]["uid"] = f"obj-{self._uids}"
        self.objects[key] = made
        self.created.append(key)
        return self.objects[key]

    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None:
        found = self.objects.get(("Secret", name))
        return None if found is None else dict(found.get("stringData") or {})

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        self.lists += 1
        return [o for (k, _), o in self.objects.items() if k == kind and _matches(o, selector)]

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        found = self.objects.get((kind, name))
        if found is not None and uid is not None and found["metadata"].get("uid") != uid:
            return  # the precondition fails (409): nothing deleted
        self.objects.pop((kind, name), None)
        self.deleted.append((kind, name))

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        self.gets.append((kind, name))
        found = self.objects.get((kind, name))
        return None if found is None else copy.deepcopy(found)

    def replace(self, kind: str, namespace: str, name: str, manifest: Manifest) -> Manifest | None:
        """PUT with the resourceVersion as a precondition (a stale one: None, as a 409)."""
        stored = self.objects.get((kind, name))
        if stored is None:
            return None
        version = stored["metadata"].get("resourceVersion")
        if manifest["metadata"].get("resourceVersion") != version:
            return None
        made = copy.deepcopy(manifest)
        made["metadata"]["resourceVersion"] = str(int(version or 0) + 1)
        self.objects[(kind, name)] = made
        self.replaced.append((kind, name))
        return made

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        obj = self.objects[(kind, name)]
        merge(obj, patch)
        if self.ready:  # a scaled workload reports ready too
            obj["status"]["readyReplicas"] = obj.get("spec", {}).get("replicas", 0)
        self.patches.append((kind, name))
        return obj

    def patch_status(self, kind: str, namespace: str, name: str, status: Manifest) -> Manifest:
        self.status_patches.append(status)
        return {}


class MemoryPods:
    """Pods keyed by (namespace, name) with merge-patch and eviction; records every call.

    Pods leave only through `evict` (a bare DELETE fails the test); a pod in `budget_refuses`
    is protected by a PodDisruptionBudget. With `forbid_list`, a per-resource LIST fails the
    test (the fleet tick must read pods from its one snapshot, `list_labelled`)."""

    def __init__(self, pods: list[Manifest], *, forbid_list: bool = False) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.calls: list[tuple[str, str]] = []
        self.lists: list[str] = []  # namespaces of list_labelled calls
        self.budget_refuses: set[str] = set()
        self.status_patches: list[tuple[str, Manifest]] = []
        self.forbid_list = forbid_list

    def pod(self, name: str, namespace: str = "ns") -> Manifest:
        return self.pods[(namespace, name)]

    def has(self, name: str, namespace: str = "ns") -> bool:
        return (namespace, name) in self.pods

    def add(self, pod: Manifest) -> None:
        self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        assert not self.forbid_list, "read pods from the tick's snapshot, not a LIST each"
        assert kind == "Pod"
        return [
            copy.deepcopy(p)
            for (ns, _), p in self.pods.items()
            if ns == namespace and _matches(p, selector)
        ]

    def list_labelled(
        self, kind: str, namespace: str, label: str, keep: Callable[[Manifest], Manifest] = dict
    ) -> list[Manifest]:
        self.lists.append(namespace)
        return [
            keep(p)
            for (ns, _), p in self.pods.items()
            if ns == namespace and label in p["metadata"]["labels"]
        ]

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        self.calls.append(("patch", name))
        merge(self.pods[(namespace, name)], patch)
        return self.pods[(namespace, name)]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        raise AssertionError("pods leave through the Eviction API, never a bare DELETE")

    def evict(self, namespace: str, name: str, uid: str | None) -> bool:
        self.calls.append(("evict", name))
        if name in self.budget_refuses:
            return False
        self.pods.pop((namespace, name), None)
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: Manifest) -> Manifest:
        self.status_patches.append((name, status))
        return {}


class CannedMetrics:
    """A metrics source answering the signals set per pod name (`HEALTHY` by default), or an
    outage while `error` is set. Records what it was asked: `asked` (pod names in the order
    given) and `calls` (window, sorted names)."""

    def __init__(self) -> None:
        self.by_name: dict[str, PodSignals] = {}
        self.error: str | None = None
        self.asked: list[list[str]] = []
        self.calls: list[tuple[float, list[str]]] = []

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation:
        self.asked.append([t.name for t in targets])
        self.calls.append((window_seconds, sorted(t.name for t in targets)))
        if self.error is not None:
            return Observation.outage(targets, self.error)
        return Observation({t.name: self.by_name.get(t.name, HEALTHY) for t in targets})


class RecordingRouters:
    """Router replicas that list every worker once; records deregistrations."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def deregister(self, worker_url: str) -> list[str]:
        if worker_url in self.removed:
            return []
        self.removed.append(worker_url)
        return [f"{worker_url} removed from router r0"]
