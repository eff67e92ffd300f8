"""The local stack's pod network: one network namespace per fake node, joined to the host by a
veth pair, so pod IPs are real addresses the API server accepts in EndpointSlices.

Layout (``netns`` mode, root or CAP_NET_ADMIN with ``ip`` and ``nft`` installed):

- pods: :data:`POD_CIDR` (100.96.0.0/16, inside CGNAT 100.64.0.0/10); node ``i`` owns
  ``100.96.<i+1>.0/24`` (KWOK hands out pod IPs from ``spec.podCIDR``, from ``.1`` up);
  ``100.96.0.0/24`` is the host side: :data:`HOST_IP` (100.96.0.1) is the gateway every node
  namespace routes through, the kube-apiserver's address, and the source of host->pod traffic.
- Services: :data:`SERVICE_CIDR` (100.97.0.0/16), routed to a veth into a sink namespace (no
  routes there), so kube-proxy's nftables DNAT (a host process) applies to host traffic; node
  namespaces route it to the host.
- node ``i``: namespace ``casnet-<cid>-n<i>``; veth ``cn<cid>h<i>`` (host end, 100.96.0.1/32,
  forwarding on that link only) <-> ``eth0`` in the namespace; host route ``100.96.<i+1>.0/24 dev
  cn<cid>h<i> src 100.96.0.1``; a pod's IP is added (/32) to the namespace's ``eth0`` by the pod
  runner, which starts the pod's process inside the namespace (:func:`enter_netns`).

Safety (traffic to pod and Service addresses never leaves the machine):

1. before anything is made, :func:`check_ranges` refuses to start when a route for (a part of)
   either range points at an interface that is not ours, or an address in them exists;
2. ``blackhole`` routes for both ranges (metric :data:`BLACKHOLE_METRIC`) sit beneath the
   specific routes, so a missing node or Service route drops instead of using the default route;
3. an nft table ``ip casnet_<cid>`` drops any packet to or from the ranges that would go out of,
   or come in on, an interface other than ours or ``lo``;
4. node namespaces route only the two ranges (no default route), and forwarding is enabled on our
   host veth ends only (``net.ipv4.conf.<link>.forwarding``), never globally.

Everything made is recorded in ``<run>/podnet.json`` as it is made, and :meth:`PodNetwork.teardown`
removes exactly those namespaces, links, routes and nft tables, by name (plus kube-proxy's own
``kube-proxy`` nft tables, which only the kube-proxy we started can have made: start refuses when
they already exist).

A run killed before its teardown (SIGKILL, a machine's session ending) leaves its network, and
its record may be in a checkout no later run knows of. So a start first claims the ranges (an
abstract Unix socket, :func:`claim_ranges`: freed by the kernel when its holder dies), then
removes a dead run's pieces for the same ranges found in the kernel's own state
(:func:`find_leftovers`: exactly our names, touching these ranges, and only while nothing listens
on the host IP, where a live cluster's API server does), then checks and makes its own.

``loopback`` mode (no privileges, or ``CAS_POD_NETWORK=loopback``): node pod CIDRs in
127.10.0.0/16 on loopback as before; Services have no endpoints (the API server refuses loopback
addresses), so tests that need them skip with :attr:`PodNetwork.reason`.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e2e.paths import write_json

POD_CIDR = "100.96.0.0/16"
SERVICE_CIDR = "100.97.0.0/16"
HOST_IP = "100.96.0.1"
SERVICE_IP = "100.97.0.1"  # the `kubernetes` Service's ClusterIP (first of SERVICE_CIDR)
LOOPBACK_PREFIX = "127.10"
BLACKHOLE_METRIC = 4242
NETNS_PREFIX = "casnet-"
STATE_FILE = "podnet.json"
KUBE_PROXY_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
NETNS_DIR = Path("/var/run/netns")
CAP_NET_ADMIN = 12
CLONE_NEWNET = 0x40000000
SAFE_ROUTE_TYPES = ("blackhole", "unreachable", "prohibit")
# Names this module gives what it makes (cid: five hex digits, see cluster_id); a look-alike that
# does not match exactly is someone else's and is never reclaimed.
OUR_LINK = re.compile(r"^cn(?P<cid>[0-9a-f]{5})(h\d+|svc)$")
OUR_NETNS = re.compile(r"^casnet-(?P<cid>[0-9a-f]{5})-(n\d+|svc)$")
OUR_TABLE = re.compile(r"^casnet_(?P<cid>[0-9a-f]{5})$")
TCP_LISTEN = "0A"
CIDR_IN_TEXT = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}/\d{1,2}\b")


class PodNetError(RuntimeError):
    """The pod network could not be made safely (the message says why)."""


def cluster_id(run_dir: Path) -> str:
    """A short stable id of a run folder: names every namespace, link and table made for it."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:5]


