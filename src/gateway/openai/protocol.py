"""Pydantic models of the OpenAI request bodies this gateway accepts.

Validation happens once per request at the HTTP boundary. Parameters the backends cannot honour are accepted
at their default values and rejected with a 400 naming them otherwise: silence would be a wrong answer.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.interface import SamplingOptions
from gateway.openai.parameters import (
    MAX_TOKENS_LIMIT,
    EmptyArray,
    InvalidText,
    MissingParameter,
    ParameterError,
    UnsupportedParameter,
    WholeInt,
    shown,
    unencodable_text,
)
from gateway.openai.tools import CHAT_TOOLS, check_function_tools, check_tool_choice, tool_choice_problem

MAX_STOP_SEQUENCES = 16
RESPONSE_FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
"""``response_format`` types and the key each one needs; ``regex`` and ``ebnf`` are extensions."""
TEXT_PART_TYPES = ("text",)
TEXT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})
"""A text part's fields; ``prompt_cache_breakpoint`` is a caching hint for OpenAI's service, taken and ignored."""
UNSUPPORTED_PART_TYPES = ("input_audio", "file", "refusal")
"""Content parts OpenAI defines that these models cannot take: a 400 that says so, not "invalid"."""
IMAGE_PART_FIELDS = frozenset({"type", "image_url"})
IMAGE_URL_FIELDS = frozenset({"url", "detail"})
IMAGE_DETAILS = ("low", "high", "auto")
"""An ``image_url`` part's fields; whether the served model takes images is the backend's to say (a 400 if not)."""
THINKING_SWITCHES = ("thinking", "enable_thinking", "drop_thinking")


class _Body(BaseModel):
    """Strict: a string is never read as a number or a boolean, nor a boolean as a number (OpenAI answers
    those with ``invalid_type``). ``null_means_default`` lists the fields OpenAI declares nullable whose
    default here is not None: ``null`` gives the default."""

    model_config = ConfigDict(extra="forbid", strict=True)
    null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.null_means_default:
            nulls = [k for k in cls.null_means_default if k in data and data[k] is None]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


class _Request(_Body):
    """A whole request body: its text must be encodable before anything else looks at it."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        where = unencodable_text(data)
        if where is not None:
            raise InvalidText(where)
        return data


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content; either is accepted")
    prefix: bool | None = Field(
        None, description="DeepSeek's prefix completion: the final assistant message is continued, not answered"
    )
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            if not value:
                raise EmptyArray("", "an array of content parts needs at least one part")
            for i, part in enumerate(value):
                kind = part.get("type")
                if kind in UNSUPPORTED_PART_TYPES:
                    raise UnsupportedParameter(
                        f"[{i}].type", f"content parts of type {shown(kind)} are not supported by this model; send text"
                    )
                if kind == "image_url":
                    _check_image_part(f"[{i}]", part)
                    continue
                if kind not in TEXT_PART_TYPES:
                    raise ParameterError(f"[{i}].type", f"expected 'text', got {shown(kind)}")
                if not isinstance(part.get("text"), str):
                    raise ParameterError(f"[{i}].text", "a text content part needs a string 'text'")
                extra = sorted(set(part) - TEXT_PART_FIELDS)
                if extra:
                    raise ParameterError(f"[{i}].{extra[0]}", "unknown field in a text content part")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _function_calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(value or ()):
            kind = call.get("type")
            if kind == "custom":
                raise UnsupportedParameter(f"[{i}].type", "custom tool calls are not supported; use function tools")
            if kind != "function":
                raise ParameterError(f"[{i}].type", f"expected 'function', got {shown(kind)}")
            if not isinstance(call.get("id"), str):
                raise MissingParameter(f"[{i}].id", "a tool call needs a string id")
            function = call.get("function")
            if not isinstance(function, dict):
                raise ParameterError(f"[{i}].function", 'expected {"name": ..., "arguments": ...}')
            for key in ("name", "arguments"):
                if not isinstance(function.get(key), str):
                    raise ParameterError(f"[{i}].function.{key}", "expected a string")
        return value

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.role == "function":
            raise UnsupportedParameter("role", "the deprecated 'function' role is not supported; use 'tool'")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise MissingParameter("content", f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise MissingParameter("tool_call_id", "a tool message needs tool_call_id")
        if self.audio is not None:
            raise UnsupportedParameter("audio", "audio in messages is not supported")
        if self.role != "user" and isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.get("type") == "image_url":
                    raise ParameterError(f"content[{i}].type", "image parts are only allowed in user messages")
        if self.function_call is not None:
            raise UnsupportedParameter("function_call", "the deprecated functions API is not supported; use tools")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(part["text"] for part in self.content if part.get("type") == "text")


def _check_image_part(where: str, part: dict[str, Any]) -> None:
    """An ``image_url`` content part as OpenAI defines it: ``{"type", "image_url": {"url", "detail"?}}``."""
    extra = sorted(set(part) - IMAGE_PART_FIELDS)
    if extra:
        raise ParameterError(f"{where}.{extra[0]}", "unknown field in an image_url content part")
    image = part.get("image_url")
    if not isinstance(image, dict):
        raise ParameterError(f"{where}.image_url", 'expected {"url": ..., "detail": ...}')
    extra = sorted(set(image) - IMAGE_URL_FIELDS)
    if extra:
        raise ParameterError(f"{where}.image_url.{extra[0]}", "unknown field in image_url")
    url = image.get("url")
    if not isinstance(url, str) or not url:
        raise MissingParameter(f"{where}.image_url.url", "an image_url part needs a url (a data URL or an http(s) URL)")
    detail = image.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise ParameterError(f"{where}.image_url.detail", f"expected 'low', 'high' or 'auto', got {shown(detail)}")


class ThinkingSwitch(_Body):
    """DeepSeek's thinking toggle: ``{"type": "enabled"}`` or ``{"type": "disabled"}``."""

    type: Literal["enabled", "disabled"]

    @property
    def enabled(self) -> bool:
        return self.type == "enabled"


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Sampling(_Request):
    """Fields shared by chat and completions."""

    null_means_default: ClassVar[frozenset[str]] = frozenset({"stream", "n"})

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: WholeInt | None = Field(None, ge=-1, description="extension: sample among the k most likely tokens")
    seed: WholeInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: WholeInt = Field(1, ge=1, le=128)
    user: str | None = None
    ignore_eos: bool = Field(False, description="extension: generate until max_tokens even past end-of-sequence")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[WholeInt, Field(ge=-100, le=100)]] | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="extension (vLLM, LMDeploy)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension (vLLM, LMDeploy)")
    min_tokens: WholeInt | None = Field(None, ge=0, description="extension: generate at least this many tokens")
    skip_special_tokens: bool = Field(True, description="extension: drop special tokens from the text")
    service_tier: Literal["auto", "default", "flex", "priority", "fast", "scale"] | None = Field(
        None,
        description="auto (or none): the API key's default tier; fast: priority, as OpenAI serves it; a tier the "
        "key may not use (scale, which this gateway does not have, included): its default",
    )
    priority: WholeInt = Field(
        0, ge=-(2**31), lt=2**31, description="extension (vLLM): within a service tier, lower is served first"
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ParameterError("", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            for i, sequence in enumerate(value):
                if not sequence:
                    raise ParameterError(f"[{i}]", "stop sequences must be non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def top_k_value(self) -> int | None:
        if self.top_p == 0:
            return 1  # nucleus of mass 0: the most likely token alone (engines take top_p in (0, 1] only)
        return None if self.top_k in (None, 0, -1) else self.top_k

    def top_p_value(self) -> float | None:
        return None if self.top_p == 0 else self.top_p

    def sampling_options(self, *, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p_value(),
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
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            skip_special_tokens=self.skip_special_tokens,
        )


class ChatCompletionRequest(_Sampling):
    null_means_default: ClassVar[frozenset[str]] = frozenset({"stream", "n", "logprobs"})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: WholeInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: WholeInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None,
        description='text, json_object, json_schema; extensions: {"type": "regex", "regex": ...}, '
        '{"type": "ebnf", "ebnf": ...}',
    )
    reasoning_effort: str | WholeInt | None = Field(
        None, description="none, minimal, low, medium, high, xhigh, max, or (extension) an integer from 1 to 100"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(None, description='extension: e.g. {"thinking": true}')
    thinking: ThinkingSwitch | None = Field(None, description='DeepSeek\'s switch: {"type": "enabled"|"disabled"}')
    user_id: str | None = Field(None, max_length=512, description="DeepSeek's end-user id (at most 512 characters)")
    # Accepted at their defaults only (see the validator).
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Hints for OpenAI's own service, accepted and not acted on.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        check_function_tools(value, CHAT_TOOLS)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        check_tool_choice(value, CHAT_TOOLS)
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type")
        if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:
            raise ParameterError(".type", f"expected one of {', '.join(RESPONSE_FORMATS)}, got {shown(kind)}")
        key = RESPONSE_FORMATS[kind]
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict):
                raise ParameterError(".json_schema", "expected an object with a 'name' (and a 'schema')")
            if not isinstance(spec.get("name"), str):
                raise ParameterError(".json_schema.name", "expected a string")
            if spec.get("schema") is not None and not isinstance(spec["schema"], dict):
                raise ParameterError(".json_schema.schema", "expected a JSON Schema object")
        elif key is not None and not isinstance(value.get(key), str):
            raise ParameterError(f".{key}", f"{kind} needs a string '{key}'")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _boolean_switches(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in THINKING_SWITCHES:
            if value is not None and key in value and not isinstance(value[key], bool):
                raise ParameterError(f".{key}", f"expected true or false, got {shown(value[key])}")
        return value

    def tool_choice_problem(self) -> str | None:
        """Why ``tool_choice`` does not fit ``tools`` (OpenAI answers these with a 400), or None."""
        return tool_choice_problem(self.tool_choice, self.tools, CHAT_TOOLS)

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.functions:
            raise UnsupportedParameter("functions", "the deprecated functions API is not supported; use tools")
        if self.function_call not in (None, "none", "auto"):
            raise UnsupportedParameter("function_call", "the deprecated functions API is not supported; use tools")
        if self.modalities and "audio" in self.modalities:
            raise UnsupportedParameter("modalities", "audio output is not supported; only text is")
        if self.audio:
            raise UnsupportedParameter("audio", "audio output is not supported")
        if self.prediction:
            raise UnsupportedParameter("prediction", "predicted outputs are not supported")
        if self.web_search_options is not None:
            raise UnsupportedParameter("web_search_options", "web search is not supported")
        if self.moderation is not None:
            raise UnsupportedParameter("moderation", "moderation is not supported")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise UnsupportedParameter("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = list[Annotated[WholeInt, Field(ge=0, le=2**31 - 1)]]


class CompletionRequest(_Sampling):
    null_means_default: ClassVar[frozenset[str]] = frozenset({"stream", "n", "echo", "max_tokens"})

    prompt: str | list[str] | TokenIds | list[Annotated[TokenIds, Field(min_length=1)]] | None = Field(
        description="null is OpenAI's default, the start of a document: generation from an empty prompt"
    )
    max_tokens: WholeInt | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT, description="0 with echo: score the prompt only")
    logprobs: WholeInt | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: WholeInt | None = Field(None, ge=1, le=128)

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix (fill-in-the-middle) is not supported by this model")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise EmptyArray("prompt", "the prompt list is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if prompt is None:
            return [""]
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
