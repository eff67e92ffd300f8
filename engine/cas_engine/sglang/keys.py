"""The admin key in SGLang 0.5.23: handed over without a command line, never shown.

What SGLang does on its own: ``--admin-api-key`` is a command-line flag (or an ``Engine``
keyword) only, no environment variable (srt/arg_groups/fields/serving.py:164-167); its
``prepare_server_args`` keeps the command line it parsed as ``launch_command``
(srt/server_args.py:711-719), redacting watermark secrets only; ``/server_info`` and
``/get_server_info`` need no key (srt/entrypoints/http_server.py:853-893) and answer
``build_server_info`` (every resolved field, ``admin_api_key`` and ``api_key`` included, and
``launch_command``: srt/utils/common.py:3584-3592) plus each scheduler's internal state (the
resolved fields again: srt/managers/scheduler_components/internal_state.py:45-48); its start-up
log prints the resolved fields (srt/entrypoints/engine.py:173-174 and :1185). So the key in a
pod's arguments is served to anyone who reaches the engine, and through a router that forwards
``GET /get_server_info`` (smg 1.13), to every client of the fleet.

What this adapter changes:

1. :func:`install_admin_key` (the launcher, before SGLang's ``launch_server`` runs): SGLang's
   ``prepare_server_args`` parses the command line with the key appended (so SGLang validates
   and uses it exactly as a flag) and the ``launch_command`` it records shows that flag as
   ``--admin-api-key=<redacted>``. The key itself comes from the environment
   (:data:`cas_engine.adminkey.ADMIN_KEY_ENV`); it reaches SGLang's other processes inside the
   server args SGLang hands them, as any flag does.
2. :func:`install_redaction` (every SGLang process, from the plugin): every surface above
   redacts through ``redact_watermark_secrets`` (srt/sampling/watermarking/core.py:34; called
   by http_server.py:883, engine.py:174 and :1575, grpc_bridge.py:448, rust_server/config.py:248
   and the request dumps); it is wrapped so that its result also goes through
   :func:`cas_engine.adminkey.redact`, the rule the sim's ``/server_info`` applies too. The
   wrapper replaces the function in the module that defines it and in every SGLang module
   already holding it by name; modules imported later take it from there.

:func:`check_targets` reads SGLang's source files (no import) and refuses to start when any
call site above is not what this was written for.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from cas_engine import adminkey

logger = logging.getLogger("cas_engine.sglang.keys")

REDACT_MODULE: Final = "sglang.srt.sampling.watermarking.core"
REDACT_FUNCTION: Final = "redact_watermark_secrets"
SERVER_ARGS_MODULE: Final = "sglang.srt.server_args"
PREPARE_FUNCTION: Final = "prepare_server_args"
PATCHED_ATTR: Final = "__cas_keys_original__"
# (file under the sglang package, text that must be there): the call sites the module
# docstring relies on
SOURCE_MARKERS: Final = (
    ("srt/server_args.py", "server_args._launch_command = redact_watermark_command_line("),
    ("srt/utils/common.py", 'result["launch_command"] = server_args.launch_command'),
    ("srt/entrypoints/http_server.py", "return await server_info()"),
    ("srt/entrypoints/http_server.py", "redact_watermark_secrets(\n            {\n"
     "                **build_server_info(server_args, _global_state.scheduler_info),"),
    ("srt/entrypoints/engine.py", "return redact_watermark_secrets(server_args.resolved_dict())"),
    ("srt/entrypoints/engine.py", 'logger.info(f"server_args={_server_args_for_logging('),
)  # fmt: skip


def sglang_root() -> Path | None:
    """The installed sglang package's directory, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def check_targets(root: Path | None = None) -> list[str]:
    """Problems that forbid relying on SGLang's key surfaces (empty: as written for)."""
    root = sglang_root() if root is None else root
    if root is None:
        return ["sglang is not installed"]
    problems = []
    for relative, marker in SOURCE_MARKERS:
        try:
            text = (root / relative).read_text()
        except OSError as exc:
            problems.append(f"{relative}: {exc}")
            continue
        if marker not in text:
            problems.append(f"{relative} no longer contains {marker.splitlines()[0]!r}")
    return problems


def argv_with_key(argv: Sequence[str], key: str) -> list[str]:
    """What SGLang's parser gets once the key is handed over: `argv` and the key's flag."""
    return [*argv, f"{adminkey.ADMIN_KEY_FLAG}={key}"]


def install_admin_key(key: str) -> None:
    """SGLang's `prepare_server_args` takes the admin key without it being on a command line
    (see the module docstring, step 1). Call before ``sglang.launch_server`` runs."""
    module = importlib.import_module(SERVER_ARGS_MODULE)
    original = getattr(module, PREPARE_FUNCTION)
    original = getattr(original, PATCHED_ATTR, original)
    flag = argv_with_key([], key)[0]
    shown = f"{adminkey.ADMIN_KEY_FLAG}={adminkey.REDACTED}"

    def prepare_server_args(argv: list[str]) -> Any:
        server_args = original(argv_with_key(argv, key))
        command = str(server_args.launch_command or "").replace(flag, shown)
        server_args._launch_command = command.replace(key, adminkey.REDACTED)
        return server_args

    setattr(prepare_server_args, PATCHED_ATTR, original)
    setattr(module, PREPARE_FUNCTION, prepare_server_args)
    logger.info("admin key taken from %s (not on any command line)", adminkey.ADMIN_KEY_ENV)


def install_redaction() -> None:
    """Wrap SGLang's redaction so that no key leaves an answer or a log line (step 2);
    idempotent."""
    core = importlib.import_module(REDACT_MODULE)
    current = getattr(core, REDACT_FUNCTION)
    if hasattr(current, PATCHED_ATTR):
        return
    wrapper = _redacting(current)
    setattr(core, REDACT_FUNCTION, wrapper)
    rebound = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("sglang.") and getattr(module, REDACT_FUNCTION, None) is current
    ]
    for name in rebound:
        setattr(sys.modules[name], REDACT_FUNCTION, wrapper)
    logger.info("key redaction installed (%d SGLang modules rebound)", len(rebound))


def _redacting(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (SGLang's recursive redaction), whose outermost call's result also goes
    through `adminkey.redact` (its own recursive calls find the wrapper by name: they pass
    through unchanged, so a deep answer is walked twice, not once per level)."""
    inner = threading.local()
    params = inspect.signature(original).parameters

    def redact_watermark_secrets(value: Any, **kwargs: Any) -> Any:
        if getattr(inner, "active", False):
            return original(value, **kwargs)
        inner.active = True
        try:
            result = original(value, **kwargs)
        finally:
            inner.active = False
        return adminkey.redact(result)

    if set(params) - {"value", "in_watermark_config"}:
        raise RuntimeError(f"{REDACT_FUNCTION}{tuple(params)}: not the signature written for")
    setattr(redact_watermark_secrets, PATCHED_ATTR, original)
    return redact_watermark_secrets
