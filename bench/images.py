"""Image requests: latency and the gateway's memory for chats with 1, 4 and 8 images.

Starts ``deepinfer-gateway serve`` on the reference engine and, for each image count, sends ``--requests`` chat
completions one after the other, each with that many distinct images (random-pixel PNGs of ``--width`` x
``--height``, which do not compress, as data URLs, ``detail: high``) and ``max_tokens: 8``; then the same count
with ``--concurrency`` requests at once. Reports the latency of each request (client side: the body is sent, the
images decoded and resized on the preparation pool, the prompt prefilled and 8 tokens generated) and the gateway's
RSS before, at its peak (sampled every 10 ms) and after each phase. Loopback only.

Usage: ``cd bench && python images.py`` (writes ``bench/results/images.json``).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from _gateway import serve_gateway

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "images.json"
sys.path.insert(0, str(ROOT))  # the suite's PNG writer: real image files without an imaging library
from tests.image_files import noisy_png  # noqa: E402

MODEL = "images"
COUNTS = (1, 4, 8)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Samples a process's RSS every 10 ms while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> PeakRss:
        self.peak = rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def body(count: int, seed: int, args: argparse.Namespace) -> bytes:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these pictures."}]
    for n in range(count):
        data = base64.b64encode(noisy_png(args.width, args.height, seed * 100 + n)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}", "detail": "high"}})
    payload = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "seed": 1}
    return json.dumps(payload).encode()


def one(client: httpx.Client, payload: bytes) -> tuple[float, int]:
    started = time.perf_counter()
    answer = client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise SystemExit(f"request failed: {answer.status_code} {answer.text[:300]}")
    return elapsed, int(answer.json()["usage"]["prompt_tokens"])


def phase(pid: int, base_url: str, payloads: list[bytes], concurrency: int) -> dict[str, Any]:
    before = rss_mib(pid)
    with httpx.Client(base_url=base_url, timeout=120) as client, PeakRss(pid) as rss:
        if concurrency == 1:
            results = [one(client, p) for p in payloads]
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda p: one(client, p), payloads))
    latencies = sorted(r[0] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(payloads),
        "prompt_tokens": results[0][1],
        "body_mib": round(len(payloads[0]) / 2**20, 2),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "latency_max_ms": round(latencies[-1] * 1000, 1),
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(rss.peak, 1),
        "rss_after_mib": round(rss_mib(pid), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per image count and concurrency")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=384)
    args = parser.parse_args()
    config = {
        "backends": [{"name": "reference", "kind": "reference", "max_model_len": 16384}],
        "models": [{"name": MODEL, "backends": ["reference"]}],
    }
    process, base_url, path = serve_gateway(config, label="images")
    rows = []
    try:
        one(httpx.Client(base_url=base_url, timeout=120), body(1, 999, args))  # warm up: pools, first decode
        for count in COUNTS:
            payloads = [body(count, seed, args) for seed in range(args.requests)]
            for concurrency in (1, args.concurrency):
                row = {"images": count, **phase(process.pid, base_url, payloads, concurrency)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)
        path.unlink(missing_ok=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
