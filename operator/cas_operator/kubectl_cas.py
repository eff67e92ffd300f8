"""`kubectl cas` (installed as the `kubectl-cas` plugin): a canary rollout's state and the
commands that steer it, without editing status or spec (GitOps keeps owning the spec).

    kubectl cas rollout status NAME [-n NAMESPACE]
    kubectl cas rollout promote|skip|abort|retry NAME [-n NAMESPACE]

A command sets the annotation `cas.dev/rollout-action` on the resource (what `kubectl annotate`
would do); the operator acts on it within one fleet tick (about 5 s) and removes it, and the
status and an Event say what it did. Data flow: the kubeconfig (KUBECONFIG, ~/.kube/config, or
in-cluster) -> `kube.Kube` (the operator's one client) -> GET or merge PATCH of the resource.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cas_operator.api import constants as c
from cas_operator.rollout.state import Action

COMMANDS = ("status", *(a.value for a in Action))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kubectl cas", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="group", required=True)
    rollout = sub.add_parser("rollout", help="a canary rollout's state, or steer it")
    rollout.add_argument("command", choices=COMMANDS)
    rollout.add_argument("name", help="the CodingAgentServing")
    rollout.add_argument("-n", "--namespace", help="default: the kubeconfig context's")
    return parser.parse_args(argv)


def context_namespace() -> str:
    """The current kubeconfig context's namespace, else `default`."""
    from kubernetes import config

    try:
        _, context = config.list_kube_config_contexts()  # type: ignore[no-untyped-call]
    except Exception:
        return "default"
    return str((context or {}).get("context", {}).get("namespace") or "default")


def describe(status: dict[str, Any]) -> str:
    """`status.rollout` as a few lines a person reads."""
    rollout = status.get("rollout") or {}
    if not rollout:
        return "no rollout recorded yet"
    traffic = rollout.get("traffic") or {}
    lines = [
        f"phase:    {rollout.get('phase')}",
        f"stable:   {rollout.get('stableRevision')}",
        f"canary:   {rollout.get('canaryRevision') or '-'}",
    ]
    if rollout.get("canaryRevision"):
        lines.append(f"step:     {int(rollout.get('step', 0)) + 1}")
        lines.append(
            f"weight:   {traffic.get('canaryWeight', 0)}% by {traffic.get('mode')}"
            + (f" ({traffic['precision']})" if traffic.get("precision") else "")
        )
    if rollout.get("abortedRevision"):
        lines.append(f"aborted:  {rollout['abortedRevision']}")
    if rollout.get("reason"):
        lines.append(f"reason:   {rollout['reason']}")
    analysis = rollout.get("analysis") or {}
    if analysis:
        lines.append(
            f"analysis: {analysis.get('verdict')} over {analysis.get('windowSeconds')}s, "
            f"{analysis.get('canaryRequests')} canary requests"
        )
        for gate in analysis.get("gates") or []:
            lines.append(
                f"  {gate['name']:<20} {gate['verdict']:<13} canary {gate['canary']}, "
                f"limit {gate['limit']}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from cas_operator.kube import Kube

    kube = Kube()
    namespace = args.namespace or context_namespace()
    found = kube.get(c.KIND, namespace, args.name)
    if found is None:
        print(f"{c.KIND} {namespace}/{args.name} not found", file=sys.stderr)
        return 1
    if args.command == "status":
        print(describe(found.get("status") or {}))
        return 0
    patch = {"metadata": {"annotations": {c.ANNOTATION_ROLLOUT_ACTION: args.command}}}
    kube.patch(c.KIND, namespace, args.name, patch)
    print(
        f"{args.command} asked of {namespace}/{args.name}: the operator acts within a few seconds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
