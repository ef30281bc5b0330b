"""The framework internals the gateway leans on still have the shape it relies on.

``gateway/bodies.py`` reads FastAPI's ``APIRoute.dependant`` and wraps its request handler, ``gateway/connections.py``
subclasses uvicorn's ``HttpToolsProtocol`` and drives its parser callbacks, ``gateway/server.py`` extends uvicorn's
``Server``. None of these are public API, so pyproject.toml bounds the versions; when a bound is raised, this test
says which internal moved, in which installed version, and which file depends on it, before any request fails.

``PROVEN`` lists the oldest and newest versions the suite has run green on: the installed ones, and the lower
bounds, run in a virtualenv that had only those four packages pinned down (this file, test_connections,
test_http_edges, test_chat, test_frames, test_bodies, test_disconnect and test_slow_clients: 100 passed). The
bounds in pyproject.toml are those: from the oldest proven to the minor after the newest.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.routing import APIRoute, get_request_handler
from pydantic import BaseModel
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.connections import DirectBody, GuardedHttpToolsProtocol

PROVEN: dict[str, tuple[str, str]] = {
    "fastapi": ("0.115.0", "0.165.0"),
    "starlette": ("0.37.2", "1.10.0"),
    "uvicorn": ("0.30.0", "0.54.0"),
    "httptools": ("0.6.3", "0.9.0"),
}
PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("distribution", sorted(PROVEN))
def test_the_installed_framework_is_a_version_the_suite_has_run_on(distribution: str) -> None:
    oldest, newest = PROVEN[distribution]
    installed = version(distribution)
    assert _minor(oldest) <= _minor(installed) <= _minor(newest), (
        f"{distribution} {installed} is outside the versions this suite has run on ({oldest} to {newest}): run the "
        "suite on it, then move PROVEN and the bound in pyproject.toml"
    )


@pytest.mark.parametrize("distribution", sorted(PROVEN))
def test_the_pyproject_bounds_are_the_proven_versions(distribution: str) -> None:
    oldest, newest = PROVEN[distribution]
    major, minor = _minor(newest)
    bound = f"{distribution}>={oldest},<{major}.{minor + 1}"
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    assert any(d.replace("[standard]", "") == bound for d in dependencies), f"pyproject.toml should say {bound}"


class LoneBody(BaseModel):
    text: str


async def lone_body_endpoint(body: LoneBody, request: Request) -> None:
    """The endpoint shape ``OffloadedJSONRoute`` serves without FastAPI's request machinery."""


def _lone_body_route() -> APIRoute:
    return APIRoute("/lone", lone_body_endpoint, methods=["POST"])


def _dependant_lists() -> None:
    dependant = _lone_body_route().dependant
    for name in ("query_params", "header_params", "path_params", "cookie_params", "dependencies"):
        assert getattr(dependant, name) == [], f"dependant.{name} is {getattr(dependant, name, None)!r}, not []"
    assert len(dependant.body_params) == 1, f"dependant.body_params is {dependant.body_params!r}"
    assert dependant.request_param_name == "request", (
        f"dependant.request_param_name is {dependant.request_param_name!r}"
    )


def _body_field() -> None:
    field = _lone_body_route().dependant.body_params[0]
    assert field.name == "body", f"the body ModelField's name is {field.name!r}"
    assert field.field_info.annotation is LoneBody, f"field_info.annotation is {field.field_info.annotation!r}"
    assert hasattr(field.field_info, "embed"), "field_info has no 'embed'"
    assert not field.field_info.embed, "a lone body model is embedded"


def _route_handler() -> None:
    handler = _lone_body_route().get_route_handler()
    assert inspect.iscoroutinefunction(handler), f"get_route_handler() returned {handler!r}, not an async handler"


def _handler_reads_json() -> None:
    source = inspect.getsource(get_request_handler)
    assert "await request.json()" in source, "get_request_handler no longer reads a JSON body with request.json()"


def _request_shape() -> None:
    parameters = list(inspect.signature(Request.__init__).parameters)
    assert parameters[1:3] == ["scope", "receive"], f"Request.__init__ takes {parameters[1:]}"
    assert inspect.iscoroutinefunction(Request.body) and inspect.iscoroutinefunction(Request.json)
    app = FastAPI()
    assert Request({"type": "http", "app": app}).app is app, "Request.app is not scope['app']"


GUARD_OVERRIDES = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "_should_upgrade",
    "send_400_response",
)


