"""`python -m e2e.runtime.older_operator ARGS`: the operator as an older build would run it.

The stand-in for an operator version whose rendering of the same spec differs from this
one's (a field added with a default, a changed default flag): this build's operator with one
env var more on every engine container (``CAS_OLDER_OPERATOR=1``). Everything else, the
handlers, the command line and the chart identity, is this build's. Used by
``bench/lifecycle.py`` ("operator upgrade": a fleet made by this build, then the operator
replaced by the current one while traffic runs).

Data flow: patches ``pools.engine_env`` in this process before the handlers import, then runs
``cas_operator.__main__.main`` with the given arguments.
"""

from __future__ import annotations

from typing import Any

OLDER_ENV = {"name": "CAS_OLDER_OPERATOR", "value": "1"}


def patch_rendering() -> None:
    """Render the engine containers as the older build did (one env var more)."""
    from cas_operator.desired.resources import pools

    current = pools.engine_env

    def older_env(plan: Any) -> list[dict[str, Any]]:
        return [*current(plan), dict(OLDER_ENV)]

    pools.engine_env = older_env


if __name__ == "__main__":
    from cas_operator.__main__ import main

    patch_rendering()
    main()
