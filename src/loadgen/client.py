"""One timed request: stream an OpenAI completion and record when each content chunk arrived.

aiohttp rather than httpx: measured on one core against a local SSE server, aiohttp parsed about 180,000 SSE
chunks per CPU-second and httpx about 18,000-33,000 (docs/bench.md), and a load generator must not be the
bottleneck. Per chunk the hot loop does one ``perf_counter`` call and one ``orjson.loads``; nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import orjson

CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
"""Delta fields whose first non-empty value stops the TTFT clock (role-only or empty chunks do not)."""


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are seconds since the load point started (shared clock)."""

    index: int
    max_tokens: int
    target_input_len: int | None = None
    start: float = 0.0
    end: float = 0.0
    first_chunk: float | None = None  # first frame carrying a choice, even an empty one (vLLM's TTFT)
    token_times: list[float] = field(default_factory=list)  # frames carrying non-empty content / reasoning
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None  # from the server's usage
    cached_prompt_tokens: int | None = None  # the server's prompt_cache_hit_tokens (or cached_tokens), if it sent them
    finish_reason: str | None = None
    error: str | None = None  # kind, e.g. http_429, timeout, connect, stream_error, incomplete, no_output
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count when it sent usage, else the number of content chunks."""
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)


def cache_hits(usage: dict) -> int | None:
    """The prompt tokens a server says its prefix cache held: DeepSeek's field, else OpenAI's; None if neither."""
    hits = usage.get("prompt_cache_hit_tokens")
    if hits is None:
        hits = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return hits if isinstance(hits, int) else None


def _has_content(choice: dict) -> bool:
    delta = choice.get("delta")
    if delta is None:  # /v1/completions chunks carry ``text``
        return bool(choice.get("text"))
    return any(delta.get(key) for key in CONTENT_KEYS)


def _error_message(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))[:300]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return body[:300].decode("utf-8", "replace")


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: RequestRecord,
    *,
    t0: float,
    headers: dict[str, str],
    client_timeout: aiohttp.ClientTimeout,
) -> RequestRecord:
    """Sends one streaming request and fills ``record``; never raises for server or network faults."""
    clock = time.perf_counter
    record.start = clock() - t0
    done = False
    try:
        async with session.post(url, data=body, headers=headers, timeout=client_timeout) as response:
            if response.status >= 400:
                record.error = f"http_{response.status}"
                record.error_detail = _error_message(await response.content.read(4096))
                return record
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": ping" comments, event: lines
                now = clock() - t0
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(payload)
                choices = chunk.get("choices")
                if choices:
                    if record.first_chunk is None:
                        record.first_chunk = now
                    choice = choices[0]
                    if _has_content(choice):
                        record.token_times.append(now)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens")
                    record.cached_prompt_tokens = cache_hits(usage)
                if "error" in chunk and record.error is None:
                    record.error = "stream_error"
                    record.error_detail = str(chunk["error"])[:300]
    except TimeoutError:
        record.error = "timeout"
    except aiohttp.ClientConnectorError as exc:
        record.error, record.error_detail = "connect", str(exc)[:300]
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        record.error, record.error_detail = "disconnected", str(exc)[:300]
    except aiohttp.ClientError as exc:
        record.error, record.error_detail = "client_error", f"{type(exc).__name__}: {exc}"[:300]
    except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
        record.error, record.error_detail = "protocol", f"bad stream frame: {exc}"[:300]
    finally:
        record.end = clock() - t0
    if record.error is None:
        if not done:
            record.error = "incomplete"
            record.error_detail = "stream ended without data: [DONE]"
        elif not record.token_times:
            record.error = "no_output"
            record.error_detail = "no chunk carried content or reasoning"
    return record


async def plain_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: RequestRecord,
    *,
    t0: float,
    headers: dict[str, str],
    client_timeout: aiohttp.ClientTimeout,
) -> RequestRecord:
    """A non-streaming request (``stream`` false): only end-to-end latency and usage are known."""
    clock = time.perf_counter
    record.start = clock() - t0
    try:
        async with session.post(url, data=body, headers=headers, timeout=client_timeout) as response:
            payload = await response.read()
            if response.status >= 400:
                record.error, record.error_detail = f"http_{response.status}", _error_message(payload)
            else:
                reply = orjson.loads(payload)
                usage = reply.get("usage") or {}
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens")
                record.cached_prompt_tokens = cache_hits(usage)
                choices = reply.get("choices") or [{}]
                record.finish_reason = choices[0].get("finish_reason")
    except TimeoutError:
        record.error = "timeout"
    except aiohttp.ClientError as exc:
        record.error, record.error_detail = "client_error", f"{type(exc).__name__}: {exc}"[:300]
    except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
        record.error, record.error_detail = "protocol", str(exc)[:300]
    finally:
        record.end = clock() - t0
    return record
