"""``BatchRunner``: each gateway process looks for open batches, takes one under a lease, and runs its requests
through the online routes in process (``gateway.batches.inprocess``) at the ``batch`` service tier, a bounded
number at a time per batch and per key. Each request's result is stored as it ends; a batch ends (completed,
cancelled, expired, failed) with its output and error files written in the same transaction as its status.

A process that dies leaves its lease to run out; the next process to look (a restarted one, a sibling, another
replica) takes the batch over and runs the requests that have no result yet. Those in flight at the crash run
again, and the store keeps one result per line, so each ``custom_id`` is in the files exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp

from gateway.auth import InternalCaller
from gateway.batches.config import BatchesConfig
from gateway.batches.inprocess import Answer, call_in_process
from gateway.batches.records import (
    ALL_STATUSES,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    ENDED_STATUSES,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    OUTPUT_PURPOSE,
    VALIDATING,
    file_object,
    new_id,
    output_line,
    unrun_line,
)
from gateway.batches.store import BatchStore, Claim, Result
from gateway.batches.validation import BatchLine, validate_input

logger = logging.getLogger(__name__)
_transitions = structlog.get_logger("gateway.batches")
BATCH_TIER = "batch"
RETRIED_STATUSES = frozenset({429, 503})
"""Answers that say "not now" (the key's budget, a saturated backend, a draining process): tried again later."""
CLIENT_CLOSED_REQUEST = 499
STREAM_REFUSED = orjson.dumps(
    {
        "error": {
            "message": "A batch request cannot stream: remove 'stream' or set it to false.",
            "type": "invalid_request_error",
            "param": "stream",
            "code": None,
        }
    }
)


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.batches = Gauge(
            "gateway_batches",
            "Batches in the store by status (as this process last counted).",
            ("status",),
            registry=registry,
        )
        self.requests = Counter(
            "gateway_batch_requests",
            "Batch requests this process ran to an answer, by outcome (completed: 200; failed: any other answer).",
            ("outcome",),
            registry=registry,
        )
        self.retries = Counter(
            "gateway_batch_request_retries",
            "Batch requests put back for later because the API said not now (429 budget, 503 capacity).",
            registry=registry,
        )
        self.running = Gauge(
            "gateway_batches_running", "Batches this process runs now (holds the lease of).", registry=registry
        )
        self.pending = Gauge(
            "gateway_batch_requests_pending",
            "Requests of the batches this process runs that have no result yet.",
            registry=registry,
        )
        self.tokens = Counter(
            "gateway_batch_tokens", "Tokens of batch requests that completed, by kind.", ("kind",), registry=registry
        )
        self.duration = Histogram(
            "gateway_batch_duration_seconds",
            "From a batch's creation to its end, by how it ended.",
            ("status",),
            buckets=(10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 48 * 3600),
            registry=registry,
        )
        # every label value exists from the start, at 0, so dashboards and alerts see the series before any batch
        for outcome in ("completed", "failed"):
            self.requests.labels(outcome)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)
        for status in ALL_STATUSES:
            self.batches.labels(status).set(0)
        for status in ENDED_STATUSES:
            self.duration.labels(status)


