"""`cas-operator render -f FILE`: every child manifest the operator would apply, no cluster.

Like `helm template`: users (and tests) review what a change does before GitOps applies it.
Data flow: the resource file (YAML, one or more documents; each CodingAgentServing is
rendered) -> `desired.build.plan_raw` (the same parse, validation and plan as the reconcile,
with no measured load: Auto mode shows the planner's first answer) -> `desired.resources.
build_all` and, with `spec.gateway`, the traffic Services and HTTPRoute -> YAML on stdout. An
invalid spec prints each bad field on stderr and exits 2. The owner uid of the children is a
placeholder (the API server assigns the real one). The keys Secret is not rendered: its keys
are random, made once by the operator (or yours, named in `spec.security.keysSecret`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

import yaml

from cas_operator.api import constants as c
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec, Plan
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.traffic import build_traffic
from cas_operator.desired.traffic import single_revision
from cas_operator.types import Manifest

API_VERSION = f"{c.GROUP}/{c.VERSION}"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
DEFAULT_NAMESPACE = "default"


def resources_in(documents: Iterable[Any]) -> list[Manifest]:
    """The CodingAgentServing documents of a YAML stream (others are skipped)."""
    return [
        d
        for d in documents
        if isinstance(d, dict) and d.get("kind") == c.KIND and d.get("apiVersion") == API_VERSION
    ]


def plan_of(resource: Manifest, namespace: str | None = None) -> Plan:
    meta = resource.get("metadata") or {}
    ns = namespace or meta.get("namespace") or DEFAULT_NAMESPACE
    return plan_raw(str(meta.get("name", "")), str(ns), dict(resource.get("spec") or {}))


def render(resource: Manifest, namespace: str | None = None) -> list[Manifest]:
    """Every child of one resource, in apply order; raises InvalidSpec."""
    plan = plan_of(resource, namespace)
    owner = Owner(plan.name, plan.namespace, PLACEHOLDER_UID)
    return build_all(owner, plan) + build_traffic(owner, plan, single_revision(plan, None))


def main(path: str, *, namespace: str | None, revision_only: bool, out: TextIO = sys.stdout) -> int:
    """The `render` subcommand; returns the exit code."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    found = resources_in(yaml.safe_load_all(text))
    if not found:
        print(f"{path}: no {API_VERSION} {c.KIND} in this file", file=sys.stderr)
        return 2
    code = 0
    for index, resource in enumerate(found):
        name = (resource.get("metadata") or {}).get("name", "?")
        try:
            if revision_only:
                print(f"{name}\t{plan_of(resource, namespace).revision}", file=out)
            else:
                children = render(resource, namespace)
                out.write(
                    ("---\n" if index else "") + yaml.safe_dump_all(children, sort_keys=False)
                )
        except InvalidSpec as exc:
            for error in exc.errors:
                print(f"{name}: {error}", file=sys.stderr)
            code = 2
    return code
