"""Leader election against an API server that hangs for the holder only (issue 41, item 6).

Two operator processes under the namespaced chart's identity, both with `--leader-elect`: the
holder reaches the API server through `e2e.runtime.stallproxy` (a TCP proxy the test makes
stall: its requests hang, unanswered, as behind a partition), the standby directly. The
holder must stop acting before the standby can take the Lease, and nothing it sends may reach
the API server after that; the standby then carries on.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from cas_operator.desired.resources.meta import stable_hash
from e2e.runtime import chart
from e2e.runtime.operator_process import OperatorProcess
from e2e.runtime.stallproxy import StallProxy, upstream_of
from tests.paths import load_sample

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]
WRITES = ("create", "update", "patch", "delete")


def wait_until(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := probe():
            return found
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def stopped_at(proc: OperatorProcess, done: threading.Event) -> list[float]:
    """Watch `proc` on a thread: the wall-clock time it exited goes into the list."""
    when: list[float] = []

    def watch() -> None:
        while not done.is_set() and proc.running():
            time.sleep(0.05)
        if not proc.running():
            when.append(time.time())

    threading.Thread(target=watch, daemon=True).start()
    return when


def parse(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_a_holder_cut_off_from_the_api_stops_acting_before_the_standby_takes_over(
    cluster: Any, kubectl: Kubectl, namespace: str, crds: None, tmp_path: Path
) -> None:
    """Regression (issue 41): the standby took the Lease 15 s after the last renewal, while
    the holder, its renewal hanging for up to 30 s, noticed 15 s after that: both acted for
    tens of seconds. Now the holder, cut off mid-run, exits at its renew deadline (10 s after
    its last renewal started), before the standby's takeover (15 s after it last saw the
    record change); after the network heals nothing of the holder's reaches the API server
    (the audit log, by its User-Agent), and the standby applies the change made meanwhile."""
    ns, release = namespace, f"cas-op-{stable_hash(namespace)}"
    values = {"watchNamespaces": [ns]}
    identity = chart.install_identity(kubectl, cluster.kubeconfig, tmp_path / "kubeconfig",
                                      release=release, namespace=ns, values=values)  # fmt: skip
    proxy = StallProxy(upstream_of(identity.kubeconfig)).start()
    elect = ("-n", ns, "--leader-elect", "--leader-elect-namespace", ns,
             "--leader-elect-name", "cas-op")  # fmt: skip
    holder = OperatorProcess(proxy.kubeconfig_through(identity.kubeconfig, tmp_path / "via-proxy"),
                             tmp_path / "holder.log", extra_args=elect)  # fmt: skip
    standby = OperatorProcess(identity.kubeconfig, tmp_path / "standby.log", extra_args=elect)
    done = threading.Event()
    try:
        holder.start()
        wait_until("the holder to lead", lambda: "leading: Lease" in holder.log_tail(200))
        standby.start()
        wait_until("the standby", lambda: "standing by" in standby.log_tail(200))
        manifest = load_sample("minimal.yaml")
        manifest["spec"].update(prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
        kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(manifest))
        children = ("get", "deploy", "-n", ns, "-l", "cas.dev/name=minimal", "-o", "name")
        wait_until("the holder's children", lambda: kubectl(*children).strip())
        holder_pid = holder.pid
        exited = stopped_at(holder, done)
        proxy.stall()
        stalled = time.time()
        kubectl("patch", "cas", "minimal", "-n", ns, "--type=merge",
                "-p", json.dumps({"spec": {"decode": {"replicas": 2}}}))  # fmt: skip
        wait_until("the standby to lead", lambda: "leading: Lease" in standby.log_tail(200))
        lease = json.loads(kubectl("get", "lease", "cas-op", "-n", ns, "-o", "json"))
        assert lease["spec"]["holderIdentity"].endswith(f"-{standby.pid}"), lease["spec"]
        acquired = parse(lease["spec"]["acquireTime"])
        assert exited, f"the holder still ran {acquired - stalled:.1f}s after the stall, when " \
            f"the standby took over:\n{holder.log_tail(20)}"  # fmt: skip
        print(f"stall -> holder exited {exited[0] - stalled:.1f}s, "
              f"standby took over {acquired - stalled:.1f}s")  # fmt: skip
        assert exited[0] < acquired, (exited[0] - stalled, acquired - stalled)
        assert "lost Lease" in holder.log_tail(50), holder.log_tail(20)
        proxy.heal()
        wait_until("the standby applying the change", lambda: kubectl(
            "get", "deploy", "-n", ns, "-l", "cas.dev/name=minimal,cas.dev/role=decode",
            "-o", "jsonpath={.items[*].spec.replicas}").strip() == "2")  # fmt: skip
        time.sleep(2.0)  # anything the holder left in the proxy would have landed by now
    finally:
        done.set()
        holder.stop()
        standby.stop()
        proxy.close()
        chart.remove_cluster_scoped(kubectl, release, ns, values)
    events = chart.audit_events(cluster.audit_log, identity.username)
    late = [f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('name')} at "
            f"{e['requestReceivedTimestamp']}" for e in events
            if e.get("verb") in WRITES and f"-{holder_pid})" in e.get("userAgent", "")
            and parse(e["requestReceivedTimestamp"]) >= acquired]  # fmt: skip
    assert late == [], late
    refused = chart.refusals(events)
    assert refused.rbac == [] and refused.other == [], refused
