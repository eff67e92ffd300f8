"""The engine layer's admin-key rule (`cas_engine.adminkey`), the launcher's handling of the
key, and the sim's `/server_info`, which answers as SGLang 0.5.23 does through the same rule.

Regression (issue 41, item 1): the key was on every engine's command line, and SGLang serves
its command line (`launch_command`) and its resolved settings (`admin_api_key`) to anyone at
`/server_info` and `/get_server_info`; the sim's `/server_info` had neither field, so no test
of the stack could see it. The real SGLang's side: tests/engine/test_admin_key_sglang_real.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cas_engine import adminkey
from cas_engine.launch import plan_launch
from cas_engine.sglang import keys
from cas_engine.sim.config import parse_args
from cas_engine.sim.server import SimServer
from cas_engine.sim.worker import SimWorker

KEY = "0123abcd" * 8


def test_redact_hides_key_fields_at_any_depth_and_key_flags_in_command_lines() -> None:
    info = {
        "admin_api_key": KEY,
        "api_key": None,
        "model_path": "m",
        "launch_command": f"--model-path m --admin-api-key {KEY} --api-key={KEY} --port 1",
        "internal_states": [{"admin_api_key": KEY, "nested": ({"api_key": KEY},)}],
    }
    out = adminkey.redact(info)
    assert KEY not in json.dumps(out)
    assert out["api_key"] is None and out["model_path"] == "m"
    assert out["launch_command"] == (
        "--model-path m --admin-api-key <redacted> --api-key=<redacted> --port 1"
    )
    assert info["admin_api_key"] == KEY  # a copy: the input is left as it was


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "1", "--admin-api-key", KEY],
        ["--port", "1", f"--admin-api-key={KEY}"],
        ["--port", "1", f"--admin-api={KEY}"],  # an abbreviation argparse would expand
    ],
)
def test_an_admin_key_on_a_command_line_is_taken_out_of_sglangs_arguments(
    argv: list[str],
) -> None:
    plan = plan_launch(argv, {})
    assert plan.sglang_argv == ["--port", "1"]
    assert plan.admin_key == KEY and plan.admin_key_source == "command line"
    assert KEY not in repr(plan)


def test_the_launcher_takes_the_key_from_the_variable_the_pod_names() -> None:
    plan = plan_launch(["--port", "1", "--cas-admin-key-env", "MY_KEY"], {"MY_KEY": KEY})
    assert plan.admin_key == KEY and plan.admin_key_source == "env MY_KEY"
    assert plan.sglang_argv == ["--port", "1"]
    assert plan_launch([], {adminkey.ADMIN_KEY_ENV: KEY}).admin_key == KEY
    assert plan_launch([], {}).admin_key is None


def test_the_launcher_refuses_a_named_variable_that_is_unset_or_two_keys() -> None:
    """A pod that names a key must not start without it (its admin endpoints would be open)."""
    with pytest.raises(SystemExit):
        plan_launch(["--cas-admin-key-env", "MY_KEY"], {})
    with pytest.raises(SystemExit):
        plan_launch(["--cas-admin-key-env", "MY_KEY", "--admin-api-key", "x"], {"MY_KEY": KEY})


def test_check_targets_reads_the_installed_sglang_and_names_a_changed_call_site(
    tmp_path: Path,
) -> None:
    """The launcher refuses to start when a surface that served the key changed shape."""
    root = keys.sglang_root()
    if root is None:
        pytest.skip("sglang not installed")
    assert keys.check_targets(root) == []
    for relative, _ in keys.SOURCE_MARKERS:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text((root / relative).read_text())
    engine = tmp_path / "srt/entrypoints/engine.py"
    engine.write_text(engine.read_text().replace("redact_watermark_secrets(server_args", "x("))
    assert [p.split(" ")[0] for p in keys.check_targets(tmp_path)] == ["srt/entrypoints/engine.py"]


async def test_the_sims_server_info_has_sglangs_key_fields_redacted() -> None:
    """The sim answers `/server_info` and `/get_server_info` with SGLang's key fields and its
    `launch_command`, through `adminkey.redact`; the key from the variable the pod names."""
    cfg = parse_args(
        ["--sim-speedup", "50", "--cas-admin-key-env", "MY_KEY", "--api-key", "client"],
        env={"MY_KEY": KEY},
    )
    assert cfg.admin_api_key == KEY and KEY not in repr(cfg)
    worker = SimWorker(cfg)
    await worker.start()
    try:
        async with TestClient(TestServer(SimServer(cfg, worker).app())) as c:
            for path in ("/server_info", "/get_server_info"):
                resp = await c.get(path, headers={"Authorization": "Bearer client"})
                text = await resp.text()
                assert resp.status == 200 and KEY not in text and "client" not in text
                info = json.loads(text)
                assert info["admin_api_key"] == info["api_key"] == "<redacted>"
                assert info["internal_states"][0]["admin_api_key"] == "<redacted>"
                assert "--api-key <redacted>" in info["launch_command"]
            flush = await c.post("/flush_cache", headers={"Authorization": f"Bearer {KEY}"})
            assert flush.status == 200  # the key it read is the one its admin endpoints take
    finally:
        await worker.stop()
