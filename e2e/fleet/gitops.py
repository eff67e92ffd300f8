"""A fleet as Argo CD syncs it on the local stack: the git repository it reads, the Application
(the one docs/architecture.md gives), and views of the Application's own status.

Data flow: :class:`FleetRepo` keeps a bare repository under the git daemon's folder
(:mod:`e2e.cluster.argocd`) and a work tree beside it; each :meth:`FleetRepo.commit` writes
manifests, commits and pushes, and returns the commit's sha. :func:`application` reads the
Application example from docs/architecture.md ("GitOps rules") and points it at that repository
and namespace. :func:`app_state` reads what Argo CD says about it (sync status and revision,
health, the managed resource's health message, the last operation), and :class:`AppRecorder`
samples that every ``interval_s`` in a thread, for steps that must hold "never OutOfSync".

Ownership: the repository and its work tree are the caller's run folder's; the recorder owns its
thread (``stop`` joins it). Nothing here writes to the cluster but :func:`refresh` (the
annotation Argo CD's webhook handler sets after a push) and the Application itself.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.paths import REPO_ROOT

Kubectl = Callable[..., str]
ARCHITECTURE = REPO_ROOT / "docs/architecture.md"
REFRESH = "argocd.argoproj.io/refresh"
COMPARE_OPTIONS = "argocd.argoproj.io/compare-options"
GIT_IDENTITY = ("-c", "user.name=cas e2e", "-c", "user.email=e2e@cas.invalid")


@dataclass
class FleetRepo:
    """A bare repository ``<repos>/<name>`` and its work tree ``<work>``, branch ``main``."""

    repos: Path
    work: Path
    name: str = "fleets.git"

    @property
    def bare(self) -> Path:
        return self.repos / self.name

    def git(self, *args: str, cwd: Path | None = None) -> str:
        done = subprocess.run(
            ["git", *GIT_IDENTITY, *args], cwd=cwd or self.work, capture_output=True,
            text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def init(self) -> None:
        self.repos.mkdir(parents=True, exist_ok=True)
        self.git("init", "--quiet", "--bare", "--initial-branch=main", str(self.bare),
                 cwd=self.repos)  # fmt: skip
        self.git("clone", "--quiet", str(self.bare), str(self.work), cwd=self.repos)
        self.git("checkout", "--quiet", "-B", "main")

    def commit(self, message: str, files: dict[str, Any | None]) -> str:
        """Write each path (a manifest as YAML, or None to delete it), commit, push; the sha."""
        for rel, doc in files.items():
            path = self.work / rel
            if doc is None:
                path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.git("add", "--all")
        self.git("commit", "--quiet", "-m", message)
        self.git("push", "--quiet", "origin", "main")
        return self.git("rev-parse", "HEAD")

    def revert(self, sha: str) -> str:
        """``git revert`` of one commit, pushed; the new sha."""
        self.git("revert", "--no-edit", sha)
        self.git("push", "--quiet", "origin", "main")
        return self.git("rev-parse", "HEAD")


def documented_application() -> dict[str, Any]:
    """The Application example of docs/architecture.md, "GitOps rules" (the first ``yaml``
    block with ``kind: Application`` there)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## GitOps rules") :]
    for block in re.findall(r"```yaml\n(.*?)```", section, flags=re.S):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and doc.get("kind") == "Application":
            return doc
    raise AssertionError("docs/architecture.md has no Application example under GitOps rules")


def application(
    name: str, namespace: str, repo_url: str, path: str, *, server_side_diff: bool
) -> dict[str, Any]:
    """The documented Application, pointed at ``repo_url``/``path`` (branch main) and at
    ``namespace`` (Argo CD's and the fleets' here), with ServerSideDiff on or off."""
    app = documented_application()
    app["metadata"]["name"], app["metadata"]["namespace"] = name, namespace
    annotations = app["metadata"].setdefault("annotations", {})
    annotations[COMPARE_OPTIONS] = f"ServerSideDiff={'true' if server_side_diff else 'false'}"
    app["spec"]["source"] = {"repoURL": repo_url, "path": path, "targetRevision": "main"}
    app["spec"]["destination"]["namespace"] = namespace
    return app


