"""One batch request through the gateway's own ASGI app, in process: the online route's validation, limits, routing,
admission, metrics and access-log line, with no socket and no HTTP round trip. The caller's key and tier ride in
the scope's extensions (``gateway.auth.InternalCaller``), where no client can put them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

from gateway.auth import INTERNAL_CALLER, InternalCaller


@dataclass(frozen=True, slots=True)
class Answer:
    """The status and body the online route gave."""

    status: int
    body: bytes
    retry_after: float | None


async def call_in_process(
    app: ASGIApp, path: str, body: bytes, *, request_id: str, caller: InternalCaller, stop: asyncio.Event
) -> Answer:
    """POSTs ``body`` to ``path``. When ``stop`` is set the request's client "disconnects", which aborts its engine
    work as for any client that leaves (the answer is then the route's 499)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
        ],
        "client": None,
        "server": None,
        "state": {},
        "extensions": {INTERNAL_CALLER: caller},
    }
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await stop.wait()
        return {"type": "http.disconnect"}

    status = 500
    retry_after: float | None = None
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status, retry_after
        if message["type"] == "http.response.start":
            status = message["status"]
            for name, value in message.get("headers", []):
                if name.lower() == b"retry-after":
                    retry_after = float(value) if value.replace(b".", b"", 1).isdigit() else None
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, b"".join(chunks), retry_after)
