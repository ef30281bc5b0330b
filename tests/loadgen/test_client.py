"""The streaming client against scripted SSE servers on loopback: what stops the TTFT clock, and errors by kind."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from loadgen.client import RequestRecord, stream_request

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def chunk(content: str | None = None, *, reasoning: str | None = None, finish: str | None = None) -> dict:
    delta = {k: v for k, v in (("content", content), ("reasoning_content", reasoning)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sse(
    frames: list[dict | str], *, pause: float = 0.0, done: bool = True, written: list[float] | None = None
) -> Handler:
    """Serves ``frames`` as SSE, ``pause`` seconds apart; ``written`` gets the ``perf_counter`` (the load generator's
    clock, in the same process) at which each frame was written."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for frame in frames:
            payload = frame.encode() if isinstance(frame, str) else b"data: " + orjson.dumps(frame)
            if written is not None:
                written.append(time.perf_counter())
            await response.write(payload + b"\n\n")
            await asyncio.sleep(pause)
        if done:
            await response.write(b"data: [DONE]\n\n")
        return response

    return handler


async def run_against(handler: Handler) -> RequestRecord:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            return await stream_request(
                session,
                f"http://127.0.0.1:{port}/v1/chat/completions",
                b"{}",
                RequestRecord(0, 8),
                t0=0.0,
                headers={},
                client_timeout=aiohttp.ClientTimeout(total=10),
            )
    finally:
        await runner.cleanup()


async def test_role_only_and_empty_chunks_do_not_stop_the_ttft_clock() -> None:
    frames = [ROLE, chunk(""), chunk("Hel"), chunk(reasoning="think"), chunk("lo", finish="length")]
    frames.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})
    written: list[float] = []
    record = await run_against(sse(frames, pause=0.01, written=written))
    assert record.ok
    assert len(record.token_times) == 3  # "Hel", the reasoning chunk, "lo"
    assert record.first_chunk is not None and written[0] <= record.first_chunk < record.token_times[0]
    assert record.token_times[0] >= written[2], "the first token is the first text, written after two pauses"
    assert (record.prompt_tokens, record.output_tokens, record.finish_reason) == (5, 4, "length")
    assert record.tokens == 4  # the server's count wins over the number of chunks


async def test_pings_and_comments_are_ignored() -> None:
    record = await run_against(sse([": ping", chunk("a"), ": ping", chunk("b", finish="stop")]))
    assert record.ok and len(record.token_times) == 2 and record.output_tokens is None and record.tokens == 2


async def test_error_frame_after_the_stream_started_is_a_stream_error() -> None:
    record = await run_against(sse([chunk("a"), {"error": {"message": "engine failed", "code": "x"}}]))
    assert record.error == "stream_error" and "engine failed" in (record.error_detail or "")


async def test_stream_cut_before_done_is_incomplete() -> None:
    record = await run_against(sse([chunk("a")], done=False))
    assert record.error == "incomplete"


async def test_stream_without_content_is_no_output() -> None:
    record = await run_against(sse([ROLE, chunk("", finish="stop")]))
    assert record.error == "no_output"


async def test_http_errors_are_kinded_by_status_with_the_openai_message() -> None:
    async def overloaded(request: web.Request) -> web.Response:
        body = {"error": {"message": "too many requests", "type": "rate_limit", "param": None, "code": None}}
        return web.json_response(body, status=429)

    record = await run_against(overloaded)
    assert record.error == "http_429" and record.error_detail == "too many requests"


async def test_unreachable_server_is_a_connect_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        async with aiohttp.ClientSession() as session:
            record = await stream_request(
                session,
                f"http://127.0.0.1:{port}/v1/chat/completions",
                b"{}",
                RequestRecord(0, 8),
                t0=0.0,
                headers={},
                client_timeout=aiohttp.ClientTimeout(total=5),
            )
    assert record.error == "connect" and record.end >= record.start
