"""``python -m cas_engine.sim.router_launch MODULE ARGS``: run a router launcher (``MODULE``:
sglang-router's or smg's ``launch_router``) with ARGS as the router's own image runs it, without
SGLang.

sglang-router 0.3.2's ``launch_router`` imports its Python mini load balancer, which tries to
import SGLang's tracing (``sglang_router/mini_lb.py``, inside a ``try``): where SGLang and
torch are installed, as in this project's virtualenv, that is about 5 s of CPU and 800 MB per
router process, for tracing the Rust router never uses. Here that import fails, as it does in a
router image. Used by :class:`cas_engine.sim.fleet.Fleet` and the local stack's pod runner.
"""

from __future__ import annotations

import runpy
import sys

ROUTER_LAUNCHERS = ("sglang_router.launch_router", "smg.launch_router")


def run(module: str, args: list[str]) -> None:
    """Run `module` as ``python -m module args`` would, with ``import sglang`` failing."""
    if module not in ROUTER_LAUNCHERS:
        raise SystemExit(f"router_launch: {module!r} is not one of {ROUTER_LAUNCHERS}")
    sys.modules["sglang"] = None  # type: ignore[assignment]  # `import sglang...` -> ImportError
    sys.argv = [module, *args]  # the launcher parses sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
