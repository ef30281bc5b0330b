"""What the Anthropic Messages API costs next to chat completions: the same request through both, interleaved.

Starts the real gateway (``deepinfer-gateway serve``) on the reference engine; a chat completion and a message with
the same system prompt, user text, ``max_tokens`` and greedy decoding (``temperature: 0``) run the same prompt tokens
and write the same output (the script checks the token counts). For each case the two APIs alternate request by
request (ABAB, then BABA, ...), one at a time, on keep-alive connections, and the script reports per API the median
and 90th percentile of the client's
latency (whole responses: until the body is read; streams: time to the first text and until the stream ended) and
the ratio of the two medians with a bootstrap 95% interval over the pairs. The gateway's CPU per request is
measured in alternating blocks of each API (``/proc``), since two interleaved requests cannot be told apart.

Cases: ``small`` (a one-line system prompt), ``tools`` (12 tools and a 30 KB system prompt, about the size of
what Claude Code sends; the reply is text).

Usage: ``python bench/messages_overhead.py --pairs 200``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx
import orjson

from _gateway import cpu_seconds, serve_gateway

MODEL = "bench-reference"
MAX_TOKENS = 64
WORDS = [
    "files",
    "buffers",
    "sockets",
    "threads",
    "codecs",
    "paths",
    "modules",
    "parsers",
    "tokens",
    "streams",
    "records",
    "lists",
]


def _tools(count: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"tool_{i}",
            "description": " ".join(random.Random(i).choices(WORDS, k=60)),
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "where"},
                    "count": {"type": "integer", "minimum": 0},
                    "flags": {"type": "array", "items": {"type": "string", "enum": WORDS[:4]}},
                },
                "required": ["path"],
            },
        }
        for i in range(count)
    ]


CASES: dict[str, dict[str, Any]] = {
    "small": {"system": "You are brief.", "user": "Say something about files.", "tools": []},
    "tools": {
        "system": " ".join(random.Random(7).choices(WORDS, k=4500)),
        "user": "Describe a file.",
        "tools": _tools(12),
    },
}


def chat_body(case: dict[str, Any], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "system", "content": case["system"]}, {"role": "user", "content": case["user"]}],
    }
    if case["tools"]:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
            }
            for t in case["tools"]
        ]
    return body


def messages_body(case: dict[str, Any], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "system": case["system"],
        "messages": [{"role": "user", "content": case["user"]}],
    }
    if case["tools"]:
        body["tools"] = case["tools"]
    return body


def _first_text(line: bytes, api: str) -> bool:
    if not line.startswith(b"data: {"):
        return False
    event = orjson.loads(line[6:])
    if api == "chat":
        return bool(event.get("choices") and event["choices"][0]["delta"].get("content"))
    return event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta"


def one(client: httpx.Client, api: str, body: dict[str, Any]) -> tuple[float, float | None, int]:
    """(latency, time to first text or None, output tokens) of one request."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    started = time.perf_counter()
    if not body["stream"]:
        reply = client.post(path, json=body)
        reply.raise_for_status()
        usage = reply.json()["usage"]
        tokens = usage["completion_tokens"] if api == "chat" else usage["output_tokens"]
        return time.perf_counter() - started, None, tokens
    first = None
    with client.stream("POST", path, json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if first is None and _first_text(line.encode(), api):
                first = time.perf_counter() - started
    return time.perf_counter() - started, first, -1


def _bootstrap_ratio(a: list[float], b: list[float], rounds: int = 2000) -> tuple[float, float, float]:
    """The ratio of medians b/a and its 95% bootstrap interval, resampling pairs."""
    rng = random.Random(1)
    pairs = list(zip(a, b, strict=True))
    ratios = []
    for _ in range(rounds):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(statistics.median(p[1] for p in sample) / statistics.median(p[0] for p in sample))
    ratios.sort()
    return statistics.median(b) / statistics.median(a), ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds)]


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def interleaved(client: httpx.Client, case: dict[str, Any], stream: bool, pairs: int) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float | None, int]]] = {"chat": [], "messages": []}
    bodies = {"chat": chat_body(case, stream), "messages": messages_body(case, stream)}
    for api in ("chat", "messages"):  # warm-up
        one(client, api, bodies[api])
    for i in range(pairs):
        order = ("chat", "messages") if i % 2 == 0 else ("messages", "chat")
        for api in order:
            runs[api].append(one(client, api, bodies[api]))
    out: dict[str, Any] = {}
    for metric, pick in (("latency", 0), ("first text", 1)):
        if stream or metric == "latency":
            a = [r[pick] for r in runs["chat"]]
            b = [r[pick] for r in runs["messages"]]
            out[metric] = (a, b)
    tokens = {api: {r[2] for r in runs[api]} for api in runs}
    out["tokens"] = tokens
    return out


