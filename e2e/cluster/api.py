"""A minimal Kubernetes REST client for the harness (standard library and yaml only).

Why not kubectl: every kubectl call is a process start plus discovery (seconds on a busy
2-core machine), and ``up`` and the tests poll a lot. Data flow: the cluster module builds an
:class:`Api` from the apiserver URL and the admin TLS context; it creates nodes, server-side
applies CRDs and webhook configurations, and reads readiness conditions. The tests' ``kubectl``
fixture (``e2e.cluster.stack.ClusterKubectl``) builds one from the kubeconfig
(:meth:`Api.from_kubeconfig`) for its polls' reads; tests write, and users do everything,
through kubectl.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

FIELD_MANAGER = "cas-e2e"


class ApiError(RuntimeError):
    """A non-2xx answer; ``status`` is the HTTP code (0 when the server was unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Api:
    """JSON over HTTPS to one apiserver with a fixed TLS context (CA + client certificate)."""

    def __init__(self, server: str, ctx: ssl.SSLContext, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self.ctx = ctx
        self.timeout = timeout
        # One opener, no proxies: the apiserver is the local stack's. `urlopen` built an
        # opener per request, reading the proxy variables from os.environ each time; from the
        # e2e namespace reaper's thread that iteration raced pytest setting and deleting
        # PYTEST_CURRENT_TEST in the main thread (KeyError in CI), and the reaper died.
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
        )

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; return the decoded JSON answer or raise :class:`ApiError`."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")[:500]) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ApiError(0, str(exc)) from None
        return dict(json.loads(raw)) if raw else {}

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Api | None:
        """An :class:`Api` for the current context of a kubeconfig that embeds its CA and
        client certificate (what the local stack writes); None for any other kind (a token, an
        exec plugin, files), which the caller reads through kubectl instead."""
        config = yaml.safe_load(path.read_text()) or {}
        current = config.get("current-context")
        context = _named(config.get("contexts"), current).get("context") or {}
        cluster = _named(config.get("clusters"), context.get("cluster")).get("cluster") or {}
        user = _named(config.get("users"), context.get("user")).get("user") or {}
        needed = (cluster.get("server"), cluster.get("certificate-authority-data"),
                  user.get("client-certificate-data"), user.get("client-key-data"))  # fmt: skip
        if not all(needed):
            return None
        server, ca, cert, key = (str(x) for x in needed)
        ctx = ssl.create_default_context(cadata=base64.b64decode(ca).decode())
        with tempfile.TemporaryDirectory() as tmp:  # load_cert_chain reads files only
            pem = Path(tmp) / "client.pem"
            pem.touch(mode=0o600)
            pem.write_bytes(base64.b64decode(cert) + b"\n" + base64.b64decode(key))
            ctx.load_cert_chain(os.fspath(pem))
        return cls(server, ctx)

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None when it does not exist (404)."""
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST ``obj`` into ``collection`` (e.g. ``/api/v1/nodes``)."""
        return self.request("POST", collection, obj)

    def apply(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` at its object path (JSON is valid apply YAML), forcing
        ownership of conflicting fields to this harness's field manager."""
        query = f"?fieldManager={FIELD_MANAGER}&force=true"
        return self.request("PATCH", path + query, obj, "application/apply-patch+yaml")

    def create_or_apply(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj`` (cheap on a fresh cluster); if it exists, server-side apply it."""
        try:
            return self.create(collection, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise
        return self.apply(f"{collection}/{obj['metadata']['name']}", obj)


def raw_get(kubectl: Callable[..., str], path: str) -> dict[str, Any] | None:
    """``kubectl get --raw path`` as JSON, None when nothing is there: the read for a cluster
    whose kubeconfig :meth:`Api.from_kubeconfig` declines."""
    out = kubectl("get", "--raw", path, check=False)
    return dict(json.loads(out)) if out.strip() else None


def _named(items: Any, name: Any) -> dict[str, Any]:
    """The entry called ``name`` in a kubeconfig list (clusters, users, contexts), or {}."""
    found = next((x for x in items or [] if isinstance(x, dict) and x.get("name") == name), {})
    return dict(found)


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    """``status`` of the condition of type ``kind`` in ``obj['status']['conditions']``."""
    if not obj:
        return None
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None