@dataclass(frozen=True)
class AppState:
    """What the Application's status says, flattened."""

    sync: str  # Synced | OutOfSync | Unknown | ""
    revision: str  # status.sync.revision: the commit it compared with
    health: str  # status.health.status
    resource_health: str  # the CodingAgentServing's own health, from status.resources
    message: str  # and its message (the operator's health check's words)
    operation: str  # status.operationState.phase: Running | Succeeded | Failed | Error | ""
    operation_message: str
    operation_revision: str
    operation_started: str  # status.operationState.startedAt (RFC 3339, seconds)
    operation_automated: bool  # initiated by the automated sync policy (a sync or self-heal)
    operation_results: tuple[str, ...]  # per resource: "Kind/name status: message"
    resources: tuple[str, ...] = ()  # status.resources: what it manages, "Kind/name"
    conditions: tuple[str, ...] = ()  # status.conditions: "Type: message"
    at: float = field(default_factory=time.monotonic)

    def said(self) -> tuple[str, ...]:
        """Every message Argo CD gives about it: the last operation's, each resource's result
        in it, the Application's conditions."""
        return (self.operation_message, *self.operation_results, *self.conditions)

    def brief(self) -> str:
        return (f"{self.sync}@{self.revision[:7]} {self.health} "
                f"[{self.resource_health}: {self.message}] op={self.operation}"
                f"@{self.operation_revision[:7]} {self.operation_message[:160]}")  # fmt: skip


def app_reader(kubeconfig: Path, namespace: str, name: str) -> Callable[[], AppState]:
    """A function that reads the Application and returns :func:`app_state` of it (in-process,
    no kubectl start per read: the steps poll it twice a second)."""
    from kubernetes import client, config

    load = config.new_client_from_config
    custom = client.CustomObjectsApi(load(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]

    def read() -> AppState:
        obj = custom.get_namespaced_custom_object(
            "argoproj.io", "v1alpha1", namespace, "applications", name, _request_timeout=10
        )
        return app_state(obj)

    return read


def app_state(app: dict[str, Any], kind: str = "CodingAgentServing") -> AppState:
    """What an Application's status says about it and its resource of ``kind`` (pure)."""
    status = app.get("status") or {}
    sync = status.get("sync") or {}
    res = next((r for r in status.get("resources") or [] if r.get("kind") == kind), {})
    op = status.get("operationState") or {}
    result = op.get("syncResult") or {}
    return AppState(
        sync=sync.get("status", ""),
        revision=sync.get("revision", ""),
        health=(status.get("health") or {}).get("status", ""),
        resource_health=(res.get("health") or {}).get("status", ""),
        message=(res.get("health") or {}).get("message", ""),
        operation=op.get("phase", ""),
        operation_message=op.get("message", ""),
        operation_revision=result.get("revision", "")
        or ((op.get("operation") or {}).get("sync") or {}).get("revision", ""),
        operation_started=op.get("startedAt", ""),
        operation_automated=bool(
            ((op.get("operation") or {}).get("initiatedBy") or {}).get("automated")
        ),
        operation_results=tuple(
            f"{r.get('kind')}/{r.get('name')} {r.get('status')}: {r.get('message', '')}"
            for r in result.get("resources") or []
        ),
        resources=tuple(f"{r.get('kind')}/{r.get('name')}" for r in status.get("resources") or []),
        conditions=tuple(
            f"{c.get('type')}: {c.get('message')}" for c in status.get("conditions") or []
        ),
    )


def refresh(kubectl: Kubectl, namespace: str, name: str) -> None:
    """Ask Argo CD to compare with git now, as its webhook handler does after a push."""
    kubectl("annotate", "applications.argoproj.io", name, "-n", namespace, f"{REFRESH}=normal",
            "--overwrite")  # fmt: skip


@dataclass
class AppRecorder:
    """Samples :func:`app_state` every ``interval_s`` in a thread; ``states`` keeps every
    sample (a failed read is skipped)."""

    read: Callable[[], AppState]
    interval_s: float = 1.0
    states: list[AppState] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> AppRecorder:
        self._thread = threading.Thread(target=self._run, name="app-recorder", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # an API hiccup: the next sample counts
                self.states.append(self.read())
            self._stop.wait(self.interval_s)

    def since(self, t: float) -> list[AppState]:
        """The samples taken at or after ``t``, in time order."""
        return sorted((s for s in list(self.states) if s.at >= t), key=lambda s: s.at)

    def stop(self) -> list[AppState]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return list(self.states)