@dataclass
class _Run:
    """A batch this process holds: what stops its requests and why."""

    claim: Claim
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str | None = None  # cancelled | expired | lost | shutdown

    def stop_for(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        config: BatchesConfig,
        *,
        model_exists: Callable[[str], bool],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = BatchMetrics(registry)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._model_exists = model_exists
        self._clock = clock
        self._app: ASGIApp | None = None
        self._wake = asyncio.Event()
        self._runs: dict[str, _Run] = {}
        self._key_slots: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return self._clock()

    def created(self, batch: dict[str, Any], key_label: str) -> None:
        """A batch was created: logged, and looked at now rather than at the next poll."""
        _log_transition(batch, "", key_label)
        self._wake.set()

    def cancel(self, batch: dict[str, Any], key_label: str) -> None:
        """A batch was cancelled: if this process runs it, its requests stop at once (anywhere else, at the
        runner's next lease renewal)."""
        _log_transition(batch, "", key_label)
        run = self._runs.get(batch["id"])
        if run is not None:
            run.stop_for("cancelled")

    async def serve(self, app: ASGIApp) -> None:
        """Runs until cancelled: claims open batches and runs them; the batches it holds are released at the end."""
        self._app = app
        try:
            while True:
                claim = None
                if self.store.exists():
                    if len(self._runs) < self.config.batches_per_process:
                        claim = await self._claim()
                    await self._housekeeping()  # after the claim: the gauges say what this look decided
                if claim is not None:
                    run = self._runs[claim.batch["id"]] = _Run(claim)
                    self.metrics.running.set(len(self._runs))
                    task = asyncio.create_task(self._run_batch(run))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.poll_seconds)
        finally:
            for run in self._runs.values():
                run.stop_for("shutdown")
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _claim(self) -> Claim | None:
        try:
            return await self.store.claim(self.holder, self._clock(), self.config.lease_seconds)
        except Exception:
            logger.exception("claiming a batch failed")
            return None

    async def _housekeeping(self) -> None:
        try:
            await self.store.purge(self._clock())
            counts = await self.store.count_by_status()
        except Exception:
            logger.exception("batch store housekeeping failed")
            return
        for status in ALL_STATUSES:
            self.metrics.batches.labels(status).set(counts.get(status, 0))

    async def _run_batch(self, run: _Run) -> None:
        batch_id = run.claim.batch["id"]
        renewing = asyncio.create_task(self._renew(run))
        try:
            await self._run_claimed(run)
        except Exception:
            logger.exception("batch %s failed in this process; its lease runs out and another takes it", batch_id)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            self._runs.pop(batch_id, None)
            self.metrics.running.set(len(self._runs))
            self._wake.set()  # room for another batch
            if run.reason in ("shutdown", "lost") or run.reason is None:
                with contextlib.suppress(Exception):
                    await self.store.release(batch_id, self.holder)

    async def _renew(self, run: _Run) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            await self._refresh(run)
            if run.reason == "lost":
                return

    async def _refresh(self, run: _Run) -> None:
        """Renews the lease and reads the batch as stored: a lost lease or a cancel stops its requests here."""
        batch_id = run.claim.batch["id"]
        try:
            stored = await self.store.renew(batch_id, self.holder, self._clock(), self.config.lease_seconds)
        except Exception:
            logger.exception("renewing the lease of batch %s failed", batch_id)
            return
        if stored is None:
            logger.warning("batch %s: lease lost to another process; its requests here stop", batch_id)
            run.stop_for("lost")
        elif self._clock() >= stored["expires_at"]:
            run.stop_for("expired")
        elif stored["status"] == CANCELLING:
            run.claim.batch.update(status=CANCELLING, cancelling_at=stored["cancelling_at"])
            run.stop_for("cancelled")

    async def _run_claimed(self, run: _Run) -> None:
        claim = run.claim
        batch = claim.batch
        content = await self.store.file_content(batch["input_file_id"], claim.owner, self._clock())
        if content is None:
            error = {"code": "file_not_found", "message": "The input file is gone.", "param": None, "line": None}
            await self._end(run, FAILED, errors=[error])
            return
        config = self.config
        validated = await asyncio.to_thread(
            validate_input,
            content,
            endpoint=batch["endpoint"],
            model_exists=self._model_exists,
            max_lines=config.max_lines,
        )
        if validated.errors:
            await self._end(run, FAILED, errors=validated.errors)
            return
        lines = validated.lines
        batch["request_counts"]["total"] = len(lines)
        if batch["status"] == VALIDATING and not await self._transition(run, IN_PROGRESS):
            await self._refresh(run)  # cancelled while it was validated, or the lease is gone
        elif batch["status"] == CANCELLING:
            run.stop_for("cancelled")
        done = await self.store.done_lines(batch["id"])
        todo = [line for line in lines if line.line not in done]
        expiry = asyncio.get_running_loop().call_later(
            max(0.0, batch["expires_at"] - self._clock()), run.stop_for, "expired"
        )
        self.metrics.pending.inc(len(todo))
        try:
            await self._run_lines(run, todo)
        finally:
            expiry.cancel()
        if run.reason in ("lost", "shutdown"):
            return
        ended = {"cancelled": CANCELLED, "expired": EXPIRED}.get(run.reason or "", COMPLETED)
        await self._end(run, ended, lines=lines)

    async def _run_lines(self, run: _Run, todo: list[BatchLine]) -> None:
        batch_slots = asyncio.Semaphore(self.config.concurrency_per_batch)
        key_slots = self._key_slots.setdefault(run.claim.owner, asyncio.Semaphore(self.config.concurrency_per_key))
        running: set[asyncio.Task[None]] = set()

        async def one(line: BatchLine) -> None:
            try:
                async with key_slots:
                    if not run.stop.is_set():
                        await self._run_line(run, line)
            finally:
                batch_slots.release()
                self.metrics.pending.dec()

        for index, line in enumerate(todo):
            await batch_slots.acquire()
            if run.stop.is_set():
                batch_slots.release()
                self.metrics.pending.dec(len(todo) - index)
                break
            task = asyncio.create_task(one(line))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running, return_exceptions=True)

    async def _run_line(self, run: _Run, line: BatchLine) -> None:
        batch = run.claim.batch
        request_id = f"{batch['id']}-{line.line}"
        answer = Answer(400, STREAM_REFUSED, None) if line.streams else await self._answer(run, line, request_id)
        if answer is None:  # stopped before it had an answer: the batch's end says why
            return
        try:
            body: Any = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            body = answer.body.decode("utf-8", "replace")
        ok = answer.status == 200
        tokens = _tokens(body) if ok else (0, 0)
        kept = await self.store.add_result(
            batch["id"],
            Result(line.line, ok, sum(tokens), output_line(line.custom_id, request_id, answer.status, body)),
        )
        if kept:
            self.metrics.requests.labels("completed" if ok else "failed").inc()
            self.metrics.tokens.labels("prompt").inc(tokens[0])
            self.metrics.tokens.labels("completion").inc(tokens[1])

    async def _answer(self, run: _Run, line: BatchLine, request_id: str) -> Answer | None:
        assert self._app is not None
        claim = run.claim
        caller = InternalCaller(claim.key_label, claim.owner, BATCH_TIER)
        while True:
            answer = await call_in_process(
                self._app, claim.batch["endpoint"], line.body, request_id=request_id, caller=caller, stop=run.stop
            )
            if run.stop.is_set():
                # an answer that came whole is kept; one cut by the stop (499) never happened, for the files
                return answer if answer.status not in RETRIED_STATUSES | {CLIENT_CLOSED_REQUEST} else None
            if answer.status not in RETRIED_STATUSES:
                return answer
            self.metrics.retries.inc()
            config = self.config
            wait = max(config.retry_seconds, min(answer.retry_after or 0.0, config.retry_max_seconds))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.stop.wait(), wait)
            if run.stop.is_set():
                return None

    async def _transition(self, run: _Run, status: str) -> bool:
        batch = run.claim.batch
        previous = batch["status"]
        batch["status"] = status
        batch[f"{status}_at"] = int(self._clock())
        written = await self.store.update(batch, self.holder)
        if written:
            _log_transition(batch, previous, run.claim.key_label)
        elif status != previous:
            batch["status"] = previous
        return written

    async def _end(
        self,
        run: _Run,
        status: str,
        *,
        errors: list[dict[str, Any]] | None = None,
        lines: list[BatchLine] | None = None,
    ) -> None:
        """Writes the batch's result files and its last status in one transaction."""
        claim = run.claim
        batch = claim.batch
        results = await self.store.results(batch["id"]) if lines is not None else []
        counts = batch["request_counts"]
        counts["completed"] = sum(result.ok for result in results)
        counts["failed"] = len(results) - counts["completed"]
        if status != FAILED:
            await self._transition(run, FINALIZING)
        files: list[tuple[dict[str, Any], bytes]] = []
        if lines is not None:
            code = {CANCELLED: "batch_cancelled", EXPIRED: "batch_expired"}.get(status, "batch_failed")
            output, error = await asyncio.to_thread(_result_files, results, lines, code)
            created = int(self._clock())
            retention = self.config.file_retention_seconds
            expires = created + int(retention) if retention is not None else None
            for kind, content in (("output", output), ("error", error)):
                if content:
                    file = file_object(
                        new_id("file-"),
                        size=len(content),
                        created_at=created,
                        filename=f"{batch['id']}_{kind}.jsonl",
                        purpose=OUTPUT_PURPOSE,
                        expires_at=expires,
                    )
                    batch[f"{kind}_file_id"] = file["id"]
                    files.append((file, content))
        if errors is not None:
            batch["errors"] = {"object": "list", "data": errors}
        previous = batch["status"]
        batch["status"] = status
        batch[f"{status}_at"] = int(self._clock())
        if await self.store.finish(batch, self.holder, files, claim.owner):
            _log_transition(batch, previous, claim.key_label)
            self.metrics.duration.labels(status).observe(max(0.0, self._clock() - batch["created_at"]))


