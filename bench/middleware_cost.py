"""What the gateway's ASGI middleware costs per request: this tree against another (``--base-src``), interleaved.

Two measurements, each alternating the two trees round by round, so drift and a busy machine hit both alike:

- ``http``: a gateway from each tree (``deepinfer-gateway serve``, one process each) in front of the same upstream
  (``--upstream fake``: ``loadgen.fake_upstream``, so the gateway's own work is nearly all there is; or
  ``reference``: the CPU reference engine in process, timing model off). Each round sends every gateway
  ``--requests`` small non-streamed chat completions, then as many short streams (``--stream-tokens`` tokens), at
  ``--concurrency``; the figure is the gateway process's CPU time (all threads, read from its CPU-time clock with
  nanosecond resolution: /proc's 10 ms ticks are too coarse for a few microseconds) over the requests of that
  round, in microseconds.
- ``asgi``: the tree's own middleware (the app's ``user_middleware``, as ``create_app`` installs them) around an app
  that reads the body and answers 200 at once, called in process with no server and no socket: a ``GET``, a
  ``POST`` with a small JSON body, and the same ``POST`` answered by 16 body frames sent through ASGI (a stream's
  frames that do not go straight to the connection), ``--calls`` times each per round, in a child process per
  tree; the figure is that process's CPU time per call: the middleware's cost and nothing else.

Reported per measurement and tree: the median over rounds and the spread (min-max), and the per-round difference
(this tree minus base) as its median. The access log is off in both trees (its line is the same in each; writing
it would only add noise).

Usage: ``python bench/middleware_cost.py --base-src /tmp/base-main/src [--rounds 9] [--parts http,asgi]``.
All traffic stays on 127.0.0.1. Results go to ``bench/results/middleware_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from _gateway import free_port, serve_gateway

RESULTS = Path(__file__).resolve().parent / "results" / "middleware_cost.json"
MODEL = "bench"

ASGI_PROBE = r"""
import asyncio, json, sys, time
from gateway.app import create_app
from gateway.config import GatewayConfig

config = GatewayConfig.model_validate(json.loads(sys.argv[1]))
calls = int(sys.argv[2])

async def answer(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})

async def answer_stream(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(16):
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})

def wrapped(app):
    for cls, args, kwargs in reversed(create_app(config).user_middleware):
        app = cls(app, *args, **kwargs)
    return app

stacks = {"plain": wrapped(answer), "stream": wrapped(answer_stream)}

async def receive():
    return {"type": "http.request", "body": b"{}", "more_body": False}

async def send(message):
    return None

def scope(method, path, headers):
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": {}}

async def main():
    out = {}
    json_headers = [(b"host", b"gw"), (b"content-type", b"application/json"), (b"content-length", b"2")]
    for name, method, path, headers in (
        ("get", "GET", "/v1/models", [(b"host", b"gw")]),
        ("post", "POST", "/v1/chat/completions", json_headers),
        ("post_16_frames", "POST", "/v1/chat/completions", json_headers),
    ):
        stack = stacks["stream" if name == "post_16_frames" else "plain"]
        for _ in range(500):
            await stack(scope(method, path, list(headers)), receive, send)
        started = time.process_time()
        for _ in range(calls):
            await stack(scope(method, path, list(headers)), receive, send)
        out[name] = (time.process_time() - started) / calls * 1e6
    print(json.dumps(out))

asyncio.run(main())
"""


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def cpu_clock(pid: int) -> int:
    """The CPU-time clock of a process (all its threads), for ``time.clock_gettime_ns``."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(ctypes.get_errno(), f"no CPU clock for process {pid}")
    return clock.value


def gateway_config(upstream: str, upstream_url: str | None) -> dict[str, Any]:
    if upstream == "fake":
        backend: dict[str, Any] = {"name": "up", "kind": "lmdeploy", "urls": [upstream_url], "max_model_len": 4096}
    else:
        backend = {"name": "up", "kind": "reference"}
    server = {"access_log": False, "log_level": "warning", "keep_alive_timeout": 60}
    return {"server": server, "backends": [backend], "models": [{"name": MODEL, "backends": ["up"]}]}


