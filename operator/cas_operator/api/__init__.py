"""The v1alpha1 contract: typed models (the single source of truth of the CRD), keys, conditions."""

from cas_operator.api.constants import GROUP, KIND, PLURAL, VERSION
from cas_operator.api.models import CodingAgentServingSpec

__all__ = ["GROUP", "KIND", "PLURAL", "VERSION", "CodingAgentServingSpec"]
