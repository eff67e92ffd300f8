"""Traffic for the sims and routers of the local stack: clients only, no cluster access.

- :mod:`~e2e.traffic.simload`: steady chat traffic, live fault injection on one sim
  (``POST /sim/fault``) and a bare observe -> decide loop, for the anomaly tests and
  ``bench/anomaly.py``.
- :mod:`~e2e.traffic.liveload`: bounded coding-agent sessions per resource with rolling
  req/s, errors and TTFT windows, for ``make run``'s live view.

Ownership: each generator owns its tasks (or thread and loop) and stops when told; the caller
owns the stop event and reads the results.
"""
