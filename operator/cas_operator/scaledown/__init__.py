"""The scale-down loop (run by the fleet tick after loops 2 and 3): shrink a pool, cut nothing.

When a pool's desired count (`status.<pool>.replicas`, from the spec, `kubectl scale` or Auto)
is below its live instances, `decide.retire_step` (pure) picks the instances to remove (least
running work and no KV transfer in flight; for a LeaderWorkerSet, the highest group indices,
which its StatefulSet removes), and `act.scale_down_tick` takes them out of rotation, waits for
them to go idle, then gives them the lowest `controller.kubernetes.io/pod-deletion-cost`. The
reconcile lowers the workload's replica count only as far as released instances allow
(`decide.replicas_to_apply`), so the ReplicaSet (or LWS) removes exactly those.
"""
