"""`python -m cas_operator` / `cas-operator`: run the operator against the current kubeconfig."""

from __future__ import annotations

import argparse
import logging

import kopf


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
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not args.verbose:  # kopf logs every successful timer run at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    import cas_operator.handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)

    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
