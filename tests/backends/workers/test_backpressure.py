"""Bounded ZeroMQ queues between the dispatcher and its workers: when a queue is full, nothing is dropped.

Up (worker -> dispatcher): a step's outputs wait for room, the engine pauses. Down (dispatcher -> worker): commands
stay in the dispatcher and go once the worker has read. See ``messages.QUEUE_MESSAGES``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Sequence

import numpy as np
import zmq

from backends.config import ReferenceBackendConfig
from backends.engine.driver import Sink
from backends.engine.protocol import EngineOutput
from backends.errors import BackendError
from backends.reference.backend import build_rank_engine, load_tokenizer
from backends.workers import messages as m
from backends.workers.driver import DataParallelDriver
from backends.workers.launch import WorkerPlan
from backends.workers.rank_loop import Worker
from backends.workers.spec import RankContext, WorkerSpec

FACTORY = "backends.reference.backend:build_rank_engine"
PARAMS = {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True, "top_logprobs": 0}


def test_a_step_waits_for_room_when_the_dispatchers_queue_is_full() -> None:
    options = ReferenceBackendConfig(name="bp").model_dump(mode="json")
    context = zmq.Context()
    try:
        worker_socket = context.socket(zmq.ROUTER)
        m.bound_queues(worker_socket)
        worker_socket.bind("inproc://rank")
        engine = build_rank_engine(RankContext(0, 1, False, None, options))
        worker = Worker(WorkerSpec(0, 1, "inproc://rank", FACTORY, options), worker_socket, engine)
        dispatcher = context.socket(zmq.DEALER)
        dispatcher.setsockopt(zmq.ROUTING_ID, b"front-end")
        m.bound_queues(dispatcher)
        dispatcher.setsockopt(zmq.RCVTIMEO, 30_000)
        dispatcher.connect("inproc://rank")
        dispatcher.send(m.pack([m.RESET]))
        worker._drain()  # the hello: the worker knows the dispatcher (and answers READY)
        assert b"front-end" in worker.dispatchers

        filled = 1  # the READY
        while filled < 100_000:  # a dispatcher that does not read: the worker's queue fills up
            if not worker.send(b"front-end", [m.HEARTBEAT, [], [0, 0]], block=False):
                break
            filled += 1
        assert m.QUEUE_MESSAGES <= filled <= 2 * m.QUEUE_MESSAGES, "the queue is bounded"

        step = [m.STEP, [("r1", 42, True)], [], [], [0, 0]]
        sender = threading.Thread(target=worker.send, args=(b"front-end", step))
        sender.start()
        received = [m.unpack_event(dispatcher.recv()) for _ in range(filled + 1)]  # the dispatcher reads again
        sender.join()
        assert received[-1] == (m.STEP, (("r1", 42, True),), (), (), (0, 0))
        assert b"front-end" in worker.dispatchers, "a dispatcher that reads within its lease keeps it"
    finally:
        context.destroy(linger=0)


async def test_commands_for_a_rank_that_stopped_reading_wait_in_the_dispatcher_and_all_arrive() -> None:
    options = ReferenceBackendConfig(name="bp", worker_processes=True).model_dump(mode="json")
    plan = WorkerPlan(1, FACTORY, options, heartbeat_timeout=3600.0)  # the stopped worker is silent on purpose
    driver = DataParallelDriver("bp", plan, load_tokenizer)
    await driver.start()
    try:
        rank = driver.ranks[0]
        assert rank.process is not None
        loop = asyncio.get_running_loop()
        done: dict[str, asyncio.Future[int]] = {}

        def sink_for(request_id: str) -> Sink:
            future: asyncio.Future[int] = loop.create_future()
            done[request_id] = future
            tokens = 0

            def sink(index: int, item: Sequence[EngineOutput] | BackendError) -> None:
                nonlocal tokens
                if future.done():  # the test gave up on it
                    return
                if isinstance(item, BackendError):
                    future.set_exception(item)
                    return
                tokens += len(item)
                if item[-1].finished:
                    future.set_result(tokens)

            return sink

        rng = np.random.default_rng(7)
        held_back = 0
        os.kill(rank.process.pid, signal.SIGSTOP)  # the worker reads nothing until SIGCONT
        try:
            for i in range(400):  # 16 KB each: far more than the bounded queues and the kernel's buffers hold
                request_id = f"r{i}"
                prompt = rng.integers(10, 8000, size=4000).astype(np.int32)
                driver.add(request_id, {**PARAMS, "seq_seed": i}, prompt, sink_for(request_id), 0)
                await asyncio.sleep(0)  # one loop iteration: its own flush, its own message
                held_back = max(held_back, len(rank.adds))
        finally:
            os.kill(rank.process.pid, signal.SIGCONT)
        tokens = await asyncio.wait_for(asyncio.gather(*done.values()), timeout=60)
        assert tokens == [1] * 400
        assert driver.in_flight == 0
        assert held_back > 0, "the rank's queue filled up and the dispatcher kept commands back"
    finally:
        await driver.stop()
