"""Pure: spec -> plan -> complete child manifests. No I/O, no clock, no API client.

`plan.build_plan` validates the spec (`validate`), resolves the instance shapes (`shapes`),
the revision (`revision`), the replica counts (`replicas`, `recommend` for the planner's
answer) and the LayerSplit layout (`layersplit`); `resources.build_all` turns the plan into
every child manifest the reconcile applies.
"""
