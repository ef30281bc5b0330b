"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the token ids a model sees, with vLLM's field names.

Evaluation harnesses (lm-eval's remote tokenizer) count context lengths with these instead of downloading the
model's tokenizer from a hub. Chat messages are encoded by the backend's own chat encoder, so the ids are exactly
the prompt ``/v1/chat/completions`` would send to the engine. Requests may leave out ``model`` (lm-eval's do):
the first configured model answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from backends.errors import BackendError, ModelNotFoundError
from backends.interface import GenerateRequest, TokenizingBackend
from gateway.capabilities import capability
from gateway.errors import APIError, api_error_from_backend
from gateway.gateway_state import GatewayState, gateway_state
from gateway.openai.protocol import ChatMessage, ThinkingSwitch

router = APIRouter(tags=["tokenizer"])

MAX_DETOKENIZE_TOKENS = 1_000_000
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, description="default: the first configured model")


class TokenizeRequest(_Body):
    """Either ``prompt`` (text) or ``messages`` (chat, encoded as for ``/v1/chat/completions``)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt (BOS), false for messages (the chat encoding writes BOS)"
    )
    add_generation_prompt: bool = Field(True, description="messages only; the V4.1 encoding always ends with it")
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | int | None = Field(
        None, description="messages only; as in /v1/chat/completions, it sets thinking mode and the prompt's effort"
    )
    thinking: ThinkingSwitch | None = Field(None, description="messages only; DeepSeek's switch, as in chat")
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


@contextmanager
def _counted(state: GatewayState, endpoint: str) -> Iterator[None]:
    """Counts the request in ``gateway_tokenizer_requests_total`` with the status it ends with."""
    status = 500
    try:
        yield
        status = 200
    except APIError as exc:
        status = exc.status
        raise
    except BackendError as exc:
        status = api_error_from_backend(exc).status
        raise
    finally:
        state.metrics.tokenizer_requests.labels(endpoint, str(status)).inc()


def _backend(state: GatewayState, model: str | None) -> tuple[str, TokenizingBackend]:
    """The model's first backend that can tokenize; 404 for an unknown model, 400 if none of its backends can."""
    names = state.router.model_names
    name = model if model is not None else (names[0] if names else "")
    name = state.router.aliases.get(name, name)
    if name not in names:
        raise ModelNotFoundError(f"The model '{name}' does not exist or you do not have access to it.")
    backends = state.router.backends_of(name)
    for backend in backends:
        tokenizing = capability(backend, TokenizingBackend)
        if tokenizing is not None:
            return name, tokenizing
    kinds = ", ".join(dict.fromkeys(b.kind for b in backends))
    raise APIError(400, f"the backends of model '{name}' ({kinds}) do not expose their tokenizer.", param="model")


def _check_chat_options(body: TokenizeRequest) -> None:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages.", param="prompt")
    if body.messages is None:
        for name in ("tools", "chat_template_kwargs", "reasoning_effort"):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} applies to messages only.", param=name)
        return
    if not body.add_generation_prompt:
        raise APIError(
            400,
            "add_generation_prompt=false is not supported: the chat encoding always ends with the assistant's turn.",
            param="add_generation_prompt",
        )
    if body.continue_final_message:
        raise APIError(400, "continue_final_message is not supported.", param="continue_final_message")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    with _counted(state, "tokenize"):
        _check_chat_options(body)
        name, backend = _backend(state, body.model)
        messages = body.messages
        generate = GenerateRequest(
            request_id=request.state.request_id,
            model=name,
            messages=[m.model_dump(exclude_none=True) for m in messages] if messages is not None else None,
            prompt=body.prompt,
            tools=body.tools,
            chat_template_kwargs=body.chat_template_kwargs,
            thinking=body.thinking.enabled if body.thinking is not None else None,
            reasoning_effort=body.reasoning_effort,
        )
        ids = await backend.tokenize(generate, add_special_tokens=body.add_special_tokens)
        info = backend.tokenizer_info()
        result: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = backend.token_strings(ids)
        return result


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    with _counted(state, "detokenize"):
        _, backend = _backend(state, body.model)
        return {"prompt": await backend.detokenize(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: Annotated[str | None, Query()] = None) -> dict[str, Any]:
    """The special tokens and limits a remote tokenizer client mirrors (lm-eval requires ``eos_token``).

    There is no ``chat_template``: the DeepSeek V4.1 encoding is code, not a Jinja template; send ``messages`` to
    ``/tokenize`` instead.
    """
    state = gateway_state(request)
    with _counted(state, "tokenizer_info"):
        _, backend = _backend(state, model)
        info = backend.tokenizer_info()
    return {
        "tokenizer_class": info.tokenizer_class,
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "pad_token": info.pad_token,
        "vocab_size": info.vocab_size,
        "model_max_length": info.max_model_len,
        "max_model_len": info.max_model_len,
    }
