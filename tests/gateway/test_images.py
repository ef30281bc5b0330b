"""Images through every API on the reference engine, which takes them as DeepInfer takes V4.1's images: accepted,
counted exactly (deepseek-recipe's own count is the reference), fed to sampling, limited per request with a 400 or
413 naming the part, and freed when the client leaves while they are being decoded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import deepseek_recipe as recipe
import httpx
import openai
import pytest

from backends.config import ImageSettings, ReferenceBackendConfig
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.deepseek.images import ImageResolution
from backends.engine.backend import EngineBackend
from backends.interface import IMAGE_TOKENS_BOUND
from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs
from gateway.admission import behind_flow_control
from gateway.capabilities import unwrapped
from gateway.config import GatewayConfig

from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until
from ..image_files import b64, data_url, declared_png, noisy_png, png
from .test_disconnect import _raw_request

STRICT = "strict-images"
TINY = "tiny-images"
STRICT_LIMITS = {"max_images": 2, "max_image_bytes": 40_000, "max_total_bytes": 60_000, "max_pixels": 1_000_000}
RED = png(640, 480, (220, 30, 30))
BLUE = png(640, 480, (30, 30, 220))
QUESTION = "What is in this picture?"
THINKING_OFF = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def images_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        backends=[
            {"name": "reference", "kind": "reference", "prefix_cache_tokens": 8192, "prefix_cache_block_size": 16},
            {"name": "strict", "kind": "reference", "images": STRICT_LIMITS},
            {"name": "tiny", "kind": "reference", "max_model_len": 128},
        ],
        models=[
            {"name": MODEL, "backends": ["reference"]},
            {"name": STRICT, "backends": ["strict"]},
            {"name": TINY, "backends": ["tiny"]},
        ],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


@pytest.fixture(scope="module")
def chat(images_gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{images_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(images_gateway: RunningGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=images_gateway.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(images_gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=images_gateway.base_url, timeout=60) as client:
        yield client


def image_message(*images: bytes, detail: str | None = None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    for image in images:
        url: dict[str, Any] = {"url": data_url(image)}
        if detail is not None:
            url["detail"] = detail
        parts.append({"type": "image_url", "image_url": url})
    return {"role": "user", "content": parts}


def library_prompt_tokens(gateway: RunningGateway, messages: list[dict[str, Any]]) -> int:
    """deepseek-recipe's count of a chat's prompt on the reference tokenizer: its own converter, encoding and image
    resolution (placeholder plus image_token_adjustment)."""
    body = {"model": "DeepSeek-V4.1-Flash", "messages": messages, **THINKING_OFF}
    conversation = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions()).conversation
    tokenizer = unwrapped(gateway.state.backends["reference"]).driver.engine.tokenizer  # type: ignore[attr-defined]
    encoding = recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_str(tokenizer.to_str()))
    sources = [source for message in conversation.messages for source in message.image_sources]
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    images = resolver.resolve(sources, recipe.ImageQuota())
    return len(encoding.encode(conversation)) + images.image_token_adjustment()


# ---- accepted and counted -------------------------------------------------------------------------------------


@pytest.mark.parametrize("detail", ["low", "high", None])
def test_chat_counts_an_images_tokens_as_the_library_does(
    images_gateway: RunningGateway, chat: openai.OpenAI, detail: str | None
) -> None:
    messages = [image_message(RED, BLUE, detail=detail)]
    expected = library_prompt_tokens(images_gateway, messages)
    reply = chat.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        seed=1,
        extra_body=THINKING_OFF,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == expected
    chunks = list(
        chat.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=THINKING_OFF,
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == expected
    text_only = chat.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=1, extra_body=THINKING_OFF
    )
    assert text_only.usage is not None and expected > text_only.usage.prompt_tokens + 2 * 64


def test_the_same_image_gives_the_same_reply_and_another_image_another(chat: openai.OpenAI) -> None:
    def reply(image: bytes) -> str:
        answer = chat.chat.completions.create(
            model=MODEL,
            messages=[image_message(image, detail="low")],  # type: ignore[list-item]
            max_tokens=24,
            seed=11,
            temperature=1.0,
        )
        return answer.choices[0].message.content or ""

    red = reply(RED)
    assert reply(png(640, 480, (220, 30, 30))) == red  # the same bytes, sent again
    assert reply(BLUE) != red


def test_responses_take_input_images_streamed_and_not(images_gateway: RunningGateway, chat: openai.OpenAI) -> None:
    url = data_url(RED)
    expected = library_prompt_tokens(
        images_gateway, [{"role": "user", "content": [{"type": "text", "text": QUESTION}, _chat_image(url, "low")]}]
    )
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": url, "detail": "low"}]
    items: Any = [{"role": "user", "content": content}]
    response = chat.responses.create(model=MODEL, input=items, max_output_tokens=8, store=False)
    assert response.usage is not None and response.usage.input_tokens == expected
    events = list(chat.responses.create(model=MODEL, input=items, max_output_tokens=8, store=False, stream=True))
    final = events[-1].response  # type: ignore[union-attr]  # response.incomplete: max_output_tokens was reached
    assert final.usage is not None and final.usage.input_tokens == expected


def test_messages_take_base64_image_blocks_streamed_and_not(
    images_gateway: RunningGateway, claude: anthropic.Anthropic
) -> None:
    expected = library_prompt_tokens(
        images_gateway,
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}, _chat_image(data_url(BLUE), None)]}],
    )
    source = {"type": "base64", "media_type": "image/png", "data": b64(BLUE)}
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}
    ]
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=messages)
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages) as stream:
        final = stream.get_final_message()
    for usage in (message.usage, final.usage):  # Anthropic's input_tokens leave out the cache reads
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == expected


def test_count_tokens_counts_an_images_tokens(claude: anthropic.Anthropic) -> None:
    source = {"type": "base64", "media_type": "image/png", "data": b64(RED)}
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}
    ]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    usage = claude.messages.create(model=MODEL, max_tokens=1, messages=messages).usage
    assert counted == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _chat_image(url: str, detail: str | None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image}


def test_an_image_prompt_over_the_context_is_a_context_length_error(http: httpx.Client) -> None:
    body = {"model": TINY, "messages": [image_message(RED, detail="low")], "max_tokens": 4}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"


def test_prefix_cache_hits_stop_at_an_image_that_differs(http: httpx.Client) -> None:
    def hit(image: bytes) -> tuple[int, int]:
        body = {"model": MODEL, "messages": [image_message(image, detail="low")], "max_tokens": 1}
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
        return usage["prompt_cache_hit_tokens"], usage["prompt_tokens"]

    purple = png(640, 480, (120, 20, 160))
    green = png(640, 480, (20, 160, 20))
    hit(purple)
    again, prompt = hit(purple)
    assert again >= prompt - 16, "the same image: every whole block is cached"
    other, _ = hit(green)
    assert other < 32, "another image: nothing past the text before it is cached"


# ---- refused, naming the part ---------------------------------------------------------------------------------


BROKEN = b"\x89PNG\r\n\x1a\nthis is not an image"


@pytest.mark.parametrize(
    ("model", "content", "status", "param", "code"),
    [
        pytest.param(MODEL, [data_url(BROKEN)], 400, "messages[0].content[1]", "invalid_image", id="broken"),
        pytest.param(
            MODEL, ["http://127.0.0.1:9/cat.png"], 400, "messages[0].content[1]", "image_url_disabled", id="url"
        ),
        pytest.param(STRICT, [data_url(RED)] * 3, 400, "messages[0].content[3]", "too_many_images", id="too-many"),
        pytest.param(
            STRICT, [data_url(noisy_png(300, 150))], 413, "messages[0].content[1]", "image_too_large", id="over-bytes"
        ),
        pytest.param(
            STRICT,
            [data_url(noisy_png(120, 100, n)) for n in (1, 2)],
            413,
            "messages[0].content[2]",
            "images_too_large",
            id="over-total",
        ),
        pytest.param(
            STRICT, [data_url(declared_png(5000, 5000))], 400, "messages[0].content[1]", "image_too_large", id="pixels"
        ),
    ],
)
def test_a_bad_image_is_refused_naming_its_part(
    http: httpx.Client, model: str, content: list[str], status: int, param: str, code: str
) -> None:
    parts = [{"type": "text", "text": QUESTION}, *({"type": "image_url", "image_url": {"url": u}} for u in content)]
    answer = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": parts}]})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")


def test_an_image_outside_a_user_message_is_refused(http: httpx.Client) -> None:
    message = {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]}
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [message]})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages[0].content[0].type"


def test_responses_and_messages_name_a_broken_images_part(http: httpx.Client) -> None:
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(BROKEN)}]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}], "store": False}
    answer = http.post("/v1/responses", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input[0].content[1]"
    source = {"type": "base64", "media_type": "image/png", "data": b64(BROKEN)}
    blocks = [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}
    answer = http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in answer.json()["error"]["message"]


# ---- a client that leaves while its images decode -------------------------------------------------------------


class DecodeGate:
    """Test double of a slow image decode: holds each decode (on the preparation thread, with its permit) until
    the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, source: recipe.ImageSource) -> None:
        self.entered.set()
        assert self.opened.wait(60), "the test never opened the gate"


