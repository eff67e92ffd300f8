"""Prometheus (Debian's ``prometheus`` package) for the local stack: config and process.

Data flow: :func:`file_sd_scrape_config` renders the scrape job for engine pods; the targets come
from a file_sd JSON file that the pod runner (:mod:`e2e.runtime.podrunner`) rewrites from what it
sees on the API server (Debian's Prometheus has no Kubernetes service discovery), one target per
annotated pod at ``<pod IP>:<prometheus.io/port>`` labelled ``namespace``, ``pod`` and ``role``
(what the operator's ``PrometheusSource`` groups by). :func:`static_scrape_config` does the same for
fixed addresses (processes without a cluster). :func:`start_prometheus` writes the config, starts
the binary on a loopback port with its TSDB under ``run_dir`` (via :mod:`e2e.cluster.procs`:
detached, stopped by recorded pid only) and waits for ``/-/ready``.

``python -m e2e.runtime.prometheus --sd-file PATH [--run-dir DIR]`` runs it in the foreground.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import procs


def duration(seconds: float) -> str:
    """A Prometheus duration (whole units only: 800ms, not 0.8s)."""
    return f"{max(1, round(seconds * 1000))}ms"


def prometheus_binary() -> Path | None:
    """``$PATH``'s prometheus (Debian installs /usr/bin/prometheus), or None."""
    found = shutil.which("prometheus")
    return Path(found) if found else None


def file_sd_scrape_config(sd_file: Path, interval_s: float = 5.0) -> dict[str, Any]:
    """A job scraping the targets listed in ``sd_file`` (re-read every second).

    Debian's build of Prometheus leaves Kubernetes service discovery out (its
    ``kubernetes_sd_configs`` does not parse), so the pod runner, which watches the API server
    anyway, writes the engine pods it runs into this file (:func:`write_file_sd`).
    """
    return {
        "job_name": "cas-engine-pods",
        "scrape_interval": duration(interval_s),
        "scrape_timeout": duration(max(0.5, interval_s * 0.8)),
        "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}],
    }


def write_file_sd(sd_file: Path, targets: list[tuple[str, dict[str, str]]]) -> None:
    """Atomically replace ``sd_file`` with ``[{targets: [addr], labels: {...}}, ...]``."""
    entries = [{"targets": [addr], "labels": labels} for addr, labels in sorted(targets)]
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    tmp.replace(sd_file)


def static_scrape_config(
    targets: list[tuple[str, dict[str, str]]], interval_s: float = 1.0
) -> dict[str, Any]:
    """A job scraping fixed ``host:port`` addresses, each with its own labels (pod, ...)."""
    return {
        "job_name": "cas-static",
        "scrape_interval": duration(interval_s),
        "scrape_timeout": duration(max(0.5, interval_s * 0.8)),
        "static_configs": [{"targets": [addr], "labels": labels} for addr, labels in targets],
    }


def render(jobs: list[dict[str, Any]], interval_s: float) -> str:
    """The whole prometheus.yml."""
    config = {
        "global": {"scrape_interval": duration(interval_s), "evaluation_interval": "15s"},
        "scrape_configs": jobs,
    }
    return str(yaml.safe_dump(config, sort_keys=False))


@dataclass
class PrometheusHandle:
    url: str
    record: procs.ProcRecord

    def stop(self) -> str:
        return procs.stop(self.record, grace_s=10.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def start_prometheus(
    run_dir: Path,
    jobs: list[dict[str, Any]],
    *,
    interval_s: float = 5.0,
    port: int | None = None,
    timeout_s: float = 30.0,
) -> PrometheusHandle:
    """Write the config, start Prometheus on 127.0.0.1 and wait until it is ready."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus not found (Debian: apt-get install prometheus)")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "prometheus.yml"
    config.write_text(render(jobs, interval_s))
    port = port or _free_port()
    argv = [
        str(binary),
        f"--config.file={config}",
        f"--storage.tsdb.path={run_dir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=2h",
        "--log.level=warn",
    ]
    record = procs.spawn("prometheus", argv, run_dir / "logs")
    handle = PrometheusHandle(f"http://127.0.0.1:{port}", record)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _ready(handle.url):
            return handle
        if not procs.is_running(record):
            raise RuntimeError(f"prometheus exited:\n{procs.log_tail(record)}")
        time.sleep(0.2)
    handle.stop()
    raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s:\n{procs.log_tail(record)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.runtime.prometheus")
    parser.add_argument("--sd-file", type=Path, required=True, help="file_sd targets (JSON)")
    parser.add_argument("--run-dir", type=Path, default=Path("run/prometheus"))
    parser.add_argument("--port", type=int, default=9090)
    parser.add_argument("--interval", type=float, default=5.0)
    args = parser.parse_args(argv)
    job = file_sd_scrape_config(args.sd_file.resolve(), args.interval)
    handle = start_prometheus(args.run_dir, [job], interval_s=args.interval, port=args.port)
    print(f"prometheus ready at {handle.url} (pid {handle.record.pid}); Ctrl-C stops it")
    try:
        while procs.is_running(handle.record):
            time.sleep(1.0)
    except KeyboardInterrupt:
        print(handle.stop())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
