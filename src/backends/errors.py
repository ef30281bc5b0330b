"""Typed backend errors. The gateway alone maps them to HTTP status codes and OpenAI error bodies."""

from __future__ import annotations


class BackendError(Exception):
    """Base class: something a backend could not do for a request."""

    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequestError(BackendError):
    """The request cannot be served as asked (a client mistake)."""


class SlowClientError(InvalidRequestError):
    """The client did not take its output: more of it waited than the gateway holds for one request (or the
    connection took nothing for the stall timeout), so the request was stopped. Not the backend's fault."""

    code = "slow_client"


class PayloadTooLargeError(InvalidRequestError):
    """A part of the request (an image) is larger than the gateway takes: a 413 naming it."""

    code = "payload_too_large"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context window."""

    code = "context_length_exceeded"


class ModelNotFoundError(BackendError):
    """No backend serves the requested model name."""

    code = "model_not_found"


class OverloadedError(BackendError):
    """The backend is saturated right now; retrying later may succeed."""

    def __init__(self, message: str, *, retry_after: float | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class UnavailableError(BackendError):
    """The backend is not started, not ready, or has died."""

    def __init__(self, message: str, *, retry_after: float | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class UpstreamError(BackendError):
    """The engine or upstream server failed while serving the request."""


class UpstreamProtocolError(UpstreamError):
    """The upstream answered something that breaks its protocol (a malformed or wrongly shaped chunk)."""

    code = "upstream_protocol_error"


class BackendTimeoutError(BackendError):
    """The request ran past its deadline."""

    code = "timeout"


class RankKeysError(ValueError):
    """The rank plane's key directory lacks a file this side needs, or a file is not a ZeroMQ certificate
    (a deployment mistake, found before any rank starts: never a request's error)."""
