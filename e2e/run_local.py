"""`make run`: the local control plane, the CRD, the operator and the sample fleets, then a live
view of them until Ctrl-C (or `--duration`), then a clean teardown of what this run started.

Data flow: start (or reuse) the cluster -> apply crds/ -> start `python -m cas_operator` as a
process -> apply the samples -> every 2 s print the resources' status table, pods per role and
conditions -> on exit stop the operator and, if this run started it, the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import (
    ClusterHandle,
    default_run_dir,
    load_cluster,
    run_kubectl,
    start_cluster,
)
from e2e.operator_process import OperatorProcess

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ("minimal.yaml", "glm5-long-context.yaml")
DEMO_NAMESPACE = "cas-demo"


def say(msg: str) -> None:
    print(f"[run] {msg}", flush=True)


def demo_manifests() -> list[dict[str, Any]]:
    """The samples, adapted to the fake nodes: no weights volume exists on a local cluster."""
    out = []
    for name in SAMPLES:
        manifest = yaml.safe_load((REPO_ROOT / "config" / "samples" / name).read_text())
        manifest["spec"]["model"].pop("pvcName", None)
        out.append(manifest)
    return out


class Session:
    """What this run started, so teardown stops exactly that."""

    def __init__(self, cluster: ClusterHandle, started_cluster: bool) -> None:
        self.cluster = cluster
        self.started_cluster = started_cluster
        self.operator: OperatorProcess | None = None

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return run_kubectl(
            self.cluster.kubectl_path, self.cluster.kubeconfig, *args, stdin=stdin, check=check
        )

    def start_operator(self) -> Path:
        log_path = self.cluster.run_dir / "logs" / "operator.log"
        self.operator = OperatorProcess(self.cluster.kubeconfig, log_path, metrics_port=8081)
        self.operator.start()
        return log_path

    def teardown(self) -> None:
        if self.operator and self.operator.running():
            say("stopping the operator")
            self.operator.stop()
        if self.started_cluster:
            say("stopping the local cluster")
            for line in self.cluster.stop():
                say(line)
        else:
            say(f"deleting namespace {DEMO_NAMESPACE}; leaving the cluster running")
            self.kubectl("delete", "namespace", DEMO_NAMESPACE, "--wait=false", check=False)


def open_cluster() -> tuple[ClusterHandle, bool]:
    """CAS_KUBECONFIG, else a running `make cluster-up`, else a new local stack."""
    external = os.environ.get("CAS_KUBECONFIG")
    if external:
        from e2e.bins import resolve

        path = Path(external).expanduser().resolve()
        return ClusterHandle(path.parent, path, {}, resolve().kubectl), False
    running = load_cluster()
    if running is not None:
        say(f"reusing the running local cluster in {running.run_dir}")
        return running, False
    say("starting the local control plane (etcd, apiserver, controllers, KWOK, LWS)")
    started = time.monotonic()
    handle = start_cluster(default_run_dir(), log=say)
    say(f"control plane ready in {time.monotonic() - started:.1f}s")
    return handle, True


def status_table(session: Session) -> str:
    """`kubectl get cas`, pods per role and each resource's conditions, as one screen."""
    table = session.kubectl("get", "cas", "-n", DEMO_NAMESPACE, "-o", "wide", check=False)
    data = json.loads(session.kubectl("get", "cas", "-n", DEMO_NAMESPACE, "-o", "json") or "{}")
    pods = json.loads(session.kubectl("get", "pods", "-n", DEMO_NAMESPACE, "-o", "json") or "{}")
    lines = [table.rstrip(), ""]
    for item in data.get("items", []):
        name = item["metadata"]["name"]
        per_role: dict[str, list[str]] = {}
        for pod in pods.get("items", []):
            labels = pod["metadata"].get("labels", {})
            if labels.get("cas.dev/name") == name:
                phase = pod.get("status", {}).get("phase", "?")
                per_role.setdefault(labels.get("cas.dev/role", "?"), []).append(phase)
        roles = "  ".join(
            f"{role}: {len(p)} ({','.join(sorted(set(p)))})" for role, p in sorted(per_role.items())
        )
        lines.append(f"{name}: pods {roles or 'none yet'}")
        for cond in item.get("status", {}).get("conditions", []):
            lines.append(
                f"    {cond['type']:<23} {cond['status']:<6} {cond.get('reason', ''):<25} "
                f"{cond.get('message', '')[:80]}"
            )
    return "\n".join(lines)


def live_view(session: Session, duration: float | None) -> None:
    deadline = time.monotonic() + duration if duration else None
    interactive = sys.stdout.isatty()
    while deadline is None or time.monotonic() < deadline:
        screen = status_table(session)
        if interactive:
            print("\033[2J\033[H", end="")
        print(time.strftime("%H:%M:%S"), "— Ctrl-C to stop and tear down\n" + screen, flush=True)
        if session.operator and not session.operator.running():
            say(f"the operator exited:\n{session.operator.log_tail()}")
            return
        time.sleep(2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cluster, started = open_cluster()
    session = Session(cluster, started)
    try:
        session.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
        session.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s",
            "crd/codingagentservings.serving.cas.dev",
        )  # fmt: skip
        log_path = session.start_operator()
        say(f"operator started (log: {log_path})")
        session.kubectl("create", "namespace", DEMO_NAMESPACE, check=False)
        for manifest in demo_manifests():
            session.kubectl(
                "apply", "-n", DEMO_NAMESPACE, "-f", "-", stdin=yaml.safe_dump(manifest)
            )
            say(f"applied {manifest['kind']} {manifest['metadata']['name']} in {DEMO_NAMESPACE}")
        live_view(session, args.duration)
    except KeyboardInterrupt:
        print()
    finally:
        session.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
