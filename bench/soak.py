"""Soak: steady streaming load on the real gateway for a while; RSS over time and what is left in flight.

Starts ``deepinfer-gateway serve`` on the reference engine (timing model on, so the engine paces tokens as
an accelerator would), keeps ``--concurrency`` streams going for ``--duration`` seconds (a mix of finished,
stop-string and client-cancelled requests), samples the gateway's RSS every ``--sample-every`` seconds, and
reports in-flight requests and engine requests after the load stops, and how long they took to reach zero.
Loopback only; bounded in time.

``--disconnects SHARE`` mixes abrupt client disconnects into that share of the requests, over raw sockets: a
reset (RST) after three frames, a close right after the response headers, and a close halfway through sending
the request body.

Usage: ``python bench/soak.py --duration 600 --concurrency 32 --disconnects 0.2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _gateway import serve_gateway

MODEL = "soak-reference"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauges(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("gateway_requests_in_flight", "gateway_engine_requests"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.name == "gateway_requests_total":
                key = f"requests_{sample.labels['status']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


DISCONNECTS = ("reset_after_frames", "close_after_headers", "close_mid_body")


async def raw_disconnect(base_url: str, kind: str, rng: random.Random) -> None:
    """One streaming request over a raw socket that the client abandons the way ``kind`` says."""
    host, port = httpx.URL(base_url).host, httpx.URL(base_url).port
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if kind == "close_mid_body":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            return
        writer.write(head + body)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
        if kind == "reset_after_frames":
            frames = 0
            while frames < 3:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                frames += chunk.count(b"data: ")
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    finally:
        writer.close()


async def client_loop(
    client: httpx.AsyncClient,
    stop_at: float,
    rng: random.Random,
    counts: dict[str, int],
    disconnects: float,
) -> None:
    while time.monotonic() < stop_at:
        if rng.random() < disconnects:
            kind = rng.choice(DISCONNECTS)
            try:
                await raw_disconnect(str(client.base_url), kind, rng)
                counts[kind] = counts.get(kind, 0) + 1
            except (OSError, asyncio.IncompleteReadError) as exc:
                counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
            continue
        kind = rng.choice(["finish", "finish", "stop", "cancel", "whole"])
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
            "max_tokens": rng.randint(16, 256),
            "stream": kind != "whole",
        }
        if kind == "stop":
            body["stop"] = [" the", "."]
        try:
            if kind == "whole":
                response = await client.post("/v1/chat/completions", json=body)
                counts[f"status_{response.status_code}"] = counts.get(f"status_{response.status_code}", 0) + 1
            else:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    frames = 0
                    async for _ in response.aiter_lines():
                        frames += 1
                        if kind == "cancel" and frames > 5:
                            break  # the client goes away mid-stream
                counts[kind] = counts.get(kind, 0) + 1
        except httpx.HTTPError as exc:
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1


async def run_load(base_url: str, concurrency: int, duration: float, seed: int, disconnects: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        stop_at = time.monotonic() + duration
        await asyncio.gather(
            *(client_loop(client, stop_at, random.Random(seed + i), counts, disconnects) for i in range(concurrency))
        )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between RSS samples")
    parser.add_argument("--decode-seconds-per-step", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--disconnects", type=float, default=0.0, help="share of requests whose client disconnects abruptly (0-1)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args()

    process, base_url, config = serve_gateway(
        {
            "server": {"runtime": {"access_log": False}},
            "backends": [
                {
                    "name": "reference",
                    "kind": "reference",
                    "timing": {"decode_seconds_per_step": args.decode_seconds_per_step},
                }
            ],
            "models": [{"name": MODEL, "backends": ["reference"]}],
        }
    )
    try:
        samples: list[dict[str, float]] = [{"t": 0.0, "rss_mib": rss_mib(process.pid)}]
        started = time.monotonic()

        async def sampler() -> None:
            while time.monotonic() - started < args.duration:
                await asyncio.sleep(args.sample_every)
                sample = {"t": round(time.monotonic() - started, 1), "rss_mib": round(rss_mib(process.pid), 1)}
                samples.append(sample)
                print(f"t={sample['t']:7.1f}s  rss={sample['rss_mib']:8.1f} MiB", flush=True)

        async def both() -> dict[str, int]:
            task = asyncio.create_task(sampler())
            counts = await run_load(base_url, args.concurrency, args.duration, args.seed, args.disconnects)
            task.cancel()
            return counts

        counts = asyncio.run(both())
        stopped = time.monotonic()
        after = gauges(base_url)  # at once: what the load left in flight
        settled = after
        while time.monotonic() - stopped < 30 and (
            settled.get("gateway_requests_in_flight") or settled.get("gateway_engine_requests")
        ):
            time.sleep(0.1)
            settled = gauges(base_url)
        drained_after = round(time.monotonic() - stopped, 1)
        samples.append({"t": round(time.monotonic() - started, 1), "rss_mib": round(rss_mib(process.pid), 1)})
    finally:
        process.terminate()
        process.wait(timeout=60)
        config.unlink(missing_ok=True)
    report = {
        "duration": args.duration,
        "concurrency": args.concurrency,
        "disconnect_share": args.disconnects,
        "client_outcomes": counts,
        "after_load": after,
        "settled": settled,
        "seconds_to_settle": drained_after,
        "rss_samples": samples,
        "rss_growth_mib_after_first_sample": round(samples[-1]["rss_mib"] - samples[1]["rss_mib"], 1)
        if len(samples) > 2
        else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))


if __name__ == "__main__":
    main()
