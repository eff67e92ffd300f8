"""NetworkPolicy enforcement on the local stack's pod network, for the tests that need it.

The pod network (:mod:`e2e.cluster.podnet`) has no policy engine of its own. :class:`Enforcer`
runs ``cas-netpol`` (e2e/cluster/netpol/main.go, built by ``make bins``): the kernel queues the
first packet of every new connection to or from a managed pod (iptables-nft NFQUEUE rules in a
mangle chain of its own) and kube-network-policies' policy engine gives the verdict. It runs on
the host, managing the pods of the namespaces it is given (whatever their node), so a test
enforces the policies of its own namespaces only and the other tests sharing the cluster see
no change. What it sees: every connection between nodes (each node is a network namespace
routed through the host) and from pods to the host; not connections between pods of one
node, which share that node's namespace here, and not the host's own root processes (admitted,
as kube-network-policies admits a node's kubelet probes).

:func:`connect_from` makes a connection as a pod makes it: from the pod's IP (bound), inside
its node's network namespace. The local stack's pods share their node's namespace, so a pod
that does not bind gets whichever address the kernel picks; binding gives the test the source
a real pod network would.

Ownership: the Enforcer owns its process and its iptables-nft chain (mangle ``<chain>`` and the
POSTROUTING rule jumping to it), which it removes by name when it stops, whatever the process
left.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from e2e.cluster import procs
from e2e.cluster.bins import resolve
from e2e.cluster.podnet import PodNetwork


def _chain() -> str:
    return f"CASNP-{uuid.uuid4().hex[:8]}"


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables-nft", "-w", "-t", "mangle", *args],
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip


@dataclass
class Enforcer:
    """See the module docstring. :meth:`start` once, :meth:`stop` always."""

    kubeconfig: Path
    namespaces: tuple[str, ...]
    log_dir: Path
    chain: str = field(default_factory=_chain)
    queue: int = field(default_factory=lambda: random.randint(1000, 60000))
    record: procs.ProcRecord | None = None

    def start(self) -> None:
        argv = [str(resolve().netpol), "--kubeconfig", str(self.kubeconfig),
                "--namespaces", ",".join(self.namespaces), "--chain", self.chain,
                "--queue", str(self.queue)]  # fmt: skip
        self.record = procs.spawn(f"netpol-{self.chain}", argv, self.log_dir)

    def managed(self) -> set[str]:
        """The pod IPs whose new connections are queued now (empty before the rules exist)."""
        if "-j " + self.chain not in _iptables("-S", "POSTROUTING").stdout:
            return set()
        rules = _iptables("-S", self.chain).stdout.splitlines()
        return {r.split()[3].removesuffix("/32") for r in rules if "NFQUEUE" in r and " -d " in r}

    def wait_managing(self, ips: set[str], timeout: float = 60.0) -> None:
        """Until every IP in `ips` is queued for a verdict; raises TimeoutError (log tail)."""
        deadline = time.monotonic() + timeout
        while not ips <= self.managed():
            if self.record is not None and not procs.is_running(self.record):
                raise RuntimeError(f"cas-netpol exited:\n{procs.log_tail(self.record)}")
            if time.monotonic() > deadline:
                tail = procs.log_tail(self.record) if self.record else ""
                raise TimeoutError(f"cas-netpol manages {self.managed()}, not {ips}:\n{tail}")
            time.sleep(0.5)

    def stop(self) -> str:
        said = procs.stop(self.record, grace_s=10.0) if self.record is not None else ""
        while _iptables("-D", "POSTROUTING", "-j", self.chain).returncode == 0:
            pass  # a jump the process left (it removes its own on SIGTERM)
        _iptables("-F", self.chain)
        _iptables("-X", self.chain)
        # iptables-nft made the `ip mangle` table for the first chain; none left: it goes too
        if all(r.startswith("-P ") for r in _iptables("-S").stdout.splitlines()):
            subprocess.run(["nft", "delete", "table", "ip", "mangle"],
                           capture_output=True, timeout=10, check=False)  # fmt: skip
        return said


PROBE = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[4]))
s.bind((sys.argv[1], 0))
try:
    s.connect((sys.argv[2], int(sys.argv[3])))
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def connect_from(
    network: PodNetwork, source_ip: str, target_ip: str, port: int, timeout: float = 3.0
) -> str:
    """A TCP connection from pod IP `source_ip` (in its node's namespace, the IP present
    there) to `target_ip:port`: "connected", "TimeoutError" (no answer: dropped on the way)
    or the error's name (e.g. "ConnectionRefusedError": nothing listens)."""
    netns = network.add_pod_ip(source_ip)
    assert netns is not None, f"{source_ip} is not in the pod network"
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", PROBE,
            source_ip, target_ip, str(port), str(timeout)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10, check=True)
    return done.stdout.strip()
