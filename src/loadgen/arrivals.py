"""How load is offered: a closed loop of N concurrent streams, or open-loop Poisson arrivals; warm-up first.

A load point runs in one process, or is split across several (``--workers``): each process takes every P-th
request and a 1/P share of the streams (a Poisson process thinned by taking every P-th arrival of a shared
schedule is still the same schedule overall). Processes agree on a wall-clock start and convert it to their own
``perf_counter``, so every record's times are seconds since the load point started, on one clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import math
import multiprocessing as mp
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .client import RequestRecord, stream_request
from .config import BenchConfig, LoadPoint
from .workload import DatasetRow, Workload, request_body

START_MARGIN = 0.05
"""Seconds between the start signal and the agreed start, so every worker process is waiting when it comes."""


@dataclass(frozen=True, slots=True)
class Share:
    """One worker's part of a load point; plain data so it can cross a process boundary."""

    config: BenchConfig
    dataset: list[DatasetRow] | None
    model: str
    point: LoadPoint
    worker: int
    workers: int

    def slots(self, total: int) -> int:
        """This worker's part of ``total`` streams (at least one)."""
        return max(1, total // self.workers + (1 if self.worker < total % self.workers else 0))


@dataclass(slots=True)
class ShareResult:
    """What one worker measured, plus how busy it was doing so (to tell when the client is the bottleneck)."""

    records: list[RequestRecord]
    cpu_seconds: float
    wall_seconds: float
    send_lags: list[float] = field(default_factory=list)  # open loop: actual send - scheduled send, seconds
    warmup_failures: int = 0


def arrival_times(seed: int, point: LoadPoint, count: int | None, duration: float | None) -> list[float]:
    """Poisson arrivals (exponential gaps at ``request_rate``), the first at 0; all at 0 for rate ``inf``."""
    rate = point.request_rate or math.inf
    rng = random.Random(f"{seed}:arrivals:{point.index}")
    times: list[float] = []
    t = 0.0
    while True:
        if count is not None and len(times) >= count:
            return times
        if count is None and (t >= (duration or 0.0) or (math.isinf(rate) and times)):
            return times
        times.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)


