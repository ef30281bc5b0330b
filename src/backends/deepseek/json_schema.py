"""Reading a client's JSON Schema: local ``$ref`` pointers, and the JSON types a schema allows.

Shared by the argument typing of parsed tool calls (``arguments``), the schema checks and the grammar compilers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_JSON_TYPE_OF: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object"}


def schema_types(schema: Any, root: Any, _seen: frozenset[int] = frozenset()) -> frozenset[str] | None:
    """The JSON types ``schema`` allows, or None when it does not restrict them (or cannot be read)."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping) or id(schema) in _seen:
        return None
    seen = _seen | {id(schema)}
    found: set[str] = set()
    restricted = False
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
        restricted = True
    elif isinstance(kind, list) and kind:
        found.update(k for k in kind if isinstance(k, str))
        restricted = True
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        values = [schema["const"]]
    if values is not None and not restricted:
        for value in values:
            found.add("null" if value is None else "array" if isinstance(value, list) else _json_type(value))
        restricted = True
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and not restricted:
            union: set[str] = set()
            for branch in branches:
                branch_types = schema_types(branch, root, seen)
                if branch_types is None:
                    return None
                union |= branch_types
            found |= union
            restricted = True
    if not restricted:
        for branch in schema.get("allOf") or ():
            branch_types = schema_types(branch, root, seen)
            if branch_types is not None:
                return branch_types
        if isinstance(schema.get("properties"), Mapping):
            return frozenset({"object"})
        return None
    if "number" in found:
        found.add("integer")
    return frozenset(found)


def _json_type(value: Any) -> str:
    for kind, name in _JSON_TYPE_OF.items():
        if type(value) is kind:
            return name
    return "string"


def resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local ``$ref`` (``#/$defs/Name``); anything that does not resolve is returned as is."""
    while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and depth < 32:
        target = pointer(root, schema["$ref"])
        if target is None:
            return schema
        schema, depth = target, depth + 1
    return schema


def pointer(root: Any, ref: str, missing: Any = None) -> Any:
    """The node a local JSON pointer (``#``, ``#/a/b``) designates in ``root``, or ``missing``."""
    if not ref.startswith("#"):
        return missing
    path = ref[1:]
    if not path:
        return root
    if not path.startswith("/"):
        return missing
    node = root
    for raw in path[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return missing
    return node
