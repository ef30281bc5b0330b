"""What this gateway adds in front of an HTTP upstream, next to what LMDeploy's and LiteLLM's proxies add, in one
interleaved run.

Four ways to reach the same OpenAI-compatible upstream:

- ``direct``: the upstream itself;
- ``gateway``: this gateway with one ``kind: lmdeploy`` backend pointing at the upstream;
- ``lmdeploy``: LMDeploy's own proxy (``lmdeploy serve proxy``) with the upstream registered as its node, run
  from the LMDeploy virtualenv the test harness builds once per machine (``tests/backends/lmdeploy/harness``);
- ``gateway-VARIANT`` (``--stream-variants``): this gateway again, streaming through another primitive in place of
  ``gateway/sse.py`` and its batches (``bench/stream_primitives.py``: Starlette's ``StreamingResponse`` plus
  a ping timer, or sse-starlette's ``EventSourceResponse``): is our own primitive worth its code?
- ``litellm``: LiteLLM's proxy (``litellm --config``, one worker) with the upstream as an ``openai/`` model,
  installed in its own virtualenv under ``$DEEPINFER_GATEWAY_CACHE/litellm-venv`` (default
  ``~/.cache/deepinfer-gateway``) so its dependencies never touch this project's.

With ``--pin`` (the default on a machine with at least 2 cores) every proxy runs on core 0 and the upstream and
this load generator on core 1, so each proxy gets the same single core and never competes with the load.

The upstream is started by the script (``--upstream reference``: a second instance of this gateway on the CPU
reference engine, timing model off; ``--upstream fake``: ``loadgen.fake_upstream``, the cheapest possible
server, best for sub-millisecond deltas) or given as a URL. In every round, each (mode, concurrency) cell runs
every target for ``--round-seconds`` in a rotated order, so drift and noise hit all targets alike. Reported per
cell: latency p50/p99 (non-streaming) and TTFT / end-to-end p50/p99 (streaming) as the median over rounds of
each round's percentile; "added" = target minus direct, the median over rounds of the per-round difference; and
the ratios target / direct and each other proxy's added / gateway added; and the CPU time the serving process
spent per request (``cpu_ms_per_req``, from /proc, the median over rounds).

Usage: ``python bench/gateway_overhead.py [--upstream reference|fake|URL] [--concurrency 1,64] [--rounds 5]
[--modes stream] [--stream-variants starlette,sse-starlette]``.
All traffic stays on 127.0.0.1. Results go to ``bench/results/gateway_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from loadgen.arrivals import run_event_loop
from loadgen.client import RequestRecord, plain_request, stream_request
from stream_primitives import VARIANTS

from _gateway import cpu_seconds, free_port

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Describe what the module does with its files, in a few words."


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_GATEWAY_CACHE") or Path.home() / ".cache" / "deepinfer-gateway")


@dataclass
class Target:
    """One way to reach the upstream, with the process that serves it (None for a URL given by the user)."""

    name: str
    url: str
    model: str
    process: subprocess.Popen[bytes] | None = None
    skipped: str | None = None
    log: Path | None = None
    api_key: str = "unused"
    extra: dict[str, Any] = field(default_factory=dict)


def wait_ready(url: str, path: str, process: subprocess.Popen[bytes] | None, timeout: float) -> str | None:
    """None once ``url + path`` answers 200, else why not (the last answer, or the process's exit)."""

    async def poll() -> str | None:
        last = "no answer"
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if process is not None and process.poll() is not None:
                    return f"process exited with status {process.returncode}"
                try:
                    async with session.get(url + path) as response:
                        if response.status == 200:
                            return None
                        last = f"{path} answered {response.status}: {(await response.text())[:300]}"
                except aiohttp.ClientError as exc:
                    last = f"{type(exc).__name__}"
                await asyncio.sleep(0.25)
        return f"not ready after {timeout:.0f} s ({last})"

    return run_event_loop(poll())


PROXY_CORE: set[int] | None = None
"""Cores the proxies under test run on (``--pin``); the upstream and the load generator get the others."""
LOAD_CORES: set[int] | None = None


def start(
    command: list[str], log: Path, env: dict[str, str] | None = None, cores: set[int] | None = None
) -> subprocess.Popen[bytes]:
    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, preexec_fn=pin
        )


