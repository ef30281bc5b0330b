"""The wire format between the dispatcher and its engine workers: msgpack arrays of plain values.

msgpack rather than pickle because ranks may sit on other hosts: the dispatcher must never execute what a socket
hands it. One message goes down per dispatcher flush (every add and abort for that rank since the last one) and one
comes up per worker step (every output of that step), so the per-message cost is paid per step, not per token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack
import zmq

from backends.engine.driver import STEPS_AHEAD as ENGINE_STEPS_AHEAD
from backends.errors import BackendError, InvalidRequestError, OverloadedError, UpstreamError

# Dispatcher -> worker.
BATCH = 0
"""``[BATCH, adds, aborts, taken]``: adds are ``[request_id, sampling_params, prompt_int32_bytes, user_id, prefix]``
and, for a prompt with images, a sixth item ``[[image_bytes, ...], [[width, height], ...]]`` (``images_wire``);
``prefix`` the prompt's prefix hashes (``RankBalancer.prefix_hashes`` as uint64 bytes, or empty), which the rank
passes on to its other dispatchers; ``taken`` is the ``seq`` of the last ``STEP`` message the dispatcher has taken
(its credit, ``STEPS_AHEAD``)."""
RESET = 1
"""``[RESET]``: the hello of a dispatcher session: abort every request *this dispatcher* holds on the worker
(requests of other dispatchers are untouched), answered with ``READY``."""
STOP = 2
"""``[STOP]``: abort everything, close the engine (with every rank, in lockstep) and exit."""
PING = 3
"""``[PING]``: the dispatcher is alive (sent every second); renews its lease on the worker's requests."""

# Worker -> dispatcher.
READY = 10
"""``[READY, pid, info, launch]``: the engine is constructed; ``info`` describes it (``EngineInfo`` fields),
``launch`` is this incarnation's number (1, then one more per restart, as its launcher counts). The answer to
``RESET``, and to any message of a dispatcher the worker does not know (a new incarnation of the rank, or one that
dropped this dispatcher when its lease ran out): such a dispatcher fails what it sent before and says hello again."""
STEP = 11
"""``[STEP, seq, outputs, errors, stats, load, prefixes]``: one engine step's outputs for this dispatcher
(``EngineOutput`` fields as arrays), its errors, the rank's counters, ``RankLoad`` (what the rank holds for *other*
dispatchers) and the prefix hashes of the prompts other dispatchers sent it since (so every dispatcher knows where
a prefix went). ``seq`` numbers the messages with outputs or errors this session (1, 2, ...); a message with neither
repeats the last number and needs no credit."""
HEARTBEAT = 12
"""``[HEARTBEAT, stats, load, prefixes]``: an idle (or waiting) worker is alive; the rest as in ``STEP``."""
FAILED = 13
"""``[FAILED, reason]``: the engine failed (to build, or while serving); the worker exits right after."""
CLOSED = 14
"""``[CLOSED]``: the engine closed cleanly; the worker exits right after."""
STARTING = 15
"""``[STARTING, pid, [launch, after, delay]]``: the answer to any message while the rank waits out its restart
backoff (``delay`` seconds more) or builds its engine (``delay`` 0); ``after`` is why the previous incarnation
ended. A hello (``RESET``) is remembered and answered with ``READY`` once the engine is built."""


STEPS_AHEAD = ENGINE_STEPS_AHEAD
"""Credits: a rank sends a dispatcher at most this many ``STEP`` messages with outputs beyond what the dispatcher has
taken (``BATCH``'s ``taken``), then waits before its next step, as the in-process engine waits for the event loop.
A dispatcher takes a message once it has handed its outputs on and the stream tasks they woke have run, so the rank
runs at most this many steps ahead of the clients, and an abort sent while taking step ``k`` is applied before
step ``k + STEPS_AHEAD``."""


class RankLoad(NamedTuple):
    """The work a rank holds for the *other* dispatchers in front of it: each dispatcher adds its own (known
    exactly, without a round trip) to choose a rank with everyone's load."""

    requests: int
    queued_prompt_tokens: int


class EngineInfo(NamedTuple):
    """What the gateway must know of a rank's engine to encode prompts and bound outputs."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    fingerprint: str | None


class RankStats(NamedTuple):
    """A rank's own counters, sent with its step messages (at most every ``REPORT_SECONDS`` when there is no output):
    the same numbers for every dispatcher, so each front end's ``/metrics`` shows the rank's true figures (from its
    start: a restarted rank counts from 0 again, a counter reset as Prometheus knows it).

    ``samples`` are the engine's own ``metric_samples()`` as ``[name, kind, help, value]``, when it offers them.
    """

    steps: int
    tokens: int
    busy_seconds: float
    engine_seconds: float
    unfinished: int
    kv_usage: float
    steps_per_second: float
    samples: list[list[Any]] | None
    requests: int  # requests the rank holds, for every dispatcher
    queued_prompt_tokens: int  # their prompt tokens not yet prefilled
    dispatched: int  # requests the rank accepted since it started, from every dispatcher


PREFIXES_PENDING = 4096
"""Prompts' prefix hashes a rank keeps for a dispatcher that has not heard them yet; older ones are dropped (an
affinity hint lost costs a prefix-cache miss, never a wrong answer)."""

QUEUE_MESSAGES = 64
"""ZeroMQ high-water mark, in messages, of each socket's send and receive queue on both sides. A DEALER whose peer's
queues are full does not drop: its send blocks (``EAGAIN`` with ``NOBLOCK``). So a worker whose dispatcher does not
keep up waits before its next step (the engine pauses instead of queueing outputs no one reads), and a dispatcher
whose worker is inside a long step keeps its commands and sends them, merged, once the worker has read."""


def bound_queues(socket: zmq.Socket) -> None:
    """Applies ``QUEUE_MESSAGES`` to a socket, before it binds or connects."""
    socket.setsockopt(zmq.SNDHWM, QUEUE_MESSAGES)
    socket.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack_command(data: bytes) -> Any:
    """Worker side: lists stay lists, because sampling parameters (``so_args``) may be checked for them."""
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


def unpack_event(data: bytes) -> Any:
    """Dispatcher side: arrays become tuples, the cheapest record to build per output."""
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)


def rebuild_error(kind: str, message: str) -> BackendError:
    """A rank's error for one request, as the dispatcher raises it to the request's caller."""
    if kind == "invalid_request":
        return InvalidRequestError(message)
    if kind == "overloaded":
        return OverloadedError(message, retry_after=1.0)
    return UpstreamError(message)


def images_wire(multi_modal_data: dict[str, Any] | None) -> list[Any]:
    """The optional last item of an add for ``multi_modal_data``: image bytes travel as msgpack binaries."""
    if multi_modal_data is None:
        return []
    return [[multi_modal_data["image_bytes"], [list(size) for size in multi_modal_data["image_sizes"]]]]


def images_of(item: list[Any]) -> dict[str, Any] | None:
    """``multi_modal_data`` from an add's optional last item (``images_wire``)."""
    if not item:
        return None
    image_bytes, sizes = item[0]
    return {"image_bytes": list(image_bytes), "image_sizes": [(int(w), int(h)) for w, h in sizes]}