def node_cidr(index: int, mode: str, pod_cidr: str = POD_CIDR) -> str:
    """Pod CIDR of node ``index`` in ``mode``: the ``index + 1``-th /24 of ``pod_cidr`` (the
    first is the host side), or ``127.10.<index>.0/24`` in loopback mode."""
    if mode == "netns":
        net = ipaddress.IPv4Network(pod_cidr)
        return str(ipaddress.IPv4Network((int(net.network_address) + ((index + 1) << 8), 24)))
    return f"{LOOPBACK_PREFIX}.{index}.0/24"


def _run(
    *argv: str, check: bool = True, netns: str | None = None
) -> subprocess.CompletedProcess[str]:
    if netns:
        argv = ("ip", "netns", "exec", netns, *argv)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise PodNetError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def _has_net_admin() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def netns_unavailable_reason() -> str | None:
    """Why netns mode cannot be used here, or None when it can."""
    if os.environ.get("CAS_POD_NETWORK", "").strip().lower() == "loopback":
        return "CAS_POD_NETWORK=loopback"
    if not _has_net_admin():
        return "no CAP_NET_ADMIN (run as root to get a pod network)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (run tools/sysdeps.sh)"
    return None


# -- the safety check (pure on its inputs, so it is unit-tested) ------------------------------


def route_conflicts(routes: list[dict[str, Any]], ranges: list[str], our_prefix: str) -> list[str]:
    """Routes (``ip -j route show table all`` entries) that would carry traffic for a part of
    ``ranges`` to an interface not named ``our_prefix*``: those whose destination lies inside a
    range (equal or more specific, so they beat our blackhole) and that are not themselves
    blackhole/unreachable/prohibit routes. Returns one line per conflict (pure)."""
    nets = [ipaddress.IPv4Network(r) for r in ranges]
    out = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("", "default") or ":" in dst:
            continue
        try:
            net = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            continue
        if route.get("type", "unicast") in SAFE_ROUTE_TYPES:
            continue
        dev = route.get("dev", "")
        if dev.startswith(our_prefix):
            continue
        for rng in nets:
            if net.subnet_of(rng):
                table = route.get("table", "main")
                out.append(f"{dst} dev {dev or '?'} (table {table}) lies in {rng}")
    return out


def address_conflicts(addrs: list[dict[str, Any]], ranges: list[str], our_prefix: str) -> list[str]:
    """Addresses (``ip -j addr`` entries) inside ``ranges`` on links not named ``our_prefix*``."""
    nets = [ipaddress.IPv4Network(r) for r in ranges]
    out = []
    for link in addrs:
        name = link.get("ifname", "")
        if name.startswith(our_prefix):
            continue
        for info in link.get("addr_info", []):
            if info.get("family") != "inet":
                continue
            ip = ipaddress.IPv4Address(info["local"])
            if any(ip in n for n in nets):
                out.append(f"{ip} on {name}")
    return out


def check_ranges(
    our_prefix: str,
    ranges: tuple[str, ...] = (POD_CIDR, SERVICE_CIDR),
    *,
    kube_proxy: bool = True,
) -> None:
    """Refuse (PodNetError) when a route or address for the ranges points at a real interface;
    with ``kube_proxy``, also when kube-proxy's nft tables exist already (another one runs)."""
    routes = json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]")
    addrs = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    problems = route_conflicts(routes, list(ranges), our_prefix)
    problems += address_conflicts(addrs, list(ranges), our_prefix)
    if problems:
        raise PodNetError(
            "refusing to make the pod network: these routes/addresses would send pod or Service "
            f"traffic ({', '.join(ranges)}) to interfaces that are not ours: "
            + "; ".join(problems)
            + " (another local cluster's network? stop it with 'make cluster-down')"
        )
    for family, table in KUBE_PROXY_TABLES if kube_proxy else ():
        if _run("nft", "list", "table", family, table, check=False).returncode == 0:
            raise PodNetError(
                f"refusing to make the pod network: nft table {family} {table} exists "
                "(a kube-proxy of another cluster runs on this host; stop it first)"
            )