def serve_gateway(
    config: dict[str, Any], workdir: Path, name: str, cores: set[int] | None, launcher: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``deepinfer-gateway serve`` with ``config``; ``launcher`` (a script and its arguments) in place of
    ``-m gateway.cli`` runs it through that script, which hands on to the CLI."""
    port = free_port()
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    log = workdir / f"{name}.log"
    entry = launcher if launcher is not None else ["-m", "gateway.cli"]
    command = [sys.executable, *entry, "serve", "--config", str(path), "--port", str(port)]
    return start(command, log, cores=cores), f"http://127.0.0.1:{port}", log


def start_upstream(kind: str, model: str | None, workdir: Path, pace_ms: float) -> Target:
    if kind == "reference":
        config = {
            "server": {"runtime": {"access_log": False, "log_level": "warning"}},
            "backends": [{"name": "reference", "kind": "reference", "max_num_seqs": 256}],
            "models": [{"name": "deepinfer-reference", "backends": ["reference"]}],
        }
        process, url, log = serve_gateway(config, workdir, "upstream", LOAD_CORES)
        target = Target("direct", url, "deepinfer-reference", process, log=log)
        ready = "/ready"
    elif kind == "fake":
        port = free_port()
        log = workdir / "upstream.log"
        command = [sys.executable, "-m", "loadgen.fake_upstream", "--port", str(port), "--pace-ms", str(pace_ms)]
        target = Target("direct", f"http://127.0.0.1:{port}", "fake", start(command, log, cores=LOAD_CORES), log=log)
        ready = "/health"
    else:
        target = Target("direct", kind.rstrip("/").removesuffix("/v1"), model or "")
        ready = "/v1/models"
    problem = wait_ready(target.url, ready, target.process, 180)
    if problem:
        raise SystemExit(f"upstream {target.url} did not start: {problem} (log: {target.log})")
    if not target.model:
        target.model = discover_model(target.url)
    return target


def discover_model(url: str) -> str:
    async def ask() -> str:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as response:
            return orjson.loads(await response.read())["data"][0]["id"]

    return run_event_loop(ask())


def start_gateway(upstream: Target, workdir: Path, connections: int, variant: str | None = None) -> Target:
    """This gateway with a ``kind: lmdeploy`` backend in front of the upstream; with ``variant``, streaming through
    that alternative primitive (``bench/stream_primitives.py``)."""
    config = {
        "server": {"runtime": {"access_log": False, "log_level": "warning"}},
        "backends": [
            {
                "name": "upstream",
                "kind": "lmdeploy",
                "urls": [upstream.url],
                "model": upstream.model,
                "max_connections": connections,
            }
        ],
        "models": [{"name": upstream.model, "backends": ["upstream"]}],
    }
    name = "gateway" if variant is None else f"gateway-{variant}"
    prefix = None if variant is None else [str(ROOT / "bench" / "stream_primitives.py"), variant]
    process, url, log = serve_gateway(config, workdir, name, PROXY_CORE, prefix)
    target = Target(name, url, upstream.model, process, log=log)
    target.skipped = wait_ready(url, "/ready", process, 60)
    return target


def litellm_python(version: str | None) -> Path:
    """The LiteLLM proxy's own virtualenv, created once and reused; pip's output goes to a log beside it."""
    venv = cache_dir() / "litellm-venv"
    python = venv / "bin" / "python"
    marker = venv / f".installed-{version or 'latest'}"
    if marker.exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing LiteLLM's proxy into {venv} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    requirement = f"litellm[proxy]=={version}" if version else "litellm[proxy]"
    with (venv / "install.log").open("wb") as log:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", requirement], check=True, stdout=log, stderr=log
        )
    marker.touch()
    return python


def installed_version(python: Path, package: str) -> str:
    """``package``'s version in the virtualenv of ``python`` (empty if it cannot be read)."""
    script = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=False).stdout.strip()


