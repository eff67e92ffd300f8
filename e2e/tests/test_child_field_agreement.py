"""Fields copied into child objects are accepted exactly when the child's own API accepts them
(issue 41, item 12), judged by the real API server.

Regression: `gateway.hostnames: ["-bad-host-"]` and `podMetadata.labels: {"bad key!": ...}`
were accepted at apply and failed only when the operator applied the HTTPRoute or the pods'
workloads; a `security.networkPolicy` CIDR was checked only by the operator, after apply. For
each input below, three verdicts must agree: the API server on a CodingAgentServing carrying it
(our CRD's schema and CEL rules), the API server on the child kind that receives it (the
Gateway API v1.4.0 HTTPRoute CRD the stack installs; a ConfigMap's metadata, checked as every
object's, a pod's included; a NetworkPolicy's ipBlock), and the operator's own validation
(`desired.validate`, for resources stored before the CRD said so). All by server-side dry run:
nothing is stored.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from cas_operator.api import constants as c
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]
Spec = dict[str, Any]

LONG_PREFIX = ".".join(["a" * 63] * 4)[:253]  # a DNS subdomain of exactly 253 characters
HOSTNAMES = [
    "code.example", "*.example.com", "a-1.b", "x", "-bad-host-", "Code.Example", "a.*.example",
    "*", "*.", "example.com.", "a..b", "host_name.example", "ünicode.example", "10.0.0.1",
    "a" * 64 + ".example", ("a" * 62 + ".") * 4 + "a", ("a" * 62 + ".") * 4 + "ab",
]  # fmt: skip
LABELS = [
    ("team", "a"), ("team", ""), ("example.com/Team_1.x", "A-b_c.9"), ("bad key!", "v"),
    ("/team", "v"), ("a/b/c", "v"), ("Example.com/team", "v"), ("x" * 63, "v"), ("x" * 64, "v"),
    (LONG_PREFIX + "/" + "n" * 63, "v"), (LONG_PREFIX + "a/b", "v"), ("_team", "v"),
    ("team.", "v"), ("é", "v"), ("team", "bad value!"), ("team", "v" * 63), ("team", "v" * 64),
    ("team", "-v"), ("team", "é"),
]  # fmt: skip
ANNOTATIONS = [
    {"Example.COM/Foo": "any text: é, spaces"}, {"bad key!": "v"}, {"a/b/c": "v"},
    {"x" * 64: "v"}, {"-a": "v"}, {f"k{i}": "x" * 4000 for i in range(64)},
    {f"k{i}": "x" * 5000 for i in range(60)},
]  # fmt: skip
CIDRS = [
    "10.0.0.0/8", "10.0.0.1/8", "10.0.0.0/08", "010.0.0.0/8", "300.0.0.0/8", "10.0.0.0/33",
    "0.0.0.0/0", "1.2.3.4/32", "fd00::/8", "FD00::/8", "fd00::1/128", "::/0",
    "::ffff:10.0.0.0/104",
]  # fmt: skip


def server_accepts(cluster: Any, namespace: str, objects: list[dict[str, Any]]) -> set[str]:
    """Names of the objects the API server would create (server-side dry run, one request
    each, in one kubectl call)."""
    result = subprocess.run(
        [str(cluster.kubectl_path), "--kubeconfig", str(cluster.kubeconfig), "create", "-n",
         namespace, "--dry-run=server", "-o", "name", "-f", "-"],
        input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    accepted = {line.rsplit("/", 1)[-1] for line in result.stdout.split()}
    refused = len(objects) - len(accepted)
    assert result.stderr.count("\n") >= refused, result.stderr  # every refusal says why
    return accepted


def fleet(name: str, patch: Spec) -> dict[str, Any]:
    return {
        "apiVersion": f"{c.GROUP}/{c.VERSION}",
        "kind": c.KIND,
        "metadata": {"name": name},
        "spec": {"model": {"name": "glm-5"}, **patch},
    }


def operator_accepts(patch: Spec) -> bool:
    try:
        plan_raw("demo", "ns", {"model": {"name": "glm-5"}, **patch})
    except InvalidSpec:
        return False
    return True


def verdicts(
    cluster: Any, namespace: str, patches: list[Spec], children: list[dict[str, Any]]
) -> tuple[list[bool], list[bool], list[bool]]:
    """(our CRD, the child's API, the operator), per input."""
    names = [f"c{i}" for i in range(len(patches))]
    ours = server_accepts(
        cluster, namespace, [fleet(n, p) for n, p in zip(names, patches, strict=True)]
    )
    for name, child in zip(names, children, strict=True):
        child.setdefault("metadata", {})["name"] = name
    theirs = server_accepts(cluster, namespace, children)
    return (
        [n in ours for n in names],
        [n in theirs for n in names],
        [operator_accepts(p) for p in patches],
    )


def disagreements(inputs: list[Any], found: tuple[list[bool], list[bool], list[bool]]) -> list[str]:
    return [
        f"{str(x)[:80]}: our CRD {'accepts' if a else 'refuses'}, the child's API "
        f"{'accepts' if b else 'refuses'}, the operator {'accepts' if o else 'refuses'}"
        for x, a, b, o in zip(inputs, *found, strict=True)
        if not a == b == o
    ]


def test_gateway_hostnames_as_the_httproute_crd(cluster: Any, crds: None, namespace: str) -> None:
    patches = [{"gateway": {"parentRefs": [{"name": "gw"}], "hostnames": [h]}} for h in HOSTNAMES]
    routes = [
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "spec": {"hostnames": [h]},
        }
        for h in HOSTNAMES
    ]
    found = verdicts(cluster, namespace, patches, routes)
    assert disagreements(HOSTNAMES, found) == []
    assert found[0][HOSTNAMES.index("-bad-host-")] is False


def test_pod_labels_as_kubernetes_metadata(cluster: Any, crds: None, namespace: str) -> None:
    patches = [{"podMetadata": {"labels": {k: v}}} for k, v in LABELS]
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"labels": {k: v}}} for k, v in LABELS
    ]
    found = verdicts(cluster, namespace, patches, objects)
    assert disagreements(LABELS, found) == []
    assert found[0][LABELS.index(("bad key!", "v"))] is False


def test_pod_annotations_as_kubernetes_metadata(cluster: Any, crds: None, namespace: str) -> None:
    patches = [{"podMetadata": {"annotations": a}} for a in ANNOTATIONS]
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"annotations": a}}
        for a in ANNOTATIONS
    ]
    found = verdicts(cluster, namespace, patches, objects)
    assert disagreements(ANNOTATIONS, found) == []
    assert found[0][ANNOTATIONS.index({"bad key!": "v"})] is False


def test_network_policy_cidrs_as_an_ipblock(cluster: Any, crds: None, namespace: str) -> None:
    patches = [{"security": {"networkPolicy": {"clientsFrom": [{"cidr": x}]}}} for x in CIDRS]
    policies = [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": x}}]}]}}
        for x in CIDRS
    ]  # fmt: skip
    found = verdicts(cluster, namespace, patches, policies)
    assert disagreements(CIDRS, found) == []
    assert found[0][CIDRS.index("300.0.0.0/8")] is False
