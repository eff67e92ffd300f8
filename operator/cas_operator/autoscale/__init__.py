"""Loop 3: the P:D planner and the one replica controller.

`model` is the queueing model and `search` the plan search over it (pure); `signals` turns the
pods' metrics into the measured load (pure); `controller` is the one replica controller (pure);
`loop.Autoscaler` keeps its per-resource state between fleet ticks; `profiles` the packaged
instance profiles.
"""
