"""Generate the CustomResourceDefinition from the typed models (`make crds`, `make verify`).

Pydantic's JSON schema is converted into a Kubernetes *structural* schema: `$ref`s inlined,
`Optional` collapsed, titles dropped, `int | str` as `x-kubernetes-int-or-string`, object
sections defaulted to their models' full defaults so the API server fills them in, and no
defaults inside list items (Argo CD drift). CEL rules come from the models' `json_schema_extra`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from cas_operator.api import constants as c
from cas_operator.api.models import CodingAgentServingSpec

JsonSchema = dict[str, Any]
KEPT_KEYS = (
    "description",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
)
DNS_1035 = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 32  # "<name>-prefill-<rev8>-<group>" must fit a StatefulSet name (52)


def _resolve(node: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema:
    """Inline a `$ref` (keeping sibling keys such as description and default)."""
    if "$ref" not in node:
        return node
    target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return target


def _collapse_optional(node: JsonSchema) -> JsonSchema:
    """`X | None` -> X; `int | str` -> int-or-string."""
    options = node.get("anyOf")
    if options is None:
        return node
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    members = [m for m in options if m.get("type") != "null"]
    if len(members) == 1:
        merged = dict(members[0])
        merged.update(rest)
        return merged
    types = {m.get("type") for m in members}
    if types == {"integer", "string"}:
        rest["x-kubernetes-int-or-string"] = True
        return rest
    raise ValueError(f"cannot express union {types} in a structural schema")


def convert(node: JsonSchema, defs: dict[str, JsonSchema], *, in_list: bool = False) -> JsonSchema:
    """Convert one pydantic JSON schema node into a structural schema node."""
    node = _collapse_optional(_resolve(node, defs))
    node = _collapse_optional(_resolve(node, defs))  # a ref may hide behind Optional
    out: JsonSchema = {k: node[k] for k in KEPT_KEYS if k in node}
    _openapi_v3_bounds(out)
    kind = node.get("type")
    if kind is None and "enum" in node:
        kind = "string"
    if kind is not None and not out.get("x-kubernetes-int-or-string"):
        out["type"] = kind
    if kind == "object":
        _convert_object(node, out, defs, in_list=in_list)
    elif kind == "array":
        out["items"] = convert(node["items"], defs, in_list=True)
    if "default" in node and node["default"] is not None and not in_list:
        out["default"] = node["default"]
    return out


def _openapi_v3_bounds(out: JsonSchema) -> None:
    """JSON Schema's numeric `exclusiveMinimum: X` is OpenAPI v3.0's `minimum: X` + `true`."""
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = out.get(exclusive)
        if value is not None and not isinstance(value, bool):
            out[bound] = value
            out[exclusive] = True


def _convert_object(
    node: JsonSchema, out: JsonSchema, defs: dict[str, JsonSchema], *, in_list: bool
) -> None:
    properties = node.get("properties")
    if properties:
        out["properties"] = {
            name: convert(prop, defs, in_list=in_list) for name, prop in properties.items()
        }
        required = node.get("required")
        if required:
            out["required"] = list(required)
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = convert(node["additionalProperties"], defs, in_list=in_list)
    elif not out.get("x-kubernetes-preserve-unknown-fields"):
        out["x-kubernetes-preserve-unknown-fields"] = True


def spec_schema() -> JsonSchema:
    """The structural schema of `.spec`; defaultable sections default to their full defaults
    (the API server checks a default against the section's CEL rules, so `{}` is refused)."""
    raw = CodingAgentServingSpec.model_json_schema(by_alias=True, mode="validation")
    schema = convert(raw, raw.get("$defs", {}))
    for name, field in CodingAgentServingSpec.model_fields.items():
        alias = field.alias or name
        if field.default_factory is not None:
            section = field.default_factory()  # type: ignore[call-arg]
            schema["properties"][alias]["default"] = section.model_dump(
                by_alias=True, exclude_none=True, mode="json"
            )
    schema["description"] = "Desired state of a PD-disaggregated SGLang fleet for coding agents."
    return schema


def status_schema() -> JsonSchema:
    """Status is written by the operator only; typed at the top, open below for forward compat."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "observedGeneration": {"type": "integer", "format": "int64"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                    },
                },
            },
        },
    }


PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
    },
    {"name": "P:D", "type": "string", "jsonPath": ".status.ratio.current"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {"name": "Stable", "type": "string", "jsonPath": ".status.rollout.stableRevision"},
    {"name": "Canary", "type": "string", "jsonPath": ".status.rollout.summary"},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.phase", "priority": 1},
    {"name": "Anomaly", "type": "string", "jsonPath": ".status.anomaly.rate"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> JsonSchema:
    """The complete CRD manifest."""
    root: JsonSchema = {
        "type": "object",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
                "(children append role and revision)",
            },
            {
                "rule": f"self.metadata.name.matches('{DNS_1035}')",
                "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits "
                "and '-', starting with a letter): it names the fleet's Services",
            },
        ],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{c.PLURAL}.{c.GROUP}",
            "labels": {c.LABEL_PART_OF: "cas-operator"},
        },
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "listKind": f"{c.KIND}List",
                "shortNames": list(c.SHORT_NAMES),
                "categories": ["all", "cas"],
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `make crds` from cas_operator/api/models.py. Do not edit.\n"


def render() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dirs", type=Path, nargs="+", help="crds/ and the chart's crds/")
    parser.add_argument("--check", action="store_true", help="fail if the files differ")
    args = parser.parse_args(argv)
    text = render()
    stale = []
    for out_dir in args.out_dirs:
        target = out_dir / f"{c.GROUP}_{c.PLURAL}.yaml"
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target)
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    for target in stale:
        print(f"{target} is out of date with the models: run `make crds`", file=sys.stderr)
    if args.check and not stale:
        print("CRDs are up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
