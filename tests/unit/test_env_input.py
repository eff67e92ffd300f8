"""`engine.env`: a value, or one of the sources an engine needs (a Secret key, a ConfigMap key,
a pod field), rendered as the kubelet reads them; anything else refused naming the field (the
same rules the API server applies through the CRD: e2e/tests/test_operator_core.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources.engine_args import engine_env

SOURCES = [
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    {"name": "TUNING",
     "valueFrom": {"configMapKeyRef": {"name": "tune", "key": "a", "optional": True}}},
    {"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "PLAIN", "value": "1"},
]  # fmt: skip


def test_the_sources_an_engine_needs_render_as_written() -> None:
    plan = plan_raw("demo", "ns", {"model": {"name": "glm-5"}, "engine": {"env": SOURCES}})
    rendered = engine_env(plan)[-len(SOURCES) :]
    assert rendered == SOURCES
    assert yaml.safe_load(yaml.safe_dump(rendered)) == SOURCES  # plain data (enums as text)


@pytest.mark.parametrize(
    ("var", "field"),
    [
        ({"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}, "valueFrom"),
        ({"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}}, "fieldPath"),
        ({"name": "X", "valueFrom": {}}, "engine.env[0].valueFrom"),
        (
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "a", "key": "b"},
                                        "fieldRef": {"fieldPath": "metadata.name"}}},
            "engine.env[0].valueFrom",
        ),
        ({"name": "X", "value": "v", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
         "engine.env[0]"),
        ({"name": "X", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}, "name"),
    ],
)  # fmt: skip
def test_other_sources_are_refused_naming_the_field(var: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        plan_raw("demo", "ns", {"model": {"name": "glm-5"}, "engine": {"env": [var]}})
    assert field in str(err.value) and "engine.env" in str(err.value)
