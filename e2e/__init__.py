"""The local Kubernetes stack as processes, the harness that runs a fleet on it, and the tests
that prove the operator against it (everything here needs no real GPU and no real cluster).

Sub-packages, bottom to top; each imports only from those before it in this list (and from
``cas_operator`` / ``cas_engine``):

- :mod:`e2e.cluster`: the control plane as processes (etcd, kube-apiserver, controller-manager,
  scheduler, KWOK with fake GPU nodes, the LWS controller), its pinned binaries, certificates and
  process bookkeeping. ``python -m e2e.cluster up|down|status``.
- :mod:`e2e.traffic`: clients only: chat traffic, fault injection and load for the sims and
  routers (no cluster access).
- :mod:`e2e.runtime`: what turns KWOK's pretend pods into real processes at their pod IPs
  (the pod runner, the router shim), plus Prometheus and the operator as processes.
- :mod:`e2e.fleet`: one namespace's fleet assembled from the above (``LiveStack``,
  ``AnomalyStack``) and read-only views of it; shared by the tests, ``make run`` and
  ``bench/anomaly.py``.
- :mod:`e2e.demo`: ``make run`` (``python -m e2e.demo.run_local``).
- :mod:`e2e.tests`: the end-to-end tests (pytest; ``make e2e``) and their cluster fixtures.

:mod:`e2e.paths` holds the repository root for modules that read ``crds/`` or write ``run/``.
"""