def start_litellm(upstream: Target, workdir: Path, version: str | None) -> Target:
    target = Target("litellm", "", upstream.model, api_key=f"sk-bench-{secrets.token_hex(16)}")
    try:
        python = litellm_python(version)
    except (subprocess.CalledProcessError, OSError) as exc:
        target.skipped = f"could not install litellm[proxy]: {exc} (see {cache_dir() / 'litellm-venv/install.log'})"
        return target
    config = workdir / "litellm.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": upstream.model,
                        "litellm_params": {
                            "model": f"openai/{upstream.model}",
                            "api_base": f"{upstream.url}/v1",
                            "api_key": "unused",
                        },
                    }
                ],
                "litellm_settings": {"telemetry": False},
                "general_settings": {"master_key": target.api_key},  # it refuses to start without one
            }
        )
    )
    port = free_port()
    log = workdir / "litellm.log"
    litellm = python.parent / "litellm"
    command = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    target.process = start(command, log, {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}, PROXY_CORE)
    target.url, target.log = f"http://127.0.0.1:{port}", log
    target.extra["version"] = installed_version(python, "litellm")
    target.skipped = wait_ready(target.url, "/health/liveliness", target.process, 180)
    return target


def start_lmdeploy_proxy(upstream: Target, workdir: Path) -> Target:
    """LMDeploy's ``lmdeploy serve proxy`` with the upstream registered as its one Hybrid node."""
    target = Target("lmdeploy", "", upstream.model)
    sys.path.insert(0, str(ROOT))
    from tests.backends.lmdeploy.harness.venv import ensure_harness_venv

    try:
        python = ensure_harness_venv(quiet=True)
    except (subprocess.CalledProcessError, OSError, RuntimeError) as exc:
        target.skipped = f"could not build the LMDeploy virtualenv: {exc}"
        return target
    port = free_port()
    log = workdir / "lmdeploy-proxy.log"
    command = [  # python -m: the virtualenv's console scripts name the folder it was built in
        str(python),
        "-m",
        "lmdeploy",
        "serve",
        "proxy",
        "--server-name",
        "127.0.0.1",
        "--server-port",
        str(port),
        "--disable-cache-status",
        "--log-level",
        "ERROR",
    ]
    target.process = start(command, log, cores=PROXY_CORE)
    target.url, target.log = f"http://127.0.0.1:{port}", log
    target.extra["version"] = installed_version(python, "lmdeploy")
    target.skipped = wait_ready(target.url, "/nodes/status", target.process, 180)
    if target.skipped is None:
        target.skipped = register_node(target.url, upstream)
    return target


def register_node(proxy: str, upstream: Target) -> str | None:
    async def add() -> str | None:
        node = {"url": upstream.url, "status": {"models": [upstream.model], "role": 1}}
        async with aiohttp.ClientSession() as session, session.post(f"{proxy}/nodes/add", json=node) as response:
            text = await response.text()
            return None if response.status == 200 and "success" in text.lower() else f"/nodes/add: {text[:200]}"

    return run_event_loop(add())


async def run_cell(
    target: Target, *, stream: bool, concurrency: int, seconds: float, tokens: int
) -> list[RequestRecord]:
    """A closed loop of ``concurrency`` clients for ``seconds`` against one target, after one warm-up each."""
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    payload = orjson.dumps(body)
    url = f"{target.url}/v1/chat/completions"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {target.api_key}"}
    timeout = aiohttp.ClientTimeout(total=120)
    send = stream_request if stream else plain_request
    connector = aiohttp.TCPConnector(limit=concurrency)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                send(session, url, payload, RequestRecord(0, tokens), t0=t0, headers=headers, client_timeout=timeout)
                for _ in range(concurrency)
            )
        )
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                record = RequestRecord(len(records), tokens)
                records.append(
                    await send(session, url, payload, record, t0=t0, headers=headers, client_timeout=timeout)
                )

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.asarray(values) * 1000, [50, 99])
    return float(p50), float(p99)


def round_stats(records: list[RequestRecord], seconds: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    latency = percentiles([r.end - r.start for r in ok])
    ttft = percentiles([r.token_times[0] - r.start for r in ok if r.token_times])
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_kinds": sorted({r.error for r in records if r.error}),
        "req_per_s": len(ok) / seconds,
        "latency_p50_ms": latency[0],
        "latency_p99_ms": latency[1],
        "ttft_p50_ms": ttft[0],
        "ttft_p99_ms": ttft[1],
    }


def median(values: list[float]) -> float | None:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else None


