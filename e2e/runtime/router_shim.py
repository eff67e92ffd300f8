"""``python -m e2e.runtime.router_shim MODULE ARGS``: a router launcher (``MODULE``, one of
``ROUTER_LAUNCHERS``: sglang-router's or smg's ``launch_router``) with the same ARGS, except
that it keeps its command line.

Both routers rename their process (``setproctitle("sglang::router")``, ``"smg::router"``), which
rewrites ``/proc/<pid>/cmdline``; :mod:`e2e.cluster.procs` identifies the processes it started by
that command line, so a renamed router would look exited (restarted twice, "address in use") and
could not be stopped by the pod runner. This shim only turns the renaming into a no-op.
"""

from __future__ import annotations

import importlib
import sys

import setproctitle

# the module a router container's command runs -> the same, importable here
ROUTER_LAUNCHERS = ("sglang_router.launch_router", "smg.launch_router")


def _keep_title(*_args: object, **_kwargs: object) -> None:
    """Stand-in for setproctitle.setproctitle: leave the command line as started."""


def main() -> None:
    module = sys.argv[1]
    if module not in ROUTER_LAUNCHERS:
        raise SystemExit(f"router_shim: {module!r} is not one of {ROUTER_LAUNCHERS}")
    setproctitle.setproctitle = _keep_title
    launcher = importlib.import_module(module)
    sys.argv = [module, *sys.argv[2:]]  # the launcher parses sys.argv[1:]
    launcher.main()


if __name__ == "__main__":
    main()
