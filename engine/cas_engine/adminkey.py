"""The engine's admin key: how it reaches the engine, and the one rule that keeps it out of
every answer, command line and log line.

The key comes in the environment (:data:`ADMIN_KEY_ENV`, which the operator sets from the
fleet's keys Secret by ``secretKeyRef``), never on a command line: SGLang 0.5.23 publishes its
command line as ``launch_command`` in ``/server_info`` and ``/get_server_info``, which need no
key (srt/entrypoints/http_server.py:853-893, srt/utils/common.py:3584-3592), and a process's
arguments are readable by anyone who can list its processes. The launcher hands the key to
SGLang itself (:mod:`cas_engine.sglang.keys`), the sim reads it there too
(:mod:`cas_engine.sim.config`).

:func:`redact` is the rule for what an engine shows: any field named in :data:`SECRET_FIELDS`
(SGLang's ``admin_api_key`` and ``api_key``) reads :data:`REDACTED`, at any depth, and a
command line (a ``launch_command`` string) has the value of every key flag replaced. SGLang's
server info and start-up log go through it (:mod:`cas_engine.sglang.keys`), and so does the
sim's ``/server_info``. Pure; no SGLang import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

ADMIN_KEY_ENV: Final = "CAS_ENGINE_ADMIN_KEY"
ADMIN_KEY_FLAG: Final = "--admin-api-key"
# SGLang's key flags: their values never show in a command line (`redact_command_line`)
KEY_FLAGS: Final = (ADMIN_KEY_FLAG, "--api-key")
SECRET_FIELDS: Final = frozenset({"admin_api_key", "api_key"})
COMMAND_LINE_FIELDS: Final = frozenset({"launch_command"})
REDACTED: Final = "<redacted>"


def admin_key_from_env(environ: Mapping[str, str], name: str = ADMIN_KEY_ENV) -> str | None:
    """The admin key the environment variable `name` carries (None when unset or empty)."""
    return environ.get(name) or None


def _is_admin_key_flag(name: str) -> bool:
    """`name` is ``--admin-api-key`` or a prefix of it argparse would expand."""
    return len(name) > len("--") and ADMIN_KEY_FLAG.startswith(name)


def split_admin_key(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` without its admin key flag (``--admin-api-key K``, ``--admin-api-key=K`` or an
    abbreviation argparse would expand), and the key it gave (None: none; the last wins)."""
    rest: list[str] = []
    key: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if not _is_admin_key_flag(name):
            rest.append(args[i])
        elif eq:
            key = value
        elif i + 1 < len(args):
            key = args[i + 1]
            i += 1
        i += 1
    return rest, key


def redact_command_line(text: str) -> str:
    """`text` (arguments joined by spaces) with the value of every key flag redacted."""
    words = text.split(" ")
    out: list[str] = []
    hide_next = False
    for word in words:
        if hide_next and word:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = word.partition("=")
        if name in KEY_FLAGS and eq:
            out.append(f"{name}={REDACTED}")
        else:
            hide_next = word in KEY_FLAGS
            out.append(word)
    return " ".join(out)


def redact(value: Any) -> Any:
    """`value` with every secret field and command line redacted (see the module docstring);
    dicts, lists and tuples are copied, anything else is returned as it is."""
    if isinstance(value, Mapping):
        return {k: _redact_item(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact(v) for v in value)
    return value


def _redact_item(key: Any, value: Any) -> Any:
    if key in SECRET_FIELDS:
        return REDACTED if value is not None else None
    if key in COMMAND_LINE_FIELDS and isinstance(value, str):
        return redact_command_line(value)
    return redact(value)
