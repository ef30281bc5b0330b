"""Data-parallel reference engines in worker processes, end to end through the HTTP API.

``dp``: two independent ranks. ``lockstep``: three ranks whose engines imitate DeepInfer's DP collectives (every
rank must make the same collective calls in the same order, or the imitation fails the group). The tests read
the dispatcher's per-rank state (``driver.ranks``) to see where requests went.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import msgpack
import numpy as np
import orjson
import zmq

from backends.workers import messages as m

from ...conftest import RunningGateway, captured_logs, logged_error_detail, wait_until
from ...image_files import data_url, png
from .conftest import chat, clock_of, driver_of, holding_rank, open_stream, steps
from .peer import RankPeer


def complete_ids(http: httpx.Client, model: str, ids: list[int]) -> None:
    response = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2})
    assert response.status_code == 200, response.text


def dispatched(gateway: RunningGateway, backend: str) -> list[int]:
    return [rank.dispatched for rank in driver_of(gateway, backend).ranks]


def delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


# ---- spreading load ----------------------------------------------------------------------------------------------


def test_concurrent_requests_spread_evenly_over_the_ranks(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    before = dispatched(dp_gateway, "dp")
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            chat(http, "dp", f"Question number {i}?", 30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert delta(dispatched(dp_gateway, "dp"), before) == [4, 4]


def test_a_rank_busy_with_a_long_request_is_avoided(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    before = dispatched(dp_gateway, "dp")
    with open_stream(http, "dp", 2000) as stream:
        next(stream)
        busy = holding_rank(dp_gateway, "dp")
        for i in range(3):  # short and sequential: equal loads would alternate ranks; a busy one is avoided
            chat(http, "dp", f"Short question {i}", 3)
    change = delta(dispatched(dp_gateway, "dp"), before)
    assert change[busy] == 1
    assert change[1 - busy] == 3


def test_prompts_sharing_a_long_prefix_go_to_the_same_rank(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 8000, size=640).tolist()
    before = dispatched(dp_gateway, "dp")
    for i in range(4):
        complete_ids(http, "dp", [*shared, 100 + i, 200 + i])
    sticky = delta(dispatched(dp_gateway, "dp"), before)
    assert sorted(sticky) == [0, 4]

    before = dispatched(dp_gateway, "dp")
    for _ in range(4):  # the control: unrelated long prompts on idle ranks alternate
        complete_ids(http, "dp", rng.integers(10, 8000, size=640).tolist())
    assert delta(dispatched(dp_gateway, "dp"), before) == [2, 2]


def test_client_disconnect_aborts_the_request_on_the_rank_that_holds_it(
    dp_gateway: RunningGateway, http: httpx.Client
) -> None:
    driver = driver_of(dp_gateway, "dp")
    with open_stream(http, "dp", 2000) as stream:
        next(stream)
        rank = driver.ranks[holding_rank(dp_gateway, "dp")]
        assert wait_until(lambda: rank.stats is not None and rank.stats.unfinished == 1)
    assert wait_until(lambda: rank.outstanding == 0)
    # The worker's own engine reports the request gone: the abort reached that rank's engine.
    assert wait_until(lambda: rank.stats is not None and rank.stats.unfinished == 0)


def test_a_front_end_whose_event_loop_stalls_holds_its_rank_within_two_steps(
    dp_gateway: RunningGateway, http: httpx.Client
) -> None:
    """Credits: while the front end takes nothing (its loop is blocked, as by a long pause), the rank stops after
    at most ``STEPS_AHEAD`` steps instead of running its queues full of tokens nobody reads. Seen by a second
    dispatcher (a raw peer), from the rank's own step counter; the streams then go on unharmed."""
    driver = driver_of(dp_gateway, "dp")
    context = zmq.Context()
    stalled, release = threading.Event(), threading.Event()

    def stall() -> None:  # runs on the front end's event loop: nothing is read or taken until released
        stalled.set()
        release.wait(60)

    try:
        with open_stream(http, "dp", 3000) as stream:
            next(stream)
            rank = driver.ranks[holding_rank(dp_gateway, "dp")]
            observer = RankPeer(context, rank.endpoint, b"observer")
            observer.hello()
            assert driver._loop is not None
            driver._loop.call_soon_threadsafe(stall)
            assert stalled.wait(30)
            try:
                assert rank.stats is not None
                seen = rank.stats.steps  # the last step the front end read before its loop stalled
                # The rank reports to the observer every 0.5 s while it steps, and sends a heartbeat only once it has
                # stopped for a second: waiting for the stalled front end's credit.
                while observer.receive()[0] != m.HEARTBEAT:
                    pass
                assert observer.stats is not None and observer.stats.unfinished == 1
                assert seen <= observer.stats.steps <= seen + m.STEPS_AHEAD, (seen, observer.stats.steps)
            finally:
                release.set()
            frames = [next(stream) for _ in range(20)]  # the stream goes on once the loop does
            assert all(frame.startswith("{") for frame in frames)
    finally:
        release.set()
        context.destroy(linger=0)


