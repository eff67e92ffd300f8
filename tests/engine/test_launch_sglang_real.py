"""The launcher end to end on the real SGLang, as far as a CPU machine without a model allows.

Runs ``python -m cas_engine.launch_server`` in a subprocess with a temporary entry point for
SGLang's plugin loader (the one ``pyproject.toml`` declares): the pre-flight must pass, SGLang's
own launcher must run, load our plugin and get our patches, and then stop at model resolution
(there is no model here). Skipped where SGLang does not import (needs torch and its deps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.sglang_real import sglang_import_problem

WHY_NOT = sglang_import_problem(
    "sglang.srt.server_args", "sglang.srt.managers.scheduler_components.batch_result_processor"
)
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

REPO = Path(__file__).resolve().parents[2]


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


def test_launcher_hands_over_to_sglang_with_patches_installed(tmp_path: Path) -> None:
    """Regression: flags reach the workers' patches and SGLang really starts after pre-flight."""
    path = os.pathsep.join(
        p for p in (str(_entry_point_dir(tmp_path)), os.environ.get("PYTHONPATH", "")) if p
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAS_")}
    env.update(PYTHONPATH=path, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cas_engine.launch_server",
            "--model-path",
            str(tmp_path / "none"),
            "--enable-hierarchical-cache",
            "--cas-guard-window",
            "16",
            "--cas-hicache-detector",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        env=env,
    )
    out = proc.stdout + proc.stderr
    for line in (
        "preflight: guard hooks present on SchedulerBatchResultProcessor",
        "preflight: kv reclaim: strict",
        "preflight: HiCache load-use ordering ok",
        "Loaded plugin cas_engine",
        "cas guard patch installed",
        "cas prefix reuse patch installed on Scheduler.handle_generate_request",
        "window=16",
        "strict KV reclaim installed",
        "read-before-ready detector installed",
    ):
        assert line in out, out[-4000:]
    assert proc.returncode not in (0, 3), out[-4000:]  # stopped by SGLang (no model), not by us


def test_help_lists_sglang_flags_after_ours() -> None:
    """Regression: ``--help`` must show SGLang's own flags, not "unavailable here" (psutil...)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cas_engine.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "unavailable here" not in out, out[-4000:]
    assert out.index("--cas-kv-reclaim") < out.index("--model-path"), out[-4000:]
    for flag in ("--enable-hierarchical-cache", "--disaggregation-mode", "--speculative-algorithm"):
        assert flag in out, out[-4000:]
