"""The OpenAI Agents SDK drives one tool turn through the gateway, with its Responses model and its chat model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem

from ..conftest import MODEL, RunningGateway
from ..responses_conformance import AsyncConformingTransport

set_tracing_disabled(True)  # no trace export to OpenAI's servers

MODELS: dict[str, Callable[[openai.AsyncOpenAI], Any]] = {
    "responses": lambda client: OpenAIResponsesModel(model=MODEL, openai_client=client),
    "chat": lambda client: OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
}


@pytest.mark.parametrize(("kind", "streamed"), [("responses", False), ("responses", True), ("chat", False)])
async def test_agent_calls_its_tool_then_answers(responses_gateway: RunningGateway, kind: str, streamed: bool) -> None:
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny and 24 C in {city}."

    transport = AsyncConformingTransport()  # every Responses body and event the Agents SDK reads is checked
    client = openai.AsyncOpenAI(
        base_url=f"{responses_gateway.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather, using the tool.",
        tools=[get_weather],
        model=MODELS[kind](client),
        # The first turn must call the tool; the SDK then resets the choice to auto for the answer.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=300),
    )
    question = "What is the weather in Paris?"
    if streamed:
        run = Runner.run_streamed(agent, question, max_turns=3)
        async for _ in run.stream_events():
            pass
        result: Any = run
    else:
        result = await Runner.run(agent, question, max_turns=3)
    await client.close()
    assert len(cities) == 1 and cities[0] in ("Paris", "Rome", "Oslo")
    kinds = [type(item) for item in result.new_items]
    assert kinds.index(ToolCallItem) < kinds.index(ToolCallOutputItem)
    assert len(result.raw_responses) == 2, "one turn to call the tool, one to answer"
    assert isinstance(result.final_output, str) and result.final_output
    if kind == "responses":
        assert transport.counts["events" if streamed else "bodies"] >= 2
