"""The DeepSeek output path inside ``EngineBackend``: engine tokens -> detokenizer -> parser -> events.

The reference model never writes DSML on its own, so a scripted engine (DeepInfer's engine API, replaying given
completions a few tokens per step) stands in for it; the tokenizer is the reference engine's, so tags split into
real tokens and ``</think>`` is one token as in V4.1's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import deepseek_recipe as recipe
import numpy as np
import orjson
import pytest
from tokenizers import Tokenizer

from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.engine.backend import EngineBackend
from backends.engine.protocol import EOS_TOKEN_ID, EngineOutput
from backends.errors import InvalidRequestError
from backends.interface import Delta, Event, Finish, GenerateRequest, SamplingOptions, Usage
from backends.reference import ReferenceArtifacts

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL_BLOCK = (
    "\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)


def markers_made_special(tokenizer: Tokenizer) -> Tokenizer:
    """The reference tokenizer with ``<think>``, ``</think>`` and ``｜DSML｜`` flagged as special tokens, as a
    V4.1 tokenizer may flag them (the reference tokenizer does not)."""
    document = json.loads(tokenizer.to_str())
    for token in document["added_tokens"]:
        if token["content"] in ("<think>", "</think>", "｜DSML｜"):
            token["special"] = True
    return Tokenizer.from_str(json.dumps(document))


class ScriptedEngine:
    """Replays one scripted completion per request, ``per_step`` tokens per ``step()``, then EOS."""

    def __init__(
        self, artifacts: ReferenceArtifacts, completion: str, per_step: int, tokenizer: Tokenizer | None = None
    ) -> None:
        self.tokenizer = tokenizer or artifacts.tokenizer
        self.vocab_size = artifacts.model.vocab_size
        self.max_model_len = 4096
        self.script = [*self.tokenizer.encode(completion, add_special_tokens=False).ids, EOS_TOKEN_ID]
        self.per_step = per_step
        self.params: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []
        self._running: dict[str, tuple[int, int]] = {}  # request id -> (position, prompt length)

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> object:
        self.params.append(dict(sampling_params or {}))
        self.prompts.append(prompt_token_ids.tolist())
        self._running[request_id] = (0, int(prompt_token_ids.size))
        return object()

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._running.pop(rid, None)
        return len(ids), 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def get_num_unfinished_requests(self) -> int:
        return len(self._running)

    def step(self) -> list[EngineOutput]:
        outputs = []
        for rid, (position, prompt_len) in list(self._running.items()):
            for token in self.script[position : position + self.per_step]:
                position += 1
                done = position == len(self.script)
                outputs.append(
                    EngineOutput(rid, token, done, "stop" if done else "", position, prompt_len, -0.5, (), ())
                )
                if done:
                    del self._running[rid]
                    break
            else:
                self._running[rid] = (position, prompt_len)
        return outputs

    def flush_inflight_reqs(self) -> list[EngineOutput]:
        return []

    def close(self) -> None:
        self._running.clear()


async def run(
    artifacts: ReferenceArtifacts,
    completion: str,
    *,
    per_step: int = 3,
    tokenizer: Tokenizer | None = None,
    **fields: Any,
) -> tuple[list[Event], ScriptedEngine]:
    engine = ScriptedEngine(artifacts, completion, per_step, tokenizer)
    backend = EngineBackend("scripted", "scripted", lambda: engine, DeepSeekV41ChatTemplate())
    await backend.start()
    try:
        request = GenerateRequest(
            request_id="r",
            model="m",
            messages=fields.pop("messages", [{"role": "user", "content": "Weather?"}]),
            sampling=fields.pop("sampling", SamplingOptions()),
            **fields,
        )
        events = [event async for event in backend.generate(request)]
    finally:
        await backend.stop()
    return events, engine


def assemble(events: Sequence[Event]) -> dict[str, Any]:
    reasoning, content, calls, finish, usage = [], [], [], None, None
    for event in events:
        if isinstance(event, Delta):
            reasoning.append(event.reasoning)
            content.append(event.text)
            for piece in event.tool_calls or ():
                if piece.id is not None:
                    calls.append({"id": piece.id, "name": piece.name, "arguments": piece.arguments})
                else:
                    calls[piece.index]["arguments"] += piece.arguments
        elif isinstance(event, Finish):
            finish = event.reason
        elif isinstance(event, Usage):
            usage = event
    return {
        "reasoning": "".join(reasoning),
        "content": "".join(content),
        "calls": calls,
        "finish": finish,
        "usage": usage,
    }


@pytest.mark.parametrize("per_step", [1, 3, 7])
async def test_parallel_tool_calls_come_out_as_openai_calls_with_finish_reason_tool_calls(
    artifacts: ReferenceArtifacts, per_step: int
) -> None:
    events, _ = await run(artifacts, CALL_BLOCK, per_step=per_step, tools=[WEATHER])
    out = assemble(events)
    assert out["content"] == ""
    assert [c["name"] for c in out["calls"]] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"]) for c in out["calls"]] == [{"city": "Paris", "days": 2}, {"city": "Oslo"}]
    assert all(c["id"].startswith("call_") for c in out["calls"]) and out["calls"][0]["id"] != out["calls"][1]["id"]
    assert out["finish"] == "tool_calls"


@pytest.mark.parametrize("per_step", [1, 4])
async def test_markers_flagged_special_by_the_tokenizer_still_reach_the_parser(
    artifacts: ReferenceArtifacts, per_step: int
) -> None:
    tokenizer = markers_made_special(artifacts.tokenizer)
    think_end = tokenizer.token_to_id("</think>")
    assert tokenizer.get_added_tokens_decoder()[think_end].special
    completion = "Look it up.</think>" + CALL_BLOCK
    events, _ = await run(
        artifacts, completion, per_step=per_step, tokenizer=tokenizer, tools=[WEATHER], reasoning_effort="low"
    )
    out = assemble(events)
    assert out["reasoning"] == "Look it up." and out["content"] == ""
    assert [json.loads(c["arguments"]) for c in out["calls"]] == [{"city": "Paris", "days": 2}, {"city": "Oslo"}]
    assert out["finish"] == "tool_calls"


async def test_other_special_tokens_are_still_dropped_from_the_text(artifacts: ReferenceArtifacts) -> None:
    tokenizer = markers_made_special(artifacts.tokenizer)
    events, _ = await run(artifacts, "Hello<｜User｜> there<｜▁pad▁｜>.", tokenizer=tokenizer)
    assert assemble(events)["content"] == "Hello there."


async def test_thinking_output_splits_into_reasoning_then_content_and_counts_reasoning_tokens(
    artifacts: ReferenceArtifacts,
) -> None:
    reasoning = "The user wants a number. Four it is."
    events, engine = await run(artifacts, reasoning + "</think>The answer is 4.", reasoning_effort="high")
    out = assemble(events)
    assert (out["reasoning"], out["content"], out["finish"]) == (reasoning, "The answer is 4.", "stop")
    assert engine.tokenizer.decode(engine.prompts[0], skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    reasoning_ids = engine.tokenizer.encode(reasoning, add_special_tokens=False).ids
    assert out["usage"].reasoning_tokens == len(reasoning_ids)  # the closing tag is not reasoning


@pytest.mark.parametrize(
    "completion",
    [
        "The user wants a number.</think>The answer is 4.",
        "\n\nShort.</think>\n\nLong answer with some more words in it.",
        "Look it up." + CALL_BLOCK,
        "Look it up.</think>" + CALL_BLOCK,
    ],
)
async def test_usage_counts_reasoning_tokens_as_deepseek_recipe_does(
    artifacts: ReferenceArtifacts, completion: str
) -> None:
    events, engine = await run(artifacts, completion, tools=[WEATHER], reasoning_effort="high")
    gateway = assemble(events)["usage"]
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Weather?"}], "stream": True}
    conversation = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    processor = recipe.StreamProcessor(
        recipe.ChatCompletionRequest.chunk_generator(conversation, "chatcmpl-test", "m"),
        conversation.parsing_options,
        recipe.Tokenizer.from_str(engine.tokenizer.to_str()),
    )
    out = processor.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=1)))
    script = engine.script[:-1]  # without the EOS, which ends the reply rather than being part of it
    for at in range(0, len(script), 3):  # the steps the scripted engine made
        out += processor.push(recipe.InferenceChunk.tokens(script[at : at + 3]))
    out += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    out += processor.finish()
    usage = orjson.loads(out[-1].to_json())["usage"]
    assert gateway is not None and gateway.reasoning_tokens == usage["completion_tokens_details"]["reasoning_tokens"]


async def test_tool_call_after_reasoning_in_thinking_mode(artifacts: ReferenceArtifacts) -> None:
    events, _ = await run(artifacts, "Look it up.</think>" + CALL_BLOCK, tools=[WEATHER], reasoning_effort="low")
    out = assemble(events)
    assert out["reasoning"] == "Look it up." and out["content"] == "" and len(out["calls"]) == 2
    assert out["finish"] == "tool_calls"


async def test_text_before_a_call_stays_content(artifacts: ReferenceArtifacts) -> None:
    events, _ = await run(artifacts, "Let me check." + CALL_BLOCK, tools=[WEATHER])
    out = assemble(events)
    assert out["content"] == "Let me check." and len(out["calls"]) == 2 and out["finish"] == "tool_calls"


async def test_without_tools_dsml_is_plain_content_and_finish_is_stop(artifacts: ReferenceArtifacts) -> None:
    events, _ = await run(artifacts, CALL_BLOCK)
    out = assemble(events)
    assert out["content"] == CALL_BLOCK.lstrip("\n") and out["calls"] == [] and out["finish"] == "stop"


@pytest.mark.parametrize("per_step", [1, 3, 7])
async def test_stop_sequences_end_the_answer_not_the_reasoning(artifacts: ReferenceArtifacts, per_step: int) -> None:
    """As DeepSeek's parser does: a stop sequence in the reasoning is reasoning; in the answer it ends the choice."""
    completion = "Plan: STOP is a word.</think>The answer STOP is cut here, and all of this is never generated."
    events, engine = await run(
        artifacts, completion, per_step=per_step, reasoning_effort="high", sampling=SamplingOptions(stop=["STOP"])
    )
    out = assemble(events)
    assert (out["reasoning"], out["content"], out["finish"]) == ("Plan: STOP is a word.", "The answer ", "stop")
    assert [e.matched_stop for e in events if isinstance(e, Finish)] == ["STOP"]
    through_stop = engine.tokenizer.encode(completion[: completion.rindex("STOP") + 4], add_special_tokens=False).ids
    assert out["usage"].completion_tokens < len(through_stop) + per_step  # the engine request ended at the stop


