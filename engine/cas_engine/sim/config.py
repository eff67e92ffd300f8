"""Command line of the sim worker: SGLang's argument names plus ``--sim-*`` options.

Data flow: ``parse_args(argv)`` -> one frozen :class:`SimConfig` owned by the worker for its
lifetime (faults are the only live-mutable settings; they live in :mod:`.faults`). SGLang
arguments the sim has no use for are accepted and ignored with ONE log line, so the operator's
real pod arguments work unchanged.

Timing defaults are those of :mod:`.timing` (see its docstring for the published figures they
come from); every duration the model computes is divided by ``--sim-speedup`` on the wall
clock, so tests can run a 30 s scenario in 1 s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from cas_engine.adminkey import ADMIN_KEY_ENV, admin_key_from_env
from cas_engine.sim import SIMULATOR_NOTICE
from cas_engine.sim.timing import TimingParams

log = logging.getLogger("cas_engine.sim")

MODES = ("prefill", "decode", "null")
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
RECLAIM_MODES = ("Immediate", "Upstream", "Strict")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything the worker needs; built only by :func:`parse_args` (or tests)."""

    mode: str = "null"
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998
    model_path: str = "sim/glm-5-class"
    served_model_name: str = ""
    tp_size: int = 8
    max_running_requests: int = 256
    context_length: int = 131072
    seed: int = 0
    speedup: float = 1.0
    timing: TimingParams = field(default_factory=TimingParams)
    kv_slots: int = 512
    kv_slot_bytes: int = 256
    kv_reclaim: str = "Strict"
    prefill_budget_s: float = 300.0
    upstream_release_timeout_s: float = 30.0
    health_delay_s: float = 0.0  # wall seconds before /health answers (SGLang's: about 1)
    spec_num_steps: int = 3
    spec_accept_prob: float = 0.75
    fault: str = ""
    prefill_gone_file: str = ""
    gone_clock_skew_s: float = 10.0
    guard_enabled: bool = True
    guard_args: argparse.Namespace | None = None
    ignored_args: tuple[str, ...] = ()
    api_key: str = ""
    admin_api_key: str = field(default="", repr=False)
    launch_command: str = ""  # the arguments as given, as SGLang records them

    @property
    def model_name(self) -> str:
        """Name clients must use (``--served-model-name`` or the model path)."""
        return self.served_model_name or self.model_path

    def wall(self, sim_seconds: float) -> float:
        """Wall-clock seconds for ``sim_seconds`` of modelled time."""
        return sim_seconds / self.speedup


def build_parser() -> argparse.ArgumentParser:
    """The parser; ``--help`` states that this is a simulator."""
    p = argparse.ArgumentParser(
        prog="python -m cas_engine.sim",
        allow_abbrev=False,
        description=f"{SIMULATOR_NOTICE}. A CPU stand-in for an SGLang worker (prefill, decode "
        "or both) with a timing model instead of a model; for tests and demos only.",
    )
    _add_sglang_arguments(p)
    _add_sim_arguments(p)
    _add_cas_arguments(p)
    try:
        from cas_engine.guard.config import add_guard_arguments
    except ImportError:  # guard package not present in this checkout
        pass
    else:
        add_guard_arguments(p)
    return p


def _add_sglang_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SGLang arguments (same names as sglang.launch_server)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--model-path", "--model", default="sim/glm-5-class")
    g.add_argument("--served-model-name", default="")
    g.add_argument("--tp-size", "--tp", type=int, default=8)
    g.add_argument("--disaggregation-mode", choices=MODES, default="null")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--context-length", type=int, default=131072)
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument("--speculative-num-steps", type=int, default=3)
    g.add_argument("--log-level", default="info")
    g.add_argument("--api-key", default="", help="as SGLang: every endpoint but health/metrics")
    g.add_argument("--admin-api-key", default="", help="as SGLang: its admin endpoints")


