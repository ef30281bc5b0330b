"""How far one load-generator process goes: the real client against ``fake_upstream`` on the other core.

Reports, per load, the client's CPU seconds per wall second and the SSE chunks and requests it handled per CPU
second; the latter, at 100% of a core, is one process's ceiling. Run on an otherwise idle machine:
``python -m loadgen.capacity`` (a minute). ``--workers auto`` in ``deepinfer-gateway bench`` keeps each
process at a fraction of the ceiling measured here (docs/bench.md).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from .arrivals import run_event_loop, run_shares
from .config import BenchConfig, LengthSpec, LoadPoint
from .metrics import compute_metrics


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_fake(pace_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "loadgen.fake_upstream", "--port", str(port), "--pace-ms", str(pace_ms)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"{url}/health") as response:
                        if response.status == 200:
                            return True
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
        return False

    if not run_event_loop(ready()):
        process.kill()
        raise SystemExit("fake upstream did not start")
    return process, url


def measure(url: str, concurrency: int, tokens: int, duration: float) -> dict:
    config = BenchConfig(
        url=url,
        models=("fake",),
        out=Path("."),
        concurrency=(concurrency,),
        duration=duration,
        input_len=LengthSpec("fixed", 16),
        output_len=LengthSpec("fixed", tokens),
        workers=1,
        warmup=concurrency,
    )
    point = LoadPoint(0, concurrency=concurrency)
    shares = run_event_loop(run_shares(config, None, "fake", point, lambda done: None))
    share = shares[0]
    records = share.records
    metrics = compute_metrics(records)
    chunks = sum(len(r.token_times) for r in records)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "failed": metrics["requests"]["failed"],
        "chunks_per_second": chunks / share.wall_seconds,
        "requests_per_second": len(records) / share.wall_seconds,
        "client_cpu_utilisation": share.cpu_seconds / share.wall_seconds,
        "chunks_per_cpu_second": chunks / share.cpu_seconds if share.cpu_seconds else None,
        "requests_per_cpu_second": len(records) / share.cpu_seconds if share.cpu_seconds else None,
        "tpot_ms_p50": metrics["tpot_ms"]["p50"],
        "itl_ms_p99": metrics["itl_ms"]["p99"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unpaced", default="16,64", help="concurrency levels with all chunks sent at once")
    parser.add_argument("--paced", default="256,512,1024", help="concurrency levels with a chunk every --pace-ms")
    parser.add_argument("--pace-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=64, help="chunks per response")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for pace, levels in ((0.0, args.unpaced), (args.pace_ms, args.paced)):
        if not levels:
            continue
        process, url = start_fake(pace)
        try:
            for level in (int(x) for x in levels.split(",")):
                row = {"pace_ms": pace, **measure(url, level, args.tokens, args.duration)}
                rows.append(row)
                print(
                    f"pace {pace:4.0f} ms  c={level:5d}  {row['requests_per_second']:8.0f} req/s  "
                    f"{row['chunks_per_second']:9.0f} chunks/s  client cpu {row['client_cpu_utilisation']:.2f}  "
                    f"-> {row['chunks_per_cpu_second']:9.0f} chunks/cpu-s  {row['requests_per_cpu_second']:7.0f} "
                    f"req/cpu-s  tpot p50 {row['tpot_ms_p50'] or 0:.1f} ms  itl p99 {row['itl_ms_p99'] or 0:.1f} ms"
                    f"  failed {row['failed']}",
                    flush=True,
                )
                time.sleep(0.5)
        finally:
            process.terminate()
            process.wait(timeout=10)
    if args.out:
        args.out.write_bytes(orjson.dumps({"tokens": args.tokens, "rows": rows}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
