"""Throughput of data-parallel engine workers, their balance, and what the gateway process pays per token.

Starts the real gateway (``deepinfer-gateway serve``) over the reference engine with its timing model imitating a
decode step (``--step`` seconds, ``--tokens-per-step`` tokens per request per step, ``--max-num-seqs`` slots per
rank), once per layout: the engine in the gateway process (``inproc``), then 1, 2 and 4 worker processes, and
``RxF``: R rank workers shared by F front-end processes (``server.runtime.workers: F``; the supervisor hosts the
ranks and every front end dispatches to all of them). Each layout gets the same closed-loop load of streaming chat
requests, measured after a warm-up of one short request per client (each opens its connection), and reports:

- tokens/s and requests/s;
- the balance ratio: max / min requests dispatched per rank;
- CPU per streamed token: the gateway's front-end process(es) (user + system, all threads, from /proc; with
  several front ends, their sum plus the supervisor's) and its rank workers; the front ends' part split by thread
  and mode: the event loop's user time (Python: requests, frames) and system time (mostly the frames' socket
  writes), ZeroMQ's I/O threads (the rank messages);
- the share of the gateway's CPU per token spent turning engine outputs into text (detokenizing, stop matching:
  ``Choice.consume``), measured offline on the same tokenizer, to decide whether that work should move into
  the workers;
- one view: the sum over ranks of ``gateway_dp_rank_dispatched_requests_total`` in six scrapes taken after the
  load (each on a new connection, so with several front ends they reach different ones), against the requests
  sent: the ranks count what they took, so every scrape should show them all.

Usage: ``python bench/data_parallel.py --duration 15 --concurrency 256`` (add ``--lockstep --layouts 2,4`` for
ranks that step together; ``--layouts 2,2x2`` compares one and two front ends in front of two ranks). The
front-end CPU probe: ``--layouts 2,2x2 --concurrency 64 --max-tokens 256``. ``--against ../main/src --rounds 3``
runs every layout with this tree and with another checkout's source, interleaved (the order alternating each round), and
reports each pair's ratio. With ``--simultaneous`` the two trees' gateways (started in an order that alternates
each round) serve at the same time, each under the same closed-loop load: on a machine shared with other work,
both then see the same contention (on a loaded 2-core host, one session's interleaved pairs gave ratios from 0.79
to 1.07, its simultaneous pairs from 0.86 to 0.99, each layout's within ±3%). Calibrate with two identical trees
first: on a 2-core VM such pairs gave 0.93 to 1.05 with one front end and 0.99 to 1.07 with two, so
an effect of a few percent needs many rounds to show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from _gateway import children, cpu_seconds, serve_gateway, thread_cpu

MODEL = "bench-dp"


def scrape(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name.startswith(("gateway_dp_rank_dispatched", "gateway_generation_tokens", "gateway_engine")):
                key = sample.name + ("/" + sample.labels["rank"] if "rank" in sample.labels else "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def is_rank_worker(pid: int) -> bool:
    try:
        return b"backends.workers.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def split_layout(layout: str) -> tuple[str, int]:
    """``2x3`` -> ranks ``2``, 3 front ends; ``inproc`` and ``4`` have one front end."""
    ranks, _, front_ends = layout.partition("x")
    return ranks, int(front_ends or 1)


def start_gateway(
    layout: str, args: argparse.Namespace, source: Path | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    backend: dict[str, Any] = {
        "name": "reference",
        "kind": "reference",
        "max_num_seqs": args.max_num_seqs,
        "max_in_flight": None,
        "timing": {"decode_seconds_per_step": args.step, "tokens_per_step": args.tokens_per_step},
    }
    ranks, front_ends = split_layout(layout)
    if ranks != "inproc":
        backend["data_parallel_size"] = int(ranks)
        backend["worker_processes"] = True
        backend["lockstep"] = args.lockstep
    return serve_gateway(
        {
            "server": {"runtime": {"access_log": False, "workers": front_ends}},
            "backends": [backend],
            "models": [{"name": MODEL, "backends": ["reference"]}],
        },
        label=f"gateway ({layout})",
        source=source,
    )


async def stream_one(session: aiohttp.ClientSession, url: str, number: int, max_tokens: int) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Describe module number {number}."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    frames = 0
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for chunk in response.content.iter_any():
            frames += chunk.count(b"\n\n")
    return frames


async def run_load(
    base_url: str,
    concurrency: int,
    duration: float,
    max_tokens: int,
    warmed: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """A warm-up, one short request per client (each opens its connection and the gateway's code paths are taken
    once), then ``warmed()``, where the caller starts measuring, then ``duration`` seconds of closed-loop load."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    url = f"{base_url}/v1/chat/completions"
    warm_up = concurrency
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(stream_one(session, url, i, 4) for i in range(warm_up)))
        if warmed is not None:
            await warmed()
        counter = iter(range(10**9))
        done: list[int] = []
        stop_at = time.perf_counter() + duration

        async def client() -> None:
            while time.perf_counter() < stop_at:
                done.append(await stream_one(session, url, next(counter), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"requests": len(done), "warm_up": warm_up, "frames": sum(done), "wall_seconds": wall}


def dispatched_sums(base_url: str, before: dict[str, float], scrapes: int = 6) -> list[int]:
    """The requests the ranks say they took since ``before``, summed over ranks, in each of ``scrapes`` scrapes on
    new connections. Taken once the ranks have reported since the load ended (every second when idle)."""
    time.sleep(1.5)
    sums = []
    for _ in range(scrapes):
        now = scrape(base_url)
        prefix = "gateway_dp_rank_dispatched_requests_total/"
        sums.append(int(sum(v - before.get(k, 0.0) for k, v in now.items() if k.startswith(prefix))))
    return sums


def choice_cost_us_per_token(tokens_per_step: int) -> float:
    """CPU of ``Choice.consume`` (detokenize + stop matching) per token, on reference-engine output."""
    from backends.engine.choice import Choice
    from backends.engine.detokenizer import TokenTable
    from backends.engine.protocol import EngineOutput
    from backends.reference.artifacts import load_or_build

    artifacts = load_or_build()
    table = TokenTable(artifacts.tokenizer)
    text = "The module provides functions for reading and writing files, and for walking directory trees. " * 40
    ids = [i for i in artifacts.tokenizer.encode(text, add_special_tokens=False).ids if i > 2][:4000]
    steps = [ids[i : i + tokens_per_step] for i in range(0, len(ids) - tokens_per_step, tokens_per_step)]
    outputs = [
        [EngineOutput("r", t, False, "", 1, 10, -0.5, (), ()) for t in step]
        for step in steps  # one engine step's outputs for one request
    ]
    rounds = 20
    started = time.process_time()
    for _ in range(rounds):
        choice = Choice(0, table, table.new_detokenizer(), ["\n\nUser:"], False)
        for step in outputs:
            choice.consume(step)
    elapsed = time.process_time() - started
    return 1e6 * elapsed / (rounds * sum(len(s) for s in steps))


def cpu_by_thread_kind(pids: list[int]) -> dict[str, float]:
    """CPU seconds of the front ends' threads, summed over the processes by kind and mode (``loop user``, ``loop
    system``, ``zmq user``...): where the front end's CPU per token goes, Python or the kernel."""
    total: dict[str, float] = {}
    for pid in pids:
        for kind, times in thread_cpu(pid).items():
            for mode, seconds in zip(("user", "system"), times, strict=True):
                total[f"{kind} {mode}"] = total.get(f"{kind} {mode}", 0.0) + seconds
    return total


def measure(layout: str, args: argparse.Namespace, source: Path | None) -> dict[str, Any]:
    process, base_url, config = start_gateway(layout, args, source)
    try:
        for _ in range(20):  # new connections reach every front end: each must be ready
            while httpx.get(f"{base_url}/ready").status_code != 200:
                time.sleep(0.2)
        workers = [pid for pid in children(process.pid) if is_rank_worker(pid)]
        front_ends = [process.pid] + [pid for pid in children(process.pid) if not is_rank_worker(pid)]
        start: dict[str, Any] = {}

        async def warmed() -> None:
            start.update(
                before=scrape(base_url),
                cpu=sum(cpu_seconds(pid) for pid in front_ends),
                wcpu=sum(cpu_seconds(w) for w in workers),
                threads=cpu_by_thread_kind(front_ends),
            )

        load = asyncio.run(run_load(base_url, args.concurrency, args.duration, args.max_tokens, warmed))
        before, cpu0, wcpu0, threads0 = start["before"], start["cpu"], start["wcpu"], start["threads"]
        cpu1 = sum(cpu_seconds(pid) for pid in front_ends)
        wcpu1 = sum(cpu_seconds(w) for w in workers)
        threads1 = cpu_by_thread_kind(front_ends)
        after = scrape(base_url)
        sums = dispatched_sums(base_url, before) if workers else []
    finally:
        process.terminate()
        process.wait(timeout=60)
        config.unlink(missing_ok=True)
    tokens = after.get("gateway_generation_tokens_total", 0.0) - before.get("gateway_generation_tokens_total", 0.0)
    per_rank = sorted(
        after[k] - before.get(k, 0.0) for k in after if k.startswith("gateway_dp_rank_dispatched_requests_total/")
    )
    return {
        "layout": layout,
        "source": str(source) if source is not None else "this tree",
        "requests": load["requests"],
        "tokens": tokens,
        "tokens_per_second": tokens / load["wall_seconds"],
        "requests_per_second": load["requests"] / load["wall_seconds"],
        "requests_per_rank": per_rank,
        "balance_ratio": (per_rank[-1] / per_rank[0]) if per_rank and per_rank[0] else None,
        "dispatched_in_six_scrapes": sums,
        "requests_sent": load["requests"],  # since the warm-up, as the scrapes are
        "gateway_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / tokens,
        "gateway_cpu_utilisation": (cpu1 - cpu0) / load["wall_seconds"],
        "gateway_cpu_us_per_token_by_thread": {
            part: 1e6 * (seconds - threads0.get(part, 0.0)) / tokens for part, seconds in sorted(threads1.items())
        },
        "worker_cpu_us_per_token": 1e6 * (wcpu1 - wcpu0) / tokens if workers else None,
    }


def measure_simultaneously(layout: str, args: argparse.Namespace, other: Path, this_first: bool) -> tuple[float, float]:
    """Front-end CPU per streamed token of this tree and of ``other``, both serving the same load at once. Which
    starts first alternates between rounds (``this_first``), so that the order favours neither tree: with it fixed,
    identical trees with two front ends each gave ratios of 1.01-1.07, all on the same side."""
    sources = (None, other) if this_first else (other, None)
    started = [start_gateway(layout, args, source) for source in sources]
    try:
        for _, base_url, _ in started:
            for _ in range(20):  # new connections reach every front end: each must be ready
                while httpx.get(f"{base_url}/ready").status_code != 200:
                    time.sleep(0.2)
        front_ends = [[p.pid] + [c for c in children(p.pid) if not is_rank_worker(c)] for p, _, _ in started]
        key = "gateway_generation_tokens_total"
        before: list[float] = []
        cpu0: list[float] = []

        async def load_both() -> None:
            both_warm = asyncio.Barrier(len(started))

            async def warmed() -> None:  # the last gateway to finish its warm-up starts both measurements
                if await both_warm.wait() == 0:
                    before.extend(scrape(base_url).get(key, 0.0) for _, base_url, _ in started)
                    cpu0.extend(sum(map(cpu_seconds, pids)) for pids in front_ends)
                await both_warm.wait()

            await asyncio.gather(
                *(run_load(u, args.concurrency, args.duration, args.max_tokens, warmed) for _, u, _ in started)
            )

        asyncio.run(load_both())
        cpu1 = [sum(map(cpu_seconds, pids)) for pids in front_ends]
        after = [scrape(base_url).get(key, 0.0) for _, base_url, _ in started]
    finally:
        for process, _, config in started:
            process.terminate()
            process.wait(timeout=60)
            config.unlink(missing_ok=True)
    first, second = (1e6 * (cpu1[i] - cpu0[i]) / (after[i] - before[i]) for i in range(2))
    return (first, second) if this_first else (second, first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="inproc,1,2,4", help="inproc and/or worker counts, comma-separated")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step", type=float, default=0.025, help="seconds per decode step (timing model)")
    parser.add_argument("--tokens-per-step", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="running requests per rank")
    parser.add_argument("--lockstep", action="store_true", help="ranks step together (DeepInfer DP collectives)")
    parser.add_argument("--against", type=Path, help="another checkout's src (e.g. a worktree of main) to compare")
    parser.add_argument("--rounds", type=int, default=1, help="with --against: interleaved rounds per layout")
    parser.add_argument("--simultaneous", action="store_true", help="with --against: both trees serve at once")
    parser.add_argument("--out", type=Path, default=Path("bench/results/data_parallel.json"))
    args = parser.parse_args()
    if args.simultaneous:
        if args.against is None:
            parser.error("--simultaneous needs --against")
        pairs = []
        for round_number in range(args.rounds):
            for layout in args.layouts.split(","):
                this, that = measure_simultaneously(layout, args, args.against.resolve(), round_number % 2 == 0)
                pairs.append({"layout": layout, "round": round_number, "this_tree": this, "against": that})
                print(
                    f"{layout:>7} round {round_number}: gateway CPU per token, this tree {this:.1f} us, "
                    f"{args.against} {that:.1f} us, ratio {this / that:.3f}",
                    flush=True,
                )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"settings": settings, "simultaneous": pairs}, indent=2))
        print(f"wrote {args.out}")
        return
    rows = []
    sources: list[Path | None] = [None] if args.against is None else [None, args.against.resolve()]
    for round_number in range(args.rounds):
        for layout in args.layouts.split(","):
            order = sources if round_number % 2 == 0 else sources[::-1]
            pair = {}
            for source in order:
                row = measure(layout, args, source)
                row["round"] = round_number
                rows.append(row)
                pair[source] = row
                balance = f"{row['balance_ratio']:.3f}" if row["balance_ratio"] else "-"
                worker_cpu = f"{row['worker_cpu_us_per_token']:.1f}" if row["worker_cpu_us_per_token"] else "-"
                by_thread = ", ".join(
                    f"{part} {value:.1f}" for part, value in row["gateway_cpu_us_per_token_by_thread"].items() if value
                )
                print(
                    f"{layout:>7} [{row['source']}]: {row['tokens_per_second']:8.0f} tok/s  "
                    f"{row['requests_per_second']:6.1f} req/s  balance {balance} {row['requests_per_rank']}  gateway "
                    f"{row['gateway_cpu_us_per_token']:.1f} us/tok ({row['gateway_cpu_utilisation']:.2f} cores; "
                    f"{by_thread})  "
                    f"workers {worker_cpu} us/tok  dispatched {row['dispatched_in_six_scrapes']} of "
                    f"{row['requests_sent']}",
                    flush=True,
                )
            if args.against is not None:
                this, other = pair[None], pair[args.against.resolve()]
                ratio = this["gateway_cpu_us_per_token"] / other["gateway_cpu_us_per_token"]
                print(f"{layout:>7}: gateway CPU per token, this tree / {args.against}: {ratio:.3f}", flush=True)
    choice_us = choice_cost_us_per_token(args.tokens_per_step)
    print(f"Choice.consume (detokenize + stop strings): {choice_us:.2f} us per token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"settings": settings, "layouts": rows, "choice_us_per_token": choice_us}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
