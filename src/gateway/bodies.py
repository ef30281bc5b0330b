"""Large JSON request bodies are parsed in a child process, so the event loop never stalls on a 7 MiB body.

Parsing JSON holds the GIL from start to end, whatever thread does it: a 7 MiB chat body takes 25-100 ms of
``json.loads``, during which ``/health`` and every stream wait. In a child process the parse costs the loop only
the copy back (unpickling the result: a few milliseconds). Bodies of at least ``OFFLOAD_BYTES`` go there when
``server.http.json_parse_processes`` is above 0; smaller ones are parsed in place, where a process hop would cost more
than the parse. The generation routes use ``OffloadedJSONRoute``; FastAPI reads their body through
``Request.json()``, so errors (``json_invalid`` 400s) are exactly those of an in-place parse.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import multiprocessing
import re
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import orjson
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger(__name__)

OFFLOAD_BYTES = 512 * 1024
"""Bodies at least this large are parsed in a child process (about 5 ms of parsing in place)."""


_LONG_DIGITS = re.compile(rb"\d{19}")
"""19 digits in a row may be an integer past 64 bits, which orjson would read as a float."""


def parse_json(body: bytes) -> Any:
    """``json.loads(body)``, the reference for what a body means and which bodies are ``json_invalid``; tried
    first with orjson, about 3x faster. orjson refuses what ``json`` reads beyond the standard (other encodings
    than UTF-8, NaN, lone surrogates), and reads the rest to the same values except integers past 64 bits: a body
    that may hold one, or that orjson refuses, goes to ``json.loads``."""
    if _LONG_DIGITS.search(body) is None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


class JSONBodyParser:
    """A small pool of child processes that parse large JSON bodies; started on the first large body."""

    def __init__(self, processes: int, *, offload_bytes: int = OFFLOAD_BYTES) -> None:
        self.processes = processes
        self.offload_bytes = offload_bytes
        self.offloaded = 0
        """Bodies parsed in a child process so far."""
        self._pool: ProcessPoolExecutor | None = None

    async def loads(self, body: bytes) -> Any:
        if self.processes < 1 or len(body) < self.offload_bytes:
            return parse_json(body)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(self._pool, parse_json, body)
        except BrokenProcessPool:  # a child died (killed, out of memory): parse here, start a new pool next time
            logger.warning("the JSON parser process died; parsing this body on the event loop")
            self._pool = None
            return parse_json(body)
        self.offloaded += 1
        return parsed

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class _OffloadedJSONRequest(Request):
    """A request whose ``json()`` uses the app's ``JSONBodyParser``."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            parser: JSONBodyParser = self.app.state.json_parser
            self._json = await parser.loads(await self.body())
        return self._json


class OffloadedJSONRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is parsed by the app's ``JSONBodyParser``.

    A well-formed request to an endpoint of the shape ``(body: SomeModel, request: Request)`` skips FastAPI's
    request machinery (dependency solving, query and cookie parsing, the content type parsed as a MIME header):
    a JSON content type, a body that parses and a model that validates go straight to the endpoint, validated
    exactly as FastAPI validates a lone body model. Anything else (another content type, an empty or broken body,
    a validation error) is handed to FastAPI's own handler, so every error is the one FastAPI gives.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        fast = _lone_body_model(self)
        endpoint = self.endpoint

        async def parse_large_bodies_elsewhere(request: Request) -> Response:
            request = _OffloadedJSONRequest(request.scope, request.receive)
            if fast is not None and _is_json(request.headers.get("content-type")):
                body_name, model, request_name = fast
                if await request.body():
                    try:
                        body = model.model_validate(await request.json())
                    except (ValueError, RecursionError):  # broken JSON or a ValidationError: FastAPI's error
                        return await handler(request)
                    return await endpoint(**{body_name: body, request_name: request})
            return await handler(request)

        return parse_large_bodies_elsewhere


def _lone_body_model(route: APIRoute) -> tuple[str, type[BaseModel], str] | None:
    """(body parameter, its model, request parameter) when the endpoint takes exactly those two, else None."""
    dependant = route.dependant
    if (
        len(dependant.body_params) != 1
        or dependant.query_params
        or dependant.header_params
        or dependant.path_params
        or dependant.cookie_params
        or dependant.dependencies
        or dependant.request_param_name is None
        or not inspect.iscoroutinefunction(route.endpoint)
        or len(inspect.signature(route.endpoint).parameters) != 2
    ):
        return None
    field = dependant.body_params[0]
    model = field.field_info.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or field.field_info.embed:  # type: ignore[attr-defined]
        return None
    return field.name, model, dependant.request_param_name


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"
