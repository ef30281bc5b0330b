"""What tracing costs per request: gateway CPU per request with tracing off and on (100% sampling), and without
the tracing code at all (a checkout of an earlier commit), interleaved in one run.

Three gateways serve the same upstream at once (``deepinfer-gateway serve``, one process each, pinned to core 0
with ``--pin``; the upstream, the load and the trace receiver on the other cores):

- ``base``: the source tree given by ``--base-src`` (e.g. a ``git worktree`` of main before tracing) on
  ``PYTHONPATH``, same virtualenv;
- ``off``: this tree, tracing not configured;
- ``on``: this tree, ``server.tracing`` exporting every trace (``sampler: always_on``) over OTLP/HTTP to a
  receiver in this process that reads and discards the export requests.

Upstreams: ``--upstream fake`` (an ``lmdeploy`` backend on ``loadgen.fake_upstream``: the gateway's own CPU
is nearly all there is) or ``reference`` (the in-process reference engine, timing model off: prompt rendering,
tokenizing and the engine thread count too). Each round runs every gateway for ``--requests`` requests at
``--concurrency`` in a rotated order; the figure is the gateway process's CPU time (user + system, all threads,
the exporter's included: the ``on`` gateway exports every 200 ms, and each round waits for that) over the
requests of that round. Reported per gateway: the median over rounds and the
spread (min-max), and the ratios on/off and off/base, as medians of the per-round ratios.

Usage: ``python bench/tracing_cost.py --base-src /tmp/main/src [--upstream fake,reference] [--rounds 7]``.
All traffic stays on 127.0.0.1. Results go to ``bench/results/tracing_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from _gateway import cpu_seconds, free_port

RESULTS = Path(__file__).resolve().parent / "results" / "tracing_cost.json"
MODEL = "bench"
EXPORT_DELAY_MS = 200


class DiscardingReceiver:
    """Takes OTLP/HTTP exports and throws them away (the collector's cost is not the gateway's)."""

    def __init__(self) -> None:
        self.exports = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.exports += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def launch(command: list[str], env: dict[str, str], cores: set[int] | None, log: Path) -> subprocess.Popen[bytes]:
    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become ready")


def gateway_config(upstream: str, upstream_url: str | None, tracing: dict[str, Any] | None) -> dict[str, Any]:
    if upstream == "fake":
        backend: dict[str, Any] = {"name": "up", "kind": "lmdeploy", "urls": [upstream_url], "max_model_len": 4096}
    else:
        backend = {"name": "up", "kind": "reference"}
    server: dict[str, Any] = {"access_log": False, "log_level": "warning", "keep_alive_timeout": 60}
    if tracing is not None:
        server["tracing"] = tracing
    return {"server": server, "backends": [backend], "models": [{"name": MODEL, "backends": ["up"]}]}


async def drive(url: str, concurrency: int, requests: int, body: bytes) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(
                    f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as response:
                    await response.read()
                    if response.status != 200:
                        raise SystemExit(f"{url}: HTTP {response.status}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", required=True, help="the src/ folder of the tree to compare against")
    parser.add_argument("--upstream", default="fake,reference", help="fake, reference, or both")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400, help="per gateway and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    workdir = Path(tempfile.mkdtemp(prefix="tracing-cost-"))
    gateway_cores = {0} if args.pin else None
    other_cores = set(range(1, os.cpu_count() or 1)) if args.pin else None
    if other_cores:
        os.sched_setaffinity(0, other_cores)
    receiver = DiscardingReceiver()
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Say a few words."}], "max_tokens": args.max_tokens}
    ).encode()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "upstreams": {}}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for upstream in args.upstream.split(","):
            upstream_url = None
            if upstream == "fake":
                port = free_port()
                command = [sys.executable, "-m", "loadgen.fake_upstream", "--port", str(port)]
                processes.append(launch(command, dict(os.environ), other_cores, workdir / "fake.log"))
                upstream_url = f"http://127.0.0.1:{port}"
            variants = {
                "base": ({"PYTHONPATH": str(Path(args.base_src).resolve())}, None),
                "off": ({"PYTHONPATH": str(root / "src")}, None),
                # a short export delay, so a round's spans are exported (and their CPU counted) within the round
                "on": (
                    {"PYTHONPATH": str(root / "src"), "OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_DELAY_MS)},
                    {"endpoint": receiver.endpoint, "sampler": "always_on"},
                ),
            }
            gateways: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
            for name, (env, tracing) in variants.items():
                port = free_port()
                path = workdir / f"{upstream}-{name}.yaml"
                path.write_text(json.dumps(gateway_config(upstream, upstream_url, tracing)))
                command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)]
                process = launch(command, {**os.environ, **env}, gateway_cores, workdir / f"{upstream}-{name}.log")
                processes.append(process)
                gateways[name] = (process, f"http://127.0.0.1:{port}")
            for process, url in gateways.values():
                wait_ready(url, process)
                asyncio.run(drive(url, args.concurrency, 100, body))  # warm-up: connections, caches, JIT-free paths
            cpu: dict[str, list[float]] = {name: [] for name in gateways}
            names = list(gateways)
            for round_index in range(args.rounds):
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    process, url = gateways[name]
                    before = cpu_seconds(process.pid)
                    asyncio.run(drive(url, args.concurrency, args.requests, body))
                    time.sleep(EXPORT_DELAY_MS / 1000 * 3)  # the exporter's thread sends what this round queued
                    cpu[name].append((cpu_seconds(process.pid) - before) / args.requests * 1000)
                last = {name: round(values[-1], 3) for name, values in cpu.items()}
                print(json.dumps({"upstream": upstream, "round": round_index, **last}), flush=True)
            ratios = {
                "on/off": statistics.median(a / b for a, b in zip(cpu["on"], cpu["off"], strict=True)),
                "off/base": statistics.median(a / b for a, b in zip(cpu["off"], cpu["base"], strict=True)),
            }
            report["upstreams"][upstream] = {
                "cpu_ms_per_request": {
                    name: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                    for name, v in cpu.items()
                },
                "ratios": {k: round(v, 3) for k, v in ratios.items()},
                "rounds": cpu,
            }
            print(json.dumps({"upstream": upstream, **report["upstreams"][upstream]["cpu_ms_per_request"], **ratios}))
            for process, _ in gateways.values():
                process.terminate()
                process.wait(timeout=60)
        report["exports_received"] = receiver.exports
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
