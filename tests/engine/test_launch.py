"""The launcher: flag splitting, configuration precedence, pre-flight refusals, hand-over."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cas_engine import launch
from cas_engine.guard import GuardConfig
from cas_engine.hicache import HiCacheVerdict
from cas_engine.launch import LaunchPlan, LaunchRefused, export_env, plan_launch, preflight

REPO = Path(__file__).resolve().parents[2]


def test_cas_flags_are_stripped_and_sglang_args_kept_in_order() -> None:
    """Regression: SGLang must receive exactly its own arguments, in order, values intact."""
    argv = [
        "--model-path",
        "/m",
        "--cas-guard-min-accept-length",
        "1.5",
        "--tp",
        "2",
        "--cas-kv-reclaim",
        "upstream",
        "--enable-hierarchical-cache",
        "--cas-hicache-detector",
        "true",
    ]
    plan = plan_launch(argv, env={})
    assert plan.sglang_argv == ["--model-path", "/m", "--tp", "2", "--enable-hierarchical-cache"]
    assert plan.guard == GuardConfig(min_accept_length=1.5)
    assert (plan.kv_reclaim, plan.hicache_detector, plan.hicache_check) == (
        "upstream",
        True,
        "enforce",
    )
    assert plan.hicache_enabled and not plan.show_help


def test_environment_fills_in_and_flags_override() -> None:
    """Regression: the operator configures pods by env; an explicit flag still wins."""
    env = {"CAS_KV_RECLAIM": "upstream", "CAS_GUARD_WINDOW": "8", "CAS_HICACHE_DETECTOR": "1"}
    plan = plan_launch(["--cas-guard-window", "4"], env=env)
    assert plan.guard.window == 4 and plan.kv_reclaim == "upstream" and plan.hicache_detector
    assert plan_launch([], env={}).kv_reclaim == "strict"  # the default closes the race


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--cas-guard-min-acept-length", "1.5"], {}),  # typo must not reach SGLang
        (["--cas-kv-reclaim", "lax"], {}),
        ([], {"CAS_KV_RECLAIM": "lax"}),
        ([], {"CAS_GUARD_MAX_ACCEPT_RATE": "2"}),
        ([], {"CAS_HICACHE_DETECTOR": "maybe"}),
        (["--cas-guard"], {}),  # abbreviations are not accepted
    ],
)
def test_invalid_cas_configuration_exits_with_usage_error(argv: list[str], env: dict) -> None:
    """Regression: a misconfigured pod must fail at start, not run with a silent default."""
    with pytest.raises(SystemExit) as exc:
        plan_launch(argv, env=env)
    assert exc.value.code == 2


def test_help_shows_cas_flags_and_mentions_sglang() -> None:
    """Regression: --help must document our flags and hand over to SGLang's help."""
    plan = plan_launch(["--help"], env={})
    assert plan.show_help
    lines: list[str] = []
    launch.print_help(lines.append)
    text = "\n".join(lines)
    for flag in ("--cas-guard-min-accept-length", "--cas-kv-reclaim", "--cas-hicache-detector"):
        assert flag in text
    assert "SGLang" in text
    # a failed SGLang import must not leave orphaned sglang.* modules behind
    assert "sglang" in sys.modules or not any(m.startswith("sglang.") for m in sys.modules)


def _plan(*sglang: str, **kw) -> LaunchPlan:
    base = dict(
        guard=GuardConfig(),
        kv_reclaim="strict",
        kv_quarantine_rooms=64,
        hicache_detector=False,
        hicache_check="enforce",
        sglang_argv=list(sglang),
    )
    base.update(kw)
    return LaunchPlan(**base)


def test_wrong_sglang_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: patches written for 0.5.23 must never be applied to another release."""
    monkeypatch.setattr("cas_engine.sglang.version.installed_sglang_version", lambda: "0.5.22")
    with pytest.raises(LaunchRefused, match=r"0\.5\.22.*0\.5\.23"):
        launch.check_version(_plan())
    monkeypatch.setattr("cas_engine.sglang.version.installed_sglang_version", lambda: None)
    with pytest.raises(LaunchRefused, match="not installed"):
        launch.check_version(_plan())
    monkeypatch.setattr("cas_engine.sglang.version.installed_sglang_version", lambda: "0.5.23")
    assert "0.5.23" in launch.check_version(_plan())


def test_guard_targets_that_changed_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: if SGLang's accounting method vanished, the launcher must not start."""
    fake = types.ModuleType("fake_brp")

    class SchedulerBatchResultProcessor:
        pass

    fake.SchedulerBatchResultProcessor = SchedulerBatchResultProcessor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_brp", fake)
    monkeypatch.setattr("cas_engine.sglang.guard_patch.TARGET_MODULE", "fake_brp")
    with pytest.raises(LaunchRefused, match="_resolve_spec_v2_tokens is missing"):
        launch.check_guard_targets(_plan())


