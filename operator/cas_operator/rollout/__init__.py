"""Loop 4, canary rollouts: `state` (status.rollout, shared with the reconcile), `analysis`
(the canary against the stable revision, pure), `decide` (one tick of the state machine,
pure), `act` (observe both revisions, read a user's action, decide; run by the fleet tick)."""
