"""The Helm chart (``charts/cas-operator``) on the local stack: render it with the pinned helm,
install the identity it grants (ServiceAccount, RBAC, admission policy) and run the operator
under that identity, then read the API server's audit log for the answers it got.

Data flow: values -> ``helm template`` -> objects; :func:`install_identity` applies every
object except the Deployment (the operator runs as a host process; see
:mod:`e2e.runtime.operator_process`) and writes a kubeconfig holding the ServiceAccount's token
(``kubectl create token``), so every request the operator makes is authorised as the chart's
RBAC says, not as the admin. :func:`audit_events` reads ``ClusterHandle.audit_log`` (the stack
audits every service account's request, one event at completion).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cas_operator.desired.resources.meta import stable_hash
from e2e.cluster.bins import resolve
from e2e.paths import REPO_ROOT
from e2e.runtime.operator_process import OperatorProcess

CHART_DIR = REPO_ROOT / "charts" / "cas-operator"
Kubectl = Callable[..., str]
TOKEN_DURATION = "8h"  # longer than any e2e session


@dataclass(frozen=True)
class ChartIdentity:
    """The chart's ServiceAccount as installed: its API-server username and a kubeconfig."""

    release: str
    namespace: str
    kubeconfig: Path

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.release}"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The pinned helm (``make bins``) with ``args``; raise with its stderr on failure."""
    done = subprocess.run([str(resolve().helm), *args], capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


def set_flags(values: Mapping[str, Any]) -> list[str]:
    """``--set-json key=value`` flags for top-level values (lists and maps as JSON)."""
    return [arg for k, v in values.items() for arg in ("--set-json", f"{k}={json.dumps(v)}")]


def template(
    release: str, namespace: str, values: Mapping[str, Any] | None = None, *, crds: bool = False
) -> list[dict[str, Any]]:
    """Every object ``helm template`` renders for ``values`` (CRDs too with ``crds``)."""
    args = ["template", release, str(CHART_DIR), "--namespace", namespace]
    args += ["--include-crds"] if crds else []
    out = helm(*args, *set_flags(values or {})).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def install_identity(
    kubectl: Kubectl,
    admin_kubeconfig: Path,
    out: Path,
    *,
    release: str = "cas-operator",
    namespace: str = "cas-system",
    values: Mapping[str, Any] | None = None,
) -> ChartIdentity:
    """Apply the chart's objects but its Deployment in ``namespace`` (created if missing) and
    write ``out``: a kubeconfig with the ServiceAccount's token for the admin's server."""
    kubectl("create", "namespace", namespace, check=False)
    objects = [o for o in template(release, namespace, values) if o["kind"] != "Deployment"]
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=_as_yaml(objects))
    return identity_of(kubectl, admin_kubeconfig, out, release=release, namespace=namespace)


def remove_cluster_scoped(
    kubectl: Kubectl, release: str, namespace: str, values: Mapping[str, Any] | None = None
) -> None:
    """Delete what the release's template makes outside namespaces (admission policies and
    their bindings, ClusterRoles): a test's release leaves nothing on the shared cluster. Never
    the session's all-namespaces release, which other tests share."""
    if release == "cas-operator":
        raise ValueError("the shared release cas-operator stays installed")
    objects = template(release, namespace, values)
    outside = [o for o in objects if "namespace" not in o["metadata"]]
    names = [f"{o['kind']}/{o['metadata']['name']}" for o in outside
             if o["kind"] != "CustomResourceDefinition"]  # fmt: skip
    if names:  # one kubectl for all of them: a fleet test's teardown ran one per object
        kubectl("delete", *names, "--ignore-not-found", "--wait=false", check=False)