def test_hicache_check_refuses_warns_or_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: HiCache on an SGLang without the per-layer wait must not start (enforce)."""
    bad = HiCacheVerdict(
        False, "0.5.10", {"X.get_index_k_scale_buffer": False}, "needs sglang >= 0.5.11"
    )
    monkeypatch.setattr("cas_engine.sglang.hicache_check.check_hicache_ordering", lambda: bad)
    with pytest.raises(LaunchRefused, match=r"0\.5\.11"):
        launch.check_hicache(_plan("--enable-hierarchical-cache"))
    assert launch.check_hicache(_plan("--enable-hierarchical-cache", hicache_check="warn")) == (
        bad.message
    )
    with pytest.raises(LaunchRefused):  # SGLang's alias of the same flag
        launch.check_hicache(_plan("--enable-hicache"))
    assert "skipped" in launch.check_hicache(_plan())  # HiCache off: nothing to check


def test_strict_reclaim_requires_its_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: strict mode must never silently fall back to the timeout release."""
    from cas_engine.sglang import reclaim

    class Queue:
        pass

    def refuse(cls: type) -> None:
        raise reclaim.StrictReclaimError("DecodeTransferQueue.resolve_deferred_releases missing")

    monkeypatch.setattr(reclaim, "load_decode_queue_class", lambda: Queue)
    monkeypatch.setattr(reclaim, "check_decode_queue", refuse)
    with pytest.raises(LaunchRefused, match="resolve_deferred_releases"):
        launch.check_reclaim(_plan())
    monkeypatch.setattr(reclaim, "check_decode_queue", lambda cls: None)
    monkeypatch.setattr(reclaim, "check_other_targets", lambda: None)
    assert launch.check_reclaim(_plan()) == "kv reclaim: strict"
    assert "upstream" in launch.check_reclaim(_plan(kv_reclaim="upstream"))


def test_preflight_runs_in_order_and_stops_at_first_refusal() -> None:
    """Regression: a failed check must stop the launch before later checks or SGLang run."""
    ran: list[str] = []

    def ok(plan: LaunchPlan) -> str:
        ran.append("ok")
        return "fine"

    def refuse(plan: LaunchPlan) -> str:
        ran.append("refuse")
        raise LaunchRefused("no")

    assert preflight(_plan(), [ok, ok]) == ["fine", "fine"]
    ran.clear()
    with pytest.raises(LaunchRefused):
        preflight(_plan(), [ok, refuse, ok])
    assert ran == ["ok", "refuse"]


