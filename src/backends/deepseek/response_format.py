"""``response_format`` for DeepSeek V4.1 on DeepInfer's engine API: the engine's structured-output arguments.

It produces DeepInfer ``so_args`` (``reference/deepinfer-engine.md`` section D): a ``schema_type``
(``json`` | ``regex`` | ``ebnf``) and its ``schema`` string. The chat template adds ``trigger_token_ids`` (the
ids of ``</think>``) in thinking mode so the reasoning stays free and the grammar starts after it. A schema is
checked (``schema_checks``) before it reaches the engine, so a malformed one is a 400 naming ``response_format``
rather than a failed request later.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from backends.deepseek.schema_checks import check_constraint_size, check_json_schema

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "ebnf")
"""``regex`` and ``ebnf`` are this gateway's extensions: ``{"type": "regex", "regex": "..."}`` and
``{"type": "ebnf", "ebnf": "root ::= ..."}``."""

ANY_JSON_OBJECT = {"type": "object", "additionalProperties": True}
"""``json_object``: any object. ``additionalProperties`` is explicit because DeepInfer compiles schemas in
xgrammar's strict mode, where a bare ``{"type": "object"}`` allows only ``{}``."""


def response_format_so_args(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``so_args`` (without trigger) for an OpenAI ``response_format``; None for text.

    Raises ``ValueError`` naming what is wrong when the format or its schema is malformed.
    """
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema_type": "json", "schema": json.dumps(ANY_JSON_OBJECT)}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'name' and a 'schema'")
        schema = spec.get("schema", ANY_JSON_OBJECT)
        check_json_schema(schema, "response_format.json_schema.schema")
        check_constraint_size(schema, "response_format.json_schema.schema")
        return {"schema_type": "json", "schema": json.dumps(schema, ensure_ascii=False)}
    if kind == "regex":
        pattern = response_format.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format.regex must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"response_format.regex does not compile: {exc}") from None
        return {"schema_type": "regex", "schema": pattern}
    if kind == "ebnf":
        grammar = response_format.get("ebnf")
        if not isinstance(grammar, str) or not _ROOT_RULE.search(grammar):
            raise ValueError("response_format.ebnf must be a GBNF grammar string with a 'root ::= ...' rule")
        return {"schema_type": "ebnf", "schema": grammar}
    raise ValueError(
        f"response_format.type {kind!r} is not supported; expected one of {', '.join(RESPONSE_FORMAT_TYPES)}"
    )


_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)
