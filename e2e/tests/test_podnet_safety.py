"""Unit-level checks of the pod network's safety measures (e2e.cluster.podnet), no cluster:
the range check refuses CIDRs routed to a real interface, teardown removes exactly what setup
made (by name), leaving a look-alike namespace and link of someone else alone, and a run killed
before its teardown leaves nothing that stops the next one (while one that runs is never touched).

The make/teardown test needs CAP_NET_ADMIN; it uses its own ranges (100.98.0.0/16 pods,
100.99.0.0/16 Services), so it runs beside a live local cluster on the default ones.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster import podnet
from e2e.tests.conftest import in_ci

TEST_PODS, TEST_SERVICES = "100.98.0.0/16", "100.99.0.0/16"
# The tests that claim those ranges run on one worker, one after another: two at once on two
# xdist workers refused each other ("another process ... owns a pod network on 100.98.0.0/16").
TEST_RANGES = pytest.mark.xdist_group("podnet-test-ranges")


def test_route_check_refuses_ranges_routed_to_real_interfaces() -> None:
    """Regression: pod/Service addresses routed (more specifically than our blackhole) to eth0
    would leave the machine; such a route must make start refuse, naming it."""
    ours = "cnabcde"
    routes = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
        {"dst": "100.0.0.0/8", "dev": "eth0"},  # less specific: our blackhole wins
        {"dst": "100.96.0.0/16", "type": "blackhole"},
        {"dst": "100.96.1.0/24", "dev": "cnabcdeh0"},  # ours
        {"dst": "100.96.7.0/24", "dev": "eth0"},  # conflict (inside the pod range)
        {"dst": "100.97.0.5", "dev": "wg0", "table": "100"},  # conflict (Service range, a /32)
        {"dst": "100.97.0.0/16", "type": "unreachable"},
        {"dst": "10.0.0.0/8", "dev": "eth0"},  # unrelated
    ]
    problems = podnet.route_conflicts(routes, [podnet.POD_CIDR, podnet.SERVICE_CIDR], ours)
    assert len(problems) == 2, problems
    assert "100.96.7.0/24 dev eth0" in problems[0]
    assert "100.97.0.5 dev wg0 (table 100)" in problems[1]
    addrs = [
        {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "100.96.3.4"}]},
        {"ifname": "cnabcdeh0", "addr_info": [{"family": "inet", "local": "100.96.0.1"}]},
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1"}]},
    ]
    found = podnet.address_conflicts(addrs, [podnet.POD_CIDR, podnet.SERVICE_CIDR], ours)
    assert found == ["100.96.3.4 on eth0"]


def test_node_cidrs_are_distinct_inside_the_pod_range_and_skip_the_host_side() -> None:
    import ipaddress

    cidrs = [ipaddress.IPv4Network(podnet.node_cidr(i, "netns")) for i in range(20)]
    pods = ipaddress.IPv4Network(podnet.POD_CIDR)
    assert all(c.subnet_of(pods) for c in cidrs)
    assert len(set(cidrs)) == 20
    assert ipaddress.IPv4Address(podnet.HOST_IP) not in cidrs[0]
    assert podnet.node_cidr(3, "loopback") == "127.10.3.0/24"


def make_test_network(run_dir: Path) -> podnet.PodNetwork:
    return podnet.make(run_dir, 2, pod_cidr=TEST_PODS, service_cidr=TEST_SERVICES, kube_proxy=False)


def _need_net_admin() -> None:
    reason = podnet.netns_unavailable_reason()
    if reason is not None:
        if in_ci() and reason != "CAS_POD_NETWORK=loopback":
            pytest.fail(f"CI is set, so not skipping: {reason}")
        pytest.skip(f"needs network namespaces: {reason}")


def _names(*argv: str) -> set[str]:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {line.split()[0].split("@")[0].rstrip(":") for line in out.splitlines() if line}


def _links() -> set[str]:
    data = json.loads(
        subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True).stdout
    )
    return {link["ifname"] for link in data}


def _routes() -> str:
    return subprocess.run(
        ["ip", "route", "show", "table", "all"], capture_output=True, text=True, check=True
    ).stdout


def _without_ipv6(link: str) -> None:
    """Keep the kernel from adding IPv6 routes of its own to a decoy link.

    Once a veth pair's carrier is up, the kernel adds the link's IPv6 routes (``fe80::/64`` and
    the ``multicast ff00::/8`` one in table local) from its link-watch work, up to a second later.
    Those routes are nobody's leftovers, but they raced the route snapshots below: with
    ``addrgenmode none`` only the link-local one was gone, and CI once saw the multicast routes
    appear between snapshot and comparison. With IPv6 off on the link the kernel adds none.
    """
    knob = Path("/proc/sys/net/ipv6/conf") / link / "disable_ipv6"
    if knob.exists():
        knob.write_text("1\n")


@TEST_RANGES
def test_setup_refuses_a_routed_range_and_teardown_removes_exactly_what_it_made(
    tmp_path: Path,
) -> None:
    """Regression: cleanup by pattern removing another cluster's (or anyone's) namespaces, or
    leaving links, routes and nft tables behind after ``make cluster-down``."""
    _need_net_admin()
    # Someone else's look-alikes: a namespace with our prefix, a link that is not ours.
    decoy_ns, decoy_link = "casnet-zzzzz-n0", "cnzzzzzh0"
    subprocess.run(["ip", "netns", "add", decoy_ns], check=True)
    subprocess.run(
        ["ip", "link", "add", decoy_link, "type", "veth", "peer", "name", "cnzzzzzp"], check=True
    )
    for link in (decoy_link, "cnzzzzzp"):
        _without_ipv6(link)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    before_routes = _routes()
    try:
        # A route for a part of the test Service range on a link not ours: refused, nothing made.
        subprocess.run(["ip", "route", "add", "100.99.5.0/24", "dev", decoy_link], check=True)
        with pytest.raises(podnet.PodNetError, match=r"100\.99\.5\.0/24 dev cnzzzzzh0"):
            podnet.make(
                tmp_path, 2, pod_cidr=TEST_PODS, service_cidr=TEST_SERVICES, kube_proxy=False
            )
        subprocess.run(["ip", "route", "del", "100.99.5.0/24", "dev", decoy_link], check=True)
        assert _routes() == before_routes

        net = podnet.make(
            tmp_path, 2, pod_cidr=TEST_PODS, service_cidr=TEST_SERVICES, kube_proxy=False
        )
        made = podnet.PodNetwork.load(tmp_path)
        assert made is not None and made.made.netns == net.made.netns
        assert {net.netns_name(0), net.netns_name(1), net.sink_netns} <= _names("ip", "netns")
        assert {net.host_link(0), net.host_link(1), net.service_link} <= _links()
        assert f"blackhole {TEST_PODS}" in _routes() and f"blackhole {TEST_SERVICES}" in _routes()
        assert (
            net.nft_table
            in subprocess.run(
                ["nft", "list", "tables"], capture_output=True, text=True, check=True
            ).stdout
        )
        # Teardown from the recorded state (as `make cluster-down` does, in another process).
        removed = made.teardown()
        assert any(r.startswith("netns ") for r in removed), removed
        assert not {net.netns_name(0), net.netns_name(1), net.sink_netns} & _names("ip", "netns")
        assert not {net.host_link(0), net.host_link(1), net.service_link} & _links()
        assert _routes() == before_routes
        tables = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, check=True
        ).stdout
        assert net.nft_table not in tables
        assert decoy_ns in _names("ip", "netns") and decoy_link in _links()  # not ours: kept
        assert made.teardown() == []  # idempotent
    finally:
        subprocess.run(["ip", "route", "del", "100.99.5.0/24"], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", decoy_link], check=False)
        subprocess.run(["ip", "netns", "del", decoy_ns], check=False)
        leftover = podnet.PodNetwork.load(tmp_path)
        if leftover is not None:
            leftover.teardown()


def test_loopback_fallback_makes_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: without network namespaces the stack must still start (loopback pod CIDRs)
    and say why Services will have no endpoints, not fail or half-make a network."""
    monkeypatch.setenv("CAS_POD_NETWORK", "loopback")
    said: list[str] = []
    net = podnet.make(tmp_path, 3, log=said.append)
    assert not net.enabled and net.reason == "CAS_POD_NETWORK=loopback"
    assert net.node_cidr(2) == "127.10.2.0/24" and net.api_host == "127.0.0.1"
    assert net.made == podnet.Made() and net.netns_for_ip("127.10.2.5") is None
    assert said and "loopback mode" in said[0] and "no endpoints" in said[0]
    loaded = podnet.PodNetwork.load(tmp_path)
    assert loaded is not None and loaded.teardown() == []


