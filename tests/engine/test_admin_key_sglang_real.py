"""The engine admin key never leaves SGLang 0.5.23 through an answer, a command line or its log.

Regression (issue 41, item 1): the operator put ``--admin-api-key=$(CAS_ENGINE_ADMIN_KEY)`` on
the engine's command line. SGLang's ``/server_info`` and ``/get_server_info`` need no key and
answer every resolved field, ``admin_api_key`` included, the scheduler's internal state (the
same fields again) and ``launch_command`` (the literal ``--admin-api-key=...``); its start-up
log prints the resolved fields. Anyone who reached an engine, or a router that forwards
``GET /get_server_info`` (smg 1.13), read the key that unlocks weight updates, LoRA loads,
aborts. Now the key comes in the environment and :mod:`cas_engine.sglang.keys` hands it to
SGLang off its command line and redacts it everywhere SGLang redacts its watermark secrets.

Runs SGLang's own code: its ``prepare_server_args``, its ``/server_info`` and
``/get_server_info`` handlers (http_server.py:853-893) with a stand-in tokenizer manager whose
internal state is the resolved fields (as internal_state.py:45-48 answers), its start-up log
formatter (engine.py:173), its auth decision; and the launcher end to end up to SGLang's
start-up log line. Marked ``sglang_real``: under CI a skip fails (tests/engine/conftest.py).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engine.sglang_real import sglang_import_problem

HTTP_SERVER = "sglang.srt.entrypoints.http_server"
WHY_NOT = sglang_import_problem(HTTP_SERVER, "sglang.srt.entrypoints.engine")
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

REPO = Path(__file__).resolve().parents[2]
KEY = "c0ffee" * 10 + "cafe"  # the shape of the operator's keys (hex)
TINY_LLAMA = {  # enough of a model for SGLang's resolution to pass (weights: --load-format dummy)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@pytest.fixture
def patched_sglang() -> Iterator[None]:
    """Undo what the launcher installs into SGLang's modules in this test process."""
    from cas_engine.sglang import keys

    core = importlib.import_module(keys.REDACT_MODULE)
    server_args = importlib.import_module(keys.SERVER_ARGS_MODULE)
    redact = getattr(core, keys.REDACT_FUNCTION)
    holders = [
        m
        for n, m in list(sys.modules.items())
        if n.startswith("sglang.") and getattr(m, keys.REDACT_FUNCTION, None) is redact
    ]
    prepare = getattr(server_args, keys.PREPARE_FUNCTION)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, keys.REDACT_FUNCTION, redact)
        setattr(server_args, keys.PREPARE_FUNCTION, prepare)


def launched_server_args(tmp_path: Path) -> Any:
    """SGLang's server args as the launcher has SGLang parse them for an operator-made pod."""
    from cas_engine.launch import hand_over_admin_key, plan_launch

    environ = {"CAS_ENGINE_ADMIN_KEY": KEY}
    argv = ["--model-path", str(tmp_path), "--cas-admin-key-env", "CAS_ENGINE_ADMIN_KEY"]
    plan = plan_launch(argv, environ)
    assert KEY not in " ".join(plan.sglang_argv) and KEY not in repr(plan)
    hand_over_admin_key(plan, environ)
    assert "CAS_ENGINE_ADMIN_KEY" not in environ  # SGLang's processes do not inherit it
    server_args = importlib.import_module("sglang.srt.server_args")
    return server_args.prepare_server_args(plan.sglang_argv)


def test_server_info_and_the_start_up_log_never_show_the_admin_key(
    tmp_path: Path, patched_sglang: None
) -> None:
    """Regression: `/server_info`, `/get_server_info` and the start-up log line showed the key
    (`admin_api_key`, `internal_states[*].admin_api_key`, `launch_command`)."""
    args = launched_server_args(tmp_path)
    assert args.admin_api_key == KEY  # SGLang has it...
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    def allowed(header: str | None) -> bool:
        return bool(decide_request_auth(
            method="POST", path="/update_weights_from_disk", authorization_header=header,
            api_key=None, admin_api_key=args.admin_api_key, auth_level=AuthLevel.ADMIN_OPTIONAL,
        ).allowed)  # fmt: skip

    assert allowed(f"Bearer {KEY}") and not allowed(None)  # ...and its admin endpoints need it
    http = importlib.import_module(HTTP_SERVER)

    async def internal_state() -> list[dict[str, Any]]:
        return [args.resolved_dict()]

    manager = SimpleNamespace(server_args=args, startup_time=0.0, get_internal_state=internal_state)
    http._global_state = SimpleNamespace(tokenizer_manager=manager, scheduler_info={})
    for handler in (http.server_info, http.get_server_info):
        answer = asyncio.run(handler())
        text = json.dumps(answer, default=str)
        assert KEY not in text, handler.__name__
        assert answer["admin_api_key"] == "<redacted>"
        assert answer["internal_states"][0]["admin_api_key"] == "<redacted>"
        assert "--admin-api-key=<redacted>" in answer["launch_command"]
    engine = importlib.import_module("sglang.srt.entrypoints.engine")
    logged = f"server_args={engine._server_args_for_logging(args)}"  # engine.py:1185
    assert KEY not in logged and "'admin_api_key': '<redacted>'" in logged


def test_a_key_given_on_the_command_line_never_reaches_sglangs_launch_command(
    tmp_path: Path, patched_sglang: None
) -> None:
    """Regression: an older pod spec (`--admin-api-key=K` in its args) with this engine image
    must neither leave the engine without its key nor let SGLang publish it."""
    from cas_engine.launch import hand_over_admin_key, plan_launch

    plan = plan_launch(["--model-path", str(tmp_path), f"--admin-api-key={KEY}"], {})
    assert plan.admin_key == KEY and plan.admin_key_source == "command line"
    hand_over_admin_key(plan, {})
    args = importlib.import_module("sglang.srt.server_args").prepare_server_args(plan.sglang_argv)
    assert args.admin_api_key == KEY and KEY not in str(args.launch_command)


def _entry_point_dir(tmp_path: Path) -> Path:
    dist = tmp_path / "ep" / "cas_engine_plugin_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cas-engine-plugin-probe\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ncas_engine = cas_engine.launch:sglang_plugin\n"
    )
    return dist.parent


@pytest.mark.timeout(300)
def test_the_launcher_keeps_the_key_out_of_sglangs_start_up_log(tmp_path: Path) -> None:
    """Regression: SGLang's start-up log line `server_args={...}` printed the admin key. The
    real launcher, SGLang's real launch path up to that line (a two-layer Llama config with
    dummy weights gets resolution through); stopped once the line is out."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    path = os.pathsep.join(
        p for p in (str(_entry_point_dir(tmp_path)), os.environ.get("PYTHONPATH", "")) if p
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAS_")}
    env.update(PYTHONPATH=path, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), CAS_ENGINE_ADMIN_KEY=KEY)
    argv = [sys.executable, "-m", "cas_engine.launch_server", "--model-path", str(model),
            "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu",
            "--cas-admin-key-env", "CAS_ENGINE_ADMIN_KEY"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=env, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 240
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "server_args={" in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    out = "".join(lines)
    logged = next((line for line in lines if "server_args={" in line), None)
    assert logged is not None, out[-4000:]
    assert "'admin_api_key': '<redacted>'" in logged, logged[:2000]
    assert "preflight: admin key: from env CAS_ENGINE_ADMIN_KEY" in out, out[-4000:]
    assert KEY not in out, out[-4000:]
