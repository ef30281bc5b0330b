"""The normalized request in LMDeploy's words: which route, which body, which fields never leave the gateway.

Chat goes to ``/v1/chat/completions`` (LMDeploy's chat template, reasoning and tool parsers). Text and token-id
prompts go to ``/generate``: LMDeploy's ``/v1/completions`` takes no token ids, has no logprobs, silently runs
``n > 1`` as one choice and reports usage only at the very end, while ``/generate`` reports exact token counts in
every chunk, so usage stays exact when the gateway ends a stream at a stop string.

The body is built from scratch from known fields, so client fields LMDeploy treats as internal (``session_id``,
``migration_request``, ``with_cache``, ``preserve_cache``, ``input_ids`` next to messages, ...) can never reach
a node. Stop strings are not forwarded either: LMDeploy turns each into the ids of every vocabulary token that
*contains* it (or ignores it when it is several tokens), which cuts text OpenAI would keep; the gateway matches
them on the streamed text instead (``backends.engine.stop.StopMatcher``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.errors import ContextLengthExceededError, InvalidRequestError
from backends.interface import IMAGES_FEATURE, GenerateRequest

CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/generate"
COMPLETIONS_PATH = "/v1/completions"  # text prompts through an LMDeploy proxy, which has no /generate

SUPPORTED_SAMPLING = frozenset({"min_tokens", "min_p", "repetition_penalty", "skip_special_tokens"})
SUPPORTED_FEATURES = frozenset(
    {"tools", "tool_choice", "response_format", "thinking", "reasoning_effort", "chat_template_kwargs", IMAGES_FEATURE}
)
"""Images among them: a backend whose nodes serve no vision model refuses them itself (``images.py``)."""
REASONING_EFFORTS = frozenset({"low", "medium", "high", "max"})  # what LMDeploy accepts
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema", "regex_schema"})
DEFAULT_OUTPUT_BOUND = 32768
"""``max_tokens`` sent when neither the request nor the backend's ``max_model_len`` gives a bound."""


@dataclass(slots=True)
class UpstreamPlan:
    """What to send for each choice: the route and a body template; choice ``i`` gets ``seed + i``."""

    path: str
    body: dict[str, Any]
    seed: int | None
    chat: bool
    want_top_logprobs: int  # how many alternatives the client asked for (LMDeploy is asked for at least one)
    vision: bool = False  # the messages carry images: only a node serving a vision model may take them

    def body_for(self, index: int, model: str) -> dict[str, Any]:
        body = dict(self.body)
        if self.chat or self.completions:
            body["model"] = model
        if self.seed is not None:
            body["seed"] = self.seed + index
        return body

    def via_proxy(self) -> UpstreamPlan:
        """The plan for an LMDeploy proxy, which serves chat and ``/v1/completions`` but not ``/generate``: text
        prompts go to ``/v1/completions`` (usage only at the end); token-id prompts cannot go at all."""
        if self.chat:
            return self
        if "input_ids" in self.body:
            raise InvalidRequestError(
                "token-id prompts are not supported through an LMDeploy proxy (it does not serve /generate); "
                "send the prompt as text",
                param="prompt",
            )
        body = {**self.body, "stream_options": {"include_usage": True}}
        return UpstreamPlan(COMPLETIONS_PATH, body, self.seed, False, 0, self.vision)

    @property
    def completions(self) -> bool:
        return self.path == COMPLETIONS_PATH


def output_bound(request: GenerateRequest, max_model_len: int | None) -> int:
    """The explicit ``max_tokens`` every upstream request carries.

    LMDeploy's own default is the rest of the session; the gateway sends the client's bound or, without one, the
    node's session length (the prompt takes at least one token, so LMDeploy still stops at the session's end).
    With ``fit_context`` the client's bound is cut to the session length the same way.
    """
    asked = request.sampling.max_tokens
    if asked is None:
        return max_model_len or DEFAULT_OUTPUT_BOUND
    if max_model_len is not None and request.sampling.fit_context:
        return min(asked, max_model_len)  # LMDeploy ends the output where the session ends ("length")
    if max_model_len is not None and asked >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked} "
            "tokens for the completion alone. Please reduce max_tokens.",
            param="max_tokens",
        )
    return asked


