"""The local control plane as processes: ``python -m e2e.cluster up|down|status``.

Data flow: ``versions.env`` pins the versions; ``build-bins.sh`` (``make bins``) builds the
binaries into ``$CAS_BIN_DIR``; :mod:`~e2e.cluster.bins` resolves their paths;
:mod:`~e2e.cluster.stack` starts them (certificates from :mod:`~e2e.cluster.pki`, node and
config objects from :mod:`~e2e.cluster.manifests`, start-up API calls via
:mod:`~e2e.cluster.api`, every process through :mod:`~e2e.cluster.procs`) and records them in
``<run>/state.json``, so ``down`` stops exactly those pids.

Ownership: a :class:`~e2e.cluster.stack.ClusterHandle` owns the processes it started and its
run folder; whatever runs on the cluster (pods, the operator) belongs to the caller. Nothing in
this package knows about engines, routers or the operator.
"""