async def drive(url: str, concurrency: int, requests: int, body: bytes) -> None:
    """``requests`` POSTs of ``body`` at ``concurrency``, each read to its end."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                headers = {"Content-Type": "application/json"}
                async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        raise SystemExit(f"{url}: HTTP {response.status}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def bodies(stream_tokens: int) -> dict[str, bytes]:
    messages = [{"role": "user", "content": "Say a few words."}]
    plain = {"model": MODEL, "messages": messages, "max_tokens": 4}
    stream = {"model": MODEL, "messages": messages, "max_tokens": stream_tokens, "stream": True}
    return {"plain": json.dumps(plain).encode(), "stream": json.dumps(stream).encode()}


def summary(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """Median and spread per tree, and the median of the per-round difference (this tree minus base)."""
    out: dict[str, Any] = {
        tree: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
        for tree, v in rounds.items()
    }
    differences = [a - b for a, b in zip(rounds["this"], rounds["base"], strict=True)]
    out["this_minus_base"] = round(statistics.median(differences), 2)
    return out


def http_part(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, Any]:
    processes: list[subprocess.Popen[bytes]] = []
    configs: list[Path] = []
    try:
        upstream_url = None
        if args.upstream == "fake":
            port = free_port()
            command = [sys.executable, "-m", "loadgen.fake_upstream", "--port", str(port)]
            processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            upstream_url = f"http://127.0.0.1:{port}"
        config = gateway_config(args.upstream, upstream_url)
        gateways: dict[str, tuple[int, str]] = {}
        for tree, source in trees.items():
            process, url, path = serve_gateway(config, label=tree, source=source)
            processes.append(process)
            configs.append(path)
            gateways[tree] = (cpu_clock(process.pid), url)
        load = bodies(args.stream_tokens)
        for _, url in gateways.values():
            for body in load.values():
                asyncio.run(drive(url, args.concurrency, 200, body))  # warm-up: connections, caches
        cpu: dict[str, dict[str, list[float]]] = {kind: {tree: [] for tree in trees} for kind in load}
        for round_index in range(args.rounds):
            order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
            for tree in order:
                clock, url = gateways[tree]
                for kind, body in load.items():
                    before = time.clock_gettime_ns(clock)
                    asyncio.run(drive(url, args.concurrency, args.requests, body))
                    cpu[kind][tree].append((time.clock_gettime_ns(clock) - before) / args.requests / 1000)
            print(json.dumps({"part": "http", "round": round_index, **_last(cpu)}), flush=True)
        return {kind: summary(rounds) | {"rounds": rounds} for kind, rounds in cpu.items()}
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
        for path in configs:
            path.unlink(missing_ok=True)


def asgi_part(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, Any]:
    config = json.dumps(gateway_config("reference", None))
    cpu: dict[str, dict[str, list[float]]] = {}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for tree in order:
            env = {**os.environ, "PYTHONPATH": str(trees[tree])}
            command = [sys.executable, "-c", ASGI_PROBE, config, str(args.calls)]
            result = subprocess.run(command, env=env, capture_output=True, check=True, cwd=tempfile.gettempdir())
            for kind, micros in json.loads(result.stdout.splitlines()[-1]).items():
                cpu.setdefault(kind, {name: [] for name in trees})[tree].append(micros)
        print(json.dumps({"part": "asgi", "round": round_index, **_last(cpu)}), flush=True)
    return {kind: summary(rounds) | {"rounds": rounds} for kind, rounds in cpu.items()}


def _last(cpu: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {kind: {tree: round(v[-1], 1) for tree, v in rounds.items()} for kind, rounds in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", required=True, type=Path, help="the src/ folder of the tree to compare against")
    parser.add_argument("--parts", default="http,asgi")
    parser.add_argument("--upstream", default="fake", choices=("fake", "reference"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1000, help="per gateway, kind and round")
    parser.add_argument("--stream-tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20000, help="ASGI calls per route and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    trees = {"base": args.base_src.resolve(), "this": Path(__file__).resolve().parent.parent / "src"}
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    parts = args.parts.split(",")
    if "asgi" in parts:
        report["asgi_us_per_call"] = asgi_part(args, trees)
    if "http" in parts:
        report["http_cpu_us_per_request"] = http_part(args, trees)
    for part in ("asgi_us_per_call", "http_cpu_us_per_request"):
        for kind, result in report.get(part, {}).items():
            print(json.dumps({"part": part, "kind": kind, **{k: v for k, v in result.items() if k != "rounds"}}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