@pytest.fixture
def gated() -> Iterator[tuple[RunningGateway, ImageResolution, DecodeGate]]:
    gate = DecodeGate()
    resolution = ImageResolution(ImageSettings(max_concurrent_decodes=1), before_decode=gate)

    def engine() -> ReferenceEngine:
        return ReferenceEngine.from_engine_args(ReferenceEngineArgs())

    backends = {  # as the registry builds them, behind admission; one without an image resolver
        name: behind_flow_control(
            EngineBackend(name, "reference", engine, DeepSeekV41ChatTemplate(), images=images),
            ReferenceBackendConfig(name=name),
        )
        for name, images in (("reference", resolution), ("text-only", None))
    }
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference"}, {"name": "text-only", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}, {"name": "text-only", "backends": ["text-only"]}],
    )
    running = start_gateway(config, backends=backends)
    yield running, resolution, gate
    gate.opened.set()
    stop_gateway(running)


def test_a_client_that_leaves_while_its_images_decode_frees_everything(
    gated: tuple[RunningGateway, ImageResolution, DecodeGate],
) -> None:
    running, resolution, gate = gated
    tiny = png(16, 16)  # a data URL of a few hundred characters: prepared off the event loop all the same
    body = {"model": MODEL, "messages": [image_message(tiny)], "max_tokens": 4, "stream": True}
    sock = _raw_request(running.base_url, body)
    assert gate.entered.wait(30)
    assert resolution.decoding == 1
    assert running.metric("gateway_admission_in_flight", backend="reference") == 1
    sock.close()
    assert wait_until(lambda: running.metric("gateway_requests_total", status="499") == 1)
    gate.opened.set()
    assert wait_until(lambda: resolution.decoding == 0)
    assert running.metric("gateway_admission_in_flight", backend="reference") == 0
    assert running.engine_idle() and running.engine_tokens() == 0, "the engine never saw the request"
    # The one decode permit is free again: the next image request decodes and completes.
    with httpx.Client(base_url=running.base_url, timeout=20) as http:  # a leaked permit: it would wait forever
        answer = http.post("/v1/chat/completions", json={**body, "stream": False})
    assert answer.status_code == 200
    assert running.engine_tokens() > 0


