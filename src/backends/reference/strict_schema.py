"""xgrammar's strict mode made explicit in a JSON schema, for llguidance (which has no such switch)."""

from __future__ import annotations

from typing import Any

_SCHEMA_KEYS = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")


def strict_json_schema(schema: Any) -> Any:
    """A copy of ``schema`` with xgrammar's strict mode made explicit.

    Strict mode forbids what the schema does not declare: objects without ``additionalProperties`` /
    ``unevaluatedProperties`` get ``additionalProperties: false``, arrays without ``items`` /
    ``unevaluatedItems`` get ``items: false`` (only their ``prefixItems``). llguidance has no such switch.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = strict_json_schema(out[key])
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [strict_json_schema(s) for s in out[key]]
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_json_schema(s) for name, s in out[key].items()}
    types = out.get("type")
    type_set = set(types) if isinstance(types, list) else {types}
    if ("object" in type_set or any(k in out for k in _OBJECT_KEYS)) and not (
        "additionalProperties" in out or "unevaluatedProperties" in out
    ):
        out["additionalProperties"] = False
    if ("array" in type_set or "prefixItems" in out) and not ("items" in out or "unevaluatedItems" in out):
        out["items"] = False
    return out
