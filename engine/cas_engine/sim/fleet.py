"""A local PD fleet on loopback: N prefill + M decode sim workers behind the real SGLang router.

Used by the engine tests, the load generator's ``--launch`` and ``make sim-demo``. Ownership:
a :class:`Fleet` starts its processes itself and :meth:`Fleet.stop` ends exactly those (by pid,
SIGTERM then SIGKILL after a bounded wait); logs go to files under ``log_dir``.

Router: PyPI ``sglang-router`` (``python -m sglang_router.launch_router``, started through
:mod:`cas_engine.sim.router_launch` as its image runs it, without SGLang), PD mode::

    --pd-disaggregation --prefill http://HOST:PORT BOOTSTRAP_PORT --decode http://HOST:PORT ...
    --policy round_robin --host 127.0.0.1 --port P --prometheus-port Q
    --worker-startup-check-interval 1 --log-level warn

For each request the router adds ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` to the
body, posts it to one prefill and one decode at once and relays the decode's answer; it retries
a 5xx (503 included) on another pair (``--retry-max-retries``, default 5).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROUTER_MODULE = "sglang_router.launch_router"


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 8000  # how many ports under the kernel's ephemeral range free_port picks from


def ephemeral_low(range_file: Path = EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel hands to outgoing connections (Linux's default: 32768)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host``, for a process about to bind it.

    Picked at random just under the kernel's ephemeral range: a port the OS picks (bind to 0)
    comes from that range, and in the moment between its release here and the process's own
    bind an outgoing connection of the busy suite could take it (a fresh-clone run once had a
    router exit with "Address already in use" and its test time out). No outgoing connection
    is given a port below the range. The OS's pick where nothing below it is free."""
    low = ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(64 if low > BELOW_EPHEMERAL + 1024 else 0):
        port = pick.randrange(low - BELOW_EPHEMERAL, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def router_available() -> bool:
    """True when the SGLang router package can be imported by this interpreter."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Fleet:
    """Processes and URLs of one local fleet."""

    prefills: int = 1
    decodes: int = 2
    speedup: float = 20.0
    host: str = "127.0.0.1"
    log_dir: Path = field(default_factory=lambda: Path("/tmp/cas-sim-fleet"))
    common_args: list[str] = field(default_factory=list)
    prefill_args: list[list[str]] = field(default_factory=list)
    decode_args: list[list[str]] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prefill_urls: list[str] = field(default_factory=list)
    bootstrap_ports: list[int] = field(default_factory=list)  # each prefill's, in order
    decode_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _ports: set[int] = field(default_factory=set)  # handed out by `_port`

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, timeout: float = 90.0) -> Fleet:
        """Start workers and router; return once the router serves a request (or raise).

        `timeout` only bounds each wait (it returns as soon as the fleet answers): 30 s failed
        on a 2-core machine at load average 8, where a router took longer to come up."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        bootstrap: list[int] = []
        for i in range(self.prefills):
            port, bport = self._port(), self._port()
            extra = self.prefill_args[i] if i < len(self.prefill_args) else []
            self._sim(
                f"prefill{i}",
                "prefill",
                port,
                extra,
                ["--disaggregation-bootstrap-port", str(bport)],
            )
            self.prefill_urls.append(f"http://{self.host}:{port}")
            bootstrap.append(bport)
            self.bootstrap_ports.append(bport)
        for i in range(self.decodes):
            port = self._port()
            extra = self.decode_args[i] if i < len(self.decode_args) else []
            self._sim(f"decode{i}", "decode", port, extra, [])
            self.decode_urls.append(f"http://{self.host}:{port}")
        try:
            for url in self.prefill_urls + self.decode_urls:
                _wait_http(f"{url}/health", timeout, self._procs)
            # the router starts once workers answer: started earlier, its own startup polling
            # backs off and the fleet is ready later, not sooner
            self._router(bootstrap)
            _wait_router(self.router_url, timeout, self._procs)
        except BaseException:
            self.stop()
            raise
        return self

    def _sim(self, name: str, mode: str, port: int, extra: list[str], more: list[str]) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cas_engine.sim",
            "--disaggregation-mode",
            mode,
            "--host",
            self.host,
            "--port",
            str(port),
            "--sim-speedup",
            str(self.speedup),
            "--log-level",
            "warning",
            *more,
            *self.common_args,
            *extra,
        ]
        self._spawn(name, cmd)

    def _port(self) -> int:
        """A free port this fleet has not handed out yet. `free_port` closes its probe socket,
        so until a worker binds the port the OS may offer it again: a CI run gave a decode the
        port its prefill was about to bind ("address already in use")."""
        while (port := free_port(self.host)) in self._ports:
            pass
        self._ports.add(port)
        return port

    def _router(self, bootstrap: list[int]) -> None:
        port = self._port()
        cmd = [
            sys.executable,
            "-m",
            "cas_engine.sim.router_launch",
            ROUTER_MODULE,
            "--pd-disaggregation",
            "--host",
            self.host,
            "--port",
            str(port),
            "--prometheus-port",
            str(self._port()),
            "--policy",
            "round_robin",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warn",
        ]
        for url, bport in zip(self.prefill_urls, bootstrap, strict=True):
            cmd += ["--prefill", url, str(bport)]
        for url in self.decode_urls:
            cmd += ["--decode", url]
        self._spawn("router", cmd + self.router_args)
        self.router_url = f"http://{self.host}:{port}"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "GLOG_minloglevel": "2", "PYTHONUNBUFFERED": "1", **self.env}
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every process this fleet started, SIGKILL what is left after ``grace``."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._procs.clear()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_alive(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is not None:
            raise RuntimeError(f"fleet process {proc.args!r} exited with {proc.returncode}")


def _wait_http(url: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(procs)
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def _wait_router(url: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    """The router is ready once a tiny generate request goes through it."""
    body = b'{"text": "ping", "sampling_params": {"max_new_tokens": 1}}'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(procs)
        req = urllib.request.Request(
            f"{url}/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=5) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"router {url} not ready after {timeout}s")
