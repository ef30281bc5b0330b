"""What the front end's Python costs per stream per engine step on the rank path, warm and after an idle gap.

On the rank probe (64 streams x 256 tokens over two ranks) the gateway process is idle about four fifths of
the time: every rank step wakes it for a millisecond or so, it turns the step's outputs into one frame per stream,
and it sleeps again. This script runs that work alone, in process, with nothing else to disturb it: a reference
backend's streams whose outputs are replayed (the engine's steps are fed to the requests' sinks, as the
data-parallel driver does with a rank's step message) and read as the streaming loop reads them in production
(``gateway.streaming``: the ready batch of events, frames of ``chat.completion.chunk``, the request's token count).
The write to the client and the stream task's wake-up are left out: what is left is the Python per frame.

It reports the median time per stream per step twice: with the steps back to back (warm caches), and with the decode
step's gap between them, the front end idling meanwhile as it does when serving. The difference is the cost of
waking cold: on the 2-core VM this project is developed on, the same work cost 2.3x-4.4x as much after a 12.5 ms
gap as back to back, which is why the probe's figure is well above what a loop of the same calls suggests.

Usage: ``python bench/output_path.py`` (``--streams 32 --steps 60 --gap 0.0125``); to measure another tree's
source, ``PYTHONPATH=../other/src python bench/output_path.py``. Both are medians over the steps of one run: compare
two trees by alternating runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Callable, Sequence

from backends.config import ReferenceBackendConfig
from backends.engine.backend import EngineBackend
from backends.engine.protocol import EngineOutput
from backends.interface import BatchStream, Delta, Event, GenerateRequest, SamplingOptions
from backends.reference.backend import build_reference_backend
from gateway.metrics import GatewayMetrics, RequestObserver
from gateway.openai.output import ChatFormat

Sink = Callable[[int, Sequence[EngineOutput]], None]
TEXT = "The gateway streams each engine step to its client as one server-sent event frame. " * 40


class ReplayedSteps:
    """Stands in for the engine driver's ``add``: remembers each request's sink, so steps can be fed to it."""

    def __init__(self) -> None:
        self.sinks: dict[str, Sink] = {}

    def add(
        self,
        request_id: str,
        params: object,
        prompt: object,
        sink: Sink,
        index: int,
        user: str = "",
        multi_modal_data: object = None,
    ) -> None:
        self.sinks[request_id] = sink


class Reader:
    """One stream's side of a step: its ready batch rendered into frames, as ``gateway.streaming`` does."""

    def __init__(self, events: BatchStream[Event], frames: ChatFormat, observer: RequestObserver) -> None:
        self.events, self.frames, self.observer = events, frames, observer

    def read(self) -> bytes:
        rendered = []
        for event in self.events.ready():
            if type(event) is Delta:
                self.observer.output(event.tokens, event.prompt_tokens)
            frame = self.frames.frame(event)  # type: ignore[arg-type]
            if frame is not None:
                rendered.append(frame)
        return b"".join(rendered)


async def open_streams(
    backend: EngineBackend, replay: ReplayedSteps, count: int, tokens: list[int]
) -> list[tuple[str, Reader]]:
    """``count`` streaming chat requests, each past its first token, with its reader."""
    metrics = GatewayMetrics()
    ids: list[tuple[str, Reader]] = []
    for number in range(count):
        request = GenerateRequest(
            request_id=f"bench-{number}",
            model="bench",
            messages=[{"role": "user", "content": f"Describe module number {number}."}],
            sampling=SamplingOptions(max_tokens=1024, ignore_eos=True),
            max_buffered_tokens=4096,
        )
        events = backend.generate(request)
        first = asyncio.ensure_future(events.__anext__())
        while not (added := replay.sinks.keys() - {engine_id for engine_id, _ in ids}):
            if first.done():
                first.result()  # the request failed before it reached the engine
            await asyncio.sleep(0)
        (engine_id,) = added
        fed = 0
        while not first.done():  # the first tokens, until one makes a delta (the stream's task gets it)
            replay.sinks[engine_id](0, [EngineOutput(engine_id, tokens[fed], False, "", fed + 1, 10, 0.0, (), ())])
            fed += 1
            await asyncio.sleep(0)
        assert isinstance(first.result(), Delta)
        frames = ChatFormat(f"chatcmpl-{number}", 0, "bench", "fp_bench", 1)
        observer = metrics.observer("bench", backend.name, {})
        ids.append((engine_id, Reader(events, frames, observer)))  # type: ignore[arg-type]
    return ids


async def measure(streams: int, steps: int, tokens_per_step: int, gap: float) -> list[float]:
    """Microseconds per stream for each step."""
    backend = build_reference_backend(ReferenceBackendConfig(name="reference", kind="reference"))
    await backend.start()
    try:
        replay = ReplayedSteps()
        backend.driver.add = replay.add  # type: ignore[method-assign]  # the engine's steps are replayed
        backend.driver.abort = lambda request_ids: None  # type: ignore[method-assign]
        assert backend.driver.engine is not None
        tokens = backend.driver.engine.tokenizer.encode(TEXT, add_special_tokens=False).ids
        opened = await open_streams(backend, replay, streams, tokens)
        ids = [engine_id for engine_id, _ in opened]
        sinks = [(replay.sinks[engine_id], reader) for engine_id, reader in opened]
        batches = []
        for step in range(steps):
            first = 16 + step * tokens_per_step
            batches.append(
                [
                    [
                        EngineOutput(
                            engine_id, tokens[(first + k + at) % len(tokens)], False, "", first + k, 10, 0.0, (), ()
                        )
                        for k in range(tokens_per_step)
                    ]
                    for at, engine_id in enumerate(ids)
                ]
            )
        gc.collect()
        per_stream = []
        for batch in batches:
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter()
            for (sink, reader), outputs in zip(sinks, batch, strict=True):
                sink(0, outputs)
                reader.read()
            per_stream.append((time.perf_counter() - started) / streams * 1e6)
        return per_stream
    finally:
        await backend.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="streams per step (one rank's share of the probe)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tokens-per-step", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.0125, help="idle seconds between steps (two ranks at 25 ms)")
    args = parser.parse_args()
    warm = asyncio.run(measure(args.streams, args.steps, args.tokens_per_step, 0.0))
    cold = asyncio.run(measure(args.streams, args.steps, args.tokens_per_step, args.gap))
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"per stream per step: back to back {w:.2f} us, after {args.gap * 1000:g} ms idle {c:.2f} us ({c / w:.2f}x)")


if __name__ == "__main__":
    main()
