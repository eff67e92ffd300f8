"""Guards the suite's grouping under pytest-xdist: tests marked ``xdist_group`` (the clusterwide
e2e tests, the tests that share a module-scoped fleet) must run on one worker. xdist 3.8 names
a group by setting ``item._nodeid``, which pytest 9.2 ignores; the root conftest's
``name_group`` does it the way pytest reads. Without it this test sees the group on two
workers, as the clusterwide tests were once split and ran beside an operator per namespace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = f"""
import importlib.util, pytest
spec = importlib.util.spec_from_file_location("cas_root_conftest", {str(ROOT / "conftest.py")!r})
root = importlib.util.module_from_spec(spec)
spec.loader.exec_module(root)

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):
        for item in items:
            root.name_group(item)
"""

TESTS = """
import os, time, pytest

def _note(name):
    with open(os.environ["WHERE"], "a") as out:
        out.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    _note("grouped")
    time.sleep(0.2)

@pytest.mark.parametrize("n", range(6))
def test_free(n):
    _note("free")
    time.sleep(0.2)
"""


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_groups.py").write_text(TESTS)
    where = tmp_path / "where.txt"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line.split() for line in where.read_text().splitlines()]
    grouped = {worker for name, worker in lines if name == "grouped"}
    assert len([1 for name, _ in lines if name == "grouped"]) == 6
    assert len(grouped) == 1, f"the group ran on {sorted(grouped)}"
    assert {worker for _, worker in lines} == {"gw0", "gw1"}, "both workers should have run tests"
