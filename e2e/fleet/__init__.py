"""One namespace's fleet on the local stack, assembled from :mod:`e2e.runtime` and
:mod:`e2e.traffic`, and read-only views of it; shared by the e2e tests, ``make run`` and
``bench/anomaly.py``.

- :mod:`~e2e.fleet.livestack`: the operator's path: pod runner (sims and real routers),
  Prometheus and the operator as a process, for a CodingAgentServing the caller applies.
- :mod:`~e2e.fleet.anomaly_stack`: the direct path: a Deployment of sims, a label-following
  router and ``anomaly_tick`` called in-process.
- :mod:`~e2e.fleet.fleetview`: which pods serve, what the router lists, requests served
  (through a ``kubectl`` callable and HTTP to pod IPs).

Ownership: a stack owns the threads and processes it started and stops them on ``close()``; the
namespace, the custom resources and the cluster belong to the caller.
"""