# -- a dead run's leftovers (found in the kernel's state, so those of any checkout) -----------


@dataclass(frozen=True)
class Leftovers:
    """What a run that died without teardown left for the same ranges, by name (decided by
    :func:`find_leftovers`, removed by :func:`remove_leftovers`). ``live``: ports that listen
    on the host IP, so that run is alive and nothing may be removed."""

    live: tuple[int, ...] = ()
    links: tuple[str, ...] = ()
    netns: tuple[str, ...] = ()
    nft_tables: tuple[str, ...] = ()
    blackholes: tuple[str, ...] = ()  # ranges with a blackhole route at BLACKHOLE_METRIC
    kube_proxy: bool = False  # kube-proxy's tables name our host IP: its kube-proxy is gone

    def __bool__(self) -> bool:
        return bool(
            self.links or self.netns or self.nft_tables or self.blackholes or self.kube_proxy
        )


@dataclass(frozen=True)
class KernelState:
    """The parts of the host's network state :func:`find_leftovers` reads."""

    routes: list[dict[str, Any]]
    addrs: list[dict[str, Any]]  # `ip -j addr`: every link, with its addresses
    netns: list[str]
    tables: dict[str, str]  # nft `ip casnet_*` table name -> its listing
    kube_proxy_table: str  # listing of `ip kube-proxy` ("" when absent)
    listening: list[tuple[str, int]]  # TCP listeners (address, port)


def find_leftovers(state: KernelState, ranges: tuple[str, ...], host_ip: str) -> Leftovers:
    """A dead run's pieces for ``ranges`` in ``state`` (pure). A piece is a leftover only when
    its name is exactly one this module gives (OUR_LINK, OUR_NETNS, OUR_TABLE) and it routes,
    holds or filters an address in ``ranges`` (or shares a cid with one that does); nothing is
    one while a process listens on ``host_ip`` (the API server of a cluster that runs)."""
    live = tuple(sorted({port for addr, port in state.listening if addr == host_ip}))
    if live:
        return Leftovers(live=live)
    nets = [ipaddress.IPv4Network(r) for r in ranges]

    def inside(dst: str) -> bool:
        try:
            net = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            return False
        return any(net.subnet_of(rng) for rng in nets)

    def filters_ranges(table: str) -> bool:  # nft prints the ranges merged (100.96.0.0/15)
        cidrs = [ipaddress.IPv4Network(c, strict=False) for c in CIDR_IN_TEXT.findall(table)]
        return any(c.overlaps(rng) for c in cidrs for rng in nets)

    def addresses(link: dict[str, Any]) -> list[str]:
        return [a.get("local", "") for a in link.get("addr_info", []) if a.get("family") == "inet"]

    tables = tuple(
        name
        for name, text in sorted(state.tables.items())
        if _cid(OUR_TABLE, name) and filters_ranges(text)
    )
    cids = {_cid(OUR_TABLE, name) for name in tables}
    cids |= {_cid(OUR_LINK, r.get("dev", "")) for r in state.routes if inside(r.get("dst", ""))}
    cids |= {
        _cid(OUR_LINK, a.get("ifname", "")) for a in state.addrs if any(map(inside, addresses(a)))
    }
    cids.discard(None)
    blackholes = tuple(
        r["dst"]
        for r in state.routes
        if r.get("type") == "blackhole"
        and r.get("metric") == BLACKHOLE_METRIC
        and r.get("dst") in ranges
    )
    kube_proxy = re.search(rf"(?<![\d.]){re.escape(host_ip)}(?!\d)", state.kube_proxy_table)
    return Leftovers(
        links=tuple(
            a["ifname"] for a in state.addrs if _cid(OUR_LINK, a.get("ifname", "")) in cids
        ),
        netns=tuple(n for n in state.netns if _cid(OUR_NETNS, n) in cids),
        nft_tables=tables,
        blackholes=blackholes,
        kube_proxy=kube_proxy is not None,
    )