def _protocol_methods() -> None:
    missing = [name for name in GUARD_OVERRIDES if not callable(getattr(HttpToolsProtocol, name, None))]
    assert not missing, f"HttpToolsProtocol has no {', '.join(missing)}"
    overridden = [name for name in GUARD_OVERRIDES if name in vars(GuardedHttpToolsProtocol)]
    for name in overridden:
        ours = inspect.signature(getattr(GuardedHttpToolsProtocol, name)).parameters
        theirs = inspect.signature(getattr(HttpToolsProtocol, name)).parameters
        assert list(ours) == list(theirs), f"HttpToolsProtocol.{name} takes {list(theirs)}, the guard {list(ours)}"


def _protocol_constructor() -> None:
    parameters = inspect.signature(HttpToolsProtocol.__init__).parameters
    missing = [name for name in ("config", "server_state", "app_state", "_loop") if name not in parameters]
    assert not missing, f"HttpToolsProtocol.__init__ takes no {', '.join(missing)} (it takes {list(parameters)})"


class _Transport(asyncio.Transport):
    """Enough of a transport for one request head."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def _protocol_state() -> None:
    received = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        received.set()
        await receive()

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    protocol = HttpToolsProtocol(
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = _Transport()
    protocol.connection_made(transport)
    assert protocol.loop is asyncio.get_running_loop(), "HttpToolsProtocol.loop is not the loop it was given"
    assert protocol.transport is transport, "HttpToolsProtocol.transport is not the connection's transport"
    assert protocol.cycle is None, "HttpToolsProtocol.cycle is set before any request"
    protocol.data_received(b"POST /v1/x?y=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n")
    assert protocol.url == b"/v1/x?y=1", f"HttpToolsProtocol.url is {getattr(protocol, 'url', None)!r}"
    assert (b"host", b"a") in protocol.headers, f"HttpToolsProtocol.headers is {protocol.headers!r}"
    assert callable(protocol.parser.should_upgrade), "HttpToolsProtocol.parser has no should_upgrade()"
    cycle = protocol.cycle
    assert isinstance(cycle, RequestResponseCycle), f"HttpToolsProtocol.cycle is {cycle!r}"
    assert cycle.response_started is False and cycle.disconnected is False
    assert isinstance(cycle.message_event, asyncio.Event), "RequestResponseCycle.message_event is not an Event"
    assert isinstance(cycle.scope["state"], dict), "RequestResponseCycle.scope has no 'state' dict"
    await asyncio.wait_for(received.wait(), 10)
    protocol.connection_lost(None)
    assert cycle.disconnected, "connection_lost did not mark the cycle disconnected"
    await asyncio.gather(*protocol.tasks)


async def _cycle_body_writes() -> None:
    """``DirectBody`` reads the request cycle's response state and writes what uvicorn's ``send`` would."""
    sent = asyncio.Event()
    finish = asyncio.Event()
    state: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        state["writer"] = DirectBody(protocol.cycle)
        transport.written = b""
        await send({"type": "http.response.body", "body": b"frame", "more_body": True})
        state["through_send"] = transport.written
        sent.set()
        await finish.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    protocol = HttpToolsProtocol(
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = _Transport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    await asyncio.wait_for(sent.wait(), 10)
    cycle = protocol.cycle
    assert cycle is not None and cycle.chunked_encoding is True, "a response without a length is not chunked"
    assert cycle.flow.write_paused is False and cycle.transport is transport
    transport.written = b""
    assert state["writer"].write(b"frame"), "DirectBody refused a write to a started chunked response"
    assert transport.written == state["through_send"], (
        f"DirectBody wrote {transport.written!r}, uvicorn's send {state['through_send']!r}"
    )
    cycle.flow.pause_writing()
    assert not state["writer"].write(b"frame"), "DirectBody wrote to a socket uvicorn's flow control paused"
    cycle.flow.resume_writing()
    finish.set()
    await asyncio.gather(*protocol.tasks)
    assert cycle.response_complete and not state["writer"].write(b"frame"), "DirectBody wrote after the end"
    protocol.connection_lost(None)


async def _parse_error_answer() -> None:
    """uvicorn answers bytes its parser refuses through ``send_400_response``, which the guard overrides."""
    answers: list[str] = []

    class Answering(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            answers.append(msg)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a request the parser refused reached the app")

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    protocol = Answering(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    protocol.connection_made(_Transport())
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad: a\nb\r\n\r\n")
    assert answers, "a bare LF in a header value did not reach send_400_response"


async def _abandoned_cycle() -> None:
    """A response ``DirectBody.abandon`` ended (its client stopped reading) is not logged as the app's error."""
    started = asyncio.Event()
    state: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        DirectBody(protocol.cycle).abandon()
        state["started"] = True
        started.set()

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    protocol = HttpToolsProtocol(
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = _Transport()
    protocol.connection_made(transport)
    errors = _Recorded(logging.ERROR)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(errors)
    try:
        protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.gather(*protocol.tasks)
    finally:
        logger.removeHandler(errors)
    assert transport.closed, "abandon() did not close the connection"
    assert not errors.messages, f"uvicorn logged {errors.messages}"
    protocol.connection_lost(None)


class _Recorded(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _server_shape() -> None:
    state = ServerState()
    assert isinstance(state.connections, set), "ServerState.connections is not a set"
    assert isinstance(state.default_headers, list), "ServerState.default_headers is not a list"
    for name in ("startup", "shutdown", "on_tick"):
        assert inspect.iscoroutinefunction(getattr(uvicorn.Server, name, None)), f"uvicorn.Server.{name} is not async"
    assert callable(getattr(uvicorn.Server, "handle_exit", None)), "uvicorn.Server has no handle_exit"
    server = uvicorn.Server(uvicorn.Config(FastAPI()))
    assert isinstance(server.server_state, ServerState), "uvicorn.Server.server_state is not a ServerState"


def _parse_url() -> None:
    assert httptools.parse_url(b"/v1/x?y=1").path == b"/v1/x", "httptools.parse_url(...).path is not the path"


@dataclass(frozen=True)
class Internal:
    """One framework internal, the distribution that ships it and the gateway file that relies on it."""

    what: str
    distribution: str
    used_by: str
    check: Callable[[], Awaitable[None] | None]


INTERNALS = [
    Internal(
        "fastapi.routing.APIRoute.dependant (its param lists)", "fastapi", "src/gateway/bodies.py", _dependant_lists
    ),
    Internal(
        "the body ModelField (name, field_info.annotation/.embed)", "fastapi", "src/gateway/bodies.py", _body_field
    ),
    Internal("fastapi.routing.APIRoute.get_route_handler", "fastapi", "src/gateway/bodies.py", _route_handler),
    Internal(
        "fastapi.routing.get_request_handler reads Request.json()",
        "fastapi",
        "src/gateway/bodies.py",
        _handler_reads_json,
    ),
    Internal(
        "starlette.requests.Request(scope, receive), .app, .body(), .json()",
        "starlette",
        "src/gateway/bodies.py",
        _request_shape,
    ),
    Internal("uvicorn HttpToolsProtocol's callbacks", "uvicorn", "src/gateway/connections.py", _protocol_methods),
    Internal("uvicorn HttpToolsProtocol.__init__ keywords", "uvicorn", "src/gateway/server.py", _protocol_constructor),
    Internal(
        "uvicorn HttpToolsProtocol's per-request state (url, headers, parser, cycle)",
        "uvicorn",
        "src/gateway/connections.py",
        _protocol_state,
    ),
    Internal(
        "uvicorn RequestResponseCycle's response state (chunked_encoding, flow, transport, response_complete)",
        "uvicorn",
        "src/gateway/connections.py",
        _cycle_body_writes,
    ),
    Internal(
        "uvicorn HttpToolsProtocol answers a parse error with send_400_response",
        "uvicorn",
        "src/gateway/connections.py",
        _parse_error_answer,
    ),
    Internal(
        "uvicorn's run_asgi logs no error for a cycle marked disconnected",
        "uvicorn",
        "src/gateway/connections.py",
        _abandoned_cycle,
    ),
    Internal("uvicorn.Server hooks and ServerState", "uvicorn", "src/gateway/server.py", _server_shape),
    Internal("httptools.parse_url", "httptools", "src/gateway/connections.py", _parse_url),
]


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda internal: internal.check.__name__.strip("_"))
async def test_a_framework_internal_has_the_shape_the_gateway_relies_on(internal: Internal) -> None:
    problem: str | None = None
    try:
        outcome = internal.check()
        if inspect.isawaitable(outcome):
            await outcome
    except (AssertionError, AttributeError, TypeError, KeyError, IndexError) as exc:
        first_line = str(exc).splitlines()[0].strip("'") if str(exc) else repr(exc)
        problem = f"{type(exc).__name__}: {first_line}"
    if problem is not None:
        pytest.fail(
            f"{internal.what} changed in {internal.distribution} {version(internal.distribution)} "
            f"(relied on by {internal.used_by}; its bound is in pyproject.toml): {problem}",
            pytrace=False,
        )
