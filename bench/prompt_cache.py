"""Prefix-cache hits and TTFT of a multi-turn chat workload under ``prefix_affinity`` against ``least_outstanding``.

One gateway serves two models, each over two reference engines (two ranks' worth of engines) with a prefix cache
and a timing model, so a cached prompt token saves its prefill time as it would on a GPU:

- ``affinity``: the two engines behind ``policy: prefix_affinity``;
- ``spread``: two more behind ``policy: least_outstanding``.

Each round replays the same set of conversations against both models, in an order that alternates by round: every
conversation has its own long opening (a document to talk about) and several turns, each turn sent after the
previous answer, the answer appended to the history as the client saw it; conversations run concurrently. A round
uses fresh conversations, so no cache carries over from an earlier round. Hits are what each response's usage
reported (``prompt_cache_hit_tokens``); the engines' own counters in ``/metrics`` are checked against them. TTFT is
the time to the first content chunk, client side.

Usage: ``python bench/prompt_cache.py [--conversations 12] [--turns 4] [--rounds 2]``. Writes
``bench/results/prompt_cache.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from _gateway import serve_gateway

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_cache.json"
POLICIES = {"affinity": "prefix_affinity", "spread": "least_outstanding"}
WORDS = [
    "harbour",
    "tide",
    "lantern",
    "keeper",
    "ship",
    "storm",
    "ledger",
    "rope",
    "anchor",
    "gull",
    "pier",
    "beacon",
    "chart",
    "compass",
    "ferry",
    "cargo",
    "hull",
    "mast",
    "sail",
    "reef",
    "current",
    "shoal",
    "island",
    "fog",
    "bell",
    "net",
    "crew",
    "captain",
    "log",
    "voyage",
    "north",
    "south",
    "east",
    "west",
    "morning",
    "evening",
]


def config(args: argparse.Namespace) -> dict[str, Any]:
    engine = {
        "kind": "reference",
        "max_model_len": 8192,
        "prefix_cache_tokens": args.cache_tokens,
        "timing": {"prefill_seconds_per_token": args.prefill, "decode_seconds_per_step": args.step},
    }
    backends = [{"name": f"{model}-{rank}", **engine} for model in POLICIES for rank in range(2)]
    models = [
        {"name": model, "backends": [f"{model}-0", f"{model}-1"], "policy": policy}
        for model, policy in POLICIES.items()
    ]
    return {"backends": backends, "models": models}


def conversations(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


async def turn(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed turn: its TTFT, its usage and its answer."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    answer: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = choice["delta"].get("content")
                if text:
                    first = first or time.perf_counter()
                    answer.append(text)
    assert first is not None and usage, "a turn without content or usage"
    return {"ttft": first - started, "usage": usage, "answer": "".join(answer)}


async def conversation(
    client: httpx.AsyncClient, model: str, opening: str, turns: int, max_tokens: int
) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "Answer questions about this log: " + opening}]
    results = []
    for index in range(turns):
        messages.append({"role": "user", "content": f"What does entry {index + 1} say about the tide?"})
        result = await turn(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": result["answer"]})
        results.append(result)
    return results


async def replay(base_url: str, model: str, openings: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(openings))
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        runs = await asyncio.gather(
            *(conversation(client, model, opening, args.turns, args.max_tokens) for opening in openings)
        )
    return [result for run in runs for result in run]


def scrape(base_url: str) -> dict[tuple[str, str], float]:
    """(sample name, backend) -> value, for the prompt and cache counters."""
    wanted = {
        "gateway_prompt_tokens_total",
        "gateway_prompt_cache_hit_tokens_total",
        "gateway_engine_prefix_cache_hit_tokens_total",
        "gateway_engine_prefix_cache_queried_tokens_total",
    }
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name in wanted:
                key = (sample.name, sample.labels.get("backend", ""))
                values[key] = values.get(key, 0.0) + sample.value
    return values


def summary(results: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    hits = sum(r["usage"]["prompt_cache_hit_tokens"] for r in results)
    ttfts = sorted(r["ttft"] * 1000 for r in results)
    later = sorted(r["ttft"] * 1000 for i, r in enumerate(results) if i % turns)  # turns after the first
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "hit_tokens": hits,
        "hit_rate": hits / prompt if prompt else 0.0,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
        "later_turns_ttft_p50_ms": statistics.median(later) if later else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--words", type=int, default=600, help="words in each conversation's opening")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=float, default=0.0002, help="seconds per uncached prompt token")
    parser.add_argument("--step", type=float, default=0.01, help="seconds per decode step")
    parser.add_argument("--cache-tokens", type=int, default=262_144, help="each engine's prefix-cache bound")
    args = parser.parse_args()
    process, base_url, path = serve_gateway(config(args), label="gateway")
    try:
        results: dict[str, list[dict[str, Any]]] = {model: [] for model in POLICIES}
        for round_index in range(args.rounds):
            openings = conversations(args.conversations, args.words, seed=round_index)
            order = list(POLICIES) if round_index % 2 == 0 else list(reversed(POLICIES))
            for model in order:
                # The other model's engines hold these openings too, but no request of this model reaches them.
                results[model] += asyncio.run(replay(base_url, model, openings, args))
        metrics = scrape(base_url)
    finally:
        process.terminate()
        process.wait(timeout=30)
        path.unlink(missing_ok=True)
    report: dict[str, Any] = {
        "machine": platform.platform(),
        "cpus": __import__("os").cpu_count(),
        "settings": vars(args),
        "policies": {},
    }
    print(f"{'model':10} {'policy':18} {'requests':>8} {'hit rate':>9} {'TTFT p50':>9} {'p90':>8} {'later p50':>9}")
    for model, policy in POLICIES.items():
        found = summary(results[model], args.turns)
        backends = {}
        for rank in range(2):
            name = f"{model}-{rank}"
            prompt = metrics.get(("gateway_prompt_tokens_total", name), 0.0)
            hits = metrics.get(("gateway_prompt_cache_hit_tokens_total", name), 0.0)
            engine = metrics.get(("gateway_engine_prefix_cache_hit_tokens_total", name), 0.0)
            backends[name] = {"prompt_tokens": prompt, "hit_tokens": hits, "engine_hit_tokens": engine}
            assert hits == engine, f"{name}: usage reported {hits} hit tokens, the engine counted {engine}"
        report["policies"][policy] = {"model": model, **found, "backends": backends}
        later = found["later_turns_ttft_p50_ms"]
        print(
            f"{model:10} {policy:18} {found['requests']:8d} {found['hit_rate']:9.1%} "
            f"{found['ttft_p50_ms']:8.1f}ms {found['ttft_p90_ms']:6.1f}ms {later:8.1f}ms"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