def plan_request(request: GenerateRequest, max_model_len: int | None) -> UpstreamPlan:
    """Validates what LMDeploy cannot honour for this kind of prompt and builds the upstream body."""
    sampling = request.sampling
    body: dict[str, Any] = {"stream": True, "max_tokens": output_bound(request, max_model_len)}
    if sampling.temperature is not None:
        body["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    if sampling.top_k is not None:
        body["top_k"] = sampling.top_k
    if sampling.min_p:
        body["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        body["repetition_penalty"] = sampling.repetition_penalty
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if not sampling.skip_special_tokens:
        body["skip_special_tokens"] = False
    if request.kind == "chat":
        return _chat_plan(request, body)
    return _generate_plan(request, body)


def _chat_plan(request: GenerateRequest, body: dict[str, Any]) -> UpstreamPlan:
    sampling = request.sampling
    body["messages"] = request.messages
    body["stream_options"] = {"include_usage": True}
    body["return_token_ids"] = True  # token ids per chunk: exact completion tokens even when the gateway stops early
    if sampling.min_tokens:
        body["min_new_tokens"] = sampling.min_tokens
    if sampling.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = max(1, sampling.top_logprobs)
    if request.tools:
        body["tools"] = request.tools
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.response_format is not None:
        kind = request.response_format.get("type", "text")
        if kind not in RESPONSE_FORMATS:
            raise InvalidRequestError(
                f"response_format type {kind!r} is not supported; use one of {sorted(RESPONSE_FORMATS)}",
                param="response_format",
            )
        if kind != "text":
            body["response_format"] = request.response_format
    template_kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:  # LMDeploy's templates read either name, depending on the model family
        template_kwargs["enable_thinking"] = request.thinking
        template_kwargs["thinking"] = request.thinking
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    effort = request.reasoning_effort
    if effort is not None and effort not in ("none", "minimal"):
        if effort not in REASONING_EFFORTS:
            allowed = sorted(REASONING_EFFORTS)
            raise InvalidRequestError(
                f"reasoning_effort must be one of {allowed} for this backend", param="reasoning_effort"
            )
        body["reasoning_effort"] = effort
    return UpstreamPlan(CHAT_PATH, body, sampling.seed, True, sampling.top_logprobs if sampling.logprobs else 0)


def _generate_plan(request: GenerateRequest, body: dict[str, Any]) -> UpstreamPlan:
    sampling = request.sampling
    if sampling.seed is not None:
        raise InvalidRequestError(
            "seed is not supported for completions by the LMDeploy backend (LMDeploy's /generate takes no seed)",
            param="seed",
        )
    if (request.echo and sampling.logprobs) or sampling.max_tokens == 0:
        raise InvalidRequestError(
            "scoring a prompt (echo with logprobs, or max_tokens 0) is not supported by the LMDeploy backend: "
            "LMDeploy's servers return no per-token prompt logprobs (only /get_ppl's aggregate perplexity)",
            param="echo" if request.echo and sampling.logprobs else "max_tokens",
        )
    if sampling.logprobs:
        raise InvalidRequestError(
            "logprobs are not supported for completions by the LMDeploy backend (LMDeploy returns token ids "
            "without token text)",
            param="logprobs",
        )
    if sampling.min_tokens:
        raise InvalidRequestError(
            "min_tokens is not supported for completions by the LMDeploy backend", param="min_tokens"
        )
    if request.echo and request.prompt is None:
        raise InvalidRequestError("echo with token-id prompts is not supported by the LMDeploy backend", param="echo")
    if request.prompt is not None:
        if not request.prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        body["prompt"] = request.prompt
    else:
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        body["input_ids"] = request.prompt_token_ids
    return UpstreamPlan(GENERATE_PATH, body, None, False, 0)
