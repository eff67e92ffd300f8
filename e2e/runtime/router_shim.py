"""``python -m e2e.runtime.router_shim MODULE ARGS``: a router launcher (``MODULE``, one of
``ROUTER_LAUNCHERS``: sglang-router's or smg's ``launch_router``) with the same ARGS, except
that it keeps its command line.

Both routers rename their process (``setproctitle("sglang::router")``, ``"smg::router"``), which
rewrites ``/proc/<pid>/cmdline``; :mod:`e2e.cluster.procs` identifies the processes it started by
that command line, so a renamed router would look exited (restarted twice, "address in use") and
could not be stopped by the pod runner. This shim turns the renaming into a no-op, then runs
the launcher without SGLang, as the router's image does (:mod:`cas_engine.sim.router_launch`).
"""

from __future__ import annotations

import sys

import setproctitle

from cas_engine.sim import router_launch

# the module a router container's command runs -> the same, importable here
ROUTER_LAUNCHERS = router_launch.ROUTER_LAUNCHERS


def _keep_title(*_args: object, **_kwargs: object) -> None:
    """Stand-in for setproctitle.setproctitle: leave the command line as started."""


def main() -> None:
    setproctitle.setproctitle = _keep_title
    router_launch.run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
