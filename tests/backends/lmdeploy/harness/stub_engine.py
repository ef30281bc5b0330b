"""A stub in place of LMDeploy's TurboMind / PyTorch engine, so LMDeploy's real api_server runs on a CPU.

Runs inside the harness virtualenv (it imports ``lmdeploy``). The "model" echoes the last user turn of the prompt
token by token, then ends with EOS. Directives written in the prompt select the path a test needs, e.g.
``[[stub delay=0.05 chunk=3 fail=INTERNAL_ENGINE_ERROR after=2 cached=5 tag=abc]]``:

- ``delay``: seconds to sleep before each engine step;  ``first_delay``: before the first step only;
  ``pause``: seconds to sleep once, after ``pause_after`` tokens (a stream that goes quiet mid-way);
- ``chunk``: tokens per engine step (speculative decoding emits several);
- ``fail`` (a ``ResponseType`` name) and ``after``: end with that status after that many tokens; with
  ``fail_on=NAME`` only on the node of that name (``STUB_NODE_NAME``);
- ``cached``: prefix-cached prompt tokens reported in the request metrics;
- ``repeat``: repeat the echoed text this many times;
- ``tag``: a label written to the event log with every event of the request.

With ``ignore_eos`` the echo cycles until ``max_new_tokens``. Every request start, finish and cancellation is
appended as one JSON line to the file named by ``STUB_EVENT_LOG`` (when set), which is how tests observe the
engine: for example that closing a client connection cancelled the engine request.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from typing import Any

from lmdeploy.messages import EngineOutput, RequestMetrics, ResponseType, ScheduleMetrics

DIRECTIVE = re.compile(r"\s*\[\[stub([^\]]*)\]\]")
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def parse_directives(text: str) -> tuple[str, dict[str, str]]:
    """Returns the text without directives and the directives' key=value pairs."""
    options: dict[str, str] = {}
    for match in DIRECTIVE.finditer(text):
        for part in match.group(1).split():
            key, _, value = part.partition("=")
            options[key] = value
    return DIRECTIVE.sub("", text), options


