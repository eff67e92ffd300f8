"""A fleet on the local stack to replay through, one per routing policy, and what its engines
counted.

Data flow: `replay_fleet` (the minimal sample with `prefills` prefill and `decodes` decode
instances, the router implementation and policy asked for, admission off: a routing
measurement, not a capacity one) -> `fleet_up` (a `LiveStack` for the namespace: pod runner,
operator; the sims hold `capacity` tokens of prefix cache each) -> `wait_serving` (the entry
Service answers and every router pod lists every prefill and decode: a router that has seen
one prefill so far would route the first sessions all to it) -> the replay
(`bench.replay.client`) through the entry Service's ClusterIP -> `engine_tokens` before and
after: the prefill sims' own `sglang:prompt_tokens` and `sglang:cached_tokens`, the engines'
side of the achieved hit rate.

Used by ``python -m bench.replay --local`` (one namespace per policy, made and deleted here)
and by e2e/tests/test_replay.py (its own namespace and LiveStack fixture).
"""

from __future__ import annotations

import contextlib
import copy
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from cas_operator.api import constants as c
from e2e.fleet.fleetview import (
    Kubectl,
    apply_crds,
    control_key,
    entry_url_when_serving,
    role_pods,
    router_workers,
)
from e2e.fleet.livestack import LiveStack, probed_by_runner
from e2e.paths import REPO_ROOT
from e2e.waits import wait_for

NAME = "replay"
MODEL = "Qwen/Qwen3-Coder-30B-A3B-Instruct"  # the minimal sample's; smg serves only this name
SIM_KV_CAPACITY = 2_000_000  # the sim engine's default KV capacity per instance (tokens, unscaled)


@dataclass(frozen=True)
class Policy:
    """A router implementation and its policy (None: the operator's default for it)."""

    implementation: str
    policy: str | None = None

    @property
    def label(self) -> str:
        return f"{self.implementation}/{self.policy or 'default'}"

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``smg/consistent_hashing``, ``sglang-router/manual``, ``smg`` (its default)."""
        implementation, _, policy = text.partition("/")
        if implementation not in ("sglang-router", "smg"):
            raise ValueError(f"{text!r}: the implementation is sglang-router or smg")
        return cls(implementation, policy or None)


def replay_fleet(policy: Policy, prefills: int = 2, decodes: int = 1) -> dict[str, Any]:
    """The CodingAgentServing to replay through (module doc), readiness left to the runner."""
    cas: dict[str, Any] = yaml.safe_load((REPO_ROOT / "config/samples/minimal.yaml").read_text())
    cas["metadata"]["name"] = NAME
    cas["spec"]["model"] = {"name": MODEL}
    cas["spec"]["prefill"] = {"replicas": prefills}
    cas["spec"]["decode"] = {"replicas": decodes}
    router: dict[str, Any] = {"implementation": policy.implementation}
    if policy.policy:
        router["policy"] = policy.policy
    router["admission"] = {"mode": "Off"}
    cas["spec"]["router"] = router
    return probed_by_runner(copy.deepcopy(cas))


def sim_args(capacity_tokens: int, speedup: float) -> list[str]:
    """The sims' arguments: `capacity_tokens` of prefix cache (and decode KV) each."""
    return ["--sim-speedup", str(speedup), "--sim-kv-capacity", str(capacity_tokens),
            "--log-level", "warning"]  # fmt: skip


def _routers_list_all(kubectl: Kubectl, namespace: str, prefills: int, decodes: int) -> bool:
    key = control_key(kubectl, namespace)
    routers = [p for p in role_pods(kubectl, namespace, c.ROLE_ROUTER, NAME)
               if (p.get("status") or {}).get("podIP")]  # fmt: skip
    if not key or not routers:
        return False
    want = prefills + decodes
    return all(
        len(router_workers(f"http://{p['status']['podIP']}:{c.ROUTER_PORT}", key)) == want
        for p in routers
    )


def wait_serving(
    kubectl: Kubectl, namespace: str, prefills: int, decodes: int, timeout_s: float = 240
) -> str:
    """The entry Service's URL once it answers and every router lists every instance."""

    def entry() -> str | None:
        if not kubectl("get", "service", NAME, "-n", namespace, "-o", "name", check=False):
            return None  # not made yet
        return entry_url_when_serving(kubectl, namespace, NAME)

    url: str = wait_for("the entry Service", entry, timeout_s)
    wait_for(
        f"every router listing {prefills} prefills and {decodes} decodes",
        lambda: _routers_list_all(kubectl, namespace, prefills, decodes),
        timeout_s,
    )
    return url


def _metric(text: str, name: str) -> float:
    heads = (f"{name}_total{{", f"{name}_total ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(heads))  # fmt: skip


def engine_tokens(kubectl: Kubectl, namespace: str) -> tuple[float, float]:
    """(prompt tokens, cached tokens) the prefill sims have counted so far, summed."""
    prompt = cached = 0.0
    for pod in role_pods(kubectl, namespace, c.ROLE_PREFILL, NAME):
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        with urllib.request.urlopen(f"http://{ip}:{c.ENGINE_PORT}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        prompt += _metric(text, "sglang:prompt_tokens")
        cached += _metric(text, "sglang:cached_tokens")
    return prompt, cached


@contextlib.contextmanager
def fleet_up(
    stack: LiveStack,
    kubectl: Kubectl,
    manifest: dict[str, Any],
    log: Callable[[str], None] = print,
) -> Iterator[None]:
    """Start `stack` (no Prometheus: the operator scrapes the pods), apply this tree's CRDs
    (a cluster shared with other checkouts may hold another's) and `manifest`; the stack is
    closed however the block ends."""
    try:
        stack.start(use_prometheus=False, log=log)
        apply_crds(kubectl)
        kubectl("apply", "-n", stack.namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
        yield
    finally:
        stack.close(log=log)


def engine_hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Cached over prompt tokens the prefill engines counted between two readings."""
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return cached / prompt if prompt > 0 else None


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)
