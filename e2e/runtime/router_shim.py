"""``python -m e2e.runtime.router_shim ARGS``: the SGLang router
(``sglang_router.launch_router``) with the same ARGS, except that it keeps its command line.

The router renames its process (``setproctitle("sglang::router")``), which rewrites
``/proc/<pid>/cmdline``; :mod:`e2e.cluster.procs` identifies the processes it started by that
command line, so a renamed router would look exited (restarted twice, "address in use") and could
not be stopped by the pod runner. This shim only turns the renaming into a no-op.
"""

from __future__ import annotations

import setproctitle
from sglang_router import launch_router


def _keep_title(*_args: object, **_kwargs: object) -> None:
    """Stand-in for setproctitle.setproctitle: leave the command line as started."""


def main() -> None:
    setproctitle.setproctitle = _keep_title
    launch_router.main()


if __name__ == "__main__":
    main()
