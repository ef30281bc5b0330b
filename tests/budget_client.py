"""What the per-key budget tests share: a frozen clock (buckets never refill under a test), a client that reads
part of a stream and hangs up, and the readings a tenant and an operator see (headers, the charge metric)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from gateway.limits import estimate_prompt_tokens

from .conftest import RunningGateway, wait_until


class FrozenClock:
    """The budgets' clock, stopped: a bucket's level moves only by what requests take and settle."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def post(base_url: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        content=orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )


def prompt_estimate(body: dict[str, Any]) -> int:
    """What the gateway reserves for the prompt of ``body`` sent as ``post`` sends it (README, Per-key limits)."""
    return estimate_prompt_tokens(len(orjson.dumps(body)))


def prompt_tokens(base_url: str, key: str, body: dict[str, Any]) -> int:
    """The exact prompt of the chat request ``body``, as ``/tokenize`` renders it: what an engine backend tells
    the gateway on its first delta, so what a request cut short before its usage is charged for its prompt."""
    fields = {"model": body["model"], "messages": body["messages"]}
    response = httpx.post(f"{base_url}/tokenize", json=fields, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def remaining_tokens(response: httpx.Response) -> int:
    return int(response.headers["x-ratelimit-remaining-tokens"])


def stream_and_hang_up(base_url: str, key: str, body: dict[str, Any], tokens: int) -> int:
    """Streams ``body`` (which asks for logprobs: one entry per token) and closes the connection once at least
    ``tokens`` tokens were read; returns the tokens read."""
    read = 0
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            f"{base_url}/v1/chat/completions",
            content=orjson.dumps({**body, "stream": True}),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:]).get("choices", ()):  # the last may be an error frame
                read += len((choice.get("logprobs") or {}).get("content") or ())
            if read >= tokens:
                break
    return read


def charged(gateway: RunningGateway, label: str) -> float:
    """Tokens charged to the key so far (``gateway_key_tokens_total``): counted once a settlement is done."""
    return gateway.metric("gateway_key_tokens_total", key=label)


def charge_of_next_request(gateway: RunningGateway, label: str, before: float) -> float:
    """Waits for the settlement of a request that ended after ``before`` was read, and returns its charge."""
    assert wait_until(lambda: charged(gateway, label) > before, timeout=30), "the request was never settled"
    return charged(gateway, label) - before
