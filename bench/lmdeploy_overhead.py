"""What the gateway adds in front of LMDeploy: latency, time to first token and TCP connections.

Starts LMDeploy's real api_server (stub engine, from the test harness: ``tests/backends/lmdeploy/harness``) and
the gateway (``deepinfer-gateway serve``) with an ``lmdeploy`` backend pointing at it, both on loopback. Then,
in one run and interleaved round by round, streams the same chat completion directly to LMDeploy and through the
gateway at each concurrency, and reports per path the median and p90 of time to first token and end-to-end
latency, and the gateway's added time (gateway minus direct). New upstream TCP connections per request in steady
state come from the backend's ``gateway_lmdeploy_connections_created_total`` counter, read before and after each
gateway phase (after each phase's warm-up requests: the pool drops connections idle for 4 s, which the
direct phase in between always exceeds), and the gateway process's CPU time per request.

``--clients`` instead measures the two candidate HTTP client libraries (httpx, aiohttp) streaming from the
harness: client CPU per request and latency, the measurement behind the backend's choice of aiohttp.

Usage: ``python bench/lmdeploy_overhead.py [--concurrency 1,64] [--requests 40,512] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.backends.lmdeploy.harness.server import API_KEY, MODEL_NAME, make_node  # noqa: E402

from _gateway import cpu_seconds, serve_gateway  # noqa: E402

PUBLIC_MODEL = "bench-lmdeploy"
# 32 echoed tokens at 5 ms per engine step: a short, steady stream that keeps 64 clients busy at once.
CONTENT = "one two three four five six seven eight nine ten " * 3 + "[[stub delay=0.005]]"


def start_gateway(node_url: str) -> tuple[subprocess.Popen[bytes], str]:
    process, base_url, _ = serve_gateway(
        {
            "server": {"runtime": {"access_log": False, "log_level": "warning"}},
            "backends": [
                {
                    "name": "lm",
                    "kind": "lmdeploy",
                    "urls": [node_url],
                    "api_key": API_KEY,
                    "max_model_len": 4096,
                    "max_connections": 256,
                }
            ],
            "models": [{"name": PUBLIC_MODEL, "backends": ["lm"]}],
        },
        timeout=120,
    )
    return process, base_url


def connections_created(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("gateway_lmdeploy_connections_created_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("gateway_lmdeploy_connections_created_total not exported")


async def one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[float, float]:
    """(time to first content token, end-to-end latency) of one streamed chat completion."""
    started = time.perf_counter()
    first = 0.0
    async with session.post(url, data=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not first and line.startswith(b"data: {") and b'"content": "' in line.replace(b'":"', b'": "'):
                first = time.perf_counter() - started
    return first, time.perf_counter() - started


async def phase(
    url: str,
    model: str,
    headers: dict[str, str],
    concurrency: int,
    requests: int,
    on_warm: Any = None,
) -> list[tuple[float, float]]:
    body = orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": CONTENT}], "stream": True, "max_tokens": 64}
    )
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        semaphore = asyncio.Semaphore(concurrency)
        results: list[tuple[float, float]] = []

        async def worker() -> None:
            async with semaphore:
                results.append(await one_stream(session, url, body, headers))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))  # warm the pools
        results.clear()
        if on_warm is not None:
            on_warm()
        await asyncio.gather(*(worker() for _ in range(requests)))
    return results


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
    }


async def overhead(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="lmdeploy-bench-"))
    node = make_node(workdir, "bench", "--model-name", MODEL_NAME, "--session-len", "4096", "--api-keys", API_KEY)
    node.start()
    gateway, gateway_url = start_gateway(node.url)
    direct_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    gateway_headers = {"Content-Type": "application/json"}
    report: dict[str, Any] = {"content": CONTENT, "rounds": args.rounds, "levels": []}
    marks: dict[str, float] = {}

    def mark() -> None:
        marks["connections"] = connections_created(gateway_url)
        marks["cpu"] = cpu_seconds(gateway.pid)

    try:
        for concurrency, requests in zip(args.concurrency, args.requests, strict=True):
            direct: list[tuple[float, float]] = []
            through: list[tuple[float, float]] = []
            new_connections = 0.0
            gateway_cpu = 0.0
            for _ in range(args.rounds):  # interleaved: direct, gateway, direct, gateway, ...
                direct += await phase(
                    f"{node.url}/v1/chat/completions", MODEL_NAME, direct_headers, concurrency, requests
                )
                through += await phase(
                    f"{gateway_url}/v1/chat/completions", PUBLIC_MODEL, gateway_headers, concurrency, requests, mark
                )
                new_connections += connections_created(gateway_url) - marks["connections"]
                gateway_cpu += cpu_seconds(gateway.pid) - marks["cpu"]
            level = {
                "concurrency": concurrency,
                "requests_per_path": len(direct),
                "direct": {"ttft": summary([d[0] for d in direct]), "latency": summary([d[1] for d in direct])},
                "gateway": {"ttft": summary([g[0] for g in through]), "latency": summary([g[1] for g in through])},
                "new_upstream_connections_per_request": round(new_connections / len(through), 4),
                "gateway_cpu_ms_per_request": round(gateway_cpu / len(through) * 1000, 3),
            }
            for key in ("ttft", "latency"):
                level[f"added_{key}_p50_ms"] = round(
                    level["gateway"][key]["p50_ms"] - level["direct"][key]["p50_ms"], 2
                )
                level[f"added_{key}_p90_ms"] = round(
                    level["gateway"][key]["p90_ms"] - level["direct"][key]["p90_ms"], 2
                )
            report["levels"].append(level)
            print(json.dumps(level), flush=True)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        node.stop()
    return report


async def clients(args: argparse.Namespace) -> dict[str, Any]:
    """httpx vs aiohttp as the upstream client: client CPU per streamed request, same server, same body."""
    workdir = Path(tempfile.mkdtemp(prefix="lmdeploy-clients-"))
    node = make_node(workdir, "clients", "--model-name", MODEL_NAME, "--session-len", "4096").start()
    body = orjson.dumps(
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": CONTENT.split("[[")[0]}], "stream": True}
    )
    headers = {"Content-Type": "application/json"}
    url = f"{node.url}/v1/chat/completions"

    async def run_httpx(concurrency: int, requests: int) -> tuple[float, float]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=4)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:

            async def one() -> float:
                started = time.perf_counter()
                async with client.stream("POST", url, content=body, headers=headers) as response:
                    async for _ in response.aiter_lines():
                        pass
                return time.perf_counter() - started

            return await drive(one, concurrency, requests)

    async def run_aiohttp(concurrency: int, requests: int) -> tuple[float, float]:
        connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=4)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> float:
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as response:
                    while await response.content.readany():
                        pass
                return time.perf_counter() - started

            return await drive(one, concurrency, requests)

    report: dict[str, Any] = {"levels": []}
    try:
        for concurrency, requests in zip(args.concurrency, args.requests, strict=True):
            for name, run in (
                ("httpx", run_httpx),
                ("aiohttp", run_aiohttp),
                ("httpx", run_httpx),
                ("aiohttp", run_aiohttp),
            ):
                cpu, p50 = await run(concurrency, requests)
                row = {
                    "client": name,
                    "concurrency": concurrency,
                    "cpu_ms_per_request": round(cpu * 1000, 3),
                    "p50_latency_ms": round(p50 * 1000, 2),
                }
                report["levels"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        node.stop()
    return report


async def drive(one: Any, concurrency: int, requests: int) -> tuple[float, float]:
    semaphore = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def worker() -> None:
        async with semaphore:
            latencies.append(await one())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.clear()
    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(requests)))
    return (time.process_time() - cpu) / requests, statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", default="40,512", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rounds", default=3, type=int)
    parser.add_argument("--clients", action="store_true", help="compare httpx and aiohttp instead")
    parser.add_argument("--out", default=None, help="JSON report path (default: bench/results/...)")
    args = parser.parse_args()
    report = asyncio.run(clients(args) if args.clients else overhead(args))
    name = "lmdeploy_clients.json" if args.clients else "lmdeploy_overhead.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
