"""The operator as a real process against a cluster: used by `make run`, the e2e tests and the
operator-scale benchmark (one way to start, kill and stop it; logs appended to one file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from e2e.paths import REPO_ROOT


class OperatorProcess:
    """`python -m cas_operator` with KUBECONFIG=`kubeconfig`; restartable. `extra_args` go to
    the operator's command line (e.g. ``("-n", ns)`` to watch one namespace only), `env` on top
    of this process's environment (e.g. ``CAS_PROMETHEUS_URL``)."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        *,
        metrics_port: int = 0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        module: str = "cas_operator",
    ) -> None:
        self.kubeconfig, self.log_path, self.metrics_port = kubeconfig, log_path, metrics_port
        self.extra_args, self.env = extra_args, dict(env or {})
        # what `python -m` runs: e2e.runtime.older_operator plays an older build
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--liveness", "",
                 "--metrics-port", str(self.metrics_port), *self.extra_args],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.proc is not None, "operator not started"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crashed or evicted operator."""
        if self.proc and self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        """SIGTERM, without waiting: kopf's graceful stop then overlaps the caller's own
        teardown (:meth:`wait_stopped` waits for it)."""
        if self.proc and self.running():
            self.proc.terminate()

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        """Wait for a terminated operator to exit; SIGKILL it after ``timeout_s``."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
