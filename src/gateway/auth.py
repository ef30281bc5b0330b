"""API-key authentication as pure ASGI middleware, and who a request acts for.

``/v1`` (and every other path not listed below) needs a client key once ``server.auth.api_keys`` is set. The operator's
endpoints, ``/admin`` and everything under ``/admin/``, need ``server.auth.admin_api_key``; with client keys set and no
admin key they are refused (fail closed), never open to anyone. ``/metrics`` is an operator endpoint too (its labels
name models, backends and API keys), unless ``server.auth.public_metrics`` opens it for a Prometheus that scrapes
without credentials. Only ``/health`` and ``/ready`` are always open, matched exactly.

Keys are compared in constant time, never logged or echoed; the request's state carries only the key's label (for
logs, metrics and budgets) and its owner (whose stored responses it may read).

The Batch API runs its requests through the same app in process (``gateway.batches.inprocess``): such a request
carries its batch's caller in the ASGI scope's extensions (``INTERNAL_CALLER``), which only code in this process can
set (a client's headers and body never reach the scope's keys), and acts for that key at that service tier.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, error_body
from gateway.server_config import ApiKeyConfig

OPEN_PATHS = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"
ADMIN_ROOT = "/admin"
ANONYMOUS = "anonymous"
"""The label of requests on a gateway without client keys (one tenant: everyone)."""
SINGLE_OWNER = ""
"""The owner of everything stored on a gateway without client keys."""
INTERNAL_CALLER = "deepinfer.internal_caller"
"""Key in the ASGI scope's ``extensions`` of a request the gateway makes to itself (``InternalCaller``)."""
TIER = "service_tier"
"""Key in the request's state: the service tier its caller runs at, when not the route's default."""
ADMIN_SCOPE = "admin"
"""Key in an open path's request state: True when the caller may see operator detail (``is_admin``)."""


@dataclass(frozen=True, slots=True)
class InternalCaller:
    """Who a request the gateway makes to itself acts for: the key's label and owner, and its service tier."""

    label: str
    owner: str
    service_tier: str


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_label(config: ApiKeyConfig, position: int) -> str:
    return config.name or f"key-{position}"


def key_owner(config: ApiKeyConfig) -> str:
    """Who owns what a key stores: its name (keys sharing a name are one tenant, so a rotated key keeps its
    conversations), or for a key without a name a digest of the key itself (stable when keys are reordered,
    unlike its ``key-N`` label)."""
    if config.name:
        return f"name:{config.name}"
    return f"key:{_digest(config.key).hex()[:32]}"


def request_label(request: Request) -> str:
    """The label of the key a request came with (``anonymous`` without client keys)."""
    return getattr(request.state, "api_key", None) or ANONYMOUS


def request_owner(request: Request) -> str:
    """The tenant a request acts for: the owner of its key, or the single owner without client keys."""
    return getattr(request.state, "owner", None) or SINGLE_OWNER


def request_service_tier(request: Request, default: str = "default") -> str:
    """The service tier a request runs at: the Batch API's for its own requests, else ``default``."""
    tier = getattr(request.state, TIER, None)
    return tier if isinstance(tier, str) else default


def is_admin_path(path: str) -> bool:
    return path == ADMIN_ROOT or path.startswith(ADMIN_ROOT + "/")


class ApiKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        client_keys: list[ApiKeyConfig],
        admin_key: str | None,
        public_metrics: bool = False,
    ) -> None:
        self.app = app
        # Comparing fixed-size digests keeps the comparison constant-time whatever the keys' lengths.
        self._clients = [(_digest(k.key), key_label(k, i), key_owner(k)) for i, k in enumerate(client_keys)]
        self._admin = _digest(admin_key) if admin_key else None
        self._public_metrics = public_metrics

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
        internal = scope.get("extensions", {}).get(INTERNAL_CALLER)
        if isinstance(internal, InternalCaller):  # set only by this process (gateway.batches.inprocess)
            state = scope.setdefault("state", {})
            state["api_key"] = internal.label if self._clients else None
            state["owner"], state[TIER] = internal.owner, internal.service_tier
            await self.app(scope, receive, send)
            return
        if path in OPEN_PATHS:  # open, but only an admin sees their operator detail (``ADMIN_SCOPE``)
            scope.setdefault("state", {})[ADMIN_SCOPE] = self.is_admin(_presented_key(scope))
            await self.app(scope, receive, send)
            return
        if path == METRICS_PATH and self._public_metrics:
            await self.app(scope, receive, send)
            return
        presented = _presented_key(scope)
        if path == METRICS_PATH or is_admin_path(path):
            if self._admin is not None:
                if not _matches(presented, self._admin):
                    await _refuse(scope, send, 401, "This endpoint needs the admin API key.", "invalid_api_key")
                    return
            elif self._clients:
                message = (
                    "This endpoint needs the admin API key, and server.auth.admin_api_key is not set: operator "
                    "endpoints stay closed while client keys (server.auth.api_keys) are configured."
                )
                await _refuse(scope, send, 403, message, "admin_key_not_configured")
                return
        elif self._clients:
            found = _client(presented, self._clients)
            if found is None:
                message = (
                    "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
                    if presented is None
                    else "Incorrect API key provided."
                )
                await _refuse(scope, send, 401, message, "invalid_api_key")
                return
            state = scope.setdefault("state", {})
            state["api_key"], state["owner"] = found
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


def _client(presented: str | None, clients: list[tuple[bytes, str, str]]) -> tuple[str, str] | None:
    """The (label, owner) of the presented key, if it is a client key."""
    if presented is None:
        return None
    digest = _digest(presented)
    found = None
    for expected, label, owner in clients:  # no early exit: the time taken does not depend on which key matched
        if hmac.compare_digest(digest, expected):
            found = (label, owner)
    return found


async def _refuse(scope: Scope, send: Send, status: int, message: str, code: str) -> None:
    log = scope.get("state", {}).get("log")
    if log is not None:  # the access-log line says why (gateway.middleware's run outside this one)
        log["error_code"] = code
    # In the words of the API the client called: Anthropic's error types on the Messages routes, OpenAI's elsewhere.
    body = error_body(APIError(status, message, code=code), scope["path"], scope.get("state", {}).get("request_id"))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deepinfer-gateway"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
