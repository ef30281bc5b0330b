"""LMDeploy's error bodies and statuses, mapped to the backends' typed errors.

LMDeploy answers OpenAI routes with a flat body ``{"message", "type", "code": <HTTP status>, "param", "object"}``,
FastAPI's ``{"detail": ...}`` for unknown routes, plain text for unhandled exceptions, and, once a stream has
started, one ``data: {"error": {...}}`` frame under HTTP 200. Whatever arrives, the gateway gets a typed error.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    UnavailableError,
    UpstreamError,
    UpstreamProtocolError,
)

# LMDeploy's request fields that differ from the ones the client sent.
_PARAM_NAMES = {"min_new_tokens": "min_tokens", "input_ids": "prompt", "max_completion_tokens": "max_tokens"}
_THE_PARAM = re.compile(r"^The (\w+) ")  # "The temperature -1.0 must be in [0, 2]"
_PYDANTIC_PARAM = re.compile(r"^([A-Za-z_][\w.]*): ")  # "temperature: Input should be a valid number"


class UpstreamFailure(Exception):
    """A typed error plus what the node pool needs to know: may another node be tried, and is the node at fault."""

    def __init__(self, error: BackendError, *, retryable: bool, node_fault: bool, kind: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable
        self.node_fault = node_fault
        self.kind = kind


def error_message(body: bytes) -> tuple[str, str | None]:
    """The message and (when LMDeploy names one) parameter of an error body in any of LMDeploy's shapes."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", errors="replace").strip()
        return text[:500] or "no error message", None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict):
            parsed = inner
        message = parsed.get("message") or parsed.get("detail") or ""
        if not isinstance(message, str):
            message = orjson.dumps(message).decode()
        param = parsed.get("param") if isinstance(parsed.get("param"), str) else None
        return message or "no error message", param
    return str(parsed)[:500], None


def _param_of(message: str, param: str | None) -> str | None:
    if param is None:
        match = _THE_PARAM.match(message) or _PYDANTIC_PARAM.match(message)
        param = match.group(1) if match else None
    if param is None:
        return None
    return _PARAM_NAMES.get(param, param)


def failure_from_status(status: int, body: bytes, node: str) -> UpstreamFailure:
    """Maps an HTTP error answer (before any output) to a typed error."""
    message, param = error_message(body)
    return failure_from_error(status, message, param, node)


def failure_from_error(status: int, message: str, param: str | None, node: str) -> UpstreamFailure:
    if status == 400 or status == 422 or status == 413:
        if "context length" in message:
            return UpstreamFailure(
                ContextLengthExceededError(message, param="messages"),
                retryable=False,
                node_fault=False,
                kind="client",
            )
        if message == "Client disconnected":  # LMDeploy's answer to a non-stream client that went away
            return UpstreamFailure(UpstreamError(message), retryable=False, node_fault=False, kind="client")
        return UpstreamFailure(
            InvalidRequestError(message, param=_param_of(message, param)),
            retryable=False,
            node_fault=False,
            kind="client",
        )
    if status in (401, 403):
        return UpstreamFailure(
            UpstreamError(
                f"the LMDeploy node {node} rejected the gateway's credentials (HTTP {status}): check the backend's "
                "api_key",
                code="upstream_auth",
            ),
            retryable=False,
            node_fault=False,
            kind="auth",
        )
    if status == 404 and "does not exist" in message:
        return UpstreamFailure(
            ModelNotFoundError(f"{message} (LMDeploy node {node})"), retryable=False, node_fault=False, kind="model"
        )
    if status == 503:
        return UpstreamFailure(
            UnavailableError(f"LMDeploy node {node} is unavailable: {message}", retry_after=1.0),
            retryable=True,
            node_fault=True,
            kind="unavailable",
        )
    if status >= 500 or status == 409:
        return node_failure(f"LMDeploy node {node} failed (HTTP {status}): {message}", kind="server")
    return UpstreamFailure(
        UpstreamError(f"LMDeploy node {node} answered HTTP {status}: {message}"),
        retryable=False,
        node_fault=False,
        kind="protocol",
    )


def node_failure(message: str, *, kind: str, retryable: bool = True) -> UpstreamFailure:
    """An upstream failure that is the node's fault (retryable on another node before the first byte); a
    ``protocol`` failure (a chunk or event the node should never send) is an ``UpstreamProtocolError``."""
    error = UpstreamProtocolError(message) if kind == "protocol" else UpstreamError(message)
    return UpstreamFailure(error, retryable=retryable, node_fault=True, kind=kind)


def failure_from_frame(error: Any, node: str) -> UpstreamFailure:
    """Maps a ``data: {"error": {...}}`` frame (LMDeploy's error after the HTTP status was sent)."""
    if not isinstance(error, dict):
        return node_failure(f"LMDeploy node {node} sent an error frame: {error!r}"[:500], kind="stream_error")
    status = error.get("code")
    message = error.get("message") or "no error message"
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if not isinstance(status, int):
        status = 500
    failure = failure_from_error(status, message, param, node)
    if failure.kind == "server":
        failure.kind = "stream_error"
    return failure
