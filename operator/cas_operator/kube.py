"""The only module that talks to the API server (kopf's own watching and patching aside).

Server-side apply with one field manager (`cas-operator`), forcing ownership of the fields we
set; listing children by label; deleting stale children. Paths are computed from a small table
of the kinds we manage, so no discovery round trips are needed.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from cas_operator.api import constants as c
from cas_operator.metrics import API_REQUESTS
from cas_operator.types import Manifest, rfc3339

log = logging.getLogger(__name__)
CONNECTION_POOL_SIZE = 48
REQUEST_TIMEOUT_S = 30.0
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def process_identity() -> str:
    """This process among the operator's replicas: `<hostname>-<pid>` (the Lease holder's
    identity, and in every request's User-Agent, so the audit log tells replicas apart)."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class KindInfo:
    api_version: str
    plural: str

    def base_path(self, namespace: str) -> str:
        prefix = "/api" if "/" not in self.api_version else "/apis"
        return f"{prefix}/{self.api_version}/namespaces/{namespace}/{self.plural}"


KINDS: dict[str, KindInfo] = {
    "ServiceAccount": KindInfo("v1", "serviceaccounts"),
    "ConfigMap": KindInfo("v1", "configmaps"),
    "Secret": KindInfo("v1", "secrets"),
    "Service": KindInfo("v1", "services"),
    "Pod": KindInfo("v1", "pods"),
    "Event": KindInfo("v1", "events"),
    "Lease": KindInfo("coordination.k8s.io/v1", "leases"),
    "Role": KindInfo("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": KindInfo("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": KindInfo("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": KindInfo("networking.k8s.io/v1", "networkpolicies"),
    "Deployment": KindInfo("apps/v1", "deployments"),
    "LeaderWorkerSet": KindInfo(c.LWS_API_VERSION, "leaderworkersets"),
    "HTTPRoute": KindInfo("gateway.networking.k8s.io/v1", "httproutes"),
    c.KIND: KindInfo(f"{c.GROUP}/{c.VERSION}", c.PLURAL),
}
# Kinds that carry a revision label and are deleted once a newer revision is ready.
REVISIONED_KINDS = ("Deployment", "LeaderWorkerSet", "Service", "PodDisruptionBudget")


class KindNotInstalled(Exception):
    """The API server does not serve this kind (e.g. the LeaderWorkerSet CRD is missing)."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"{kind} is not served by this cluster")
        self.kind = kind


class NamespaceTerminating(Exception):
    """The API server refuses to create anything in a namespace being deleted."""


class NotLeading(Exception):
    """A write refused before it was sent: this process no longer holds the Lease."""


class NotTheSameObject(Exception):
    """A write named the object's uid (a precondition) and no object of that uid exists under
    its name any more: it was deleted, or deleted and made again by someone else."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind} {name} is not the object of the given uid any more")
        self.kind, self.name = kind, name


def load_api_client() -> client.ApiClient:
    """In-cluster config when running in a pod, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    cfg = client.Configuration.get_default_copy()
    # One pooled connection per concurrent caller (apply pool, refreshes, kopf's executor,
    # guard workers); urllib3's default of 10 discarded connections and re-did TLS handshakes.
    cfg.connection_pool_maxsize = CONNECTION_POOL_SIZE
    api = client.ApiClient(cfg)
    api.user_agent = f"cas-operator ({process_identity()})"
    return api


class Kube:
    """Thin synchronous API access; safe to share between kopf's handler threads.

    `may_write`, when set, is asked before every write and a False refuses it unsent
    (`NotLeading`): leader election's gate. Each request gives up after `timeout` seconds."""

    def __init__(
        self, api_client: client.ApiClient | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.api = api_client or load_api_client()
        self.timeout = timeout
        self.may_write: Callable[[], bool] | None = None

    def with_timeout(self, seconds: float) -> Kube:
        """The same client (connections, gate) whose requests give up after `seconds`."""
        other = copy.copy(self)
        other.timeout = seconds
        return other

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Manifest | None = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
        """One request; non-2xx answers raise ApiException with the server's status body."""
        if method in WRITE_METHODS and self.may_write is not None and not self.may_write():
            raise NotLeading(f"{method} {path}: this process no longer holds the Lease")
        method, url, headers, payload, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=payload, _request_timeout=self.timeout
        )
        raw: bytes = response.read()  # type: ignore[no-untyped-call]
        API_REQUESTS.labels(method, _kind_of(path), str(response.status)).inc()
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason, body=raw.decode())
        return json.loads(raw) if raw else None

    def apply(self, manifest: Manifest, uid: str | None = None) -> Manifest:
        """Server-side apply; raises KindNotInstalled when the kind is not served and
        NamespaceTerminating when its namespace is being deleted. With `uid`, only the object
        of that uid is written: the API server answers 409 when none exists under the name and
        422 when another one does (both raise NotTheSameObject, nothing written); without,
        the object is created or taken over, whoever had it."""
        kind = manifest["kind"]
        meta = manifest["metadata"]
        path = f"{KINDS[kind].base_path(meta['namespace'])}/{meta['name']}"
        body = manifest if uid is None else {**manifest, "metadata": {**meta, "uid": uid}}
        try:
            result: Manifest = self._call(
                "PATCH",
                path,
                body=body,
                content_type="application/apply-patch+yaml",
                query=[("fieldManager", c.FIELD_MANAGER), ("force", "true")],
            )
        except ApiException as exc:
            if exc.status == 404 and _is_missing_kind(exc):
                raise KindNotInstalled(kind) from exc
            if exc.status == 403 and "being terminated" in str(exc.body or ""):
                raise NamespaceTerminating(meta["namespace"]) from exc
            if uid is not None and _is_uid_mismatch(exc):
                raise NotTheSameObject(kind, meta["name"]) from exc
            raise
        return result

    def list_labelled(
        self,
        kind: str,
        namespace: str,
        label: str,
        keep: Callable[[Manifest], Manifest] = lambda obj: obj,
        page_size: int = 250,
    ) -> list[Manifest]:
        """Objects of `kind` that carry `label` with any value (one LIST for many owners),
        read in pages of `page_size`; `keep` slims each object as its page arrives, so a large
        namespace never sits in memory whole."""
        items: list[Manifest] = []
        token = ""
        while True:
            query = [("labelSelector", label), ("limit", str(page_size))]
            if token:
                query.append(("continue", token))
            page = self._call("GET", KINDS[kind].base_path(namespace), query=query)
            items.extend(keep(obj) for obj in page.get("items", []))
            token = page.get("metadata", {}).get("continue") or ""
            if not token:
                return items

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]:
        """Objects of `kind` matching every label of `selector`; [] when the kind is not served."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))]
        try:
            result = self._call("GET", KINDS[kind].base_path(namespace), query=query)
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise
        items: list[Manifest] = result.get("items", [])
        return items

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        """One object; None when it does not exist."""
        try:
            found: Manifest = self._call("GET", f"{KINDS[kind].base_path(namespace)}/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None:
        """The decoded keys of one Secret (read by name: the operator may not list Secrets);
        None when it does not exist."""
        found = self.get("Secret", namespace, name)
        if found is None:
            return None
        data = found.get("data") or {}
        return {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in data.items()}

    def create(self, kind: str, namespace: str, manifest: Manifest) -> Manifest | None:
        """Create; None when it exists already (409)."""
        try:
            made: Manifest = self._call("POST", KINDS[kind].base_path(namespace), body=manifest)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return made

    def replace(self, kind: str, namespace: str, name: str, manifest: Manifest) -> Manifest | None:
        """PUT with the manifest's resourceVersion as a precondition; None when someone
        else wrote the object first (409)."""
        try:
            done: Manifest = self._call(
                "PUT", f"{KINDS[kind].base_path(namespace)}/{name}", body=manifest
            )
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return done

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete with background propagation; a missing object is not an error, nor (with
        `uid`, a precondition) one of another uid, which stays. (Pods leave through `evict`,
        which carries their uid as a precondition.)"""
        body: Manifest = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", f"{KINDS[kind].base_path(namespace)}/{name}", body=body)
        except ApiException as exc:
            if exc.status == 404 or (uid and exc.status == 409):
                return
            raise

    def evict(self, namespace: str, name: str, uid: str | None) -> bool:
        """Remove a pod through the Eviction API, so PodDisruptionBudgets hold and its
        preStop hook and grace period run. `uid` is a precondition: a newer pod under the same
        name is never hit. True once the pod is going (or gone); False while a disruption
        budget refuses (429: try again later)."""
        body: Manifest = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            self._call("POST", f"{KINDS['Pod'].base_path(namespace)}/{name}/eviction", body=body)
        except ApiException as exc:
            if exc.status == 429:
                return False
            if exc.status in (404, 409):
                return True
            raise
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        """JSON merge patch (used for labels and status of objects we own)."""
        path = f"{KINDS[kind].base_path(namespace)}/{name}"
        result: Manifest = self._call(
            "PATCH", path, body=patch, content_type="application/merge-patch+json"
        )
        return result

    def post_event(self, obj: Manifest, event_type: str, reason: str, message: str) -> None:
        """A core/v1 Event about `obj`: the operator's one event path (handlers, passes and
        the fleet tick alike); `kubectl describe` shows it like kopf's own."""
        meta = obj["metadata"]
        now = rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", f"{c.GROUP}/{c.VERSION}"),
                "kind": obj.get("kind", c.KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": c.FIELD_MANAGER},
            "reportingComponent": c.FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self._call("POST", KINDS["Event"].base_path(meta["namespace"]), body=event)

    def patch_status(self, kind: str, namespace: str, name: str, status: Manifest) -> Manifest:
        """JSON merge patch of the status subresource (only the given keys change)."""
        path = f"{KINDS[kind].base_path(namespace)}/{name}/status"
        result: Manifest = self._call(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json"
        )
        return result


def _kind_of(path: str) -> str:
    """The plural resource name of an API path (the segment after the namespace)."""
    parts = path.split("/")
    if "namespaces" in parts[:-2]:
        kind = parts[parts.index("namespaces") + 2]
        return f"{kind}/eviction" if parts[-1] == "eviction" else kind
    return parts[-1]


def _is_uid_mismatch(exc: ApiException) -> bool:
    """The answer to a write whose `metadata.uid` names no object under that name: 409 "uid
    mismatch ... no existing object was found" (none there), or 422 on `metadata.uid` "field is
    immutable" (another object there)."""
    text = str(exc.body or "")
    return (exc.status == 409 and "uid mismatch" in text) or (
        exc.status == 422 and "metadata.uid" in text
    )


def _is_missing_kind(exc: ApiException) -> bool:
    """A 404 for the resource type itself: the server names no object ("the server could not
    find the requested resource"). A 404 naming one (a missing namespace; a RoleBinding whose
    Role the server cannot find yet while it checks escalation) is an ordinary failure."""
    try:
        details = json.loads(exc.body or "{}").get("details") or {}
    except ValueError:
        return True
    return "name" not in details
