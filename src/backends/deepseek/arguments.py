"""A DSML call's parameters as OpenAI ``arguments`` JSON, typed by the tool's declared schema (format spec H8).

The model marks each value ``string="true"`` (raw text) or ``string="false"`` (JSON), and sometimes marks it
wrongly: ``string="true">2`` for an integer parameter, a bare number for a string one. DeepSeek's reference
parser corrects such values against the tool's parameter schema, and so does this module, so a client validating
the arguments against its own schema sees the types it declared:

- a text value for a parameter that does not accept strings becomes the first of null / integer / number /
  boolean / object / array (in that order) that the schema allows and the text spells;
- a JSON value of a type the schema does not allow becomes its JSON text when the schema allows strings;
- objects and arrays are corrected member by member where the schema declares ``properties`` / ``items``.

Types come from ``type``, ``enum`` / ``const`` values, ``anyOf`` / ``oneOf`` / ``allOf`` branches and local
``$ref`` pointers. A schema that says nothing about types leaves the value alone. Unlike the reference parser, a
text value stays text whenever the schema accepts strings (the model said it was a string, and it is valid).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from backends.deepseek.json_schema import resolve, schema_types
from backends.deepseek.markers import DSML, DSML_PARAMETER_END

_PARAMETER = re.compile(
    "<"
    + re.escape(DSML)
    + r' parameter\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>(.*?)'
    + "(?:"
    + re.escape(DSML_PARAMETER_END)
    + "|(?=<"
    + re.escape(DSML)
    + r" parameter\s+name=))",
    re.DOTALL,
)
"""One complete parameter. A value whose closing tag is missing ends at the next parameter (as in DeepSeek's
parser); one that runs to the end of the call or of the output is unfinished and left out. The ``string`` attribute
may be missing (the model sometimes leaves it out): the value is then read as ``string="false"`` is, JSON or else
text, as vLLM's V4.1 parser reads it, rather than dropping the parameter."""

_UNWRAP_KEYS = ("arguments", "input")
_TEXT_TYPES = ("null", "integer", "number", "boolean", "object", "array")
"""The order in which a text value is tried against the non-string types a schema allows."""


def arguments_json(raw: str, parameters: Mapping[str, Any] | None) -> str:
    """Turn an invoke's raw DSML parameters into OpenAI's JSON ``arguments`` string.

    ``parameters`` is the tool's JSON Schema (None for an undeclared tool: values keep the types the model
    marked). With a schema, a lone ``arguments`` or ``input`` parameter that the tool does not declare, holding
    an object whose keys it does declare, is replaced by that object (DeepSeek's unwrap rule), and values are
    corrected to the declared types.
    """
    params: dict[str, Any] = {}
    for name, is_string, value in _PARAMETER.findall(raw):
        if is_string == "true":
            params[name] = value
        else:
            try:
                params[name] = json.loads(value)
            except ValueError:
                params[name] = value
    if parameters is not None:
        properties = parameters.get("properties")
        declared = properties if isinstance(properties, Mapping) else {}
        params = _unwrapped(params, declared)
        params = coerce(params, parameters, parameters)
    return json.dumps(params, ensure_ascii=False)


def _unwrapped(params: dict[str, Any], declared: Mapping[str, Any]) -> dict[str, Any]:
    if len(params) != 1:
        return params
    ((key, inner),) = params.items()
    if key not in _UNWRAP_KEYS or key in declared:
        return params
    if isinstance(inner, str):
        try:
            inner = json.loads(inner)
        except ValueError:
            return params
    if isinstance(inner, dict) and set(inner) <= set(declared):
        return inner
    return params


def coerce(value: Any, schema: Any, root: Any) -> Any:
    """``value`` corrected to the types ``schema`` allows (``root`` resolves ``$ref``); unchanged if it fits."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping):
        return value
    types = schema_types(schema, root)
    if isinstance(value, str):
        if types is None or "string" in types:
            return value
        return _from_text(value, types)
    if isinstance(value, dict):
        if types is not None and "object" not in types:
            return _as_text(value, types)
        properties = _merged(schema, "properties", root)
        if properties:
            return {k: coerce(v, properties[k], root) if k in properties else v for k, v in value.items()}
        return value
    if isinstance(value, list):
        if types is not None and "array" not in types:
            return _as_text(value, types)
        items = resolve(schema.get("items"), root)
        if isinstance(items, Mapping):
            return [coerce(item, items, root) for item in value]
        return value
    if types is None or _fits(value, types):
        return value
    if isinstance(value, float) and value.is_integer() and "integer" in types:
        return int(value)
    return _as_text(value, types)


def _fits(value: Any, types: frozenset[str]) -> bool:
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return "integer" in types or "number" in types
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    return True


def _as_text(value: Any, types: frozenset[str]) -> Any:
    """A JSON value of a type the schema refuses: its JSON text if strings are allowed, else unchanged."""
    return json.dumps(value, ensure_ascii=False) if "string" in types else value


def _from_text(text: str, types: frozenset[str]) -> Any:
    """The first non-string type in ``_TEXT_TYPES`` that ``types`` allows and ``text`` spells, else ``text``."""
    stripped = text.strip()
    for kind in _TEXT_TYPES:
        if kind not in types:
            continue
        if kind == "null" and stripped.lower() == "null":
            return None
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            try:
                parsed = json.loads(stripped)
            except ValueError:
                continue
            if kind == "integer" and isinstance(parsed, int | float) and not isinstance(parsed, bool):
                if isinstance(parsed, int) or parsed.is_integer():
                    return int(parsed)
            elif kind == "number" and isinstance(parsed, int | float) and not isinstance(parsed, bool):
                if math.isfinite(parsed):
                    return parsed
            elif (kind == "object" and isinstance(parsed, dict)) or (kind == "array" and isinstance(parsed, list)):
                return parsed
    return text


def _merged(schema: Mapping[str, Any], key: str, root: Any) -> dict[str, Any]:
    """``schema[key]`` merged with the same key of its ``allOf`` branches (for ``properties``)."""
    out: dict[str, Any] = {}
    for branch in schema.get("allOf") or ():
        branch = resolve(branch, root)
        if isinstance(branch, Mapping) and isinstance(branch.get(key), Mapping):
            out.update(branch[key])
    if isinstance(schema.get(key), Mapping):
        out.update(schema[key])
    return out
