"""A minimal, fast OpenAI-compatible server: the yardstick for a load generator's own ceiling and for proxies.

Raw asyncio (no framework), pre-rendered frames, one timer for all streams: it costs far less per chunk than
any real server, so a client or proxy measured against it is the thing being measured. It answers like an
LMDeploy ``api_server``: ``GET /health`` (``{"status": "healthy"}``), ``GET /v1/models`` and
``POST /v1/chat/completions`` (streaming with usage, or not), one token per chunk, ``max_tokens`` tokens
(default 64), a chunk every ``--pace-ms`` (0: all at once).

Run: ``python -m loadgen.fake_upstream --port 9000 --pace-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson

MODEL = "fake"
DEFAULT_TOKENS = 64


def _frame(payload: dict) -> bytes:
    body = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(body), body)  # one HTTP chunk per SSE frame, as streaming servers send them


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


FIRST = _frame(_chunk({"role": "assistant", "content": " tok"}))
TOKEN = _frame(_chunk({"content": " tok"}))
DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _last(tokens: int, prompt: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    return _frame(_chunk({}, "length")) + _frame({**_chunk({}), "choices": [], "usage": usage}) + DONE


def _json(status: str, payload: dict) -> bytes:
    body = orjson.dumps(payload)
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _completion(tokens: int, prompt: int) -> bytes:
    return _json(
        "200 OK",
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " tok" * tokens},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens},
        },
    )


class Pacer:
    """One timer for every open stream: each tick writes the next frame of each, so cost grows with frames only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pace: float) -> None:
        self.loop = loop
        self.pace = pace
        self.streams: dict[asyncio.Transport, list[int]] = {}  # transport -> [tokens left, tokens, prompt]
        self.ticking = False
        self.next_tick = 0.0

    def add(self, transport: asyncio.Transport, tokens: int, prompt: int) -> None:
        transport.write(STREAM_HEAD + FIRST)
        if tokens <= 1:
            transport.write(_last(tokens, prompt))
            return
        self.streams[transport] = [tokens - 1, tokens, prompt]
        if not self.ticking:
            self.ticking = True
            self.next_tick = self.loop.time() + self.pace
            self.loop.call_at(self.next_tick, self.tick)

    def tick(self) -> None:
        finished = []
        for transport, state in self.streams.items():
            if transport.is_closing():
                finished.append(transport)
                continue
            transport.write(TOKEN)
            state[0] -= 1
            if state[0] == 0:
                transport.write(_last(state[1], state[2]))
                finished.append(transport)
        for transport in finished:
            del self.streams[transport]
        if self.streams:  # on a fixed grid, so the time spent writing does not stretch the pace
            self.next_tick = max(self.next_tick + self.pace, self.loop.time())
            self.loop.call_at(self.next_tick, self.tick)
        else:
            self.ticking = False


class FakeOpenAI(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: all that OpenAI clients send."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.respond(head[0], body)

    def respond(self, request_line: str, body: bytes) -> None:
        assert self.transport is not None
        method, path = request_line.split(" ")[:2]
        if method == "GET" and path == "/health":
            self.transport.write(_json("200 OK", {"status": "healthy"}))  # as LMDeploy api_server answers
        elif method == "GET" and path == "/v1/models":
            self.transport.write(_json("200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif method == "POST" and path == "/v1/chat/completions":
            try:
                request = orjson.loads(body)
            except orjson.JSONDecodeError:
                self.transport.write(_json("400 Bad Request", {"error": {"message": "body is not JSON"}}))
                return
            tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or DEFAULT_TOKENS)
            prompt = max(1, len(body) // 8)
            if not request.get("stream"):
                self.transport.write(_completion(tokens, prompt))
            elif self.pacer.pace > 0:
                self.pacer.add(self.transport, tokens, prompt)
            else:
                self.transport.write(STREAM_HEAD + FIRST + TOKEN * (tokens - 1) + _last(tokens, prompt))
        else:
            self.transport.write(_json("404 Not Found", {"error": {"message": f"no route {method} {path}"}}))


async def serve(host: str, port: int, pace: float) -> None:
    loop = asyncio.get_running_loop()
    pacer = Pacer(loop, pace)
    server = await loop.create_server(lambda: FakeOpenAI(pacer), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pace-ms", type=float, default=0.0, help="milliseconds between chunks of a stream")
    args = parser.parse_args()
    from .arrivals import run_event_loop

    run_event_loop(serve(args.host, args.port, args.pace_ms / 1000))


if __name__ == "__main__":
    main()
