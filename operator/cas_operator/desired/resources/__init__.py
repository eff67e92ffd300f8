"""Pure builders: `build_<kind>(owner, plan) -> dict`, complete manifests ready to apply.

`build_all` returns every child in dependency order (identity and config before workloads,
workloads before the router that discovers them). No I/O; `kube.py` applies what this returns.
"""

from cas_operator.desired.resources.all import build_all

__all__ = ["build_all"]
