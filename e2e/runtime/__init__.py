"""What runs on the local stack's pretend pods, and the processes beside them.

KWOK binds pods to fake GPU nodes but runs nothing. :mod:`~e2e.runtime.podrunner` watches the
API server and starts, for each engine pod, a ``cas_engine.sim`` process at the pod's IP (and
for each router pod the real SGLang router, via :mod:`~e2e.runtime.router_shim`), plays the
kubelet's readiness prober where pods opt in, and writes Prometheus file_sd targets that
:mod:`~e2e.runtime.prometheus` scrapes. :mod:`~e2e.runtime.operator_process` runs
``python -m cas_operator`` against the cluster.

Ownership: each runner owns the processes it started (stopped by recorded pid, through
:mod:`e2e.cluster.procs`); the cluster and the pods belong to the caller.
"""
