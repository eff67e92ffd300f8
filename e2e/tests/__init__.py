"""End-to-end tests of the operator and the engine layer on the local stack (``make e2e``).

Fixtures in ``conftest.py``: the session's cluster (``CAS_KUBECONFIG``, a running
``make cluster-up``, or a private one), a fresh namespace per test and a bound ``kubectl``.
Tests marked ``e2e`` need that cluster; the others here need only local processes.
"""