@contextlib.contextmanager
def namespaced_operator(
    kubectl: Kubectl,
    admin_kubeconfig: Path,
    namespace: str,
    workdir: Path,
    extra_args: tuple[str, ...] = (),
) -> Iterator[tuple[OperatorProcess, ChartIdentity]]:
    """The operator as a process watching only `namespace`, under the namespaced chart's
    identity (a release of its own, released into `namespace`; its cluster-scoped objects
    are removed afterwards)."""
    release, values = f"cas-op-{stable_hash(namespace)}", {"watchNamespaces": [namespace]}
    identity = install_identity(
        kubectl, admin_kubeconfig, workdir / "operator-kubeconfig",
        release=release, namespace=namespace, values=values,
    )  # fmt: skip
    proc = OperatorProcess(identity.kubeconfig, workdir / "operator.log",
                           extra_args=("-n", namespace, *extra_args))  # fmt: skip
    proc.start()
    try:
        yield proc, identity
    finally:
        proc.stop()
        remove_cluster_scoped(kubectl, release, namespace, values)


def identity_of(
    kubectl: Kubectl, admin_kubeconfig: Path, out: Path, *, release: str, namespace: str
) -> ChartIdentity:
    """The installed release's ServiceAccount: ``out`` gets a kubeconfig with its token."""
    token = kubectl("create", "token", release, "-n", namespace, f"--duration={TOKEN_DURATION}")
    out.write_text(_token_kubeconfig(admin_kubeconfig, token.strip(), release))
    return ChartIdentity(release=release, namespace=namespace, kubeconfig=out)


def kubectl_as(
    identity: ChartIdentity, kubectl_path: Path | None, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl as the chart's ServiceAccount (`stdin`: its input); the caller reads the exit
    code and stderr (the API server's refusal message)."""
    exe = str(kubectl_path or resolve().kubectl)
    return subprocess.run(
        [exe, "--kubeconfig", str(identity.kubeconfig), *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _as_yaml(objects: Iterable[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(list(objects), sort_keys=False)


def _token_kubeconfig(admin_kubeconfig: Path, token: str, user: str) -> str:
    """The admin kubeconfig's cluster (server, CA) with a bearer-token user instead."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = admin["clusters"][0]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": cluster["name"], "user": user}}],
        "current-context": user,
    }
    return yaml.safe_dump(config, sort_keys=False)


def audit_events(audit_log: Path, username: str) -> list[dict[str, Any]]:
    """The audit events of ``username``'s requests, oldest first (rotated file included)."""
    if not audit_log.exists():
        raise FileNotFoundError(
            f"{audit_log}: no audit log (the local stack writes one; an external cluster's"
            " operator identity cannot be checked here)"
        )
    events: list[dict[str, Any]] = []
    for path in sorted(audit_log.parent.glob(f"{audit_log.stem}*{audit_log.suffix}")):
        for line in path.read_text(errors="replace").splitlines():
            if username not in line:  # cheap filter before parsing
                continue
            event = json.loads(line)
            if event.get("user", {}).get("username") == username:
                events.append(event)
    return events


# 403s that RBAC allowed and something else refused, for reasons that pass: admission's
# RESTMapper has not mapped a CRD installed seconds ago (OwnerReferencesPermissionEnforcement;
# the operator retries), or the namespace is being deleted (a test's cleanup).
PASSING_REFUSALS = ("cannot find RESTMapping", "because it is being terminated")


@dataclass(frozen=True)
class Refusals:
    """The 401/403 answers in audit events: RBAC's (the chart lacks a verb), the passing ones
    above, and any other (an admission policy or plugin refused something)."""

    rbac: list[str]
    passing: list[str]
    other: list[str]


def refusals(events: Iterable[dict[str, Any]]) -> Refusals:
    """Sort every 401/403 into RBAC's, passing and other (``verb resource ns/name -> why``)."""
    found = Refusals([], [], [])
    for event in events:
        status = event.get("responseStatus", {})
        if status.get("code") not in (401, 403):
            continue
        ref = event.get("objectRef", {})
        what = "/".join(p for p in (ref.get("resource"), ref.get("subresource")) if p)
        why = status.get("message", "")
        line = f"{event.get('verb')} {what} {ref.get('namespace', '')}/{ref.get('name', '')}"
        line += f" -> {status.get('code')} {why[:200]}"
        decision = event.get("annotations", {}).get("authorization.k8s.io/decision")
        if status.get("code") == 401 or decision == "forbid":
            found.rbac.append(line)
        elif any(reason in why for reason in PASSING_REFUSALS):
            found.passing.append(line)
        else:
            found.other.append(line)
    return found