def _add_cas_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--cas-*`` flags the operator puts on engine pods (see cas_engine.launch)."""
    g = p.add_argument_group("cas_engine flags (as on real engine pods)")
    g.add_argument(
        "--cas-admin-key-env",
        default=None,
        metavar="NAME",
        help=f"the environment variable holding the admin key, as the launcher reads it "
        f"(default: {ADMIN_KEY_ENV} when set; --admin-api-key wins)",
    )
    g.add_argument(
        "--cas-kv-reclaim",
        type=_reclaim_mode,
        default=None,
        help="strict | upstream | immediate (env CAS_KV_RECLAIM)",
    )
    g.add_argument(
        "--cas-prefill-gone-file",
        default=None,
        help="decode: the operator's feed of prefill pods confirmed gone (a mounted ConfigMap)",
    )
    g.add_argument(
        "--sim-gone-clock-skew",
        type=float,
        default=None,
        help="decode: seconds a room's handshake must precede a gone prefill's end (wall "
        "clock; default as the SGLang adapter, 10)",
    )


def _reclaim_mode(text: str) -> str:
    for mode in RECLAIM_MODES:
        if text.strip().lower() == mode.lower():
            return mode
    raise argparse.ArgumentTypeError(f"expected one of {RECLAIM_MODES}, got {text!r}")


def _resolve_reclaim(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """``--sim-kv-reclaim`` > ``--cas-kv-reclaim`` > ``CAS_KV_RECLAIM`` > Strict."""
    if ns.sim_kv_reclaim:
        return str(ns.sim_kv_reclaim)
    if ns.cas_kv_reclaim:
        return str(ns.cas_kv_reclaim)
    return _reclaim_mode(env.get("CAS_KV_RECLAIM", "Strict"))


def _seconds(flag: float | None, env: Mapping[str, str], name: str, default: float) -> float:
    """``flag`` if given, else the SGLang environment variable ``name``, else ``default``."""
    if flag is not None:
        return flag
    raw = env.get(name, "").strip()
    return float(raw) if raw else default


def _add_sim_arguments(p: argparse.ArgumentParser) -> None:
    d = TimingParams()
    g = p.add_argument_group("simulator options")
    g.add_argument(
        "--sim-speedup",
        type=float,
        default=1.0,
        help="divide every modelled duration by this on the wall clock",
    )
    g.add_argument(
        "--sim-prefill-tps",
        type=float,
        default=d.prefill_tokens_per_s,
        help="uncached prompt tokens/s of one prefill instance",
    )
    g.add_argument(
        "--sim-prefill-attn-ctx",
        type=float,
        default=d.prefill_attn_ctx_tokens,
        help="context length at which a prefill token costs twice as much",
    )
    g.add_argument(
        "--sim-decode-step-ms",
        type=float,
        default=d.decode_step_base_ms,
        help="decode step time at batch size 1 (ms)",
    )
    g.add_argument(
        "--sim-decode-per-seq-ms",
        type=float,
        default=d.decode_per_seq_ms,
        help="extra decode step time per running request (ms)",
    )
    g.add_argument(
        "--sim-decode-per-mtok-ms",
        type=float,
        default=d.decode_per_mtok_ms,
        help="extra decode step time per million KV tokens in the batch (ms)",
    )
    g.add_argument(
        "--sim-kv-capacity",
        type=int,
        default=d.kv_capacity_tokens,
        help="KV capacity in tokens (prefix cache + running requests)",
    )
    g.add_argument(
        "--sim-block-size", type=int, default=d.block_size, help="prefix cache block size in tokens"
    )
    g.add_argument(
        "--sim-kv-slots",
        type=int,
        default=512,
        help="decode KV pool slots (registered memory receiving transfers)",
    )
    g.add_argument(
        "--sim-kv-slot-bytes",
        type=int,
        default=256,
        help="bytes per KV slot (a digest of the prompt's KV, not real KV)",
    )
    g.add_argument(
        "--sim-kv-reclaim",
        choices=RECLAIM_MODES,
        default=None,
        help="when an aborted request's KV slot may be reused (default: --cas-kv-reclaim, "
        "env CAS_KV_RECLAIM, else Strict)",
    )
    g.add_argument(
        "--sim-prefill-budget",
        type=float,
        default=None,
        help="decode aborts a request whose KV has not arrived after this (sim s; default "
        f"env {WAITING_TIMEOUT_ENV} as the operator sets it, else 300 as in SGLang)",
    )
    g.add_argument(
        "--sim-upstream-release-timeout",
        type=float,
        default=None,
        help="Upstream mode: release an aborted slot after this without ack (sim s; default "
        f"env {RELEASE_TIMEOUT_ENV}, else 30 as in SGLang 0.5.23)",
    )
    g.add_argument(
        "--sim-health-delay",
        type=float,
        default=0.0,
        help="wall seconds /health takes to answer (default 0; SGLang 0.5.23's takes a little "
        "over 1: it looks for its scheduler's answer first after a second)",
    )
    g.add_argument(
        "--sim-spec-accept-prob",
        type=float,
        default=0.75,
        help="healthy per-draft acceptance probability (chained)",
    )
    g.add_argument(
        "--sim-fault",
        default="",
        help="faults, e.g. 'kv_write_stall=0.2:5,corruption=0.01,repetition=0,"
        "slow_decode=1,slow_prefill=1,crash=0,hang=0' (see cas_engine.sim.faults)",
    )
    g.add_argument("--sim-seed", type=int, default=None, help="seed (default --random-seed)")


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> SimConfig:
    """Parse ``argv``; unknown (SGLang) arguments are logged once and ignored."""
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    admin_key = ns.admin_api_key or admin_key_from_env(env, ns.cas_admin_key_env or ADMIN_KEY_ENV)
    if ns.cas_admin_key_env and not admin_key:
        parser.error(f"--cas-admin-key-env {ns.cas_admin_key_env}: that variable is unset or empty")
    try:
        kv_reclaim = _resolve_reclaim(ns, env)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"CAS_KV_RECLAIM: {exc}")
    if unknown:
        log.info(
            "sim: ignoring %d SGLang argument(s) it does not model: %s",
            len(unknown),
            " ".join(unknown),
        )
    timing = TimingParams(
        prefill_tokens_per_s=ns.sim_prefill_tps,
        prefill_attn_ctx_tokens=ns.sim_prefill_attn_ctx,
        decode_step_base_ms=ns.sim_decode_step_ms,
        decode_per_seq_ms=ns.sim_decode_per_seq_ms,
        decode_per_mtok_ms=ns.sim_decode_per_mtok_ms,
        kv_capacity_tokens=ns.sim_kv_capacity,
        block_size=ns.sim_block_size,
    )
    if ns.sim_speedup <= 0:
        parser.error("--sim-speedup must be > 0")
    return SimConfig(
        mode=ns.disaggregation_mode,
        host=ns.host,
        port=ns.port,
        bootstrap_port=ns.disaggregation_bootstrap_port,
        model_path=ns.model_path,
        served_model_name=ns.served_model_name,
        tp_size=ns.tp_size,
        max_running_requests=ns.max_running_requests,
        context_length=ns.context_length,
        seed=ns.random_seed if ns.sim_seed is None else ns.sim_seed,
        speedup=ns.sim_speedup,
        timing=timing,
        kv_slots=ns.sim_kv_slots,
        kv_slot_bytes=ns.sim_kv_slot_bytes,
        kv_reclaim=kv_reclaim,
        guard_enabled=ns.cas_guard_enabled is not False,
        prefill_budget_s=_seconds(ns.sim_prefill_budget, env, WAITING_TIMEOUT_ENV, 300.0),
        upstream_release_timeout_s=_seconds(
            ns.sim_upstream_release_timeout, env, RELEASE_TIMEOUT_ENV, 30.0
        ),
        health_delay_s=max(0.0, ns.sim_health_delay),
        spec_num_steps=ns.speculative_num_steps,
        spec_accept_prob=ns.sim_spec_accept_prob,
        fault=ns.sim_fault,
        api_key=ns.api_key,
        admin_api_key=admin_key or "",
        launch_command=" ".join(argv),
        prefill_gone_file=ns.cas_prefill_gone_file or "",
        gone_clock_skew_s=10.0 if ns.sim_gone_clock_skew is None else ns.sim_gone_clock_skew,
        guard_args=ns,
        ignored_args=tuple(unknown),
    )
