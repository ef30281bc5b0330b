"""Validation of Responses API bodies and stream events against the ``openai`` package's own types.

Stricter than the SDK itself: strict pydantic validation (no coercion), and no field that the types do not
know (the SDK's models accept extra fields silently, which would hide a misspelt or invented one).
"""

from __future__ import annotations

from typing import Any

import orjson
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

_EVENT = TypeAdapter(ResponseStreamEvent)


def _no_unknown_fields(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        extra = value.model_extra or {}
        assert not extra, f"{path}: fields the openai types do not know: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, entry in enumerate(value):
            _no_unknown_fields(entry, f"{path}[{i}]")


def check_response(body: dict[str, Any]) -> Response:
    response = Response.model_validate(body, strict=True)
    _no_unknown_fields(response, "response")
    assert body["object"] == "response"
    for key in ("status", "error", "incomplete_details", "usage", "output", "tools", "text", "reasoning"):
        assert key in body, f"response has no {key!r}"
    return response


def check_event(payload: dict[str, Any]) -> BaseModel:
    event = _EVENT.validate_python(payload, strict=True)
    assert isinstance(event, BaseModel) and event.type == payload["type"], payload["type"]
    _no_unknown_fields(event, payload["type"])
    if "response" in payload:
        check_response(payload["response"])
    return event


def check_item_list(body: dict[str, Any]) -> ResponseItemList:
    items = ResponseItemList.model_validate(body, strict=True)
    _no_unknown_fields(items, "list")
    return items


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    """The events of a Responses stream: each ``event:`` line must name the type its ``data:`` line carries."""
    events = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            payload = orjson.loads(line[6:])
            assert payload["type"] == name, f"event: {name} carries a {payload['type']} payload"
            events.append(payload)
            name = None
    return events