def _cid(pattern: re.Pattern[str], name: str) -> str | None:
    """The cluster id in ``name`` when it is exactly one of our names (``pattern``), else None."""
    match = pattern.match(name)
    return match["cid"] if match else None


def tcp_listeners(proc_net_tcp: str) -> list[tuple[str, int]]:
    """(address, port) of each listening socket in a ``/proc/net/tcp`` listing (pure)."""
    out = []
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == TCP_LISTEN:
            hex_ip, hex_port = fields[1].split(":")
            ip = ipaddress.IPv4Address(int(hex_ip, 16).to_bytes(4, "little"))
            out.append((str(ip), int(hex_port, 16)))
    return out


def read_kernel_state() -> KernelState:
    """Snapshot the host's routes, links, namespaces, our nft tables and TCP listeners."""
    tables = {}
    for line in _run("nft", "list", "tables", "ip").stdout.splitlines():
        name = line.split()[-1]
        if OUR_TABLE.match(name):
            tables[name] = _run("nft", "list", "table", "ip", name, check=False).stdout
    kube_proxy = _run("nft", "list", "table", "ip", "kube-proxy", check=False)
    return KernelState(
        routes=json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]"),
        addrs=json.loads(_run("ip", "-j", "addr", "show").stdout or "[]"),
        netns=[line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line],
        tables=tables,
        kube_proxy_table=kube_proxy.stdout if kube_proxy.returncode == 0 else "",
        listening=tcp_listeners(Path("/proc/net/tcp").read_text()),
    )


def remove_leftovers(found: Leftovers) -> list[str]:
    """Remove what :func:`find_leftovers` found (idempotent); returns what it removed."""
    done = []
    for family, table in KUBE_PROXY_TABLES if found.kube_proxy else ():
        if _run("nft", "delete", "table", family, table, check=False).returncode == 0:
            done.append(f"nft table {family} {table}")
    # Links before namespaces: a namespace's deletion destroys its veth pairs in the
    # background, so a host end deleted after it may or may not still be there (the report of
    # what was removed, which says where each piece went, would vary run to run).
    for link in found.links:
        if _run("ip", "link", "del", link, check=False).returncode == 0:
            done.append(f"link {link}")
    for ns in found.netns:
        if _run("ip", "netns", "del", ns, check=False).returncode == 0:
            done.append(f"netns {ns}")
    for table in found.nft_tables:
        if _run("nft", "delete", "table", "ip", table, check=False).returncode == 0:
            done.append(f"nft table ip {table}")
    for dst in found.blackholes:
        args = ["blackhole", dst, "metric", str(BLACKHOLE_METRIC)]
        if _run("ip", "route", "del", *args, check=False).returncode == 0:
            done.append(f"route {' '.join(args)}")
    return done


_CLAIMS: dict[str, socket.socket] = {}  # pod CIDR -> the claim this process holds on it


def claim_ranges(pod_cidr: str) -> None:
    """Hold an abstract Unix socket named after ``pod_cidr`` while this process makes (and then
    owns) a network on it: the kernel frees the name when the process dies, so a second run on
    the same host network refuses at once instead of taking a half-made network for a dead one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0cas-operator/podnet/{pod_cidr}")
    except OSError as exc:
        sock.close()
        raise PodNetError(
            f"another process on this machine is making or owns a pod network on {pod_cidr} "
            "right now (a second local cluster? stop it first: 'make cluster-down' in its checkout)"
        ) from exc
    _CLAIMS[pod_cidr] = sock


def release_ranges(pod_cidr: str) -> None:
    """Give up this process's claim on ``pod_cidr`` (after teardown; no-op without one)."""
    sock = _CLAIMS.pop(pod_cidr, None)
    if sock is not None:
        sock.close()


