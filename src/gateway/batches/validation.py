"""The up-front check of a batch's input file: every line must be a JSON request with a unique ``custom_id``, the
batch's endpoint and a model that exists. Any line that is not fails the whole batch, with ``errors`` naming each
such line, as OpenAI does. A request body that is otherwise invalid is not judged here: it runs through the online
route like any other, whose 400 lands in the error file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

MAX_ERRORS = 100
"""Errors named in a failed batch at most (OpenAI names a few too): enough to fix a file, not a second copy of it."""


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch: its line (1-based, as ``errors`` name them), its ``custom_id`` and its body."""

    line: int
    custom_id: str
    body: bytes
    streams: bool
    """The body asks for a stream, which a batch cannot give (the line's answer is a 400)."""


@dataclass(frozen=True, slots=True)
class Validated:
    lines: list[BatchLine]
    errors: list[dict[str, Any]]


def _error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def validate_input(content: bytes, *, endpoint: str, model_exists: Callable[[str], bool], max_lines: int) -> Validated:
    """The file's requests, or the errors that fail the batch (then ``lines`` is empty)."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    raw_lines = [raw for raw in content.split(b"\n")]
    if raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()  # the newline that ends the last line
    if not raw_lines:
        return Validated([], [_error(1, "empty_file", "The input file has no requests.")])
    if len(raw_lines) > max_lines:
        message = f"The input file has {len(raw_lines)} lines; a batch holds at most {max_lines} requests."
        return Validated([], [_error(max_lines + 1, "too_many_lines", message)])
    for number, raw in enumerate(raw_lines, start=1):
        problem = _check_line(raw, number, endpoint, model_exists, seen)
        if isinstance(problem, BatchLine):
            lines.append(problem)
        else:
            errors.append(problem)
            if len(errors) >= MAX_ERRORS:
                break
    return Validated([] if errors else lines, errors)


def _check_line(
    raw: bytes, number: int, endpoint: str, model_exists: Callable[[str], bool], seen: set[str]
) -> BatchLine | dict[str, Any]:
    try:
        request = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _error(number, "invalid_json_line", f"Line {number} is not valid JSON.")
    if not isinstance(request, dict):
        return _error(number, "invalid_json_line", f"Line {number} is not a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error(number, "missing_custom_id", f"Line {number} has no custom_id string.", "custom_id")
    if custom_id in seen:
        return _error(
            number, "duplicate_custom_id", f"Line {number}: custom_id {custom_id!r} is used twice.", "custom_id"
        )
    seen.add(custom_id)
    if request.get("method") != "POST":
        return _error(number, "invalid_method", f"Line {number}: method must be 'POST'.", "method")
    if request.get("url") != endpoint:
        return _error(
            number,
            "mismatched_endpoint",
            f"Line {number}: url {request.get('url')!r} is not the batch's endpoint {endpoint!r}.",
            "url",
        )
    body = request.get("body")
    if not isinstance(body, dict):
        return _error(number, "invalid_body", f"Line {number}: body must be a JSON object.", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model_exists(model):
        return _error(number, "model_not_found", f"Line {number}: the model {model!r} does not exist.", "body.model")
    return BatchLine(number, custom_id, orjson.dumps(body), body.get("stream") is True)