def _dead_run_state(host: str = "100.96.0.1") -> podnet.KernelState:
    """Kernel state with a dead run ``ab12c`` on the default ranges, beside look-alikes."""
    return podnet.KernelState(
        routes=[
            {"dst": "100.96.0.0/16", "type": "blackhole", "metric": 4242},
            {"dst": "100.97.0.0/16", "type": "blackhole", "metric": 4242},
            {"dst": "100.98.0.0/16", "type": "blackhole", "metric": 4242},  # other ranges
            {"dst": "100.96.1.0/24", "dev": "cnab12ch0"},
            {"dst": "100.97.0.0/16", "dev": "cnab12csvc"},
            {"dst": "100.96.9.0/24", "dev": "cnzzzzzh0"},  # not our name: never removed
            {"dst": "100.98.1.0/24", "dev": "cn00001h0"},  # ours, but other ranges
        ],
        addrs=[
            {"ifname": "cnab12ch0", "addr_info": [{"family": "inet", "local": host}]},
            {"ifname": "cnab12ch1", "addr_info": [{"family": "inet", "local": host}]},
            {"ifname": "cnab12csvc", "addr_info": [{"family": "inet", "local": host}]},
            {"ifname": "cnzzzzzh0", "addr_info": []},
            {"ifname": "cn00001h0", "addr_info": [{"family": "inet", "local": "100.98.0.1"}]},
            {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.7"}]},
        ],
        netns=[
            "casnet-ab12c-n0",
            "casnet-ab12c-n1",
            "casnet-ab12c-svc",
            "casnet-zzzzz-n0",
            "casnet-00001-n0",
        ],
        tables={
            "casnet_ab12c": "table ip casnet_ab12c { ... ip daddr { 100.96.0.0/15 } drop }",
            "casnet_00001": "table ip casnet_00001 { ... ip daddr { 100.98.0.0/15 } drop }",
        },
        kube_proxy_table="set nodeport-ips { elements = { 100.96.0.1 } }",
        listening=[("127.0.0.1", 8080), ("0.0.0.0", 22), ("100.98.0.1", 6443)],
    )


def test_leftovers_of_a_dead_run_are_exactly_its_named_pieces_on_these_ranges() -> None:
    """Regression: a run killed before teardown (here: another checkout's, whose record no
    later run can read) left routes, links and kube-proxy's tables, so every later start on the
    machine refused the taken ranges until someone removed them by hand."""
    ranges = (podnet.POD_CIDR, podnet.SERVICE_CIDR)
    found = podnet.find_leftovers(_dead_run_state(), ranges, podnet.HOST_IP)
    assert found.live == ()
    assert found.links == ("cnab12ch0", "cnab12ch1", "cnab12csvc")
    assert found.netns == ("casnet-ab12c-n0", "casnet-ab12c-n1", "casnet-ab12c-svc")
    assert found.nft_tables == ("casnet_ab12c",)
    assert found.blackholes == ("100.96.0.0/16", "100.97.0.0/16")
    assert found.kube_proxy and found
    # kube-proxy's tables are ours only when they name our host IP (not 100.96.0.10).
    other = podnet.find_leftovers(
        dataclasses.replace(_dead_run_state(), kube_proxy_table="{ 100.96.0.10, 10.0.0.1 }"),
        ranges,
        podnet.HOST_IP,
    )
    assert not other.kube_proxy and other.links == found.links


def test_a_cluster_that_listens_on_the_host_ip_has_no_leftovers() -> None:
    """Regression guard: reclaiming must never take the network of a cluster that runs (its
    API server listens on the host IP), even when the process that made it is gone."""
    state = _dead_run_state(host="100.98.0.1")
    found = podnet.find_leftovers(state, (TEST_PODS, TEST_SERVICES), "100.98.0.1")
    assert found.live == (6443,) and not found
    sample = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 01006064:1937 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0\n"
    )
    assert podnet.tcp_listeners(sample) == [("100.96.0.1", 6455)]


