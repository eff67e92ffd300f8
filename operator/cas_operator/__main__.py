"""`python -m cas_operator` / `cas-operator`: run the operator against the current kubeconfig.

`cas-operator render -f FILE [--revision-of] [-n NAMESPACE]` prints the children the operator
would apply for a resource file instead, with no cluster (see `render.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf

from cas_operator.api import constants as c
from cas_operator.api.limits import MAX_GPUS_ENV, SCRAPER_NAMESPACES_ENV


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cas-operator", description=__doc__)
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL ('' to disable)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="serve Prometheus metrics on this port (0 disables)",
    )
    parser.add_argument(
        "--max-gpus-per-resource",
        type=int,
        default=None,
        help=f"refuse a resource that plans more GPUs than this (sets {MAX_GPUS_ENV})",
    )
    parser.add_argument(
        "--metrics-scraper-namespace",
        action="append",
        default=[],
        help="the fleets' NetworkPolicies admit Prometheus pods (app.kubernetes.io/name="
        "prometheus) of this namespace to the metrics ports (repeatable; sets "
        f"{SCRAPER_NAMESPACES_ENV}); none: no scraper, unless a resource names metricsFrom",
    )
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding a Lease (run several replicas; one acts)",
    )
    parser.add_argument(
        "--leader-elect-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    parser.add_argument("--leader-elect-name", default="cas-operator", help="the Lease's name")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def parse_render_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cas-operator render",
        description="Print every child manifest the operator would apply (no cluster).",
    )
    parser.add_argument("-f", "--filename", required=True, help="resource YAML file, - for stdin")
    parser.add_argument("-n", "--namespace", help="namespace when the file names none")
    parser.add_argument(
        "--revision-of", action="store_true", help="print only each resource's revision"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        from cas_operator import render

        args = parse_render_args(argv[1:])
        sys.exit(
            render.main(args.filename, namespace=args.namespace, revision_only=args.revision_of)
        )
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not args.verbose:  # kopf logs every successful timer run at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.max_gpus_per_resource is not None:  # the handlers read it once, at import
        os.environ[MAX_GPUS_ENV] = str(args.max_gpus_per_resource)
    if args.metrics_scraper_namespace:  # the handlers read it once, at import
        os.environ[SCRAPER_NAMESPACES_ENV] = ",".join(args.metrics_scraper_namespace)
    if args.leader_elect:  # the handlers read it at start-up
        os.environ[c.LEADER_ELECTION_ENV] = (
            f"{args.leader_elect_namespace}/{args.leader_elect_name}"
        )
    import cas_operator.handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)

    settings = kopf.OperatorSettings()
    # Watching named namespaces needs nothing cluster-scoped: kopf would otherwise list and
    # watch Namespaces and CRDs (403s under the chart's namespaced Roles) to find new ones.
    settings.scanning.disabled = bool(args.namespace)
    kopf.run(
        settings=settings,
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
