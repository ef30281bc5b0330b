"""Flow control under a flood: time to first token by service tier and by API key, against first come, first served.

Starts the real gateway (``deepinfer-gateway serve``) twice, one after the other, on the reference engine with its
timing model and 4 slots (``max_num_seqs`` = ``max_in_flight`` = 4): once with flow control on (tiers, weighted
fair sharing between keys) and once with ``flow_control: fifo`` (one first-come queue, tiers and weights off).
Against each it runs the same load for ``--seconds``:

- **flood**: ``--flood`` clients of the key ``flood``, each streaming chat completions back to back (closed loop);
- **light**: one client of the key ``light``, one request every ``--gap`` seconds (its own default tier);
- **priority**: one client of the key ``premium`` asking for ``service_tier: priority``, one every ``--gap``.

Every request asks for ``--tokens`` tokens (``ignore_eos``). It reports TTFT p50 / p99 (client side, from sending
the request to the first content delta) and refusals (503) by mode and class.

``--workers 2`` runs the same with two front-end processes (``server.runtime.workers``) sharing one engine in a rank
worker (``worker_processes``), each with ``max_in_flight`` 2: each process keeps its own queues, so ordering and
fairness hold within a process, across the requests the kernel spread to it.

Usage: ``python bench/flow_control.py`` (the table in README, Flow control), ``--workers 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import orjson

from _gateway import serve_gateway

MODEL = "bench-flow"
SLOTS = 4
KEYS = {"flood": "sk-bench-flood-01", "light": "sk-bench-light-02", "premium": "sk-bench-premium-03"}


def config(mode: str, workers: int, step: float) -> dict[str, Any]:
    backend: dict[str, Any] = {
        "name": "reference",
        "kind": "reference",
        "max_num_seqs": SLOTS,
        "max_in_flight": SLOTS // workers,
        "max_queue": 256,
        "queue_timeout": 120,
        "flow_control": mode,
        "timing": {"decode_seconds_per_step": step},
    }
    if workers > 1:
        backend["worker_processes"] = True
    return {
        "server": {
            "auth": {
                "api_keys": [
                    {"key": KEYS["flood"], "name": "flood"},
                    {"key": KEYS["light"], "name": "light"},
                    {"key": KEYS["premium"], "name": "premium"},
                ]
            },
            "runtime": {"workers": workers, "access_log": False},
        },
        "backends": [backend],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }


async def one(client: httpx.AsyncClient, key: str, tokens: int, tier: str | None) -> float | None:
    """TTFT of one streamed chat completion, or None when it was refused."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if tier is not None:
        body["service_tier"] = tier
    sent = time.perf_counter()
    first: float | None = None
    headers = {"Authorization": f"Bearer {KEYS[key]}", "Content-Type": "application/json"}
    async with client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body), headers=headers) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return None
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line:
                first = time.perf_counter() - sent
    return first


async def load(base_url: str, args: argparse.Namespace) -> dict[str, tuple[list[float], int]]:
    results: dict[str, tuple[list[float], int]] = {"flood": ([], 0), "light": ([], 0), "priority": ([], 0)}
    stop = time.perf_counter() + args.seconds
    limits = httpx.Limits(max_connections=args.flood + 8)

    def record(name: str, ttft: float | None) -> None:
        times, refused = results[name]
        if ttft is None:
            results[name] = (times, refused + 1)
        else:
            times.append(ttft)

    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def flood() -> None:
            while time.perf_counter() < stop:
                record("flood", await one(client, "flood", args.tokens, None))

        async def paced(name: str, key: str, tier: str | None) -> None:
            await asyncio.sleep(args.gap / 2)  # the flood fills the queue first
            pending = []
            while time.perf_counter() < stop:
                pending.append(asyncio.create_task(one(client, key, args.tokens, tier)))
                await asyncio.sleep(args.gap)
            for ttft in await asyncio.gather(*pending):
                record(name, ttft)

        floods = [flood() for _ in range(args.flood)]
        await asyncio.gather(*floods, paced("light", "light", None), paced("priority", "premium", "priority"))
    return results


def quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--flood", type=int, default=24, help="concurrent clients of the flooding key")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between the light and priority requests")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--step", type=float, default=0.01, help="the timing model's decode seconds per step")
    parser.add_argument("--workers", type=int, default=1, choices=(1, 2, 4))
    args = parser.parse_args()
    print(
        f"{SLOTS} slots, {args.workers} front end(s), flood {args.flood} clients, light and priority one request "
        f"every {args.gap:g} s, {args.tokens} tokens at {args.step * 1000:g} ms a step, {args.seconds:g} s each"
    )
    print("| mode | class | requests | TTFT p50 (ms) | TTFT p99 (ms) | refused |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in ("fair", "fifo"):
        process, base_url, path = serve_gateway(config(mode, args.workers, args.step), label=mode)
        try:
            results = asyncio.run(load(base_url, args))
        finally:
            process.terminate()
            process.wait(timeout=60)
            path.unlink()
        for name, (times, refused) in results.items():
            p50, p99 = quantile(times, 0.5) * 1000, quantile(times, 0.99) * 1000
            print(f"| {mode} | {name} | {len(times)} | {p50:.0f} | {p99:.0f} | {refused} |")


if __name__ == "__main__":
    main()