def reclaim_leftovers(net: PodNetwork) -> list[str]:
    """Remove what a dead run left on ``net``'s ranges (any checkout's: found by name in the
    kernel's state); refuse (PodNetError) while a cluster on them runs. Call with the claim held,
    so no live run can be half-way through making the pieces found."""
    ranges = (net.pod_cidr, net.service_cidr)
    found = find_leftovers(read_kernel_state(), ranges, net.host_ip)
    if found.live:
        ports = ", ".join(str(p) for p in found.live)
        raise PodNetError(
            f"a local cluster on {', '.join(ranges)} runs on this machine (listening on "
            f"{net.host_ip}:{ports}); stop it first ('make cluster-down' in its checkout)"
        )
    return remove_leftovers(found)


# -- entering a namespace (for the pod runner) -------------------------------------------------

_LIBC: Any = None


def enter_netns(name: str) -> None:
    """Move the calling process into network namespace ``name`` (use as a preexec_fn)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if _LIBC.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def preload_libc() -> None:
    """Load libc before forking (a preexec_fn should not import or load libraries)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)


# -- the network -------------------------------------------------------------------------------


@dataclass
class Made:
    """What was made, in order, so teardown removes exactly it."""

    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    routes: list[list[str]] = field(default_factory=list)  # `ip route del` arguments
    nft_tables: list[list[str]] = field(default_factory=list)  # [family, name]
    kube_proxy: bool = False  # a kube-proxy was started: remove its nft tables too