class ShareRunner:
    """Runs one worker's share: warm-up, then the measured phase; reports each finished request."""

    def __init__(self, share: Share, on_done: Callable[[], None]) -> None:
        self.share = share
        self.config = share.config
        self.workload = Workload(share.config, share.dataset)
        self.on_done = on_done
        self.url = share.config.base_url + share.config.path
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if share.config.api_key:
            self.headers["Authorization"] = f"Bearer {share.config.api_key}"
        self.timeout = aiohttp.ClientTimeout(total=share.config.timeout, sock_connect=30)

    def _connections(self) -> int:
        point = self.share.point
        if point.concurrency is not None:
            return self.share.slots(point.concurrency)
        return self.share.slots(point.max_concurrency) if point.max_concurrency else 0  # 0: unlimited

    def _body(self, index: int, *, warmup: bool) -> tuple[bytes, RequestRecord]:
        request = self.workload.request(self.share.point.index, index, warmup=warmup)
        if warmup:  # warm-up opens connections and wakes the server; short answers are enough
            request = dataclasses.replace(request, max_tokens=min(request.max_tokens, 16))
        body = request_body(request, self.share.model, ignore_eos=self.config.ignore_eos, extra=self.config.extra_body)
        return body, RequestRecord(request.index, request.max_tokens, request.target_input_len)

    async def _send(self, session: aiohttp.ClientSession, index: int, t0: float, *, warmup: bool) -> RequestRecord:
        body, record = self._body(index, warmup=warmup)
        return await stream_request(
            session, self.url, body, record, t0=t0, headers=self.headers, client_timeout=self.timeout
        )

    async def warmup(self, session: aiohttp.ClientSession) -> int:
        """Sends this worker's share of the warm-up requests; returns how many failed."""
        share = self.share
        indices = list(range(share.worker, self.config.warmup_for(share.point), share.workers))
        if not indices:
            return 0
        width = self._connections() or len(indices)
        pending = iter(indices)
        failures = 0

        async def slot() -> None:
            nonlocal failures
            for index in pending:
                record = await self._send(session, index, 0.0, warmup=True)
                failures += not record.ok

        await asyncio.gather(*(slot() for _ in range(min(width, len(indices)))))
        return failures

    async def closed_loop(self, session: aiohttp.ClientSession, t0: float) -> list[RequestRecord]:
        share, config = self.share, self.config
        total = config.requests_for(share.point)
        indices = itertools.count(share.worker, share.workers)
        deadline = None if config.duration is None else t0 + config.duration
        records: list[RequestRecord] = []

        async def slot() -> None:
            for index in indices:
                if (total is not None and index >= total) or (deadline is not None and time.perf_counter() >= deadline):
                    return
                records.append(await self._send(session, index, t0, warmup=False))
                self.on_done()

        await asyncio.gather(*(slot() for _ in range(self.share.slots(share.point.concurrency or 1))))
        return records

    async def open_loop(self, session: aiohttp.ClientSession, t0: float, lags: list[float]) -> list[RequestRecord]:
        share, config = self.share, self.config
        schedule = arrival_times(config.seed, share.point, config.requests_for(share.point), config.duration)
        mine = schedule[share.worker :: share.workers]
        limit = self._connections()
        gate = asyncio.Semaphore(limit) if limit else None
        records: list[RequestRecord] = []

        async def one(index: int) -> None:
            if gate is None:
                records.append(await self._send(session, index, t0, warmup=False))
            else:
                async with gate:
                    records.append(await self._send(session, index, t0, warmup=False))
            self.on_done()

        tasks: list[asyncio.Task[None]] = []
        for position, at in enumerate(mine):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(time.perf_counter() - t0 - at)
            tasks.append(asyncio.create_task(one(share.worker + position * share.workers)))
        await asyncio.gather(*tasks)
        return records

    async def run(self, wait_for_start: Callable[[], Any] | None = None) -> ShareResult:
        connector = aiohttp.TCPConnector(limit=self._connections(), limit_per_host=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            warmup_failures = await self.warmup(session)
            gc.collect()
            gc.freeze()  # what exists now is never scanned again: shorter collector pauses while timing chunks
            if wait_for_start is not None:
                start_wall = await asyncio.to_thread(wait_for_start)
                t0 = time.perf_counter() + (start_wall - time.time())
                await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
            else:
                t0 = time.perf_counter()
            cpu0 = time.process_time()
            lags: list[float] = []
            if self.share.point.concurrency is not None:
                records = await self.closed_loop(session, t0)
            else:
                records = await self.open_loop(session, t0, lags)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            gc.unfreeze()
        return ShareResult(records, cpu, wall, lags, warmup_failures)


def run_event_loop(coro: Any) -> Any:
    """Runs a coroutine on uvloop when it is installed (cheaper per chunk), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _worker_main(share: Share, counter: Any, ready: Any, go: Any, start: Any, results: Any) -> None:
    """Entry point of a worker process: run the share, send the result back through ``results``."""

    def on_done() -> None:
        counter.value += 1

    def wait_for_start() -> float:
        ready.wait()
        go.wait()
        return float(start.value)

    try:
        result = run_event_loop(ShareRunner(share, on_done).run(wait_for_start))
        results.put((share.worker, result, None))
    except BaseException as exc:  # report, never hang the parent waiting for this worker
        ready.abort()
        results.put((share.worker, None, f"{type(exc).__name__}: {exc}"))
        raise


async def run_shares(
    config: BenchConfig,
    dataset: list[DatasetRow] | None,
    model: str,
    point: LoadPoint,
    on_progress: Callable[[int], None],
) -> list[ShareResult]:
    """Runs one (model, load point) in ``config.workers_for(point)`` processes; in this process when it is one."""
    workers = config.workers_for(point)
    if workers == 1:
        done = 0

        def on_done() -> None:
            nonlocal done
            done += 1
            on_progress(done)

        return [await ShareRunner(Share(config, dataset, model, point, 0, 1), on_done).run()]

    ctx = mp.get_context("spawn")  # no fork: the parent may run threads (progress display, event loop)
    counters = [ctx.Value("q", 0, lock=False) for _ in range(workers)]
    ready, go = ctx.Barrier(workers + 1), ctx.Event()
    start = ctx.Value("d", 0.0, lock=False)
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=_worker_main,
            args=(Share(config, dataset, model, point, w, workers), counters[w], ready, go, start, results),
            daemon=True,
        )
        for w in range(workers)
    ]
    for process in processes:
        process.start()
    try:
        try:
            await asyncio.to_thread(ready.wait)  # every worker has warmed up
        except threading.BrokenBarrierError:
            worker, _, error = await asyncio.to_thread(results.get, True, 30)
            raise RuntimeError(f"load-generator process {worker} failed: {error}") from None
        start.value = time.time() + START_MARGIN
        go.set()
        collected: dict[int, ShareResult] = {}
        waiting = asyncio.ensure_future(asyncio.to_thread(_collect, results, workers, collected))
        while not waiting.done():
            on_progress(sum(c.value for c in counters))
            await asyncio.wait({waiting}, timeout=0.2)
        await waiting
        on_progress(sum(c.value for c in counters))
        return [collected[w] for w in range(workers)]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()


def _collect(results: Any, workers: int, into: dict[int, ShareResult]) -> None:
    for _ in range(workers):
        worker, result, error = results.get()
        if error is not None:
            raise RuntimeError(f"load-generator process {worker} failed: {error}")
        into[worker] = result
