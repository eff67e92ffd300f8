"""The engine launcher: ``python -m cas_engine.launch_server <sglang args> [--cas-* flags]``.

Data flow:

1. :func:`plan_launch` (pure) splits argv into our ``--cas-*`` flags and SGLang's arguments
   and resolves our configuration (flags > ``CAS_*`` environment > defaults).
2. :func:`preflight` checks before anything starts and raises :class:`LaunchRefused` with a
   message naming what is needed: the pinned SGLang version, the guard patch targets and the
   pickle IPC its stream errors ride on, the strict-reclaim patch, and, when
   ``--enable-hierarchical-cache`` is on, the HiCache load-use ordering of the installed
   SGLang (see :mod:`cas_engine.hicache.source_check`).
3. :func:`export_env` writes the resolved configuration into the environment: SGLang starts
   its scheduler and detokenizer with ``spawn``, so a monkeypatch made in this process would be
   lost; instead SGLang's plugin loader (entry point group ``sglang.srt.plugins``, called early
   in every SGLang process) runs :func:`sglang_plugin`, which installs our patches from the
   environment in each process.
4. :func:`main` then hands the admin key to SGLang without a command line
   (:mod:`cas_engine.sglang.keys`: the key comes from the environment variable
   ``--cas-admin-key-env`` names, or ``CAS_ENGINE_ADMIN_KEY``; an ``--admin-api-key`` given
   anyway is taken out of SGLang's arguments) and runs ``sglang.launch_server`` as
   ``__main__`` with SGLang's arguments. SGLang would otherwise publish the key in
   ``/server_info`` and its start-up log; every process redacts it (:mod:`cas_engine.adminkey`).

Our parts (``--cas-*``): the quality gate (:mod:`cas_engine.guard`), KV reclaim mode
(``strict``: :mod:`cas_engine.sglang.reclaim`; ``upstream``: SGLang's timeout release), and the
HiCache read-before-ready detector (off by default).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import runpy
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cas_engine.adminkey import ADMIN_KEY_ENV, admin_key_from_env, split_admin_key
from cas_engine.guard.config import GuardConfig, add_guard_arguments, guard_config_from_args

logger = logging.getLogger("cas_engine.launch")

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "cas_engine"
ENABLE_ENV = "CAS_ENGINE_PATCHES"
KV_RECLAIM_ENV = "CAS_KV_RECLAIM"
KV_QUARANTINE_ENV = "CAS_KV_QUARANTINE_ROOMS"
DEFAULT_QUARANTINE_ROOMS = 64
PREFILL_GONE_ENV = "CAS_PREFILL_GONE_FILE"
HICACHE_DETECTOR_ENV = "CAS_HICACHE_DETECTOR"
HICACHE_CHECK_ENV = "CAS_HICACHE_CHECK"
KV_RECLAIM_MODES = ("strict", "upstream")
HICACHE_CHECK_MODES = ("enforce", "warn", "off")
HICACHE_FLAG = "--enable-hierarchical-cache"
HICACHE_FLAGS = (HICACHE_FLAG, "--enable-hicache")  # SGLang accepts both spellings


class LaunchRefused(RuntimeError):
    """A pre-flight check failed; the message says what is needed."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the launcher decided before touching SGLang."""

    guard: GuardConfig
    kv_reclaim: str
    kv_quarantine_rooms: int
    hicache_detector: bool
    hicache_check: str
    prefill_gone_file: str | None = None
    sglang_argv: list[str] = field(default_factory=list)
    show_help: bool = False
    admin_key: str | None = field(default=None, repr=False)
    admin_key_source: str = ""  # where the key came from ("" when none)

    @property
    def hicache_enabled(self) -> bool:
        return any(flag in self.sglang_argv for flag in HICACHE_FLAGS)


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {raw!r}")


