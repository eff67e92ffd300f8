"""The sim's endpoint auth: SGLang 0.5.23's own decision function, not a model of it.

``--api-key`` and ``--admin-api-key`` mean what they mean to SGLang: the sim asks
``sglang.srt.utils.auth.decide_request_auth`` (srt/utils/auth.py:74-149) for every request,
with the level SGLang's http_server.py gives the endpoint (``/flush_cache`` is
ADMIN_OPTIONAL there: http_server.py:1024-1026; /generate and the OpenAI routes NORMAL; /health and
/metrics always open). The module is loaded from its file in the installed SGLang package:
importing ``sglang.srt.utils`` would import most of SGLang (~9 s, thousands of modules) in
every sim pod, and auth.py is self-contained by design (its docstring: no torch import).

The ``/sim/*`` routes are the harness's (fault injection, stats, the simulated KV transfer
between pods), not SGLang's, and stay open.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ADMIN_OPTIONAL_PATHS = frozenset({"/flush_cache"})  # the SGLang admin endpoints the sim has
_sglang_auth: ModuleType | None = None


def sglang_auth() -> ModuleType:
    """SGLang's srt/utils/auth.py as a standalone module (loaded once)."""
    global _sglang_auth
    if _sglang_auth is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("--api-key/--admin-api-key need SGLang installed (its auth code)")
        path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "utils" / "auth.py"
        loaded = importlib.util.spec_from_file_location("cas_sim_sglang_auth", path)
        if loaded is None or loaded.loader is None:
            raise RuntimeError(f"cannot load SGLang's auth module from {path}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[loaded.name] = module  # its dataclasses look their module up there
        loaded.loader.exec_module(module)
        _sglang_auth = module
    return _sglang_auth


def decide(
    method: str, path: str, authorization: str | None, api_key: str, admin_api_key: str
) -> tuple[bool, int]:
    """(allowed, status when refused) for one request, as SGLang decides it."""
    auth: Any = sglang_auth()
    level = auth.AuthLevel.ADMIN_OPTIONAL if path in ADMIN_OPTIONAL_PATHS else auth.AuthLevel.NORMAL
    decision = auth.decide_request_auth(
        method=method,
        path=path,
        authorization_header=authorization,
        api_key=api_key or None,
        admin_api_key=admin_api_key or None,
        auth_level=level,
    )
    return bool(decision.allowed), int(decision.error_status_code)
