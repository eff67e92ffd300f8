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
from dataclasses import dataclass
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


# A first-import hook, as sitecustomize (Python imports it at start-up, before `-m` runs): it
# writes what PROMETHEUS_MULTIPROC_DIR was when prometheus_client was first imported.
IMPORT_PROBE = """\
import os, sys

class _FirstPrometheusImport:
    def find_spec(self, name, path=None, target=None):
        if name == "prometheus_client" and self in sys.meta_path:
            sys.meta_path.remove(self)
            with open(os.environ["CAS_TEST_IMPORT_PROBE"], "w") as out:
                out.write(os.environ.get("PROMETHEUS_MULTIPROC_DIR", "<unset>"))
        return None

sys.meta_path.insert(0, _FirstPrometheusImport())
"""


@dataclass(frozen=True)
class HelpRun:
    """One ``python -m cas_engine.launch_server --help`` (each run imports SGLang and torch,
    ~15 s of CPU, so this module's help tests share it)."""

    returncode: int
    stdout: str
    output: str  # stdout, then stderr
    prometheus_dir_at_import: str  # PROMETHEUS_MULTIPROC_DIR when prometheus_client came in


@pytest.fixture(scope="module")
def help_run(tmp_path_factory: pytest.TempPathFactory) -> HelpRun:
    probe_dir = tmp_path_factory.mktemp("import-probe")
    (probe_dir / "sitecustomize.py").write_text(IMPORT_PROBE)
    seen = probe_dir / "seen"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    path = os.pathsep.join(p for p in (str(probe_dir), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, CAS_TEST_IMPORT_PROBE=str(seen))
    proc = subprocess.run(
        [sys.executable, "-m", "cas_engine.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=env,
    )
    at_import = seen.read_text() if seen.exists() else "<never imported>"
    return HelpRun(proc.returncode, proc.stdout, proc.stdout + proc.stderr, at_import)


def test_module_entry_point_prints_help(help_run: HelpRun) -> None:
    """Regression: `python -m cas_engine.launch_server --help` must work as a command."""
    assert help_run.returncode == 0, help_run.output[-4000:]
    assert "--cas-guard-max-accept-rate" in help_run.stdout


def test_help_lists_sglang_flags_after_ours(help_run: HelpRun) -> None:
    """Regression: ``--help`` must show SGLang's own flags, not "unavailable here" (psutil...)."""
    out = help_run.output
    assert help_run.returncode == 0, out[-4000:]
    assert "unavailable here" not in out, out[-4000:]
    assert out.index("--cas-kv-reclaim") < out.index("--model-path"), out[-4000:]
    for flag in ("--enable-hierarchical-cache", "--disaggregation-mode", "--speculative-algorithm"):
        assert flag in out, out[-4000:]


def test_prometheus_multiproc_dir_is_set_before_prometheus_client_is_imported(
    help_run: HelpRun,
) -> None:
    """Regression: importing prometheus_client before SGLang's multiprocess directory is set
    silently drops SGLang's main-process metrics from /metrics."""
    assert "cas-engine-prometheus-" in help_run.prometheus_dir_at_import, (
        help_run.prometheus_dir_at_import, help_run.output[-2000:])  # fmt: skip
