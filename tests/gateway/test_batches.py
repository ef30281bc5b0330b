"""The Batch API (/v1/files, /v1/batches) driven by the official openai SDK against a real gateway: a round trip
with bad lines, a malformed file, cancelling, tenants, budgets, limits, and batch work admitted after interactive
requests."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch

from gateway.batches.records import ENDED_STATUSES
from gateway.config import GatewayConfig

from ..budget_client import prompt_estimate
from ..conftest import MODEL, RunningGateway, captured_logs, start_gateway, stop_gateway, wait_until
from ..valkey import ValkeyServer

KEY_A = "sk-batch-tenant-a-0123"
KEY_B = "sk-batch-tenant-b-0123"
ADMIN_KEY = "sk-batch-admin-0123456"
STEP = 0.002
"""Seconds per decode step: a request of 2,000 tokens runs for 4 s, long enough to be seen running and cut."""


def _chat(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say {custom_id}"}], **body},
    }


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _client(gateway: RunningGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _submit(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> Batch:
    uploaded = client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def _ended(client: openai.OpenAI, batch_id: str, timeout: float = 60.0) -> Batch:
    found: list[Batch] = []

    def ended() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in ENDED_STATUSES

    assert wait_until(ended, timeout=timeout), f"batch still {found[0].status}"
    return found[0]


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module", params=["sqlite", "valkey"])
def tenants(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningGateway]:
    """Two keys (one with a token budget) on a timed reference engine; batches in an SQLite file of their own, or
    in a real Valkey (the state store) with file contents in a folder."""
    folder = tmp_path_factory.mktemp("batches")
    with _batch_store(request.param, folder) as (state_store, batches, _):
        config = GatewayConfig(
            server={
                "auth": {
                    "api_keys": [
                        {"key": KEY_A, "name": "team-a", "tokens_per_minute": 1_000_000},
                        {"key": KEY_B, "name": "team-b"},
                    ],
                    "admin_api_key": ADMIN_KEY,
                },
                "stores": {"state_store": state_store},
                "batches": {**batches, "concurrency_per_batch": 2, "poll_seconds": 0.2},
            },
            backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": STEP}}],
            models=[{"name": MODEL, "backends": ["reference"]}],
        )
        running = start_gateway(config)
        yield running
        stop_gateway(running)


@contextlib.contextmanager
def _batch_store(kind: str, folder: Path) -> Iterator[tuple[str | None, dict[str, Any], ValkeyServer | None]]:
    """``server.stores.state_store`` and ``server.batches`` for a store of that kind, and the real Valkey started for "
    "it."""
    if kind == "sqlite":
        yield None, {"store": f"sqlite://{folder / 'batches.sqlite3'}"}, None
        return
    valkey = ValkeyServer(folder)
    valkey.start()
    try:
        yield valkey.url, {"store": "state_store", "files_dir": str(folder / "files")}, valkey
    finally:
        if valkey.process is not None and valkey.process.poll() is None:
            valkey.kill()


def test_batch_round_trip_answers_each_custom_id_once_and_bad_bodies_get_the_online_400(
    tenants: RunningGateway,
) -> None:
    client = _client(tenants, KEY_A)
    good = [_chat(f"good-{i}", max_tokens=6) for i in range(5)]
    invalid_body = _chat("too-hot", max_tokens=6, temperature=9)
    streamed = _chat("streamed", max_tokens=6, stream=True)
    charged_before = tenants.metric("gateway_key_tokens_total", key="team-a")

    batch = _submit(client, [good[0], invalid_body, *good[1:3], streamed, *good[3:]])
    assert batch.status == "validating"
    batch = _ended(client, batch.id)

    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 5, 2)
    output = _lines(client, batch.output_file_id)
    errors = _lines(client, batch.error_file_id)
    assert [line["custom_id"] for line in output] == [f"good-{i}" for i in range(5)]
    assert sorted(line["custom_id"] for line in errors) == ["streamed", "too-hot"]
    for line in output:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["error"] is None
    by_id = {line["custom_id"]: line for line in errors}
    # the same body the online route answers
    with pytest.raises(openai.BadRequestError) as online:
        client.chat.completions.create(**invalid_body["body"])
    assert by_id["too-hot"]["response"]["status_code"] == 400
    assert by_id["too-hot"]["response"]["body"]["error"] == online.value.body
    assert by_id["streamed"]["response"]["status_code"] == 400
    assert by_id["streamed"]["response"]["body"]["error"]["param"] == "stream"

    # the key's budget was charged what the batch used, as its requests ran
    used = sum(
        line["response"]["body"]["usage"]["prompt_tokens"] + line["response"]["body"]["usage"]["completion_tokens"]
        for line in output
    )
    assert wait_until(lambda: tenants.metric("gateway_key_tokens_total", key="team-a") >= charged_before + used)
    assert tenants.metric("gateway_batch_requests_total", outcome="completed") >= 5