def test_a_backend_without_the_images_feature_refuses_them_naming_the_part(
    gated: tuple[RunningGateway, ImageResolution, DecodeGate],
) -> None:
    running, _, _ = gated
    body = {"model": "text-only", "messages": [image_message(RED)], "max_tokens": 4}
    answer = httpx.post(f"{running.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages[0].content[1]"
    assert "not supported" in answer.json()["error"]["message"]


# ---- budgets --------------------------------------------------------------------------------------------------


def test_a_budget_reserves_an_image_at_its_token_bound_not_its_base64_size() -> None:
    """A 270 KB image is 360 KB of base64, 90,000 tokens at the body estimate's 4 bytes a token; reserved at the
    most an image can take (IMAGE_TOKENS_BOUND), it leaves the rest of the key's budget to other requests."""
    config = GatewayConfig(
        server={"auth": {"api_keys": [{"key": "sk-images", "name": "images", "tokens_per_minute": 100_000}]}},
        backends=[{"name": "reference", "kind": "reference"}],
        models=[{"name": MODEL, "backends": ["reference"]}],
    )
    running = start_gateway(config, budget_clock=lambda: 0.0)  # a frozen clock: the budget does not refill
    try:
        body = {"model": MODEL, "messages": [image_message(noisy_png(300, 300))], "max_tokens": 4}
        answer = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer sk-images"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        reserved = 100_000 - int(answer.headers["x-ratelimit-remaining-tokens"])
        assert IMAGE_TOKENS_BOUND <= reserved <= IMAGE_TOKENS_BOUND + 200
        assert answer.json()["usage"]["prompt_tokens"] <= IMAGE_TOKENS_BOUND + 50
    finally:
        stop_gateway(running)
