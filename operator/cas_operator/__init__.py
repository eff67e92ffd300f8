"""cas-operator: reconciles CodingAgentServing resources into PD-disaggregated SGLang fleets.

Data flow: ``handlers`` (kopf) -> ``reconcile`` -> ``planning`` (pure plan) -> ``resources``
(pure manifests) -> ``kube`` (the only API-server I/O) -> status computed from observed children.
"""

__version__ = "0.1.0"
