"""Credits: a rank runs at most ``STEPS_AHEAD`` steps ahead of what each dispatcher has taken, so tokens nobody
reads yet are never made, and an abort reaches the rank before the step after next.

Checked with a real rank worker (the reference engine with a timing model, 10 ms a step: it would outrun any
dispatcher that does not take its outputs) and a raw dispatcher (``peer.RankPeer``) that takes nothing unless told,
on the rank's own counters: the tokens it reports having generated."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from backends.workers import messages as m

from .peer import RankPeer, add, rank_process, tokens

TIMING = {"decode_seconds_per_step": 0.01}


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/rank"


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_rank_steps_only_as_far_as_its_dispatcher_takes_and_applies_an_abort_within_two_steps(
    endpoint: str, context: zmq.Context
) -> None:
    with rank_process(endpoint, {"timing": TIMING}):
        peer = RankPeer(context, endpoint, b"front-end")
        peer.hello()
        peer.batch([add("long", 1000)])  # 10 s of tokens if nothing held the rank back
        first = peer.steps_until_heartbeat()
        assert [step[1] for step in first] == list(range(1, m.STEPS_AHEAD + 1)), "no step beyond the credits"
        assert peer.stats is not None and peer.stats.tokens == tokens(first), "the rank generated only what it sent"
        assert peer.stats.unfinished == 1

        peer.batch(taken=1)  # one message taken: one step more
        second = peer.steps_until_heartbeat()
        assert [step[1] for step in second] == [m.STEPS_AHEAD + 1]
        assert peer.stats.tokens == tokens(first) + tokens(second)

        # The client left while the dispatcher took the last step: the abort comes with the credit, before any step.
        peer.batch(aborts=["long"], taken=m.STEPS_AHEAD + 1)
        assert peer.steps_until_heartbeat() == []
        assert peer.stats.unfinished == 0, "the rank aborted the request"
        assert peer.stats.tokens == tokens(first) + tokens(second), "and generated nothing after the abort"


def test_a_dispatcher_that_keeps_pinging_but_takes_nothing_loses_its_lease_and_the_others_go_on(
    endpoint: str, context: zmq.Context
) -> None:
    lease = 1.5
    with rank_process(endpoint, {"timing": TIMING}, lease_seconds=lease):
        stuck, other = RankPeer(context, endpoint, b"stuck"), RankPeer(context, endpoint, b"other")
        stuck.hello()
        other.hello()
        stuck.batch([add("held", 1000)])
        assert len(stuck.steps_until_heartbeat()) == m.STEPS_AHEAD
        other.batch([add("short", 20)])
        stuck.send(m.PING)  # alive, but it never takes its outputs
        taken, generated, finished = 0, 0, False
        while not finished:  # the other dispatcher takes everything; its request waits for the lease, then runs
            message = other.receive()
            if message[0] == m.STEP and message[2]:
                generated += len(message[2])
                finished = message[2][-1][2]
                taken = message[1]
                other.batch(taken=taken)
        assert generated == 20
        stuck.send(m.PING)
        while (message := stuck.receive())[0] == m.HEARTBEAT:  # sent while the rank waited for it
            pass
        assert message[0] == m.READY, "the rank dropped it: it must say hello again"
        other.steps_until_heartbeat()
        assert other.stats is not None and other.stats.unfinished == 0, "its request was aborted on the rank"