def test_a_malformed_input_file_fails_the_batch_with_errors_naming_its_lines(tenants: RunningGateway) -> None:
    client = _client(tenants, KEY_A)
    lines = [
        json.dumps(_chat("ok")).encode(),
        b"{not json",
        json.dumps(_chat("ok")).encode(),  # the custom_id again
        json.dumps({**_chat("elsewhere"), "url": "/v1/completions"}).encode(),
        json.dumps(_chat("nobody", model="no-such-model") | {"body": {"model": "no-such-model"}}).encode(),
    ]
    uploaded = client.files.create(file=("bad.jsonl", b"\n".join(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = _ended(client, batch.id)

    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    assert [(error.line, error.code) for error in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "model_not_found"),
    ]
    assert batch.output_file_id is None and batch.error_file_id is None


def test_another_keys_files_and_batches_are_404(tenants: RunningGateway) -> None:
    owner, other = _client(tenants, KEY_A), _client(tenants, KEY_B)
    batch = _submit(owner, [_chat("mine", max_tokens=4)])
    batch = _ended(owner, batch.id)
    assert batch.output_file_id is not None

    for call in (
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.retrieve(batch.input_file_id),
        lambda: other.files.content(batch.output_file_id),  # type: ignore[arg-type]
        lambda: other.files.delete(batch.input_file_id),
        lambda: other.batches.create(
            input_file_id=batch.input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in {b.id for b in other.batches.list()}
    assert batch.input_file_id not in {f.id for f in other.files.list()}
    assert owner.files.retrieve(batch.input_file_id).id == batch.input_file_id  # still there for its owner


def test_cancel_aborts_running_requests_and_no_work_follows_cancelled(tenants: RunningGateway) -> None:
    client = _client(tenants, KEY_A)
    lines = [_chat(f"long-{i}", max_tokens=2000, ignore_eos=True) for i in range(6)]
    batch = _submit(client, lines)
    assert wait_until(lambda: tenants.engine_unfinished() == 2, timeout=30)  # concurrency_per_batch: 2

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = _ended(client, batch.id)
    tokens_at_cancel = tenants.engine_tokens()

    assert ended.status == "cancelled"
    assert tenants.engine_idle()  # every request of the batch was aborted before it was cancelled
    assert tenants.engine_tokens() == tokens_at_cancel
    errors = _lines(client, ended.error_file_id)
    assert sorted(line["custom_id"] for line in errors) == sorted(line["custom_id"] for line in lines)
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert ended.output_file_id is None


@pytest.fixture
def one_slot(tmp_path: Path) -> Iterator[RunningGateway]:
    """One request at a time on the engine, the rest queued in admission."""
    config = GatewayConfig(
        server={"batches": {"store": f"sqlite://{tmp_path / 'batches.sqlite3'}", "concurrency_per_batch": 4}},
        backends=[
            {
                "name": "reference",
                "kind": "reference",
                "max_in_flight": 1,
                "max_queue": 16,
                "queue_timeout": 120,
                "timing": {"decode_seconds_per_step": STEP},
            }
        ],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def test_interactive_requests_are_admitted_ahead_of_queued_batch_work(one_slot: RunningGateway) -> None:
    client = _client(one_slot, "unused")
    gate = one_slot.state.backends["reference"].gate  # type: ignore[attr-defined]
    batch = _submit(client, [_chat(f"queued-{i}", max_tokens=1000, ignore_eos=True) for i in range(4)])
    with captured_logs(one_slot) as logs:
        # one batch request holds the slot and three wait for it
        assert wait_until(lambda: gate.in_flight == 1 and gate.queued == 3, timeout=30)
        answer = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"X-Request-ID": "interactive"},
        )
        assert answer.http_response.status_code == 200
        with contextlib.suppress(openai.ConflictError):  # it may have ended, if it ran first
            client.batches.cancel(batch.id)
        _ended(client, batch.id)
    admitted = [line["request_id"] for line in logs if line.get("event") == "request" and line.get("status") == 200]
    # with one slot, requests end in the order they were admitted: the interactive one right after the batch
    # request that held the slot when it came, ahead of the three batch requests queued before it
    generated = [request_id for request_id in admitted if request_id == "interactive" or batch.id in request_id]
    assert generated[:2] == [f"{batch.id}-1", "interactive"]


def test_limits_on_files_lines_open_batches_and_stored_bytes(tmp_path: Path) -> None:
    config = GatewayConfig(
        server={
            "batches": {
                "store": f"sqlite://{tmp_path / 'batches.sqlite3'}",
                "max_file_bytes": 4096,
                "max_lines": 3,
                "max_open_batches_per_key": 1,
                "max_stored_bytes": 6000,
            }
        },
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    gateway = start_gateway(config)
    try:
        client = _client(gateway, "unused")
        with pytest.raises(openai.APIStatusError) as too_large:
            client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        assert too_large.value.status_code == 413
        assert too_large.value.body["code"] == "file_too_large"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as too_long:
            client.files.create(file=("long.jsonl", _jsonl([_chat(str(i)) for i in range(4)])), purpose="batch")
        assert too_long.value.body["code"] == "too_many_lines"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as wrong_purpose:
            client.files.create(file=("x.jsonl", _jsonl([_chat("a")])), purpose="fine-tune")
        assert wrong_purpose.value.body["param"] == "purpose"  # type: ignore[index]

        long = [_chat(f"long-{i}", max_tokens=2000, ignore_eos=True) for i in range(3)]
        first = _submit(client, long)
        with pytest.raises(openai.BadRequestError) as open_batches:
            _submit(client, long)
        assert open_batches.value.body["code"] == "batch_limit_exceeded"  # type: ignore[index]
        client.batches.cancel(first.id)
        _ended(client, first.id)

        filler = _jsonl([_chat("f" * 1000)])
        with pytest.raises(openai.BadRequestError) as full:
            for _ in range(6):
                client.files.create(file=("filler.jsonl", filler), purpose="batch")
        assert full.value.body["code"] == "storage_limit_exceeded"  # type: ignore[index]
        for file in client.files.list():
            client.files.delete(file.id)
        assert client.files.create(file=("filler.jsonl", filler), purpose="batch").bytes == len(filler)
    finally:
        stop_gateway(gateway)


def test_batches_list_pages_newest_first(tenants: RunningGateway) -> None:
    client = _client(tenants, KEY_B)
    created = [_submit(client, [_chat("page", max_tokens=2)]).id for _ in range(3)]
    for batch_id in created:
        _ended(client, batch_id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2]
    assert first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert created[0] in [b.id for b in rest.data]
    raw = httpx.get(f"{tenants.base_url}/v1/batches?limit=0", headers={"Authorization": f"Bearer {KEY_B}"})
    assert raw.status_code == 400
    assert raw.json()["error"]["param"] == "limit"


class _Clock:
    """The Batch API's wall clock, which a test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def test_a_batch_past_its_window_expires_with_its_partial_output_and_files_go_after_retention(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    config = GatewayConfig(
        server={
            "batches": {
                "store": f"sqlite://{tmp_path / 'batches.sqlite3'}",
                "concurrency_per_batch": 2,
                "lease_seconds": 0.3,
                "poll_seconds": 0.2,
            }
        },
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    gateway = start_gateway(config, batch_clock=clock)
    try:
        client = _client(gateway, "unused")
        short = [_chat(f"short-{i}", max_tokens=4) for i in range(2)]
        long = [_chat(f"long-{i}", max_tokens=2000, ignore_eos=True) for i in range(4)]
        batch = _submit(client, [*short, *long])
        assert wait_until(
            lambda: (
                client.batches.retrieve(batch.id).request_counts.completed == 2  # type: ignore[union-attr]
                and gateway.engine_unfinished() == 2
            ),
            timeout=30,
        )
        clock.offset = 24 * 3600 + 60  # past the 24 h window
        ended = _ended(client, batch.id)

        assert ended.status == "expired"
        assert ended.expired_at is not None and ended.expired_at >= ended.expires_at  # type: ignore[operator]
        assert gateway.engine_idle()
        assert [line["custom_id"] for line in _lines(client, ended.output_file_id)] == ["short-0", "short-1"]
        errors = _lines(client, ended.error_file_id)
        assert sorted(line["custom_id"] for line in errors) == [f"long-{i}" for i in range(4)]
        assert {line["error"]["code"] for line in errors} == {"batch_expired"}

        clock.offset += 31 * 24 * 3600  # past the files' 30 days
        for file_id in (ended.input_file_id, ended.output_file_id, ended.error_file_id):
            with pytest.raises(openai.NotFoundError):
                client.files.retrieve(file_id)  # type: ignore[arg-type]
        assert client.files.list().data == []
    finally:
        stop_gateway(gateway)


def test_a_failing_batch_store_is_a_503_to_retry_and_takes_nothing_down(tmp_path: Path) -> None:
    with _batch_store("valkey", tmp_path) as (state_store, batches, valkey):
        config = GatewayConfig(
            server={"stores": {"state_store": state_store}, "batches": {**batches, "poll_seconds": 0.2}},
            backends=[{"name": "reference", "kind": "reference"}],
            models=[{"name": MODEL, "backends": ["reference"]}],
        )
        gateway = start_gateway(config)
        try:
            client = _client(gateway, "unused")
            uploaded = client.files.create(file=("in.jsonl", _jsonl([_chat("a", max_tokens=2)])), purpose="batch")
            assert valkey is not None
            valkey.kill()
            with pytest.raises(openai.InternalServerError) as down:
                client.files.retrieve(uploaded.id)
            assert down.value.status_code == 503
            assert down.value.body["code"] == "batch_store_unavailable"  # type: ignore[index]
            assert down.value.response.headers["retry-after"] == "1"
            assert httpx.get(f"{gateway.base_url}/health").status_code == 200
            answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content is not None  # online traffic does not need the batch store
        finally:
            stop_gateway(gateway)


class _BudgetClock:
    """The budgets' clock: stopped (a spent budget stays spent) until ``run``, then an hour per second."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.running_since: float | None = None

    def run(self) -> None:
        self.running_since = time.monotonic()

    def __call__(self) -> float:
        if self.running_since is None:
            return self.now
        return self.now + (time.monotonic() - self.running_since) * 3600


def test_a_spent_budget_holds_batch_requests_back_until_it_refills_and_fails_none(tmp_path: Path) -> None:
    clock = _BudgetClock()
    lines = [_chat(f"metered-{i}", max_tokens=8) for i in range(6)]
    per_request = prompt_estimate(lines[0]["body"]) + 8
    config = GatewayConfig(
        server={
            "auth": {
                "api_keys": [{"key": KEY_A, "name": "metered", "tokens_per_minute": 2 * per_request + 4}],
                "admin_api_key": ADMIN_KEY,
            },
            "batches": {
                "store": f"sqlite://{tmp_path / 'batches.sqlite3'}",
                "concurrency_per_batch": 1,
                "retry_seconds": 0.05,
                "retry_max_seconds": 0.1,
            },
        },
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    gateway = start_gateway(config, budget_clock=clock)
    try:
        client = _client(gateway, KEY_A)
        batch = _submit(client, lines)
        # the budget covers a few requests (a request is charged what it used, less than it reserved): the next is
        # refused (429) and put back, again and again
        assert wait_until(lambda: gateway.metric("gateway_batch_request_retries_total") >= 3)
        held = client.batches.retrieve(batch.id)
        assert held.status == "in_progress"
        assert held.request_counts is not None
        assert 2 <= held.request_counts.completed < len(lines)
        assert held.request_counts.failed == 0

        clock.run()  # the budget refills: the held requests go on
        ended = _ended(client, batch.id)
        assert ended.status == "completed"
        assert ended.request_counts is not None
        assert (ended.request_counts.completed, ended.request_counts.failed) == (len(lines), 0)
        assert ended.error_file_id is None
        assert gateway.metric("gateway_key_rate_limited_total", key="metered") >= 3
    finally:
        stop_gateway(gateway)


def test_a_responses_batch_answers_with_response_objects(tenants: RunningGateway) -> None:
    client = _client(tenants, KEY_A)
    lines = [
        {
            "custom_id": f"resp-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": f"Say {i}", "max_output_tokens": 6},
        }
        for i in range(2)
    ]
    batch = _ended(client, _submit(client, lines, endpoint="/v1/responses").id)
    assert batch.status == "completed"
    output = _lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == ["resp-0", "resp-1"]
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
        assert client.responses.retrieve(body["id"]).id == body["id"]  # stored for the key, as online


def test_a_process_runs_at_most_batches_per_process_and_takes_the_next_when_one_ends(tmp_path: Path) -> None:
    config = GatewayConfig(
        server={
            "batches": {
                "store": f"sqlite://{tmp_path / 'batches.sqlite3'}",
                "batches_per_process": 1,
                "poll_seconds": 0.2,
            }
        },
        backends=[{"name": "reference", "kind": "reference", "timing": {"decode_seconds_per_step": STEP}}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    gateway = start_gateway(config)
    try:
        client = _client(gateway, "unused")
        first = _submit(client, [_chat("first", max_tokens=2000, ignore_eos=True)])
        assert wait_until(lambda: gateway.engine_unfinished() == 1)
        second = _submit(client, [_chat("second", max_tokens=2)])
        # the runner looked after the second was created (its gauges are set after each look) and left it waiting
        assert wait_until(lambda: gateway.metric("gateway_batches", status="validating") == 1)
        assert gateway.metric("gateway_batches_running") == 1
        assert client.batches.retrieve(second.id).status == "validating"
        client.batches.cancel(first.id)
        assert _ended(client, first.id).status == "cancelled"
        assert _ended(client, second.id).status == "completed"
    finally:
        stop_gateway(gateway)
