"""Unit-level checks of the pod network's safety measures (e2e.cluster.podnet), no cluster:
the range check refuses CIDRs routed to a real interface, and teardown removes exactly what
setup made (by name), leaving a look-alike namespace and link of someone else alone.

The make/teardown test needs CAP_NET_ADMIN; it uses its own ranges (100.98.0.0/16 pods,
100.99.0.0/16 Services), so it runs beside a live local cluster on the default ones.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from e2e.cluster import podnet
from e2e.tests.conftest import in_ci

TEST_PODS, TEST_SERVICES = "100.98.0.0/16", "100.99.0.0/16"


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
    data = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip
    return {link["ifname"] for link in data}


def _routes() -> str:
    return subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip


def test_setup_refuses_a_routed_range_and_teardown_removes_exactly_what_it_made(
    tmp_path: Path,
) -> None:
    """Regression: cleanup by pattern removing another cluster's (or anyone's) namespaces, or
    leaving links, routes and nft tables behind after ``make cluster-down``."""
    _need_net_admin()
    # Someone else's look-alikes: a namespace with our prefix, a link that is not ours.
    decoy_ns, decoy_link = "casnet-zzzzz-n0", "cnzzzzzh0"
    subprocess.run(["ip", "netns", "add", decoy_ns], check=True)
    subprocess.run(["ip", "link", "add", decoy_link, "type", "veth", "peer", "name", "cnzzzzzp"],
                   check=True)  # fmt: skip
    for link in (decoy_link, "cnzzzzzp"):
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
        assert net.nft_table in subprocess.run(["nft", "list", "tables"], capture_output=True,
                                               text=True, check=True).stdout  # fmt: skip
        # Teardown from the recorded state (as `make cluster-down` does, in another process).
        removed = made.teardown()
        assert any(r.startswith("netns ") for r in removed), removed
        assert not {net.netns_name(0), net.netns_name(1), net.sink_netns} & _names("ip", "netns")
        assert not {net.host_link(0), net.host_link(1), net.service_link} & _links()
        assert _routes() == before_routes
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                                check=True).stdout  # fmt: skip
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