class EventLog:
    """Appends JSON lines; one lock so concurrent requests never interleave a line."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    def write(self, **event: Any) -> None:
        if not self._path:
            return
        line = json.dumps({"t": time.time(), **event}) + "\n"
        with self._lock, open(self._path, "a") as f:
            f.write(line)


class StubEngine:
    """Stands in for ``TurboMind`` / the PyTorch ``Engine``: the attributes and methods AsyncEngine uses."""

    def __init__(self, hf_tokenizer: Any, engine_config: Any) -> None:
        self.tokenizer = hf_tokenizer
        if getattr(engine_config, "max_batch_size", None) is None:
            engine_config.max_batch_size = 128
        self.engine_config = engine_config
        self.events = EventLog(os.environ.get("STUB_EVENT_LOG"))
        self.node = os.environ.get("STUB_NODE_NAME", "stub")
        self.eos_id = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.vocab_size = len(hf_tokenizer)
        self.scheduler_tick = 0
        self.active = 0
        self.sleeping = False

    # engine lifecycle, as AsyncEngine calls it
    def create_instance(self, cuda_stream_id: int = 0) -> StubInstance:
        return StubInstance(self)

    def close(self) -> None:
        return None

    def end_session(self, session_id: int) -> bool:
        return True

    async def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    def wakeup(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    def complete_weights_update(self) -> None:
        return None

    def update_params(self, request: Any) -> None:
        return None

    def get_schedule_metrics(self) -> ScheduleMetrics:
        return ScheduleMetrics(active_seqs=self.active, waiting_seqs=0, scheduler_tick=self.scheduler_tick)

    async def get_health_status(self) -> dict[str, Any]:
        return {"alive": True, "message": "Stub engine is healthy.", "schedule_metrics": self.get_schedule_metrics()}


class StubInstance:
    """Stands in for ``TurboMindInstance``: one request at a time, as LMDeploy's request-handle pool uses it."""

    def __init__(self, engine: StubEngine) -> None:
        self.engine = engine
        self.tag = ""

    async def async_cancel(self, session_id: int | None = None) -> None:
        self.engine.events.write(event="cancel", session=session_id, tag=self.tag, node=self.engine.node)

    async def async_end(self, session_id: int) -> None:
        return None

    async def async_stream_infer(
        self,
        session_id: int,
        input_ids: list[int],
        gen_config: Any = None,
        stream_output: bool = False,
        multimodal: Any = None,
        **kwargs: Any,
    ):
        engine = self.engine
        tokenizer = engine.tokenizer
        prompt = tokenizer.decode(input_ids, skip_special_tokens=False)
        turns = USER_TURN.findall(prompt)
        text = turns[-1] if turns else prompt
        text, options = parse_directives(text)
        tag = self.tag = options.get("tag", "")
        text = text * int(options.get("repeat", "1"))
        echo = tokenizer.encode(text, add_special_tokens=False) or [engine.eos_id]
        delay = float(options.get("delay", "0"))
        first_delay = float(options.get("first_delay", "0"))
        pause, pause_after = float(options.get("pause", "0")), int(options.get("pause_after", "1"))
        chunk = max(1, int(options.get("chunk", "1")))
        fail = options.get("fail")
        if options.get("fail_on", engine.node) != engine.node:
            fail = None
        fail_after = int(options.get("after", "0"))
        cached = int(options.get("cached", "0"))
        max_new = gen_config.max_new_tokens if gen_config and gen_config.max_new_tokens else 1 << 30
        ignore_eos = bool(gen_config and gen_config.ignore_eos)
        min_new = (gen_config.min_new_tokens or 0) if gen_config else 0
        stop_ids = set((gen_config.stop_token_ids or []) if gen_config else [])
        top = (gen_config.logprobs or 0) if gen_config else 0
        engine.events.write(
            event="start",
            session=session_id,
            tag=tag,
            node=engine.node,
            prompt_tokens=len(input_ids),
            max_new_tokens=gen_config.max_new_tokens if gen_config else None,
        )
        engine.active += 1
        emitted = 0
        finished = False
        try:
            if first_delay:
                await asyncio.sleep(first_delay)
            while True:
                if pause and emitted >= pause_after:
                    await asyncio.sleep(pause)
                    pause = 0
                if delay:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
                engine.scheduler_tick += 1
                if fail and emitted >= fail_after:
                    status = ResponseType[fail]
                    engine.events.write(event="fail", session=session_id, tag=tag, node=engine.node, status=fail)
                    finished = True
                    yield EngineOutput(status, [], req_metrics=RequestMetrics(time.time(), [], cached_tokens=cached))
                    return
                step: list[int] = []
                done = False
                while len(step) < chunk:
                    position = emitted + len(step)
                    if position >= len(echo) and not ignore_eos and position >= min_new:
                        step.append(engine.eos_id)
                        done = True
                        break
                    token = echo[position % len(echo)]
                    step.append(token)
                    if (token in stop_ids and not ignore_eos) or emitted + len(step) >= max_new:
                        done = True
                        break
                emitted += len(step)
                logprobs = [self._logprobs(t, top) for t in step] if top else None
                metrics = RequestMetrics(time.time(), [], cached_tokens=cached)
                if done:
                    finished = True
                    engine.events.write(event="finish", session=session_id, tag=tag, node=engine.node, tokens=emitted)
                    yield EngineOutput(ResponseType.FINISH, step, logprobs=logprobs, req_metrics=metrics)
                    return
                yield EngineOutput(ResponseType.SUCCESS, step, logprobs=logprobs, req_metrics=metrics)
        finally:
            engine.active -= 1
            if not finished:
                engine.events.write(event="closed", session=session_id, tag=tag, node=engine.node, tokens=emitted)

    def _logprobs(self, token: int, top: int) -> dict[int, float]:
        """The chosen token first (the most likely), then its neighbours in the vocabulary."""
        out = {token: -0.125}
        candidate = token
        while len(out) < top:
            candidate = (candidate + 1) % self.engine.vocab_size
            out.setdefault(candidate, -1.125 - len(out))
        return out