async def test_a_stop_sequence_inside_a_call_is_part_of_its_arguments(artifacts: ReferenceArtifacts) -> None:
    events, _ = await run(artifacts, "Checking." + CALL_BLOCK, tools=[WEATHER], sampling=SamplingOptions(stop=["Oslo"]))
    out = assemble(events)
    assert out["content"] == "Checking." and out["finish"] == "tool_calls"
    assert [json.loads(c["arguments"])["city"] for c in out["calls"]] == ["Paris", "Oslo"]


async def test_forced_tool_call_sends_the_grammar_and_trigger_to_the_engine(artifacts: ReferenceArtifacts) -> None:
    _, engine = await run(artifacts, CALL_BLOCK, tools=[WEATHER], tool_choice="required", reasoning_effort="max")
    so_args = engine.params[0]["so_args"]
    assert so_args["schema_type"] == "ebnf" and so_args["schema"].startswith("root ::=")
    assert so_args["trigger_token_ids"] == [artifacts.special.think_end]


async def test_json_schema_sends_json_so_args_and_keeps_the_reply_verbatim(artifacts: ReferenceArtifacts) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    events, engine = await run(artifacts, '{"ok": true, "tag": "<think>"}', response_format=response_format)
    assert engine.params[0]["so_args"] == {"schema_type": "json", "schema": json.dumps(schema)}
    assert "trigger_token_ids" not in engine.params[0]["so_args"]
    assert json.loads(assemble(events)["content"]) == {"ok": True, "tag": "<think>"}, (
        "tags in a formatted reply are data"
    )


async def test_engine_refusing_so_args_is_a_400_naming_the_constrained_field(artifacts: ReferenceArtifacts) -> None:
    class NoStructuredOutputs(ScriptedEngine):
        def add_request(self, *args: Any, **kwargs: Any) -> object:
            if (kwargs.get("sampling_params") or {}).get("so_args") is not None:
                raise ValueError("so_args not supported by this engine")
            return super().add_request(*args, **kwargs)

    engine = NoStructuredOutputs(artifacts, "{}", 1)
    backend = EngineBackend("plain", "plain", lambda: engine, DeepSeekV41ChatTemplate())
    await backend.start()
    try:
        request = GenerateRequest(
            request_id="r",
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        )
        with pytest.raises(InvalidRequestError) as caught:
            _ = [event async for event in backend.generate(request)]
    finally:
        await backend.stop()
    assert caught.value.param == "response_format" and "so_args" in caught.value.message