def cpu_per_request(
    client: httpx.Client, pid: int, case: dict[str, Any], stream: bool, blocks: int, size: int
) -> dict[str, float]:
    """Gateway CPU ms per request of each API, from alternating blocks of ``size`` requests."""
    spent = {"chat": 0.0, "messages": 0.0}
    bodies = {"chat": chat_body(case, stream), "messages": messages_body(case, stream)}
    for i in range(blocks):
        for api in ("chat", "messages") if i % 2 == 0 else ("messages", "chat"):
            before = cpu_seconds(pid)
            for _ in range(size):
                one(client, api, bodies[api])
            spent[api] += cpu_seconds(pid) - before
    return {api: 1000 * spent[api] / (blocks * size) for api in spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200, help="interleaved request pairs per case and mode")
    parser.add_argument("--cpu-blocks", type=int, default=8, help="alternating blocks for the CPU figure")
    parser.add_argument("--cpu-block-size", type=int, default=50, help="requests per CPU block")
    parser.add_argument("--cases", default="small,tools")
    args = parser.parse_args()
    process, base_url, path = serve_gateway(
        {
            "server": {"http": {"keep_alive_timeout": 60}, "runtime": {"access_log": False}},
            "backends": [{"name": "reference", "kind": "reference", "max_model_len": 32768}],
            "models": [{"name": MODEL, "backends": ["reference"]}],
        }
    )
    rows: list[str] = []
    try:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            for name in args.cases.split(","):
                case = CASES[name]
                for stream in (False, True):
                    mode = "stream" if stream else "whole"
                    result = interleaved(client, case, stream, args.pairs)
                    cpu = cpu_per_request(client, process.pid, case, stream, args.cpu_blocks, args.cpu_block_size)
                    for metric in ("latency", "first text"):
                        if metric not in result:
                            continue
                        a, b = result[metric]
                        ratio, low, high = _bootstrap_ratio(a, b)
                        rows.append(
                            f"| {name} | {mode} | {metric} | {1000 * statistics.median(a):.2f} / "
                            f"{1000 * _p90(a):.2f} | {1000 * statistics.median(b):.2f} / {1000 * _p90(b):.2f} | "
                            f"{ratio:.3f} [{low:.3f}, {high:.3f}] |"
                        )
                    rows.append(
                        f"| {name} | {mode} | CPU ms/request | {cpu['chat']:.2f} | {cpu['messages']:.2f} | "
                        f"{cpu['messages'] / cpu['chat']:.3f} |"
                    )
                    if not stream and len(result["tokens"]["chat"] | result["tokens"]["messages"]) != 1:  # not alike
                        rows.append(f"| {name} | {mode} | output tokens differ: {result['tokens']} | | | |")
    finally:
        process.terminate()
        process.wait(timeout=30)
        path.unlink(missing_ok=True)
    print(f"{args.pairs} interleaved pairs per row; max_tokens {MAX_TOKENS}; greedy; gateway on the reference engine")
    print(
        "| case | mode | metric | chat completions ms (median / p90) | messages ms (median / p90) "
        "| messages/chat [95% CI] |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