def test_export_env_round_trips_to_the_worker_processes() -> None:
    """Regression: spawned SGLang workers must see exactly the launcher's configuration."""
    plan = _plan(
        guard=GuardConfig(min_accept_length=1.6, window=8, enabled=False),
        kv_reclaim="upstream",
        hicache_detector=True,
    )
    env = {"SGLANG_PLUGINS": "other"}
    export_env(plan, env)
    assert GuardConfig.from_env(env) == plan.guard
    assert (env["CAS_KV_RECLAIM"], env["CAS_HICACHE_DETECTOR"], env["CAS_ENGINE_PATCHES"]) == (
        "upstream",
        "true",
        "1",
    )
    assert env["SGLANG_PLUGINS"] == "other,cas_engine"  # a whitelist must not drop us
    strict: dict[str, str] = {}
    export_env(_plan(), strict)
    assert strict["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] == "1"


def test_plugin_is_inert_unless_the_launcher_enabled_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: installing cas_engine next to SGLang must not patch plain SGLang runs."""
    monkeypatch.delenv("CAS_ENGINE_PATCHES", raising=False)
    monkeypatch.setitem(sys.modules, "cas_engine.sglang.guard_patch", None)  # import would fail
    launch.sglang_plugin()


def test_main_refuses_without_handing_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a refused pre-flight must exit non-zero and never start SGLang."""
    started: list[list[str]] = []
    monkeypatch.setattr(launch, "run_sglang", started.append)
    checked: list[LaunchPlan] = []

    def refuse(plan: LaunchPlan) -> str:
        checked.append(plan)
        raise LaunchRefused("x")

    monkeypatch.setattr(launch, "PREFLIGHT", (refuse,))
    assert launch.main(["--model-path", "/m"]) == 3 and started == []
    assert len(checked) == 1


def test_main_hands_sglang_its_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: after the checks, SGLang runs with its own args and our env exported."""
    started: list[list[str]] = []
    monkeypatch.setattr(launch, "run_sglang", lambda argv: started.append(list(argv)))
    monkeypatch.setattr(launch, "PREFLIGHT", (lambda p: "ok",))
    monkeypatch.setattr(launch.os, "environ", {})
    assert launch.main(["--model-path", "/m", "--cas-guard-window", "4"]) == 0
    assert started == [["--model-path", "/m"]]
    assert launch.os.environ["CAS_GUARD_WINDOW"] == "4"


def test_run_sglang_runs_sglangs_module_as_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: hand-over must be SGLang's own __main__ with argv[1:] = SGLang's args."""
    seen = {}

    def fake_run_module(name: str, run_name: str, alter_sys: bool) -> None:
        seen.update(name=name, run_name=run_name, argv=list(sys.argv))

    monkeypatch.setattr(launch.runpy, "run_module", fake_run_module)
    monkeypatch.setattr(sys, "argv", ["x"])
    launch.run_sglang(["--model-path", "/m"])
    assert seen == {
        "name": "sglang.launch_server",
        "run_name": "__main__",
        "argv": ["sglang.launch_server", "--model-path", "/m"],
    }


def test_plugin_installs_patches_configured_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: each SGLang process must apply exactly the launcher's configuration."""
    import prometheus_client

    from cas_engine.sglang import guard_patch, hicache_check, prefix_reuse

    calls: dict[str, object] = {}
    monkeypatch.setattr(prometheus_client, "REGISTRY", prometheus_client.CollectorRegistry())
    monkeypatch.setattr(
        prefix_reuse, "install_prefix_reuse", lambda metrics: calls.setdefault("reuse", metrics)
    )
    monkeypatch.setattr(
        guard_patch,
        "install_guard_patch",
        lambda config, metrics: calls.setdefault("guard", config),
    )
    monkeypatch.setattr(
        hicache_check,
        "install_read_detector",
        lambda registry: calls.setdefault("detector", registry),
    )
    for key, value in {
        "CAS_ENGINE_PATCHES": "1",
        "CAS_GUARD_MIN_ACCEPT_LENGTH": "1.7",
        "CAS_KV_RECLAIM": "upstream",
        "CAS_HICACHE_DETECTOR": "true",
    }.items():
        monkeypatch.setenv(key, value)
    launch.sglang_plugin()
    assert calls["guard"] == GuardConfig(min_accept_length=1.7)
    assert calls["detector"] is prometheus_client.REGISTRY
    assert calls["reuse"] is not None  # the prefix reuse tracker, on the same registry
    monkeypatch.setenv("CAS_HICACHE_DETECTOR", "false")
    calls.clear()
    monkeypatch.setattr(prometheus_client, "REGISTRY", prometheus_client.CollectorRegistry())
    launch.sglang_plugin()
    assert "detector" not in calls and "guard" in calls


def test_strict_reclaim_gets_its_quarantine_budget_and_is_installed_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the plugin installed strict reclaim without a quarantine budget, so a
    decode holding rooms forever never reported unhealthy; and it installed the optional
    guard first. The operator's budget (--cas-kv-quarantine-rooms, env) reaches the patch."""
    import prometheus_client

    from cas_engine.sglang import guard_patch, hicache_check, prefill_pin, prefix_reuse, reclaim

    order: list[tuple[str, object]] = []
    monkeypatch.setattr(prometheus_client, "REGISTRY", prometheus_client.CollectorRegistry())
    monkeypatch.setattr(
        reclaim,
        "install_strict_reclaim",
        lambda metrics, quarantine_budget_rooms, gone_file: order.append(
            ("reclaim", (quarantine_budget_rooms, gone_file))
        ),
    )
    monkeypatch.setattr(
        prefill_pin, "install_prefill_pin", lambda metrics: order.append(("pin", 0))
    )
    monkeypatch.setattr(
        guard_patch, "install_guard_patch", lambda config, metrics: order.append(("guard", 0))
    )
    monkeypatch.setattr(hicache_check, "install_ordering_patches", lambda: None)
    monkeypatch.setattr(
        prefix_reuse, "install_prefix_reuse", lambda metrics: order.append(("reuse", 0))
    )
    plan = plan_launch(
        ["--cas-kv-quarantine-rooms", "12", "--cas-prefill-gone-file", "/etc/g/p.json"], env={}
    )
    env: dict[str, str] = {}
    export_env(plan, env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch.sglang_plugin()
    assert order == [
        ("reclaim", (12, Path("/etc/g/p.json"))),
        ("pin", 0),
        ("guard", 0),
        ("reuse", 0),
    ]
    assert plan_launch([], env={}).kv_quarantine_rooms == launch.DEFAULT_QUARANTINE_ROOMS
    with pytest.raises(SystemExit):
        plan_launch(["--cas-kv-quarantine-rooms", "0"], env={})


def test_a_failed_install_stops_the_process_instead_of_serving_unpatched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: SGLang catches and logs an Exception from a plugin
    (sglang/srt/plugins/__init__.py:131-136), so one worker whose install failed ran
    upstream's timer release silently. The plugin now raises SystemExit, which SGLang's
    `except Exception` does not catch."""
    from cas_engine.sglang import reclaim

    def broken(**_: object) -> None:
        raise RuntimeError("DecodeTransferQueue.resolve_deferred_releases is gone")

    monkeypatch.setattr(reclaim, "install_strict_reclaim", broken)
    monkeypatch.setenv("CAS_ENGINE_PATCHES", "1")
    monkeypatch.setenv("CAS_KV_RECLAIM", "strict")
    with pytest.raises(SystemExit) as stopped:
        launch.sglang_plugin()
    assert stopped.value.code == launch.PLUGIN_FAILED_EXIT
    assert not isinstance(stopped.value, Exception)  # escapes SGLang's handler