def _result_files(results: list[Result], lines: list[BatchLine], unrun_code: str) -> tuple[bytes, bytes]:
    """The output file (200 answers) and the error file (other answers, then the requests that never ran), each
    in the input's order."""
    output: list[bytes] = []
    errors: list[bytes] = []
    answered = {result.line for result in results}
    for result in results:
        (output if result.ok else errors).append(orjson.dumps(result.result))
    message = {
        "batch_cancelled": "The batch was cancelled before this request ran.",
        "batch_expired": "The batch expired before this request ran.",
    }.get(unrun_code, "Not run.")
    for line in lines:
        if line.line not in answered:
            errors.append(orjson.dumps(unrun_line(line.custom_id, unrun_code, message)))
    return (b"\n".join(output) + b"\n" if output else b""), (b"\n".join(errors) + b"\n" if errors else b"")


def _tokens(body: Any) -> tuple[int, int]:
    """(prompt, completion) tokens from a 200 body's usage (chat and completions, or the Responses API's names)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)


def _log_transition(batch: dict[str, Any], previous: str, key_label: str) -> None:
    counts = batch["request_counts"]
    _transitions.info(
        "batch",
        batch_id=batch["id"],
        status=batch["status"],
        previous_status=previous,
        api_key=key_label,
        endpoint=batch["endpoint"],
        total=counts["total"],
        completed=counts["completed"],
        failed=counts["failed"],
    )
