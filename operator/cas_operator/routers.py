"""The only router client: the SGLang router replicas' worker registries, over HTTP.

The router (0.3.2) keeps a worker whose pod merely stops matching its discovery selector, so
taking a pod out of rotation also deregisters it from every router replica (`GET /workers`,
`DELETE /workers/{id}`; idempotent). The worker API takes the fleet's control-plane key
(`Authorization: Bearer`, read from the keys Secret only when a request is made; a router
without a key configured ignores it). Requests go through `observe.http` (hard timeouts, one
error type). Used by the anomaly loop's act step; router pods are found by their labels.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cas_operator.api import constants as c
from cas_operator.observe.http import FetchError, request
from cas_operator.types import Manifest

log = logging.getLogger(__name__)
MAX_ANSWER_BYTES = 1 << 20


class Routers(Protocol):
    """The router replicas' worker registries (the act step's second way out of rotation)."""

    def deregister(self, worker_url: str) -> list[str]:
        """Remove `worker_url` from every replica that lists it; returns what was done."""
        ...


class PodLister(Protocol):
    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...


@dataclass
class HttpRouters:
    """SGLang router replicas at `urls()` (e.g. http://<router pod IP>:8000), over HTTP."""

    urls: Callable[[], list[str]]
    timeout_seconds: float = 3.0
    key: Callable[[], str | None] = lambda: None  # the control-plane key (None: send none)
    _headers: dict[str, str] | None = field(default=None, init=False, repr=False)

    def _json(self, method: str, url: str) -> Any:
        if self._headers is None:
            key = self.key()
            self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        answer = request(method, url, self.timeout_seconds, MAX_ANSWER_BYTES, self._headers)
        return json.loads(answer or b"null")

    def deregister(self, worker_url: str) -> list[str]:
        done = []
        for router in self.urls():
            try:
                listed = self._json("GET", f"{router}/workers").get("workers", [])
                for worker in listed:
                    if worker.get("url") == worker_url:
                        self._json("DELETE", f"{router}/workers/{worker['id']}")
                        done.append(f"{worker_url} removed from router {router}")
            except (FetchError, ValueError, AttributeError) as exc:
                done.append(f"router {router} unreachable: {exc}")  # retried next tick
        return done


def router_pod_urls(api: PodLister, namespace: str, name: str) -> Callable[[], list[str]]:
    """The resource's router replicas, found by their pods' labels."""

    def urls() -> list[str]:
        selector = {c.LABEL_NAME: name, c.LABEL_ROLE: c.ROLE_ROUTER}
        pods = api.list("Pod", namespace, selector)
        ips = [p.get("status", {}).get("podIP") for p in pods]
        return [f"http://{ip}:{c.ROUTER_PORT}" for ip in ips if ip]

    return urls


class SecretReader(Protocol):
    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None: ...


def control_plane_key(api: SecretReader, namespace: str, secret: str) -> Callable[[], str | None]:
    """The router key from the fleet's keys Secret, read when called (None if it is absent)."""

    def key() -> str | None:
        try:
            found = api.secret_keys(namespace, secret) or {}
        except Exception as exc:  # the router then refuses (401), which deregister reports
            log.warning("keys Secret %s/%s unreadable: %s", namespace, secret, exc)
            return None
        return found.get(c.KEY_ROUTER_CONTROL_PLANE)

    return key
