"""Where the binaries of the local stack live, for the pinned versions in
``e2e/cluster/versions.env``.

Data flow: ``versions.env`` is the single source of the pinned versions;
``e2e/cluster/build-bins.sh`` sources it and builds into ``$CAS_BIN_DIR/<component>-<version>/``;
this module reads the same file and resolves the same paths for ``e2e/cluster/stack.py`` and the
test fixtures. Nothing here builds or downloads anything.

``python -m e2e.cluster.bins`` prints ``NAME=path`` lines (shell-sourceable); ``--check`` exits 1
and names what is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
VERSIONS_FILE = E2E_DIR / "versions.env"
BUILD_SCRIPT = E2E_DIR / "build-bins.sh"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (comments and blank lines ignored) of the versions file."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not a KEY=VALUE line: {raw!r}")
        versions[key.strip()] = value.strip().strip("'\"")
    return versions


def bin_dir() -> Path:
    """The cache root shared by every clone: ``$CAS_BIN_DIR`` or ``~/.cache/cas-operator/bin``."""
    override = os.environ.get("CAS_BIN_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "cas-operator" / "bin"


# Started by the tests that need them, never by `up` (e2e/cluster/argocd.py for Argo CD): a
# stack without them still starts.
OPTIONAL = ("argocd_controller", "argocd_repo_server", "argocd_manifests", "netpol")


@dataclass(frozen=True)
class Bins:
    """Absolute paths of every binary and data folder the harness needs."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kube_proxy: Path
    etcd: Path
    kwok: Path
    kwok_stages: Path
    lws_controller: Path
    lws_crds: Path
    lws_webhook: Path
    traefik: Path
    gateway_crds: Path
    helm: Path
    argocd_controller: Path  # Argo CD's one binary, started under each component's name
    argocd_repo_server: Path
    argocd_manifests: Path  # crds/ and base/config/argocd-cm.yaml, from Argo CD's module
    netpol: Path  # NetworkPolicy enforcement some e2e tests start (e2e/runtime/netpol.py)

    def missing(self, *, optional: bool = False) -> list[str]:
        """Names of the entries that do not exist on disk (empty when the build is complete);
        the stack's own only, unless ``optional`` (then also what only some tests start:
        :data:`OPTIONAL`)."""
        return [f.name for f in fields(self) if (optional or f.name not in OPTIONAL)
                and not getattr(self, f.name).exists()]  # fmt: skip

    def as_env(self) -> dict[str, str]:
        """``CAS_<NAME>`` -> path, for shells and subprocesses."""
        return {f"CAS_{f.name.upper()}": str(getattr(self, f.name)) for f in fields(self)}


def resolve(root: Path | None = None) -> Bins:
    """Paths for the pinned versions under ``root`` (default: :func:`bin_dir`)."""
    v = read_versions()
    base = root or bin_dir()
    kube = base / f"kubernetes-{v['KUBERNETES_VERSION']}"
    kwok = base / f"kwok-{v['KWOK_VERSION']}"
    lws = base / f"lws-{v['LWS_VERSION']}"
    traefik = base / f"traefik-{v['TRAEFIK_VERSION']}"
    argocd = base / f"argocd-{v['ARGOCD_VERSION']}"
    return Bins(
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        kubectl=kube / "kubectl",
        kube_proxy=kube / "kube-proxy",
        etcd=base / f"etcd-{v['ETCD_VERSION']}" / "etcd",
        kwok=kwok / "kwok",
        kwok_stages=kwok / "stages",
        lws_controller=lws / "lws-controller-manager",
        lws_crds=lws / "crds",
        lws_webhook=lws / "webhook",
        traefik=traefik / "traefik",
        gateway_crds=traefik / "gateway-crds",
        helm=base / f"helm-{v['HELM_VERSION']}" / "helm",
        argocd_controller=argocd / "argocd-application-controller",
        argocd_repo_server=argocd / "argocd-repo-server",
        argocd_manifests=argocd / "manifests",
        netpol=base / f"kube-network-policies-{v['KUBE_NETWORK_POLICIES_VERSION']}" / "cas-netpol",
    )


def main(argv: list[str] | None = None) -> int:
    """Print the resolved paths; with ``--check`` fail (exit 1) when any is missing."""
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster.bins", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a binary is missing")
    args = parser.parse_args(argv)
    bins = resolve()
    for key, value in bins.as_env().items():
        print(f"{key}={value}")
    missing = bins.missing(optional=True)
    if args.check and missing:
        print(f"missing: {', '.join(missing)} (run {BUILD_SCRIPT})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
