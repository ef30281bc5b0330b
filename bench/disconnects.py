"""Disconnects and slow readers under load: does every client that leaves stop its engine work, and what can a
client that stops reading make the gateway hold?

Starts the real gateway (``deepinfer-gateway serve``, default config: the reference engine without a timing
model, so the engine runs far ahead of any client) and runs two probes on raw loopback sockets:

- **disconnect**: N clients at once stream a chat completion (``max_tokens`` 2000, ``ignore_eos``), read the
  response headers and 3 SSE frames, then close the socket, with a FIN (``close()``) or with a RST
  (``SO_LINGER`` 0). Once the engine is idle, it reports the engine's output tokens (``gateway_engine_output_tokens``)
  beyond what the clients read, as a share of what the engine would have generated for them without an abort
  (N x max_tokens minus what they read), and how the requests were logged (499 or 200).
- **slow readers**: 40 clients ask for ``n`` 4, 3000 tokens with ``top_logprobs`` 20 and never read a byte. It
  samples the gateway's RSS while they hang on, then resets the sockets and reports how long the gateway's gauges
  take to return to 0.

Usage: ``python bench/disconnects.py`` (all probes) or e.g. ``python bench/disconnects.py --clients 200 --close rst
--skip-slow-readers``; ``--config-server '{"stall_timeout": 5}'`` adds ``server`` settings to the config,
``--config-backend '{...}'`` backend settings. ``--layouts inproc,2,2x2`` runs the probes once per layout: the
engine in process, 2 rank workers, 2 rank workers shared by 2 front-end processes (``server.runtime.workers``);
with rank workers the tokens are the ranks' own counts, the same whichever front end a scrape reaches (the table in
docs/data-parallel.md: ``--layouts 2,2x2 --clients 200 --close fin --skip-slow-readers``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from _gateway import serve_gateway

MODEL = "bench-disconnects"
FRAMES_BEFORE_CLOSE = 3


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape(base_url: str) -> dict[str, float]:
    """The gateway's counters and gauges this probe reads, summed over their labels (status kept apart)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=120).text):
        for sample in family.samples:
            name = sample.name
            if name == "gateway_requests_total":
                name = f"status_{sample.labels['status']}"
            elif name == "gateway_stream_stalls_total":
                name = "stalls"
            elif name not in (
                "gateway_engine_output_tokens_total",
                "gateway_engine_requests",
                "gateway_requests_in_flight",
                "gateway_dp_rank_requests",
            ):
                continue
            out[name] = out.get(name, 0.0) + sample.value
    return out


def idle(metrics: dict[str, float]) -> bool:
    """No request left: in this front end, in any front end's streams, or on any rank (what the ranks report)."""
    keys = ("gateway_engine_requests", "gateway_requests_in_flight", "gateway_dp_rank_requests")
    return all(metrics.get(key, 0) == 0 for key in keys)


def request_bytes(body: dict[str, Any]) -> bytes:
    payload = orjson.dumps(body)
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