def test_readiness_and_metrics_report_every_rank(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    chat(http, "dp", "warm up the counters", 2)
    ready = http.get("/ready").json()
    assert ready["backends"]["dp"] == {
        "kind": "reference",
        "ready": True,
        "reason": "2/2 ranks up",
        "circuits": {"dp": "closed"},
    }
    assert ready["backends"]["lockstep"]["reason"] == "3/3 ranks up"
    text = http.get("/metrics").text
    for rank in ("0", "1"):
        labels = f'{{backend="dp",rank="{rank}"}}'
        assert f"gateway_dp_rank_up{labels} 1.0" in text
        assert f"gateway_dp_rank_dispatched_requests_total{labels}" in text
        assert f"gateway_dp_rank_steps_total{labels}" in text
        assert f"gateway_dp_rank_kv_usage_ratio{labels}" in text
        assert f"gateway_dp_rank_queued_prompt_tokens{labels}" in text


def test_the_choices_of_one_request_share_a_rank(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    before = dispatched(dp_gateway, "dp")
    reply = chat(http, "dp", "Three takes on one question", 4, n=3)
    assert len(reply["choices"]) == 3
    assert sorted(delta(dispatched(dp_gateway, "dp"), before)) == [0, 3]


# ---- failure -----------------------------------------------------------------------------------------------------


def test_killed_worker_fails_its_requests_cleanly_and_comes_back(
    dp_gateway: RunningGateway, http: httpx.Client
) -> None:
    driver = driver_of(dp_gateway, "dp")
    with clock_of(dp_gateway, "dp").held():  # the restart waits until the degraded state was looked at
        with captured_logs(dp_gateway) as logs, open_stream(http, "dp", 2000) as stream:
            next(stream)
            victim = driver.ranks[holding_rank(dp_gateway, "dp")]
            assert victim.process is not None
            old_pid = victim.process.pid
            restarts = victim.restarts
            os.kill(old_pid, signal.SIGKILL)
            rest = list(stream)
        error = orjson.loads(rest[-2])["error"]
        assert rest[-1] == "[DONE]"
        assert error["type"] == "server_error"
        detail = logged_error_detail(logs)  # the client's message is generic; the log has the detail
        assert f"data-parallel rank {victim.index}" in detail
        assert "SIGKILL" in detail

        # Degraded, still ready, and the other rank keeps serving while the victim waits out its backoff.
        assert wait_until(lambda: http.get("/ready").json()["backends"]["dp"]["reason"].startswith("1/2 ranks up"))
        before = dispatched(dp_gateway, "dp")
        chat(http, "dp", "served while degraded", 3)
        assert delta(dispatched(dp_gateway, "dp"), before)[victim.index] == 0

    assert wait_until(lambda: victim.state == "up", timeout=30)
    assert victim.process is not None and victim.process.pid != old_pid
    assert victim.restarts == restarts + 1
    before = dispatched(dp_gateway, "dp")
    for i in range(2):  # equal loads alternate ranks: one of these is served by the restarted rank
        chat(http, "dp", f"after the restart {i}", 3)
    assert delta(dispatched(dp_gateway, "dp"), before)[victim.index] == 1


def test_two_ranks_killed_in_one_backoff_window_both_come_back(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    driver = driver_of(dp_gateway, "dp")
    assert wait_until(lambda: all(r.state == "up" for r in driver.ranks), timeout=30)
    launches = [r.launches for r in driver.ranks]
    processes = [r.process for r in driver.ranks]
    for process in processes:  # one after the other, well inside the first one's backoff (RESTART_BACKOFF)
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
    assert wait_until(
        lambda: [(r.state, r.launches) for r in driver.ranks] == [("up", n + 1) for n in launches], timeout=30
    )
    assert not {p.pid for p in processes if p is not None} & {r.pid for r in driver.ranks}
    before = dispatched(dp_gateway, "dp")
    for i in range(2):
        chat(http, "dp", f"both are back {i}", 3)
    assert delta(dispatched(dp_gateway, "dp"), before) == [1, 1]


# ---- lockstep ----------------------------------------------------------------------------------------------------


def test_lockstep_group_steps_together_while_one_rank_is_busy(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    driver = driver_of(dp_gateway, "lockstep")
    start = steps(dp_gateway, "lockstep")
    assert len(set(start)) == 1
    with open_stream(http, "lockstep", 40) as stream:
        next(stream)
        busy = holding_rank(dp_gateway, "lockstep")
        assert [r.outstanding for r in driver.ranks].count(0) == 2  # the others are idle: placeholder steps
        frames = list(stream)
    assert frames[-1] == "[DONE]"
    assert orjson.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
    # Every step was a collective: all three ranks made exactly as many, at least one per generated token.
    assert wait_until(
        lambda: len(set(steps(dp_gateway, "lockstep"))) == 1 and steps(dp_gateway, "lockstep")[busy] > start[busy]
    )
    assert steps(dp_gateway, "lockstep")[0] - start[0] >= 39


def test_lockstep_abort_mid_stream_leaves_the_group_serving(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    driver = driver_of(dp_gateway, "lockstep")
    with open_stream(http, "lockstep", 2000) as stream:
        next(stream)
        rank = driver.ranks[holding_rank(dp_gateway, "lockstep")]
    assert wait_until(lambda: rank.stats is not None and rank.stats.unfinished == 0 and rank.outstanding == 0)
    reply = chat(http, "lockstep", "and now another", 5)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: len(set(steps(dp_gateway, "lockstep"))) == 1)


def test_lockstep_rank_death_restarts_the_whole_group(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    driver = driver_of(dp_gateway, "lockstep")
    with clock_of(dp_gateway, "lockstep").held():
        with captured_logs(dp_gateway) as logs, open_stream(http, "lockstep", 2000) as stream:
            next(stream)
            busy = holding_rank(dp_gateway, "lockstep")
            old_pids = [r.process.pid for r in driver.ranks if r.process is not None]
            idle = next(r for r in driver.ranks if r.index != busy)
            assert idle.process is not None
            os.kill(idle.process.pid, signal.SIGKILL)  # an idle rank dies: the busy one is stuck in a collective
            rest = list(stream)
        assert orjson.loads(rest[-2])["error"]["type"] == "server_error"
        assert "lockstep group restart" in logged_error_detail(logs)
        assert wait_until(lambda: http.get("/ready").json()["backends"]["lockstep"]["ready"] is False)
    assert wait_until(lambda: all(r.state == "up" for r in driver.ranks), timeout=30)
    new_pids = [r.process.pid for r in driver.ranks if r.process is not None]
    assert len(new_pids) == 3 and not set(new_pids) & set(old_pids)
    assert chat(http, "lockstep", "the group is back", 5)["choices"][0]["finish_reason"] == "length"


def test_prompt_scoring_and_tokenizing_work_through_rank_workers(http: httpx.Client) -> None:
    """Prompt logprobs cross the worker wire with the first output; the dispatcher's tokenizer serves /tokenize."""
    tokens = http.post("/tokenize", json={"model": "dp", "prompt": "Return the value"}).json()["tokens"]
    for model in ("dp", "lockstep"):
        body = {"model": model, "prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(tokens) and logprobs["token_logprobs"][0] is None
        assert all(isinstance(v, float) and v <= 0.0 for v in logprobs["token_logprobs"][1:])


# ---- images --------------------------------------------------------------------------------------------------


def test_images_reach_the_ranks_over_the_msgpack_wire(dp_gateway: RunningGateway, http: httpx.Client) -> None:
    """The rank's engine mixes the image bytes into its sampling: replies that follow the image prove the bytes
    crossed the wire, and the prompt counts the image's tokens on both sides of it."""

    def reply(image: bytes, max_tokens: int = 12) -> dict:
        parts = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        body = {"model": "dp", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, "seed": 5}
        response = http.post("/v1/chat/completions", json={**body, "temperature": 1.0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    red, blue = png(320, 240, (200, 0, 0)), png(320, 240, (0, 0, 200))
    first = reply(red)
    assert reply(red)["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert reply(blue)["choices"][0]["message"]["content"] != first["choices"][0]["message"]["content"]
    text_only = chat(http, "dp", "Describe it.", 1)["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] > text_only + 64
    # The rank's engine counts the expanded prompt too: a reply may not run past the context.
    room = dp_gateway.state.backends["dp"].max_model_len() - first["usage"]["prompt_tokens"]  # type: ignore[operator]
    assert (
        http.post(
            "/v1/chat/completions",
            json={
                "model": "dp",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(red)}}]}],
                "max_tokens": room + 8,
            },
        ).status_code
        == 400
    )


def test_the_wire_carries_image_bytes_and_sizes_as_msgpack_binaries() -> None:
    data = {"image_bytes": [b"\x00\xffpng", b"jpeg"], "image_sizes": [(630, 476), (16, 16)]}
    item = msgpack.unpackb(msgpack.packb(m.images_wire(data)), raw=False)
    assert m.images_of(item) == data
    assert m.images_wire(None) == [] and m.images_of([]) is None
