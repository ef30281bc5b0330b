"""The batch contract at the backend seam (``backends.streams.BatchStream``): every wrapper between a backend's
stream and the streaming loop (the engine's events, admission, routing) forwards ``ready`` and ``wait``, so a
stream's events after its first are read a batch at a time, never one coroutine chain per event.

A wrapper that dropped the methods would not break a response on its own: the loop would read it one event per
wait (``OneByOne``) and every answer would still be right, only slower. So the streamed requests here run on the
real reference engine behind the real admission and routing wrappers, with one test double in between whose stream
refuses to be read one event at a time past its first: a wrapper above it that does not forward the batch methods
fails the request.

The same holds for ``notify`` (``backends.streams.Notifying``), the synchronous wake-up that spares a stream one
future and one loop callback per engine step: a wrapper that dropped it would only make streams slower, so the
double counts how its streams were woken."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from backends.interface import Backend, BatchStream, Event, EventStream, GenerateRequest
from backends.registry import build_backend
from backends.streams import Notifying
from gateway.admission import AdmittedBackend, behind_flow_control
from gateway.capabilities import WrappedBackend
from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway

SHADOWED = "shadowed"  # a model whose requests are mirrored: routing then looks at every event of every batch


class BatchesOnlyBackend(WrappedBackend):
    """TEST DOUBLE around the real reference backend: its streams serve their first event through ``__anext__``
    and every later one only through ``ready``/``wait``/``notify``; they count the events their batches carried,
    their waits and their armed notifications."""

    __slots__ = ("batched", "notified", "waited")

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.batched = 0
        self.waited = 0
        self.notified = 0

    def generate(self, request: GenerateRequest) -> EventStream[Event]:
        return BatchesOnlyEvents(self.inner.generate(request), self)


class BatchesOnlyEvents:
    """TEST DOUBLE stream of ``BatchesOnlyBackend``."""

    def __init__(self, events: EventStream[Event], owner: BatchesOnlyBackend) -> None:
        self._events = events
        self._batches: BatchStream[Event] = events  # type: ignore[assignment]  # the engine's: it has batches
        self._notifying: Notifying = events  # type: ignore[assignment]  # and it notifies
        self._owner = owner
        self._opened = False

    def __aiter__(self) -> BatchesOnlyEvents:
        return self

    async def __anext__(self) -> Event:
        if self._opened:
            raise AssertionError("read one event at a time past its first: a wrapper dropped the batch methods")
        self._opened = True
        return await self._events.__anext__()

    def ready(self) -> list[Event]:
        batch = self._batches.ready()
        self._owner.batched += len(batch)
        return batch

    def wait(self) -> Awaitable[None]:
        self._owner.waited += 1
        return self._batches.wait()

    def notify(self, callback: Callable[[], None]) -> bool:
        armed = self._notifying.notify(callback)
        self._owner.notified += armed
        return armed

    async def aclose(self) -> None:
        await self._events.aclose()


@pytest.fixture(scope="module")
def batches_gateway() -> Iterator[tuple[RunningGateway, BatchesOnlyBackend]]:
    config = GatewayConfig(
        backends=[
            {"name": "reference", "kind": "reference", "max_in_flight": 8},
            {"name": "mirror", "kind": "reference"},
        ],
        models=[
            {"name": MODEL, "backends": ["reference"]},
            {"name": SHADOWED, "backends": ["reference"], "shadow": {"backend": "mirror", "fraction": 1.0}},
        ],
    )
    double = BatchesOnlyBackend(build_backend(config.backends[0]))
    gate = behind_flow_control(double, config.backends[0])
    assert isinstance(gate, AdmittedBackend), "the admission wrapper is part of what is proved here"
    running = start_gateway(config, backends={"reference": gate, "mirror": build_backend(config.backends[1])})
    yield running, double
    stop_gateway(running)


def stream_48_tokens(running: RunningGateway, model: str, **options: Any) -> list[ChatCompletionChunk]:
    """The chunks of a streamed chat answer of 48 tokens (no end of sequence before), read with the openai SDK."""
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    return list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=48,
            stream=True,
            extra_body={"ignore_eos": True},
            **options,
        )
    )


@pytest.mark.parametrize("model", [MODEL, SHADOWED])
def test_a_streamed_answer_after_its_first_token_comes_through_every_wrapper_s_batches(
    batches_gateway: tuple[RunningGateway, BatchesOnlyBackend], model: str
) -> None:
    running, double = batches_gateway
    before = double.batched
    chunks = stream_48_tokens(running, model, stream_options={"include_usage": True})
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 48
    assert chunks[-2].choices[0].finish_reason == "length"
    assert double.batched - before >= 2, "the events after the first (the finish and the usage at least) were batched"


def test_a_streamed_answer_s_engine_steps_wake_its_writer_through_every_wrapper_s_notify(
    batches_gateway: tuple[RunningGateway, BatchesOnlyBackend],
) -> None:
    """Every wake-up of the writer after the first token comes from the engine's own delivery of a step: the
    stream never waits on a future (each such wait costs a future and a loop callback per step)."""
    running, double = batches_gateway
    waited, notified = double.waited, double.notified
    chunks = stream_48_tokens(running, MODEL)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert double.waited == waited, "a wrapper dropped notify: the stream waited on futures"
    assert double.notified > notified
