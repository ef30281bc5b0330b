"""Big prompts: does ``/health`` keep answering while huge chat messages are prepared, and is the memory returned?

Starts ``deepinfer-gateway serve`` on the reference engine, sends ``--prompts`` concurrent chat requests whose one
message is ``--mib`` MiB of text (under the 8 MiB body limit), and meanwhile asks ``/health`` every
``--health-every`` seconds from another thread. Reports the latency of those ``/health`` answers (p50, p99, max),
the gateway's RSS before, at its peak and ``--settle`` seconds after the big requests ended, and each big
request's status and duration. Two context sizes: the default (the prompt cannot fit and is refused at once) and
``--max-model-len`` large enough that the whole prompt is tokenized before it is refused (``--rounds`` bursts of
prompts in the first case, one in the second). ``/health`` is also probed for ``--idle`` seconds before the load:
that is the floor the machine itself sets (other processes, CPU contention). Loopback only.

Usage: ``python bench/big_prompts.py --prompts 4 --mib 7``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from _gateway import serve_gateway

MODEL = "big-prompts"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "count",
    "their",
    "silver",
    "coins",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children_rss_mib(pid: int) -> float:
    """RSS of the gateway's child processes (the JSON body parsers)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):  # the child just exited
                total += rss_mib(int(child))
    return total


def message_text(mib: float, seed: int) -> str:
    rng = random.Random(seed)
    size = int(mib * 1024 * 1024)
    parts: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        parts.append(word)
        length += len(word) + 1
    return " ".join(parts)[:size]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def run_case(
    *,
    label: str,
    max_model_len: int | None,
    prompts: int,
    mib: float,
    rounds: int,
    health_every: float,
    settle: float,
    idle: float,
) -> dict[str, Any]:
    backend: dict[str, Any] = {"name": "reference", "kind": "reference"}
    if max_model_len is not None:
        backend["max_model_len"] = max_model_len
    process, base_url, config = serve_gateway(
        {
            "server": {"runtime": {"access_log": False}},
            "backends": [backend],
            "models": [{"name": MODEL, "backends": ["reference"]}],
        }
    )
    try:
        bodies = [
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": message_text(mib, i)}], "max_tokens": 1}
            ).encode()
            for i in range(prompts)
        ]
        with httpx.Client(base_url=base_url, timeout=30) as warm:  # warm the request path once
            warm.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        rss_before = rss_mib(process.pid)
        done = threading.Event()
        health_ms: list[float] = []
        health_errors = 0
        peak = rss_before

        def probe(samples: list[float], until: threading.Event) -> None:
            nonlocal health_errors, peak
            with httpx.Client(base_url=base_url, timeout=30) as http:
                while not until.is_set():
                    started = time.perf_counter()
                    try:
                        ok = http.get("/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    samples.append((time.perf_counter() - started) * 1000)
                    health_errors += not ok
                    peak = max(peak, rss_mib(process.pid))
                    time.sleep(health_every)

        idle_ms: list[float] = []
        quiet = threading.Event()
        idle_prober = threading.Thread(target=probe, args=(idle_ms, quiet))
        idle_prober.start()
        time.sleep(idle)
        quiet.set()
        idle_prober.join()

        def send(body: bytes) -> tuple[int, float]:
            started = time.perf_counter()
            with httpx.Client(base_url=base_url, timeout=600) as http:
                response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            return response.status_code, time.perf_counter() - started

        prober = threading.Thread(target=probe, args=(health_ms, done))
        prober.start()
        results: list[tuple[int, float]] = []
        with ThreadPoolExecutor(prompts) as pool:
            for _ in range(rounds):
                results += pool.map(send, bodies)
        done.set()
        prober.join()
        time.sleep(settle)
        rss_after = rss_mib(process.pid)
        children_after = children_rss_mib(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
        config.unlink(missing_ok=True)
    return {
        "case": label,
        "max_model_len": max_model_len or 4096,
        "requests": len(results),
        "statuses": sorted({status for status, _ in results}),
        "big_request_seconds_max": round(max(seconds for _, seconds in results), 2),
        "idle_health_p99_ms": round(percentile(idle_ms, 0.99), 2),
        "health_probes": len(health_ms),
        "health_errors": health_errors,
        "health_p50_ms": round(percentile(health_ms, 0.50), 2),
        "health_p99_ms": round(percentile(health_ms, 0.99), 2),
        "health_max_ms": round(max(health_ms), 2),
        "rss_before_mib": round(rss_before, 1),
        "rss_peak_mib": round(peak, 1),
        "rss_after_mib": round(rss_after, 1),
        "children_rss_after_mib": round(children_after, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="concurrent big chat requests")
    parser.add_argument("--mib", type=float, default=7.0, help="size of each message, MiB")
    parser.add_argument("--rounds", type=int, default=10, help="bursts of prompts in the first case")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of /health probes before the load")
    parser.add_argument("--health-every", type=float, default=0.01, help="seconds between /health probes")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the load before RSS is read")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=1_000_000,
        help="context of the second case: the prompt is tokenized in full (then refused)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/big_prompts.json"))
    args = parser.parse_args()
    common = {
        "prompts": args.prompts,
        "mib": args.mib,
        "health_every": args.health_every,
        "settle": args.settle,
        "idle": args.idle,
    }
    rows = [
        run_case(label="default context", max_model_len=None, rounds=args.rounds, **common),
        run_case(label="tokenized in full", max_model_len=args.max_model_len, rounds=1, **common),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))


if __name__ == "__main__":
    main()
