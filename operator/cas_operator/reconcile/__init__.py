"""Loop 1: apply the desired state with server-side apply and compute the status.

`core.reconcile` is one level-based, idempotent pass (plan -> manifests -> apply -> observe ->
retire -> status); `status` computes the status from the plan and the observed workloads
(pure). `passes.py` runs the passes and writes what they return.
"""
