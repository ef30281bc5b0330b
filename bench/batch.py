"""The Batch API on idle capacity: what a batch gets alone, and what it costs interactive requests beside it.

Starts the real gateway (``deepinfer-gateway serve``) on the reference engine with a timing model (an engine of
``--slots`` sequences, ``--step-ms`` per decode step; admission bounds the backend at the same number, so the queue
is the gateway's, where tiers order it) and measures, in one run:

1. **batch alone**: a batch of ``--lines`` completions of ``--batch-tokens`` tokens each, from ``create`` to
   ``completed``; its throughput is the output tokens of its output file over that time;
2. **interactive alone**: ``--clients`` clients each streaming ``--requests`` chat completions of
   ``--interactive-tokens`` tokens back to back; time to first token (first content frame) p50 and p99;
3. **interactive beside a batch**: the same clients while a second batch, four times as long, runs (cancelled once
   they are done).

Usage: ``python bench/batch.py`` (defaults below) or e.g. ``python bench/batch.py --lines 512 --slots 32``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from _gateway import serve_gateway

MODEL = "bench-batch"


def _config(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    return {
        "server": {
            "runtime": {"access_log": False},
            "batches": {
                "store": f"sqlite://{store}",
                "concurrency_per_batch": args.batch_concurrency,
                "concurrency_per_key": args.batch_concurrency,
                "poll_seconds": 0.2,
            },
        },
        "backends": [
            {
                "name": "reference",
                "kind": "reference",
                "max_num_seqs": args.slots,
                "max_in_flight": args.slots,
                "max_queue": 4 * args.batch_concurrency,
                "queue_timeout": 600,
                "timing": {"decode_seconds_per_step": args.step_ms / 1000},
            }
        ],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }


def _batch_file(lines: int, tokens: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": tokens, "ignore_eos": True},
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


def _start_batch(client: openai.OpenAI, content: bytes) -> str:
    uploaded = client.files.create(file=("bench.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h").id


def _wait_ended(client: openai.OpenAI, batch_id: str) -> Any:
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)


def batch_alone(client: openai.OpenAI, args: argparse.Namespace) -> tuple[float, int, float]:
    started = time.perf_counter()
    batch = _wait_ended(client, _start_batch(client, _batch_file(args.lines, args.batch_tokens)))
    elapsed = time.perf_counter() - started
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    return elapsed, tokens, tokens / elapsed


async def _ttfts(base: str, args: argparse.Namespace) -> list[float]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": args.interactive_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    found: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        for _ in range(args.requests):
            started = time.perf_counter()
            first: float | None = None
            async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content"' in line:
                        first = time.perf_counter() - started
            assert first is not None
            found.append(first)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(args.clients)))
    return found


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--batch-concurrency", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    args = parser.parse_args()

    store_dir = Path(tempfile.mkdtemp())
    process, base, config_path = serve_gateway(_config(args, store_dir / "batches.sqlite3"), label="gateway")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        elapsed, tokens, rate = batch_alone(client, args)
        alone = asyncio.run(_ttfts(base, args))
        running = _start_batch(client, _batch_file(4 * args.lines, args.batch_tokens))
        while client.batches.retrieve(running).status != "in_progress":
            time.sleep(0.05)
        beside = asyncio.run(_ttfts(base, args))
        still_running = client.batches.retrieve(running).status == "in_progress"
        if still_running:
            client.batches.cancel(running)
        _wait_ended(client, running)
    finally:
        process.terminate()
        process.wait()
        config_path.unlink()
        shutil.rmtree(store_dir, ignore_errors=True)

    print(
        f"engine: {args.slots} slots, {args.step_ms:g} ms per decode step; batch: {args.lines} lines x "
        f"{args.batch_tokens} tokens, {args.batch_concurrency} at once; interactive: {args.clients} clients x "
        f"{args.requests} streams of {args.interactive_tokens} tokens"
    )
    print()
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| batch alone: output tokens | {tokens} |")
    print(f"| batch alone: time create -> completed | {elapsed:.2f} s |")
    print(f"| batch alone: throughput | {rate:.0f} tokens/s |")
    for label, values in (("alone", alone), ("beside a batch", beside)):
        print(f"| interactive TTFT {label}: p50 | {_percentile(values, 50) * 1000:.1f} ms |")
        print(f"| interactive TTFT {label}: p99 | {_percentile(values, 99) * 1000:.1f} ms |")
    print(f"| the batch still ran when the interactive clients were done | {still_running} |")


if __name__ == "__main__":
    main()
