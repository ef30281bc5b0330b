"""Pydantic models of the OpenAI request bodies this gateway accepts.

Validation happens once per request at the HTTP boundary. Parameters the backends cannot honour are accepted
at their default values and rejected with a 400 naming them otherwise: silence would be a wrong answer.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from backends.interface import SamplingOptions

MAX_STOP_SEQUENCES = 16
MAX_TOKENS_LIMIT = 2**31 - 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESPONSE_FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
"""``response_format`` types and the key each one needs; ``regex`` and ``ebnf`` are extensions."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content; either is accepted")
    refusal: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported by this model; send text")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
        return value

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(part["text"] for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Sampling(_Body):
    """Fields shared by chat and completions."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension: sample among the k most likely tokens")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    user: str | None = None
    ignore_eos: bool = Field(False, description="extension: generate until max_tokens even past end-of-sequence")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="extension (vLLM, LMDeploy)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension (vLLM, LMDeploy)")
    min_tokens: int | None = Field(None, ge=0, description="extension: generate at least this many tokens")
    skip_special_tokens: bool = Field(True, description="extension: drop special tokens from the text")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            if any(not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def top_k_value(self) -> int | None:
        return None if self.top_k in (None, 0, -1) else self.top_k

    def sampling_options(self, *, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k_value(),
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=self.logit_bias or None,
            skip_special_tokens=self.skip_special_tokens,
        )


class UnsupportedParameter(ValueError):
    """Raised inside validators; the message names the parameter so the 400 does too."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param
        self.why = why


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None,
        description='text, json_object, json_schema; extensions: {"type": "regex", "regex": ...}, '
        '{"type": "ebnf", "ebnf": ...}',
    )
    reasoning_effort: StrictStr | StrictInt | None = Field(
        None, description="none, minimal, low, medium, high, xhigh, max, or (extension) an integer from 1 to 100"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(None, description='extension: e.g. {"thinking": true}')
    # Accepted at their defaults only (see the validator).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        names: set[str] = set()
        for i, tool in enumerate(value or ()):
            if tool.get("type") != "function":
                raise ValueError(f"tools[{i}].type must be 'function'")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise ValueError(f"tools[{i}].function must be an object")
            name = function.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, underscores or dashes")
            if name in names:
                raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
            names.add(name)
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise ValueError("expected 'none', 'auto', 'required' or a function object")
        elif value is not None:
            function = value.get("function")
            if value.get("type") != "function" or not isinstance(function, dict):
                raise ValueError('expected {"type": "function", "function": {"name": ...}}')
            if not isinstance(function.get("name"), str):
                raise ValueError("tool_choice.function.name must be a string")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type")
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"type must be one of {', '.join(RESPONSE_FORMATS)}")
        key = RESPONSE_FORMATS[kind]
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError("json_schema needs a 'json_schema' object with a 'name' (and a 'schema')")
        elif key is not None and not isinstance(value.get(key), str):
            raise ValueError(f"{kind} needs a string '{key}'")
        return value

    def tool_choice_problem(self) -> str | None:
        """Why ``tool_choice`` does not fit ``tools`` (OpenAI answers these with a 400), or None."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            return "tool_choice 'required' or a named function needs tools"
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if all(tool["function"]["name"] != name for tool in self.tools):
                return f"tool_choice names the function {name!r}, which is not in tools"
        return None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.functions:
            raise UnsupportedParameter("functions", "the deprecated functions API is not supported; use tools")
        if self.function_call not in (None, "none", "auto"):
            raise UnsupportedParameter("function_call", "the deprecated functions API is not supported; use tools")
        if self.modalities not in (None, ["text"]):
            raise UnsupportedParameter("modalities", "only the text modality is supported")
        if self.audio:
            raise UnsupportedParameter("audio", "audio output is not supported")
        if self.prediction:
            raise UnsupportedParameter("prediction", "predicted outputs are not supported")
        if self.web_search_options is not None:
            raise UnsupportedParameter("web_search_options", "web search is not supported")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise UnsupportedParameter("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = list[Annotated[int, Field(ge=0, le=2**31 - 1)]]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT, description="0 with echo: score the prompt only")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix (fill-in-the-middle) is not supported by this model")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise UnsupportedParameter("prompt", "the prompt list is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def prompt_count(self) -> int:
        return len(self.prompts())
