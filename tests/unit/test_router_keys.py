"""The router client asks each router replica with the key that replica started with.

Regression (issue 41, item 3): the operator read the control-plane key from the keys Secret
when it deregistered a worker; once the Secret held new keys, every router started before was
refused it (401) and a draining pod stayed in their rotation. Each router pod now carries its
keys version (`cas.dev/keys`), and the client tries that copy's key first, then the Secret's.
The real routers through a rotation: e2e/tests/test_keys_rotation.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cas_operator import routers
from cas_operator.api import constants as c
from cas_operator.observe.http import FetchError
from cas_operator.routers import HttpRouters, control_plane_key, router_endpoints

OLD, NEW = "old-key", "new-key"


class Cluster:
    """Router pods and Secrets by name (what the client reads), and routers that each take one
    key: GET /workers lists one worker, DELETE removes it."""

    def __init__(self) -> None:
        self.secrets = {
            "demo-keys": {c.KEY_ROUTER_CONTROL_PLANE: NEW},  # the Secret, rotated
            "demo-keys-v1": {c.KEY_ROUTER_CONTROL_PLANE: OLD},
            "demo-keys-v2": {c.KEY_ROUTER_CONTROL_PLANE: NEW},
        }
        self.pods = [
            self.pod("10.0.0.1", "v1"),  # the old revision's router
            self.pod("10.0.0.2", "v2"),  # the new one's
            self.pod("10.0.0.3", None),  # made by an operator before keys versions
        ]
        self.accepts = {"10.0.0.1": OLD, "10.0.0.2": NEW, "10.0.0.3": NEW}
        self.workers = {ip: ["http://10.1.0.9:30000"] for ip in self.accepts}
        self.refused: list[str] = []

    @staticmethod
    def pod(ip: str, version: str | None) -> dict[str, Any]:
        labels = {c.LABEL_NAME: "demo", c.LABEL_ROLE: c.ROLE_ROUTER}
        if version:
            labels[c.LABEL_KEYS] = version
        return {"metadata": {"labels": labels}, "status": {"podIP": ip}}

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return self.pods

    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.secrets.get(name)

    def request(
        self, method: str, url: str, timeout: float, max_bytes: int, headers: dict[str, str]
    ) -> bytes:
        ip = url.split("//")[1].split(":")[0]
        if headers.get("Authorization") != f"Bearer {self.accepts[ip]}":
            self.refused.append(ip)
            raise FetchError(f"HTTP 401 from {url}", 401)
        if method == "GET":
            listed = [{"id": f"w{i}", "url": u} for i, u in enumerate(self.workers[ip])]
            return json.dumps({"workers": listed}).encode()
        self.workers[ip] = []
        return b'{"status": "accepted"}'


def test_each_router_is_asked_with_its_own_key_through_a_rotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = Cluster()
    monkeypatch.setattr(routers, "request", cluster.request)
    client = HttpRouters(
        router_endpoints(cluster, "ns", "demo", "demo-keys"),
        key_in=control_plane_key(cluster, "ns"),
    )
    done = client.deregister("http://10.1.0.9:30000")
    assert cluster.workers == {ip: [] for ip in cluster.accepts}, done
    assert not [line for line in done if "unreachable" in line], done
    assert cluster.refused == []  # each router's own key came first


def test_a_router_that_takes_none_of_the_keys_is_reported_not_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = Cluster()
    cluster.accepts["10.0.0.1"] = "a-key-nobody-has"
    monkeypatch.setattr(routers, "request", cluster.request)
    client = HttpRouters(
        router_endpoints(cluster, "ns", "demo", "demo-keys"),
        key_in=control_plane_key(cluster, "ns"),
    )
    done = client.deregister("http://10.1.0.9:30000")
    assert any("10.0.0.1" in line and "401" in line for line in done), done
    assert cluster.workers["10.0.0.2"] == [] and cluster.workers["10.0.0.3"] == []
