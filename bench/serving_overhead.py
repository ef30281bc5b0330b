"""How fast the serving layer itself is, with the reference engine's timing model off.

Starts the real gateway (the ``deepinfer-gateway serve`` command) on loopback, streams chat completions at
each concurrency level and reports, in one run:

- SSE frames per second per core: frames received / CPU seconds the gateway process used (user + system,
  all threads), so the load generator sharing this machine does not distort the figure;
- engine-thread time per emitted token, split into the engine's own ``step()`` and the driver around it;
- time to first token seen by the server (request arrival to first token) and by the client.

Usage: ``python bench/serving_overhead.py --concurrency 1,256 --duration 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _gateway import children, cpu_seconds, serve_gateway

MODEL = "bench-reference"


def scrape(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name.startswith(("gateway_engine", "gateway_time_to_first_token_seconds_", "gateway_gc_")):
                if sample.name.endswith("_bucket"):
                    continue
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def start_gateway(max_num_seqs: int, worker_processes: bool) -> tuple[subprocess.Popen[bytes], str, Path]:
    backend: dict[str, Any] = {"name": "reference", "kind": "reference", "max_num_seqs": max_num_seqs}
    if worker_processes:
        backend["worker_processes"] = True
    return serve_gateway(
        {
            # Idle keep-alive connections live longer than a loaded client's gap between two requests (at the
            # default 5 s a busy load generator reuses a connection the server is just closing: ReadError).
            "server": {"http": {"keep_alive_timeout": 60}, "runtime": {"access_log": True}},
            "backends": [backend],
            "models": [{"name": MODEL, "backends": ["reference"]}],
        }
    )


async def stream_one(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, float]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe the module."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = 0.0
    frames = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            if not frames:
                ttft = time.perf_counter() - started
            frames += chunk.count(b"\n\n")  # JSON never holds a raw newline, so this counts SSE frames
    return frames, ttft


async def run_level(base_url: str, concurrency: int, duration: float, max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        await asyncio.gather(*(stream_one(client, 4) for _ in range(min(concurrency, 16))))  # warm-up
        frames: list[int] = []
        ttfts: list[float] = []
        stop_at = time.perf_counter() + duration

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                count, ttft = await stream_one(client, max_tokens)
                frames.append(count)
                ttfts.append(ttft)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"frames": sum(frames), "requests": len(frames), "wall_seconds": wall, "client_ttfts": ttfts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,256", help="comma-separated concurrency levels")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per streamed request")
    parser.add_argument(
        "--worker-processes",
        action="store_true",
        help="run the engine in a worker process (worker_processes: true); its CPU counts as the gateway's",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/serving_overhead.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    process, base_url, config = start_gateway(max(levels) + 16, args.worker_processes)

    def gateway_cpu() -> float:
        """The gateway process and its worker processes (a worker is part of the gateway with worker_processes)."""
        return cpu_seconds(process.pid) + sum(cpu_seconds(pid) for pid in children(process.pid))

    results = []
    try:
        for concurrency in levels:
            before_cpu, before = gateway_cpu(), scrape(base_url)
            level = asyncio.run(run_level(base_url, concurrency, args.duration, args.max_tokens))
            after_cpu, after = gateway_cpu(), scrape(base_url)

            def grew(name: str, after: dict[str, float] = after, before: dict[str, float] = before) -> float:
                return after.get(name, 0.0) - before.get(name, 0.0)

            tokens = grew("gateway_engine_output_tokens_total")
            server_cpu = after_cpu - before_cpu
            ttft_count = grew("gateway_time_to_first_token_seconds_count")
            row = {
                "concurrency": concurrency,
                "requests": level["requests"],
                "frames": level["frames"],
                "frames_per_second": level["frames"] / level["wall_seconds"],
                "gateway_cpu_seconds": server_cpu,
                "gateway_cpu_utilisation": server_cpu / level["wall_seconds"],
                "frames_per_cpu_second": level["frames"] / server_cpu if server_cpu else None,
                "engine_thread_us_per_token": 1e6 * grew("gateway_engine_busy_seconds_total") / tokens,
                "engine_step_us_per_token": 1e6 * grew("gateway_engine_step_seconds_total") / tokens,
                "driver_us_per_token": 1e6
                * (grew("gateway_engine_busy_seconds_total") - grew("gateway_engine_step_seconds_total"))
                / tokens,
                "server_ttft_ms_mean": 1e3 * grew("gateway_time_to_first_token_seconds_sum") / ttft_count,
                "client_ttft_ms_p50": 1e3 * statistics.median(level["client_ttfts"]),
                "gc_collections": grew("gateway_gc_collections_total"),
                "gc_pause_ms": 1e3 * grew("gateway_gc_pause_seconds_total"),
            }
            results.append(row)
            print(
                f"c={concurrency:4d}  req={row['requests']:6d}  frames/s={row['frames_per_second']:9.0f}  "
                f"frames/cpu-s={row['frames_per_cpu_second']:9.0f}  gateway cpu={row['gateway_cpu_utilisation']:.2f}  "
                f"engine-thread us/tok={row['engine_thread_us_per_token']:.2f} "
                f"(step {row['engine_step_us_per_token']:.2f}, driver {row['driver_us_per_token']:.2f})  "
                f"server ttft={row['server_ttft_ms_mean']:.2f} ms  client ttft p50={row['client_ttft_ms_p50']:.2f} ms  "
                f"gc: {row['gc_collections']:.0f} collections, {row['gc_pause_ms']:.1f} ms",
                flush=True,
            )
    finally:
        process.terminate()
        process.wait(timeout=30)
        config.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "max_tokens": args.max_tokens,
                "duration": args.duration,
                "worker_processes": args.worker_processes,
                "levels": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
