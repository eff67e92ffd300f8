"""Fields that reach a child object are checked as that child's API checks them (issue 41,
item 12): `gateway.hostnames` as the Gateway API's HTTPRoute CRD does, `podMetadata` keys
and values as Kubernetes checks a pod's metadata, and the CIDRs of `security.networkPolicy`
as the CRD's `isCIDR` (Go's netip.ParsePrefix) does.

Regression: `-bad-host-` and a label key `bad key!` were accepted and failed only when the
operator applied the HTTPRoute or the pods' workloads (every pass failing, the error far from
the field); a CIDR `10.0.0.0/08` passed the operator's own check. Here: the operator's
validation (a resource stored before the CRD said so) refuses each with InvalidSpec naming the
field, and accepts the edge cases Kubernetes accepts. The API server's verdict on the same
inputs (the CRD's schema and CEL rules, against the real HTTPRoute CRD and pod metadata
checks) is e2e/tests/test_child_field_agreement.py and the SCHEMA_REJECTIONS of
e2e/tests/test_operator_core.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.api.crdgen import build_crd
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec

GATEWAY = {"parentRefs": [{"name": "gw"}]}
LONG_PREFIX = ".".join(["a" * 63] * 4)[:253]  # a DNS subdomain of exactly 253 characters


def refusal(patch: dict[str, Any]) -> str:
    """The operator's InvalidSpec message for the minimal spec plus `patch`; '' if accepted."""
    try:
        plan_raw("demo", "ns", {"model": {"name": "glm-5"}, **patch})
    except InvalidSpec as err:
        return str(err)
    return ""


def peer(cidr: str) -> dict[str, Any]:
    return {"security": {"networkPolicy": {"clientsFrom": [{"cidr": cidr}]}}}


REFUSED = [
    ({"gateway": {**GATEWAY, "hostnames": ["-bad-host-"]}}, "gateway.hostnames.0"),
    ({"gateway": {**GATEWAY, "hostnames": ["Code.Example"]}}, "gateway.hostnames.0"),
    ({"gateway": {**GATEWAY, "hostnames": ["a.*.example"]}}, "gateway.hostnames.0"),
    ({"gateway": {**GATEWAY, "hostnames": [""]}}, "gateway.hostnames.0"),
    ({"podMetadata": {"labels": {"bad key!": "v"}}}, "podMetadata.labels['bad key!']"),
    ({"podMetadata": {"labels": {"/team": "v"}}}, "podMetadata.labels['/team']"),
    ({"podMetadata": {"labels": {"a/b/c": "v"}}}, "podMetadata.labels['a/b/c']"),
    ({"podMetadata": {"labels": {"Example.com/team": "v"}}}, "podMetadata.labels"),
    ({"podMetadata": {"labels": {"x" * 64: "v"}}}, "podMetadata.labels"),
    ({"podMetadata": {"labels": {LONG_PREFIX + "a/b": "v"}}}, "podMetadata.labels"),
    ({"podMetadata": {"labels": {"team": "bad value!"}}}, "podMetadata.labels.team"),
    ({"podMetadata": {"labels": {"team": "v" * 64}}}, "podMetadata.labels.team"),
    ({"podMetadata": {"labels": {"team": "-v"}}}, "podMetadata.labels.team"),
    ({"podMetadata": {"annotations": {"bad key!": "v"}}}, "podMetadata.annotations['bad key!']"),
    (
        {"podMetadata": {"annotations": {f"k{i}": "x" * 5000 for i in range(60)}}},
        "podMetadata.annotations: 300",
    ),
    (peer("300.0.0.0/8"), "clientsFrom[0].cidr"),
    (peer("10.0.0.0/08"), "clientsFrom[0].cidr"),
    (peer("10.0.0.0/33"), "clientsFrom[0].cidr"),
    (peer("010.0.0.0/8"), "clientsFrom[0].cidr"),
    (peer("::ffff:10.0.0.0/104"), "clientsFrom[0].cidr"),
    (peer("10.0.0.1/8"), "clientsFrom[0].cidr"),  # bits beyond the prefix
]

ACCEPTED = [
    {"gateway": {**GATEWAY, "hostnames": ["code.example", "*.example.com", "a-1.b"]}},
    {"podMetadata": {"labels": {"team": "", "example.com/Team_1.x": "A-b_c.9"}}},
    {"podMetadata": {"labels": {LONG_PREFIX + "/" + "n" * 63: "v" * 63}}},
    {"podMetadata": {"annotations": {"Example.COM/Foo": "any text: é, spaces, \n"}}},
    {"podMetadata": {"annotations": {f"k{i}": "x" * 4000 for i in range(64)}}},
    peer("10.1.0.0/16"),
    peer("0.0.0.0/0"),
    peer("10.0.0.1/32"),
    peer("fd00::/8"),
]


@pytest.mark.parametrize(("patch", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_the_operator_refuses_naming_the_field(patch: dict[str, Any], field: str) -> None:
    message = refusal(patch)
    assert field in message, message


@pytest.mark.parametrize("patch", ACCEPTED)
def test_what_kubernetes_accepts_is_accepted(patch: dict[str, Any]) -> None:
    assert refusal(patch) == ""


def test_the_crd_checks_each_field() -> None:
    """The schema the API server runs (its verdict: the e2e tests named above)."""
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    host = props["gateway"]["properties"]["hostnames"]["items"]
    # Gateway API v1.4.0, apis/v1/shared_types.go:616-618
    assert host == {
        "minLength": 1,
        "maxLength": 253,
        "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        "type": "string",
    }
    meta = props["podMetadata"]
    assert {r["fieldPath"] for r in meta["x-kubernetes-validations"]} == {
        ".labels",
        ".annotations",
    }
    assert meta["properties"]["labels"]["additionalProperties"]["maxLength"] == 63
    peer_rules = props["security"]["properties"]["networkPolicy"]["properties"]["clientsFrom"]
    rules = peer_rules["items"]["x-kubernetes-validations"]
    assert any("isCIDR(self.cidr)" in r["rule"] and r["fieldPath"] == ".cidr" for r in rules)