def summarize(rounds: dict[str, list[dict[str, Any]]], stream: bool) -> dict[str, Any]:
    """Median over rounds of each target's percentiles, and of its per-round difference from direct."""
    keys = ["latency_p50_ms", "latency_p99_ms"] + (["ttft_p50_ms", "ttft_p99_ms"] if stream else [])
    direct = rounds.get("direct", [])
    out: dict[str, Any] = {}
    for name, stats in rounds.items():
        row: dict[str, Any] = {k: median([s[k] for s in stats]) for k in keys}
        row["req_per_s"] = median([s["req_per_s"] for s in stats])
        row["cpu_ms_per_req"] = median([s.get("cpu_ms_per_req", float("nan")) for s in stats])
        row["errors"] = sum(s["errors"] for s in stats)
        row["error_kinds"] = sorted({k for s in stats for k in s["error_kinds"]})
        if name != "direct" and direct:
            for key in keys:
                row[f"added_{key}"] = median([s[key] - d[key] for s, d in zip(stats, direct, strict=False)])
                base = row[key] if row[key] is not None else None
                row[f"ratio_{key}"] = base / out["direct"][key] if base and out["direct"][key] else None
        out[name] = row
    gateway = out.get("gateway")
    for peer in [name for name in rounds if name not in ("direct", "gateway")]:
        other = out.get(peer)
        if gateway and other:
            ratios = out.setdefault(f"{peer}_over_gateway", {})
            for key in keys:
                g, o = gateway.get(f"added_{key}"), other.get(f"added_{key}")
                ratios[f"added_{key}"] = o / g if g and o and g > 0 else None
            ratios["req_per_s"] = (
                gateway["req_per_s"] / other["req_per_s"] if gateway["req_per_s"] and other["req_per_s"] else None
            )
            g_cpu, o_cpu = gateway["cpu_ms_per_req"], other["cpu_ms_per_req"]
            ratios["cpu_ms_per_req"] = o_cpu / g_cpu if g_cpu and o_cpu else None
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_cell(stream: bool, concurrency: int, summary: dict[str, Any], chunks: int) -> None:
    """One line per target: its percentiles, and for gateway and LiteLLM what they add over direct."""
    mode = f"{'stream' if stream else 'non-stream':10s} c={concurrency:<3d}"
    key = "ttft_p50_ms" if stream else "latency_p50_ms"
    for name, row in summary.items():
        if name.endswith("_over_gateway"):
            peer = name.removesuffix("_over_gateway")
            ratios = ", ".join(f"{k} {fmt(v, 2)}x" for k, v in row.items() if k not in ("req_per_s", "cpu_ms_per_req"))
            throughput, cpu = fmt(row["req_per_s"]), fmt(row["cpu_ms_per_req"])
            print(
                f"  {mode} {peer} added / gateway added: {ratios}; gateway req/s / {peer} req/s {throughput}; "
                f"{peer} CPU / gateway CPU {cpu}x"
            )
            continue
        line = f"  {mode} {name:24s} p50 {fmt(row['latency_p50_ms'])} p99 {fmt(row['latency_p99_ms'])}"
        if stream:
            line += f" TTFT p50 {fmt(row['ttft_p50_ms'])} p99 {fmt(row['ttft_p99_ms'])}"
        line += (
            f"  {fmt(row['req_per_s'], 0)} req/s  errors {row['errors']}  CPU/req {fmt(row['cpu_ms_per_req'], 3)} ms"
        )
        if name != "direct":
            line += f"  added p50 {fmt(row.get('added_latency_p50_ms'))} p99 {fmt(row.get('added_latency_p99_ms'))}"
            if stream:
                line += f" TTFT p50 {fmt(row.get('added_ttft_p50_ms'))}"
                per_chunk = row.get("added_latency_p50_ms")
                line += f" per chunk {fmt(per_chunk / chunks if per_chunk is not None else None, 4)}"
            line += f"  {fmt(row.get('ratio_' + key))}x direct"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--upstream", default="fake", help="fake (LMDeploy-like, near free), reference, or the URL of a running server"
    )
    parser.add_argument("--upstream-model", default=None, help="model name at a URL upstream (default: its first)")
    parser.add_argument("--pace-ms", type=float, default=0.0, help="fake upstream: milliseconds between chunks")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-seconds", type=float, default=2.0, help="seconds per target per cell per round")
    parser.add_argument("--max-tokens", type=int, default=16, help="non-streaming answer length")
    parser.add_argument("--stream-tokens", type=int, default=64, help="streaming answer length")
    parser.add_argument("--modes", default="plain,stream", help="plain (non-streaming), stream, or both")
    parser.add_argument(
        "--stream-variants",
        default="",
        help=f"also this gateway streaming through other primitives: any of {', '.join(VARIANTS)} (comma-separated)",
    )
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM's proxy out")
    parser.add_argument("--no-lmdeploy", action="store_true", help="leave LMDeploy's proxy out")
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="proxies on core 0, upstream and load generator on the others (default with 2+ cores)",
    )
    parser.add_argument("--litellm-version", default=None, help="pin litellm[proxy] (default: newest)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_overhead.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    global PROXY_CORE, LOAD_CORES
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        PROXY_CORE, LOAD_CORES = {cores[0]}, set(cores[1:])
        os.sched_setaffinity(0, LOAD_CORES)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    targets: list[Target] = []
    try:
        upstream = start_upstream(args.upstream, args.upstream_model, workdir, args.pace_ms)
        targets.append(upstream)
        targets.append(start_gateway(upstream, workdir, max(levels) * 2))
        for variant in filter(None, args.stream_variants.split(",")):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown --stream-variants {variant!r}: any of {', '.join(VARIANTS)}")
            targets.append(start_gateway(upstream, workdir, max(levels) * 2, variant))
        if not args.no_lmdeploy:
            targets.append(start_lmdeploy_proxy(upstream, workdir))
        if not args.no_litellm:
            targets.append(start_litellm(upstream, workdir, args.litellm_version))
        for target in targets:
            if target.skipped:
                print(f"skipping {target.name}: {target.skipped} (log: {target.log})", flush=True)
        live = [t for t in targets if not t.skipped]
        modes = [mode == "stream" for mode in ("plain", "stream") if mode in args.modes.split(",")]
        cells = [(stream, c) for stream in modes for c in levels]
        rounds: dict[tuple[bool, int], dict[str, list[dict[str, Any]]]] = {cell: {} for cell in cells}
        for number in range(args.rounds):
            for stream, concurrency in cells:
                order = live[number % len(live) :] + live[: number % len(live)]  # rotate who goes first
                for target in order:
                    tokens = args.stream_tokens if stream else args.max_tokens
                    cpu_before = cpu_seconds(target.process.pid) if target.process is not None else 0.0
                    records = run_event_loop(
                        run_cell(
                            target, stream=stream, concurrency=concurrency, seconds=args.round_seconds, tokens=tokens
                        )
                    )
                    stats = round_stats(records, args.round_seconds)
                    if target.process is not None and records:  # warm-up requests included: a constant share
                        cpu = cpu_seconds(target.process.pid) - cpu_before
                        stats["cpu_ms_per_req"] = cpu * 1000 / (len(records) + concurrency)
                    rounds[(stream, concurrency)].setdefault(target.name, []).append(stats)
            print(f"round {number + 1}/{args.rounds} done", flush=True)
        results = []
        print(
            f"\nupstream: {args.upstream} ({upstream.url}, model {upstream.model}); medians over {args.rounds} rounds "
            f"of {args.round_seconds:g} s per target and cell; ms"
        )
        for (stream, concurrency), per_target in rounds.items():
            summary = summarize(per_target, stream)
            results.append({"stream": stream, "concurrency": concurrency, "summary": summary, "rounds": per_target})
            print_cell(stream, concurrency, summary, args.stream_tokens if stream else 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(
            orjson.dumps(
                {
                    "upstream": {"kind": args.upstream, "url": upstream.url, "model": upstream.model},
                    "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "targets": {t.name: {"skipped": t.skipped, **t.extra} for t in targets},
                    "cpu_count": os.cpu_count(),
                    "cells": results,
                },
                option=orjson.OPT_INDENT_2,
            )
        )
        print(f"wrote {args.out}")
    finally:
        for target in targets:
            if target.process is not None and target.process.poll() is None:
                target.process.terminate()
                try:
                    target.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    target.process.kill()
        if targets and not any(t.skipped for t in targets):
            shutil.rmtree(workdir, ignore_errors=True)  # keep the logs only when something did not start


if __name__ == "__main__":
    main()
