"""API-key authentication as pure ASGI middleware: /v1 needs a client key, /metrics and /admin the admin key.

Keys are compared in constant time, never logged or echoed; the request's state carries only the key's label.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import ApiKeyConfig
from gateway.errors import APIError, error_body

OPEN_PATHS = ("/health", "/ready")
ADMIN_PREFIXES = ("/metrics", "/admin")
ADMIN_SCOPE = "admin"
"""Key in an open path's request state: True when the caller may see operator detail (``is_admin``)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_label(config: ApiKeyConfig, position: int) -> str:
    return config.name or f"key-{position}"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, *, client_keys: list[ApiKeyConfig], admin_key: str | None) -> None:
        self.app = app
        # Comparing fixed-size digests keeps the comparison constant-time whatever the keys' lengths.
        self._clients = [(_digest(k.key), key_label(k, i)) for i, k in enumerate(client_keys)]
        self._admin = _digest(admin_key) if admin_key else None

    def is_admin(self, presented: str | None) -> bool:
        """May this caller see what ``/admin`` shows: the admin key when one is set; anyone when no key at all is
        set (the gateway is open); nobody when only client keys are set."""
        if self._admin is None:
            return not self._clients
        return _matches(presented, self._admin)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path.startswith(OPEN_PATHS):  # open, but only an admin sees their operator detail (``ADMIN_SCOPE``)
            scope.setdefault("state", {})[ADMIN_SCOPE] = self.is_admin(_presented_key(scope))
            await self.app(scope, receive, send)
            return
        presented = _presented_key(scope)
        if path.startswith(ADMIN_PREFIXES):
            if self._admin is not None and not _matches(presented, self._admin):
                await _unauthorized(scope, send, "This endpoint needs the admin API key.")
                return
        elif self._clients:
            label = _client_label(presented, self._clients)
            if label is None:
                message = (
                    "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
                    if presented is None
                    else "Incorrect API key provided."
                )
                await _unauthorized(scope, send, message)
                return
            scope.setdefault("state", {})["api_key"] = label
        await self.app(scope, receive, send)


def _presented_key(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value:
            return value.decode("latin-1").strip()
    return None


def _matches(presented: str | None, expected: bytes) -> bool:
    return presented is not None and hmac.compare_digest(_digest(presented), expected)


def _client_label(presented: str | None, clients: list[tuple[bytes, str]]) -> str | None:
    if presented is None:
        return None
    digest = _digest(presented)
    found = None
    for expected, label in clients:  # no early exit: the time taken does not depend on which key matched
        if hmac.compare_digest(digest, expected):
            found = label
    return found


def _unauthorized_body(scope: Scope, message: str) -> bytes:
    """The 401's body in the words of the API the client called (Anthropic's ``authentication_error`` on the
    Messages routes, OpenAI's ``invalid_api_key`` elsewhere)."""
    error = APIError(401, message, code="invalid_api_key")
    return error_body(error, scope["path"], scope.get("state", {}).get("request_id"))


async def _unauthorized(scope: Scope, send: Send, message: str) -> None:
    log = scope.get("state", {}).get("log")
    if log is not None:  # the access-log line says why (the request context middleware runs outside this one)
        log["error_code"] = "invalid_api_key"
    body = _unauthorized_body(scope, message)
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="deepinfer-gateway"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
