"""``python -m cas_engine.sim``: run one simulated SGLang worker until SIGINT/SIGTERM.

Data flow: argv -> :func:`cas_engine.sim.config.parse_args` -> :class:`SimWorker` (scheduler)
-> :class:`SimServer` routes on ``--host:--port`` (and, for ``prefill``, the bootstrap server on
``--disaggregation-bootstrap-port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from aiohttp import web

from cas_engine.sim import SIMULATOR_NOTICE
from cas_engine.sim.config import SimConfig, parse_args
from cas_engine.sim.server import SimServer, install_log_filter
from cas_engine.sim.worker import SimWorker

log = logging.getLogger("cas_engine.sim")


async def serve(
    cfg: SimConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Start the worker and its HTTP servers; return when ``stop`` is set (or on a signal)."""
    worker = SimWorker(cfg)
    await worker.start()
    server = SimServer(cfg, worker)
    runners = [web.AppRunner(server.app(), access_log=None, shutdown_timeout=0.5)]
    if cfg.mode == "prefill":
        runners.append(web.AppRunner(server.bootstrap_app(), access_log=None, shutdown_timeout=0.5))
    ports = [cfg.port, cfg.bootstrap_port]
    for runner, port in zip(runners, ports, strict=False):
        await runner.setup()
        await web.TCPSite(runner, cfg.host, port, reuse_address=True).start()
    if stop is None:  # the CLI: stop on a signal (callers passing ``stop`` own shutdown)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, stop.set)
    log.warning(
        "%s: mode=%s listening on http://%s:%s%s (speedup %sx, reclaim %s)",
        SIMULATOR_NOTICE,
        cfg.mode,
        cfg.host,
        cfg.port,
        f", bootstrap :{cfg.bootstrap_port}" if cfg.mode == "prefill" else "",
        cfg.speedup,
        cfg.kv_reclaim,
    )
    if worker.faults.crash:
        log.error("sim fault crash=1: exiting")
        os._exit(70)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_log_filter()
    cfg = parse_args(argv)
    logging.getLogger().setLevel(cfg_log_level(argv))
    asyncio.run(serve(cfg))
    return 0


def cfg_log_level(argv: list[str] | None) -> int:
    args = sys.argv[1:] if argv is None else argv
    level = "info"
    for i, a in enumerate(args):
        if a == "--log-level" and i + 1 < len(args):
            level = args[i + 1]
        elif a.startswith("--log-level="):
            level = a.split("=", 1)[1]
    return getattr(logging, level.upper(), logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