def build_cas_parser() -> argparse.ArgumentParser:
    """Parser of our flags only (``add_help`` off: ``--help`` shows ours, then SGLang's)."""
    parser = argparse.ArgumentParser(
        prog="python -m cas_engine.launch_server",
        description="SGLang with cas_engine's patches. Flags not starting with --cas- go to "
        "SGLang unchanged; SGLang's own help follows below.",
        add_help=False,
        allow_abbrev=False,
    )
    add_guard_arguments(parser)
    group = parser.add_argument_group("cas KV reclaim and HiCache")
    group.add_argument(
        "--cas-kv-reclaim",
        choices=KV_RECLAIM_MODES,
        default=None,
        help=f"strict: reuse a KV slot only after the prefill confirms no write "
        f"is in flight; upstream: SGLang's timeout release (env {KV_RECLAIM_ENV}, "
        "default strict)",
    )
    group.add_argument(
        "--cas-kv-quarantine-rooms",
        type=int,
        default=None,
        metavar="N",
        help="strict: aborted requests' KV rooms a decode may hold awaiting prefill's "
        f"answer before it reports unhealthy (env {KV_QUARANTINE_ENV}, default "
        f"{DEFAULT_QUARANTINE_ROOMS})",
    )
    group.add_argument(
        "--cas-prefill-gone-file",
        default=None,
        metavar="PATH",
        help="strict: the operator's list of prefill pods confirmed gone (a mounted "
        "ConfigMap); decode releases rooms those pods can no longer write "
        f"(env {PREFILL_GONE_ENV}, default none)",
    )
    group.add_argument(
        "--cas-hicache-detector",
        type=_bool,
        default=None,
        metavar="BOOL",
        help="count index-cache reads before their layer load completed "
        f"(env {HICACHE_DETECTOR_ENV}, default false)",
    )
    group.add_argument(
        "--cas-hicache-check",
        choices=HICACHE_CHECK_MODES,
        default=None,
        help="start-up check of HiCache load-use ordering when "
        f"{HICACHE_FLAG} is given: enforce refuses to start on failure "
        f"(env {HICACHE_CHECK_ENV}, default enforce)",
    )
    keys = parser.add_argument_group("cas admin key")
    keys.add_argument(
        "--cas-admin-key-env",
        default=None,
        metavar="NAME",
        help="the environment variable holding SGLang's admin key (it must be set); SGLang "
        "gets the key without it being on any command line and never shows it "
        f"(default: {ADMIN_KEY_ENV} when set)",
    )
    return parser