async def leaving_client(host: str, port: int, body: bytes, rst: bool, opened: asyncio.Event) -> int:
    """Reads the headers and a few SSE frames, then closes; returns the frames read (0 if the stream failed)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(body)
        await writer.drain()
        await opened.wait()  # every client is connected before any reads, so they all run at once
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return 0
        frames = 0
        buffer = b""
        while frames < FRAMES_BEFORE_CLOSE:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buffer += chunk
            frames = buffer.count(b"data: {")
        return min(frames, FRAMES_BEFORE_CLOSE)
    finally:
        if rst:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort() if rst else writer.close()


async def disconnect_round(base_url: str, clients: int, rst: bool, max_tokens: int) -> dict[str, Any]:
    host, port = base_url.removeprefix("http://").split(":")
    body = request_bytes(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    before = scrape(base_url)
    opened = asyncio.Event()
    tasks = [asyncio.create_task(leaving_client(host, int(port), body, rst, opened)) for _ in range(clients)]
    await asyncio.sleep(0)
    opened.set()
    started = time.monotonic()
    frames = await asyncio.gather(*tasks, return_exceptions=True)
    closed_after = time.monotonic() - started
    # The engine is idle once every request has ended (aborted, or run to max_tokens).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(scrape, base_url)
        if idle(now):
            break
        await asyncio.sleep(0.2)
    idle_after = time.monotonic() - started
    await asyncio.sleep(1.5)  # every rank reports its counters to every front end at least once a second
    after = await asyncio.to_thread(scrape, base_url)
    read = sum(f for f in frames if isinstance(f, int))
    generated = after["gateway_engine_output_tokens_total"] - before["gateway_engine_output_tokens_total"]
    wasted = max(generated - read, 0.0)
    without_abort = clients * max_tokens - read

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    return {
        "clients": clients,
        "close": "rst" if rst else "fin",
        "frames_read": read,
        "client_errors": sum(1 for f in frames if not isinstance(f, int) or f == 0),
        "tokens_generated": int(generated),
        "tokens_after_close": int(wasted),
        "share_after_close_pct": round(100 * wasted / without_abort, 3),
        "logged_499": delta("status_499"),
        "logged_200": delta("status_200"),
        "seconds_to_close": round(closed_after, 2),
        "seconds_to_idle": round(idle_after, 2),
    }


async def slow_readers(base_url: str, pid: int, clients: int, hold: float) -> dict[str, Any]:
    host, port = base_url.removeprefix("http://").split(":")
    body = request_bytes(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "n": 4,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    )
    before_rss = rss_mib(pid)
    before = scrape(base_url)
    socks = []
    for _ in range(clients):
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(body)
        socks.append(sock)
    peak = before_rss
    started = time.monotonic()
    while time.monotonic() - started < hold:
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.25)
    during = scrape(base_url)
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    reset_at = time.monotonic()
    while time.monotonic() - reset_at < 120:
        now = scrape(base_url)
        if idle(now):
            break
        await asyncio.sleep(0.1)
    back_to_zero = time.monotonic() - reset_at
    after = scrape(base_url)
    generated = after["gateway_engine_output_tokens_total"] - before["gateway_engine_output_tokens_total"]
    return {
        "clients": clients,
        "choices": clients * 4,
        "hold_seconds": hold,
        "rss_before_mib": round(before_rss, 1),
        "rss_peak_mib": round(peak, 1),
        "rss_after_mib": round(rss_mib(pid), 1),
        "engine_requests_at_end_of_hold": int(during.get("gateway_engine_requests", 0)),
        "tokens_generated": int(generated),
        "share_of_max_pct": round(100 * generated / (clients * 4 * 3000), 1),
        "stalls_counted": int(after.get("stalls", 0) - before.get("stalls", 0)),
        "seconds_to_gauges_zero_after_reset": round(back_to_zero, 2),
    }


def layout_settings(layout: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``inproc``, ``R`` (R rank workers) or ``RxF`` (R rank workers, F front ends): server and backend settings."""
    ranks, _, front_ends = layout.partition("x")
    server: dict[str, Any] = {"workers": int(front_ends or 1)}
    if ranks == "inproc":
        return server, {}
    return server, {"data_parallel_size": int(ranks), "worker_processes": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--close", choices=["fin", "rst"], nargs="+", default=["fin", "rst"])
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--slow-readers", type=int, default=40)
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the slow readers hang on")
    parser.add_argument("--skip-disconnects", action="store_true")
    parser.add_argument("--skip-slow-readers", action="store_true")
    parser.add_argument("--layouts", default="inproc", help="inproc, R rank workers, RxF with F front ends")
    parser.add_argument("--config-server", type=json.loads, default={}, help="extra server settings (JSON)")
    parser.add_argument(
        "--config-backend",
        type=json.loads,
        default={},
        help='extra backend settings (JSON), e.g. {"max_num_seqs": 512}',
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/disconnects.json"))
    args = parser.parse_args()

    report: dict[str, Any] = {"disconnect": [], "slow_readers": []}
    for layout in args.layouts.split(","):
        server, backend = layout_settings(layout)
        process, base_url, config = serve_gateway(
            {
                "server": {"access_log": False, **server, **args.config_server},
                "backends": [{"name": "reference", "kind": "reference", **backend, **args.config_backend}],
                "models": [{"name": MODEL, "backends": ["reference"]}],
            },
            label=f"gateway ({layout})",
        )
        try:
            if not args.skip_disconnects:
                for clients in args.clients:
                    for close in args.close:
                        row = asyncio.run(disconnect_round(base_url, clients, close == "rst", args.max_tokens))
                        row = {"layout": layout, **row}
                        report["disconnect"].append(row)
                        print(json.dumps(row), flush=True)
            if not args.skip_slow_readers:
                held = asyncio.run(slow_readers(base_url, process.pid, args.slow_readers, args.hold))
                row = {"layout": layout, **held}
                report["slow_readers"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)
            config.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
