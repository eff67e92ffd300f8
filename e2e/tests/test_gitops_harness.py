"""Fast checks of the GitOps harness (e2e/cluster/argocd.py, e2e/fleet/gitops.py) that need no
cluster and no Argo CD build: its side processes are known by pid and stopped exactly, and the
repository it serves is what a git client reads.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from e2e.cluster import argocd, procs
from e2e.cluster.bins import OPTIONAL, resolve
from e2e.cluster.stack import free_ports
from e2e.fleet.gitops import FleetRepo

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server not installed (make sysdeps)"
)


def _started(tmp_path: Path) -> argocd.ArgoCD:
    found = argocd.ArgoCD(run_dir=tmp_path, namespace="x", ports=free_ports(argocd.PORT_NAMES))
    starter = argocd._Starter(found, tmp_path / "kubeconfig", log=lambda _line: None)
    try:
        starter.redis()
        starter.git_daemon()
    except BaseException:
        found.stop()
        raise
    return found


@needs_redis
def test_redis_and_the_git_daemon_are_known_by_pid_and_stopped_exactly(tmp_path: Path) -> None:
    """Regression: redis-server rewrites its process title (argv), so the harness, which knows
    its processes by pid, start time and argv[0], took it for gone at once: `stop` reported
    "already exited" and left it running."""
    started = _started(tmp_path)
    try:
        time.sleep(0.5)
        assert started.crashed() == [], started.crash_report()
    finally:
        messages = started.stop()
    assert [m.split(" (")[0] for m in messages] == ["stopped git-daemon", "stopped redis"], messages
    assert all(not procs.is_running(r) for r in started.records)


@needs_redis
def test_commits_are_served_by_the_git_daemon(tmp_path: Path) -> None:
    """What Argo CD's repo server asks the daemon (`git ls-remote`) names each pushed commit,
    and a revert is a new commit on main."""
    started = _started(tmp_path)
    try:
        repo = FleetRepo(started.repos, tmp_path / "work")
        repo.init()
        first = repo.commit("one", {"fleet/a.yaml": {"a": 1}})
        second = repo.commit("two", {"fleet/a.yaml": None, "fleet/b.yaml": {"b": 2}})
        reverted = repo.revert(second)
        remote = subprocess.run(["git", "ls-remote", started.repo_url(repo.name)],
                                capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    finally:
        started.stop()
    assert f"{reverted}\trefs/heads/main" in remote.stdout.splitlines()
    assert len({first, second, reverted}) == 3
    assert (tmp_path / "work/fleet/a.yaml").exists()
    assert not (tmp_path / "work/fleet/b.yaml").exists()


def test_the_stack_starts_without_argo_cd_which_only_the_gitops_test_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Regression: with Argo CD among the stack's binaries, `up` refused to start (and every
    e2e test skipped) where Argo CD was not built, though only the GitOps test runs it; that
    test says what is missing instead."""
    monkeypatch.setenv("CAS_BIN_DIR", str(tmp_path))
    bins = resolve()
    assert "kube_apiserver" in bins.missing()
    assert not [name for name in bins.missing() if name.startswith("argocd")]
    assert set(OPTIONAL) <= set(bins.missing(optional=True))
    assert "Argo CD is not built" in (argocd.missing() or "")