def plan_launch(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Split ``argv`` and resolve our configuration; raises ``SystemExit(2)`` on bad flags."""
    env = os.environ if env is None else env
    parser = build_cas_parser()
    ns, rest = parser.parse_known_args(list(argv))
    unknown = [a for a in rest if a.startswith("--cas-")]
    if unknown:
        parser.error(f"unknown cas flag(s): {' '.join(unknown)}")
    try:
        guard = guard_config_from_args(ns, env)
    except ValueError as exc:
        parser.error(str(exc))
    kv = ns.cas_kv_reclaim or env.get(KV_RECLAIM_ENV, "strict").strip().lower()
    check = ns.cas_hicache_check or env.get(HICACHE_CHECK_ENV, "enforce").strip().lower()
    if kv not in KV_RECLAIM_MODES:
        parser.error(f"{KV_RECLAIM_ENV} must be one of {KV_RECLAIM_MODES}, got {kv!r}")
    if check not in HICACHE_CHECK_MODES:
        parser.error(f"{HICACHE_CHECK_ENV} must be one of {HICACHE_CHECK_MODES}, got {check!r}")
    rooms = ns.cas_kv_quarantine_rooms
    if rooms is None:
        try:
            rooms = int(env.get(KV_QUARANTINE_ENV, DEFAULT_QUARANTINE_ROOMS))
        except ValueError:
            parser.error(f"{KV_QUARANTINE_ENV} must be a whole number")
    if rooms < 1:
        parser.error(f"--cas-kv-quarantine-rooms must be at least 1, got {rooms}")
    detector = ns.cas_hicache_detector
    if detector is None:
        try:
            detector = _bool(env.get(HICACHE_DETECTOR_ENV, "false"))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"{HICACHE_DETECTOR_ENV}: {exc}")
    show_help = any(a in ("-h", "--help") for a in rest)
    gone_file = ns.cas_prefill_gone_file or env.get(PREFILL_GONE_ENV) or None
    rest, argv_key = split_admin_key(rest)
    key_env = ns.cas_admin_key_env or ADMIN_KEY_ENV
    env_key = admin_key_from_env(env, key_env)
    if ns.cas_admin_key_env and env_key is None:
        parser.error(f"--cas-admin-key-env {key_env}: that variable is unset or empty")
    if env_key is not None and argv_key is not None:
        parser.error(f"an admin key both in {key_env} and on the command line: give one")
    source = f"env {key_env}" if env_key is not None else ""
    return LaunchPlan(
        guard=guard,
        kv_reclaim=kv,
        kv_quarantine_rooms=rooms,
        prefill_gone_file=gone_file,
        hicache_detector=detector,
        hicache_check=check,
        sglang_argv=rest,
        show_help=show_help,
        admin_key=env_key or argv_key,
        admin_key_source=source or ("command line" if argv_key is not None else ""),
    )


# ---- pre-flight checks --------------------------------------------------------------------------

Check = Callable[[LaunchPlan], str]


def check_version(plan: LaunchPlan) -> str:
    from cas_engine.sglang.version import SGLangVersionError, require_sglang

    try:
        return f"sglang {require_sglang()} (pinned)"
    except SGLangVersionError as exc:
        raise LaunchRefused(str(exc)) from exc


def check_plugin_entry_point(plan: LaunchPlan) -> str:
    names = {ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in names:
        raise LaunchRefused(
            f"cas_engine's SGLang plugin (entry point {PLUGIN_GROUP}:{PLUGIN_NAME}) is not "
            "installed, so SGLang's worker processes would run unpatched; reinstall cas_engine"
        )
    return f"plugin entry point {PLUGIN_GROUP}:{PLUGIN_NAME} registered"


def check_guard_targets(plan: LaunchPlan) -> str:
    from cas_engine.sglang import guard_patch as gp

    cls = getattr(importlib.import_module(gp.TARGET_MODULE), gp.TARGET_CLASS)
    problems = gp.check_targets(cls)
    if not problems:  # the processor is what we expect; now the request type it handles
        problems = gp.check_req_class(getattr(importlib.import_module(gp.REQ_MODULE), gp.REQ_CLASS))
    if problems:
        raise LaunchRefused("quality gate cannot hook SGLang: " + "; ".join(problems))
    return f"guard hooks present on {gp.TARGET_CLASS}"


PICKLE_IPC_ENV = "SGLANG_USE_PICKLE_IPC"


def check_guard_ipc(plan: LaunchPlan) -> str:
    """The gate's streaming error needs SGLang's pickle IPC between its processes.

    A trip sets ``FINISH_ABORT(..., HTTPStatus.SERVICE_UNAVAILABLE)``; the scheduler sends its
    ``to_json()`` dict to the detokenizer and on to the tokenizer (``io_struct.py:2732-2763``,
    ``sock_send``/``sock_recv``). Pickle keeps the ``HTTPStatus``; msgpack IPC
    (``SGLANG_USE_PICKLE_IPC=false``, ``environ.py:366``) decodes it as a plain ``int``, and
    ``serving_chat.py:2568`` emits the error event only for an ``HTTPStatus``: the stream would
    end with ``finish_reason: "abort"`` and ``[DONE]``, a truncated answer that looks complete
    (tests/engine/test_guard_sglang_real.py). Non-streaming 503s survive either way.
    """
    if not plan.guard.enabled:
        return "guard ipc: observe mode (never trips)"
    from sglang.srt.environ import envs

    if not envs.SGLANG_USE_PICKLE_IPC.get():
        raise LaunchRefused(
            f"the quality gate needs SGLang's pickle IPC ({PICKLE_IPC_ENV} is false): msgpack "
            "IPC turns a trip's HTTP status into an int and SGLang then ends a stream as if "
            f"complete instead of sending the error; unset {PICKLE_IPC_ENV} or run the gate in "
            "observe mode (--cas-guard-enabled false)"
        )
    return "guard ipc: pickle (a trip's stream error reaches the client)"


def check_reclaim(plan: LaunchPlan) -> str:
    """Strict mode: the reclaim owner's target check (:mod:`cas_engine.sglang.reclaim`)."""
    if plan.kv_reclaim != "strict":
        return "kv reclaim: upstream (SGLang's timeout release; the race stays open)"
    try:
        reclaim = importlib.import_module("cas_engine.sglang.reclaim")
        reclaim.check_decode_queue(reclaim.load_decode_queue_class())
        reclaim.check_other_targets()  # decode peer hooks and prefill source-page pinning
    except ImportError as exc:
        raise LaunchRefused(f"strict KV reclaim requested but unavailable: {exc}") from exc
    except RuntimeError as exc:  # StrictReclaimError
        raise LaunchRefused(f"strict KV reclaim cannot hook SGLang: {exc}") from exc
    return "kv reclaim: strict"


def check_hicache(plan: LaunchPlan) -> str:
    if not plan.hicache_enabled or plan.hicache_check == "off":
        return "hicache check: skipped"
    from cas_engine.sglang.hicache_check import check_hicache_ordering

    verdict = check_hicache_ordering()
    if not verdict.ok and plan.hicache_check == "enforce":
        raise LaunchRefused(f"refusing {HICACHE_FLAG}: {verdict.message}")
    return verdict.message


def check_keys(plan: LaunchPlan) -> str:
    """SGLang's key surfaces are what :mod:`cas_engine.sglang.keys` was written for."""
    from cas_engine.sglang.keys import check_targets

    problems = check_targets()
    if problems:
        raise LaunchRefused(
            "cannot keep the admin key out of SGLang's answers: " + "; ".join(problems)
        )
    if not plan.admin_key:
        return "admin key: none (SGLang's admin endpoints take no key)"
    return f"admin key: from {plan.admin_key_source}, handed to SGLang off its command line"


PREFLIGHT: tuple[Check, ...] = (
    check_version,
    check_keys,
    check_plugin_entry_point,
    check_guard_targets,
    check_guard_ipc,
    check_reclaim,
    check_hicache,
)


def preflight(plan: LaunchPlan, checks: Sequence[Check] | None = None) -> list[str]:
    """Run every check (default :data:`PREFLIGHT`) in order; the first failure raises."""
    return [check(plan) for check in (PREFLIGHT if checks is None else checks)]


# ---- handing over to SGLang ---------------------------------------------------------------------


def export_env(plan: LaunchPlan, environ: MutableMapping[str, str]) -> None:
    """Write the plan where SGLang's spawned processes (and :func:`sglang_plugin`) read it."""
    for name, value in asdict(plan.guard).items():
        environ[f"CAS_GUARD_{name.upper()}"] = (
            str(value).lower() if isinstance(value, bool) else str(value)
        )
    environ[KV_RECLAIM_ENV] = plan.kv_reclaim
    environ[KV_QUARANTINE_ENV] = str(plan.kv_quarantine_rooms)
    if plan.prefill_gone_file:
        environ[PREFILL_GONE_ENV] = plan.prefill_gone_file
    if plan.kv_reclaim == "strict":
        reclaim = importlib.import_module("cas_engine.sglang.reclaim")
        for key, value in reclaim.strict_env().items():
            environ.setdefault(key, value)  # deferred release must be on for strict mode
    environ[HICACHE_DETECTOR_ENV] = "true" if plan.hicache_detector else "false"
    environ[ENABLE_ENV] = "1"
    allowed = environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        environ["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"


def _server_args_class() -> Any:
    """SGLang's ``ServerArgs``; on failure, drop half-imported ``sglang`` modules.

    A failed import leaves submodules such as the namespace package ``sglang.srt`` in
    ``sys.modules`` without their parent, which breaks every later ``import sglang...`` in
    this process with a ``KeyError`` instead of the real error.
    """
    before = set(sys.modules)
    try:
        from sglang.srt.server_args import ServerArgs
    except BaseException:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
        raise
    return ServerArgs


def print_help(out: Callable[[str], None] = print) -> None:
    out(build_cas_parser().format_help())
    try:
        server_args = _server_args_class()
    except Exception as exc:  # SGLang absent or its deps missing: say so, keep our help
        out(f"(SGLang's own flags unavailable here: {type(exc).__name__}: {exc})")
        return
    sg = argparse.ArgumentParser(prog="sglang.launch_server", add_help=False)
    server_args.add_cli_args(sg)
    out(sg.format_help())


def run_sglang(sglang_argv: Sequence[str]) -> None:
    """Run ``python -m sglang.launch_server`` in this process with ``sglang_argv``."""
    sys.argv = ["sglang.launch_server", *sglang_argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = plan_launch(sys.argv[1:] if argv is None else argv)
    if plan.show_help:
        print_help()
        return 0
    try:
        for line in preflight(plan):
            logger.info("preflight: %s", line)
    except LaunchRefused as exc:
        logger.error("cas_engine refuses to start: %s", exc)
        return 3
    export_env(plan, os.environ)
    hand_over_admin_key(plan, os.environ)
    run_sglang(plan.sglang_argv)
    return 0


def hand_over_admin_key(plan: LaunchPlan, environ: MutableMapping[str, str]) -> None:
    """SGLang gets the plan's admin key off its command line; the variable that carried it
    leaves this process's environment (SGLang's own processes get the key with its args)."""
    if plan.admin_key is None:
        return
    from cas_engine.sglang.keys import install_admin_key, install_redaction

    if plan.admin_key_source == "command line":
        logger.warning(
            "the admin key was given on the command line, where the process list shows it; "
            "SGLang gets it off its own command line (pass --cas-admin-key-env instead)"
        )
    install_redaction()
    install_admin_key(plan.admin_key)
    if plan.admin_key_source.startswith("env "):
        environ.pop(plan.admin_key_source.removeprefix("env "), None)


# ---- inside every SGLang process ----------------------------------------------------------------


PLUGIN_FAILED_EXIT = 70  # EX_SOFTWARE: a worker that cannot install its patches stops


def sglang_plugin() -> None:
    """SGLang general-plugin entry point: install our patches from the environment.

    Does nothing unless the launcher set ``CAS_ENGINE_PATCHES=1`` (so merely installing
    cas_engine next to SGLang changes nothing). SGLang catches and only logs an ``Exception``
    from a plugin (sglang/srt/plugins/__init__.py:131-136), which would leave that one process
    running upstream's 30 s timer release while the others are strict; so a failed install
    raises ``SystemExit`` (not an ``Exception``: it escapes that handler) and the process
    stops, which takes the engine down instead of serving unprotected.
    """
    if os.environ.get(ENABLE_ENV) != "1":
        return
    try:
        install_patches()
    except Exception as exc:
        logger.critical(
            "cas_engine: installing the patches failed in process %d; stopping it rather than "
            "serving without them: %s",
            os.getpid(),
            exc,
            exc_info=True,
        )
        raise SystemExit(PLUGIN_FAILED_EXIT) from exc


def install_patches() -> None:
    """The key redaction, strict reclaim (its absence silently reopens the KV race), then the
    optional parts: the quality gate, the prefix reuse tracker, the HiCache ordering fixes, the
    read detector."""
    from prometheus_client import REGISTRY

    from cas_engine.sglang.keys import install_redaction

    install_redaction()  # first: no answer or log line of this process shows a key
    if os.environ.get(KV_RECLAIM_ENV, "strict") == "strict":
        from cas_engine.kvfence.metrics import KvFenceMetrics
        from cas_engine.sglang.prefill_pin import install_prefill_pin
        from cas_engine.sglang.reclaim import install_strict_reclaim

        kv_metrics = KvFenceMetrics(registry=REGISTRY)
        rooms = int(os.environ.get(KV_QUARANTINE_ENV, DEFAULT_QUARANTINE_ROOMS))
        gone = os.environ.get(PREFILL_GONE_ENV)
        install_strict_reclaim(
            metrics=kv_metrics,
            quarantine_budget_rooms=rooms,
            gone_file=Path(gone) if gone else None,
        )
        install_prefill_pin(metrics=kv_metrics)
    from cas_engine.guard import GuardMetrics
    from cas_engine.sglang.guard_patch import install_guard_patch

    config = GuardConfig.from_env()
    install_guard_patch(config, metrics=GuardMetrics.create(REGISTRY, config))
    from cas_engine.prefixreuse import ReuseMetrics
    from cas_engine.sglang.prefix_reuse import install_prefix_reuse

    # prompt reuse times for the operator's hit-rate model (prefill and non-PD schedulers)
    install_prefix_reuse(metrics=ReuseMetrics(REGISTRY))
    from cas_engine.sglang import hicache_check

    # HiCache load-use ordering fixes the start-up check credits (hicache.source_check.PATCHED);
    # no-ops while no layer counter is registered (HiCache off)
    hicache_check.install_ordering_patches()
    if os.environ.get(HICACHE_DETECTOR_ENV) == "true":
        from cas_engine.sglang.hicache_check import install_read_detector

        install_read_detector(registry=REGISTRY)