@dataclass
class PodNetwork:
    """The pod network of one cluster (``mode`` netns or loopback); see the module docstring."""

    run_dir: Path
    mode: str
    cid: str
    nodes: int
    reason: str = ""  # loopback: why not netns
    made: Made = field(default_factory=Made)
    pod_cidr: str = POD_CIDR
    service_cidr: str = SERVICE_CIDR

    # -- names ---------------------------------------------------------------------------------
    @property
    def link_prefix(self) -> str:
        return f"cn{self.cid}"

    def netns_name(self, index: int) -> str:
        return f"{NETNS_PREFIX}{self.cid}-n{index}"

    def host_link(self, index: int) -> str:
        return f"{self.link_prefix}h{index}"

    @property
    def service_link(self) -> str:
        return f"{self.link_prefix}svc"

    @property
    def sink_netns(self) -> str:
        return f"{NETNS_PREFIX}{self.cid}-svc"

    @property
    def nft_table(self) -> str:
        return f"casnet_{self.cid}"

    @property
    def enabled(self) -> bool:
        return self.mode == "netns"

    @property
    def host_ip(self) -> str:
        """The host side's address (first of the pod CIDR; HOST_IP by default)."""
        return str(ipaddress.IPv4Network(self.pod_cidr)[1])

    @property
    def api_host(self) -> str:
        """Where the API server listens: reachable from the host and from every node namespace."""
        return self.host_ip if self.enabled else "127.0.0.1"

    def node_cidr(self, index: int) -> str:
        return node_cidr(index, self.mode, self.pod_cidr)

    def networks(self) -> tuple[ipaddress.IPv4Network, ...]:
        """Pod addresses the pod runner may run (its ``networks``)."""
        if self.enabled:
            return (ipaddress.IPv4Network(self.pod_cidr),)
        return (ipaddress.IPv4Network("127.0.0.0/8"),)

    def netns_for_ip(self, ip: str) -> str | None:
        """The node namespace that owns pod IP ``ip`` (None in loopback mode or outside)."""
        if not self.enabled:
            return None
        addr = ipaddress.IPv4Address(ip)
        for i in range(self.nodes):
            if addr in ipaddress.IPv4Network(self.node_cidr(i)):
                return self.netns_name(i)
        return None

    # -- persistence ---------------------------------------------------------------------------
    def save(self) -> None:
        data = {
            "mode": self.mode,
            "cid": self.cid,
            "nodes": self.nodes,
            "reason": self.reason,
            "pod_cidr": self.pod_cidr,
            "service_cidr": self.service_cidr,
            "made": asdict(self.made),
        }
        write_json(self.run_dir / STATE_FILE, data)

    @classmethod
    def load(cls, run_dir: Path) -> PodNetwork | None:
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(
            run_dir=run_dir,
            mode=data["mode"],
            cid=data["cid"],
            nodes=int(data["nodes"]),
            reason=data.get("reason", ""),
            made=Made(**data.get("made", {})),
            pod_cidr=data.get("pod_cidr", POD_CIDR),
            service_cidr=data.get("service_cidr", SERVICE_CIDR),
        )

    # -- making it -----------------------------------------------------------------------------
    def _do(self, *argv: str, netns: str | None = None) -> None:
        _run(*argv, netns=netns)

    def setup(self, *, kube_proxy: bool = True) -> None:
        """Make the whole network (netns mode), recording each piece as it is made."""
        if not self.enabled:
            return
        check_ranges(self.link_prefix, (self.pod_cidr, self.service_cidr), kube_proxy=kube_proxy)
        self.save()
        for cidr in (self.pod_cidr, self.service_cidr):
            args = ["blackhole", cidr, "metric", str(BLACKHOLE_METRIC)]
            if _run("ip", "route", "add", *args, check=False).returncode == 0:
                self.made.routes.append(args)
                self.save()
        self._nft_guard()
        # Service addresses go to a veth whose other end sits in a namespace with no routes (a
        # sink: there is no dummy link driver in every kernel): kube-proxy DNATs before routing
        # matters; what it does not DNAT is dropped there.
        svc, sink = self.service_link, self.sink_netns
        self._do("ip", "netns", "add", sink)
        self.made.netns.append(sink)
        self.save()
        self._do("ip", "link", "add", svc, "type", "veth", "peer", "name", "sink", "netns", sink)
        self.made.links.append(svc)
        self.save()
        self._do("ip", "-n", sink, "link", "set", "sink", "up")
        self._do("ip", "addr", "add", f"{self.host_ip}/32", "dev", svc)
        self._do("ip", "link", "set", svc, "up")
        self._do("ip", "route", "add", self.service_cidr, "dev", svc, "src", self.host_ip)
        for i in range(self.nodes):
            self._node(i)

    def _nft_guard(self) -> None:
        ours = f'"{self.link_prefix}*"'
        ranges = f"{{ {self.pod_cidr}, {self.service_cidr} }}"
        # A pod reaching a Service endpoint on its own node (itself included) comes back out of
        # the veth it came in by; unmasqueraded, the namespace would drop it (its source is a
        # local address there). One kube-proxy for all nodes only masquerades hairpins of its
        # own node's endpoints, so masquerade these here (to HOST_IP, the veth's address).
        hairpin = "\n".join(
            f'    iifname "{self.host_link(i)}" oifname "{self.host_link(i)}" ct status dnat '
            "masquerade"
            for i in range(self.nodes)
        )
        rules = f"""
table ip {self.nft_table} {{
  chain guard_out {{
    type filter hook postrouting priority 100; policy accept;
    ip daddr {ranges} oifname != "lo" oifname != {ours} counter drop
    ip saddr {ranges} oifname != "lo" oifname != {ours} counter drop
  }}
  chain guard_in {{
    type filter hook prerouting priority -300; policy accept;
    ip daddr {ranges} iifname != "lo" iifname != {ours} counter drop
    ip saddr {ranges} iifname != "lo" iifname != {ours} counter drop
  }}
  chain hairpin {{
    type nat hook postrouting priority 110; policy accept;
{hairpin}
  }}
}}
"""
        self.made.nft_tables.append(["ip", self.nft_table])
        self.save()
        proc = subprocess.run(
            ["nft", "-f", "-"], input=rules, capture_output=True, text=True, check=False, timeout=30
        )
        if proc.returncode != 0:
            raise PodNetError(f"nft guard table: {proc.stderr.strip()}")

    def _node(self, i: int) -> None:
        ns, host = self.netns_name(i), self.host_link(i)
        self._do("ip", "netns", "add", ns)
        self.made.netns.append(ns)
        self.save()
        self._do("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.made.links.append(host)
        self.save()
        gw = self.host_ip
        self._do("ip", "addr", "add", f"{gw}/32", "dev", host)
        self._do("sysctl", "-qw", f"net.ipv4.conf.{host}.forwarding=1")
        self._do("ip", "link", "set", host, "up")
        self._do("ip", "route", "add", self.node_cidr(i), "dev", host, "src", gw)
        self._do("ip", "-n", ns, "link", "set", "lo", "up")
        self._do("ip", "-n", ns, "link", "set", "eth0", "up")
        self._do("ip", "-n", ns, "route", "add", gw, "dev", "eth0", "scope", "link")
        for cidr in (self.pod_cidr, self.service_cidr):
            self._do("ip", "-n", ns, "route", "add", cidr, "via", gw, "dev", "eth0")

    # -- pods ----------------------------------------------------------------------------------
    def add_pod_ip(self, ip: str) -> str | None:
        """Add pod IP ``ip`` to its node namespace (idempotent); return the namespace."""
        ns = self.netns_for_ip(ip)
        if ns is None:
            return None
        proc = _run("ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "eth0", check=False)
        if proc.returncode != 0 and not any(s in proc.stderr for s in ("File exists", "already")):
            raise PodNetError(f"adding {ip} to {ns}: {proc.stderr.strip()}")
        return ns

    def remove_pod_ip(self, ip: str) -> None:
        ns = self.netns_for_ip(ip)
        if ns is not None:
            _run("ip", "-n", ns, "addr", "del", f"{ip}/32", "dev", "eth0", check=False)

    # -- teardown ------------------------------------------------------------------------------
    def teardown(self) -> list[str]:
        """Remove exactly what :attr:`made` records (idempotent); returns what it removed."""
        done = []
        if self.made.kube_proxy:
            for family, table in KUBE_PROXY_TABLES:
                if _run("nft", "delete", "table", family, table, check=False).returncode == 0:
                    done.append(f"nft table {family} {table}")
        for ns in reversed(self.made.netns):
            if _run("ip", "netns", "del", ns, check=False).returncode == 0:
                done.append(f"netns {ns}")
        for link in reversed(self.made.links):
            if _run("ip", "link", "del", link, check=False).returncode == 0:
                done.append(f"link {link}")
        for family, table in reversed(self.made.nft_tables):
            if _run("nft", "delete", "table", family, table, check=False).returncode == 0:
                done.append(f"nft table {family} {table}")
        for args in reversed(self.made.routes):
            if _run("ip", "route", "del", *args, check=False).returncode == 0:
                done.append(f"route {' '.join(args)}")
        self.made = Made()
        if (self.run_dir / STATE_FILE).exists():
            self.save()
        release_ranges(self.pod_cidr)
        return done


def make(
    run_dir: Path,
    nodes: int,
    *,
    log: Any = None,
    pod_cidr: str = POD_CIDR,
    service_cidr: str = SERVICE_CIDR,
    kube_proxy: bool = True,
) -> PodNetwork:
    """The pod network for a new cluster in ``run_dir``: netns mode where possible (made now),
    else loopback mode with the reason (said through ``log``). ``kube_proxy``: a kube-proxy will
    run for it (so none may run already)."""
    cid = cluster_id(run_dir)
    reason = netns_unavailable_reason()
    if reason is not None:
        net = PodNetwork(run_dir, "loopback", cid, nodes, reason=reason)
        if log:
            log(f"pod network: loopback mode ({reason}); Services will have no endpoints")
        net.save()
        return net
    net = PodNetwork(run_dir, "netns", cid, nodes, pod_cidr=pod_cidr, service_cidr=service_cidr)
    claim_ranges(pod_cidr)
    try:
        for what in reclaim_leftovers(net):
            if log:
                log(f"pod network: removed a dead run's {what}")
        net.setup(kube_proxy=kube_proxy)
    except BaseException:
        net.teardown()
        raise
    if log:
        log(
            f"pod network: {nodes} node namespaces {net.netns_name(0)}.., pods {pod_cidr}, "
            f"Services {service_cidr}, host {net.host_ip}"
        )
    return net


def load_for_kubeconfig(kubeconfig: Path) -> PodNetwork | None:
    """The pod network of the cluster whose kubeconfig is ``kubeconfig`` (same run folder)."""
    return PodNetwork.load(Path(kubeconfig).resolve().parent)