@TEST_RANGES
def test_a_second_claim_on_the_same_ranges_is_refused_until_released() -> None:
    podnet.claim_ranges(TEST_PODS)
    try:
        with pytest.raises(podnet.PodNetError, match="making or owns a pod network"):
            podnet.claim_ranges(TEST_PODS)
    finally:
        podnet.release_ranges(TEST_PODS)
    podnet.claim_ranges(TEST_PODS)
    podnet.release_ranges(TEST_PODS)


_OTHER_RUN = """
import socket, sys, time
from pathlib import Path
from e2e.cluster import podnet
net = podnet.make(Path(sys.argv[1]), 2, pod_cidr=sys.argv[2], service_cidr=sys.argv[3],
                  kube_proxy=False)
podnet.release_ranges(net.pod_cidr)  # as `make cluster-up` exits, leaving its daemons
server = socket.create_server((net.host_ip, 0))  # its API server
print(net.cid, server.getsockname()[1], flush=True)
time.sleep(300)
"""


@TEST_RANGES
def test_a_killed_run_is_reclaimed_by_the_next_start_and_a_live_one_refuses_it(
    tmp_path: Path,
) -> None:
    """Regression: after a run was killed (its record in a checkout since deleted), the next
    `make test` failed every e2e test with 'refusing to make the pod network'. The next start
    must remove exactly the dead run's pieces and start; while that run lives it must refuse."""
    _need_net_admin()
    before_routes = _routes()
    for run in ("other", "ours"):
        (tmp_path / run).mkdir()
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_RUN, str(tmp_path / "other"), TEST_PODS, TEST_SERVICES],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(podnet.__file__).parents[2],
    )
    ours: podnet.PodNetwork | None = None
    try:
        assert other.stdout is not None
        cid, port = other.stdout.readline().split()
        with pytest.raises(podnet.PodNetError, match=rf"listening on 100\.98\.0\.1:{port}"):
            podnet.make(
                tmp_path / "ours",
                2,
                pod_cidr=TEST_PODS,
                service_cidr=TEST_SERVICES,
                kube_proxy=False,
            )
        assert f"cn{cid}h0" in _links()  # the live run's network is untouched
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=30)
        said: list[str] = []
        ours = podnet.make(
            tmp_path / "ours",
            2,
            log=said.append,
            pod_cidr=TEST_PODS,
            service_cidr=TEST_SERVICES,
            kube_proxy=False,
        )
        assert any(f"dead run's link cn{cid}h0" in line for line in said), said
        assert any(f"dead run's nft table ip casnet_{cid}" in line for line in said), said
        assert not {n for n in _names("ip", "netns") if n.startswith(f"casnet-{cid}-")}
        assert not {n for n in _links() if n.startswith(f"cn{cid}")}
        assert {ours.host_link(0), ours.host_link(1), ours.service_link} <= _links()
        ours.teardown()
        ours = None
        assert _routes() == before_routes
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(timeout=30)
        if ours is not None:
            ours.teardown()
        dead = podnet.PodNetwork.load(tmp_path / "other")
        if dead is not None:
            dead.teardown()
