"""The only router client: the SGLang router replicas' worker registries, over HTTP.

The router (0.3.2) keeps a worker whose pod merely stops matching its discovery selector, so
taking a pod out of rotation also deregisters it from every router replica (`GET /workers`,
`DELETE /workers/{id}`; idempotent). The worker API takes the fleet's control-plane key
(`Authorization: Bearer`; a router without a key configured ignores it), and each router pod
holds the key of the keys version it started with (its label `cas.dev/keys`, the copy
`<name>-keys-<version>`): while new keys roll out, old and new routers hold different keys.
So each router is asked with the key of its own version first, then with the keys Secret's
current key (a router from before versions existed); a 401 moves on to the next. Keys are
read from the Secrets by name when a request needs them, once per client. Requests go through
`observe.http` (hard timeouts, one error type). Used by the anomaly loop's act step; router
pods are found by their labels.
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
UNAUTHORIZED = 401


class Routers(Protocol):
    """The router replicas' worker registries (the act step's second way out of rotation)."""

    def deregister(self, worker_url: str) -> list[str]:
        """Remove `worker_url` from every replica that lists it; returns what was done."""
        ...


class PodLister(Protocol):
    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Manifest]: ...


class SecretReader(Protocol):
    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None: ...


@dataclass(frozen=True)
class RouterEndpoint:
    """One router replica: its URL and the Secrets whose control-plane key it may hold, the
    likeliest first (none: it is asked without a key)."""

    url: str
    secrets: tuple[str, ...] = ()


@dataclass
class HttpRouters:
    """SGLang router replicas (e.g. http://<router pod IP>:8000), over HTTP."""

    endpoints: Callable[[], list[RouterEndpoint]]
    timeout_seconds: float = 3.0
    key_in: Callable[[str], str | None] = lambda secret: None  # a Secret's control-plane key
    _keys: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)

    def _key(self, secret: str) -> str | None:
        if secret not in self._keys:
            self._keys[secret] = self.key_in(secret)
        return self._keys[secret]

    def _json(self, method: str, url: str, router: RouterEndpoint) -> Any:
        """One request, with each candidate key in turn while the router answers 401."""
        found = [k for k in dict.fromkeys(self._key(s) for s in router.secrets) if k]
        keys: list[str | None] = [*found] or [None]
        refused: FetchError | None = None
        for key in keys:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            try:
                answer = request(method, url, self.timeout_seconds, MAX_ANSWER_BYTES, headers)
            except FetchError as exc:
                if exc.status != UNAUTHORIZED:
                    raise
                refused = exc
                continue
            return json.loads(answer or b"null")
        assert refused is not None
        raise refused

    def deregister(self, worker_url: str) -> list[str]:
        done = []
        for router in self.endpoints():
            try:
                listed = self._json("GET", f"{router.url}/workers", router).get("workers", [])
                for worker in listed:
                    if worker.get("url") == worker_url:
                        self._json("DELETE", f"{router.url}/workers/{worker['id']}", router)
                        done.append(f"{worker_url} removed from router {router.url}")
            except (FetchError, ValueError, AttributeError) as exc:
                done.append(f"router {router.url} unreachable: {exc}")  # retried next tick
        return done


def router_endpoints(
    api: PodLister, namespace: str, name: str, keys_secret: str | None = None
) -> Callable[[], list[RouterEndpoint]]:
    """The resource's router replicas, found by their pods' labels, each with the Secrets of
    its key: the copy of its keys version, then `keys_secret` (None: asked without a key)."""

    def endpoints() -> list[RouterEndpoint]:
        selector = {c.LABEL_NAME: name, c.LABEL_ROLE: c.ROLE_ROUTER}
        found = []
        for pod in api.list("Pod", namespace, selector):
            ip = pod.get("status", {}).get("podIP")
            if not ip:
                continue
            version = (pod.get("metadata", {}).get("labels") or {}).get(c.LABEL_KEYS)
            secrets = [c.keys_copy_name(name, version)] if version else []
            secrets += [keys_secret] if keys_secret else []
            found.append(RouterEndpoint(f"http://{ip}:{c.ROUTER_PORT}", tuple(secrets)))
        return found

    return endpoints


def control_plane_key(api: SecretReader, namespace: str) -> Callable[[str], str | None]:
    """The router key a Secret of `namespace` holds, read when called (None if absent)."""

    def key(secret: str) -> str | None:
        try:
            found = api.secret_keys(namespace, secret) or {}
        except Exception as exc:  # the router then refuses (401), which deregister reports
            log.warning("keys Secret %s/%s unreadable: %s", namespace, secret, exc)
            return None
        return found.get(c.KEY_ROUTER_CONTROL_PLANE)

    return key
