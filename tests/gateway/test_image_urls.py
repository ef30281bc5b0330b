"""http(s) image URLs through the gateway, with the official SDKs: off by default (a 400 naming the part); when on,
never a connection to a listener on 127.0.0.1 whatever spelling the allowlist names it by; a hung host bounded by
the fetch timeout; an allowed URL's image counted like the same image sent inline."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from backends.config import ImageSettings, ImageUrlsConfig, ReferenceBackendConfig
from backends.deepseek.chat import DeepSeekV41ChatTemplate
from backends.deepseek.images import ImageResolution
from backends.engine.backend import EngineBackend
from backends.reference.engine import ReferenceEngine, ReferenceEngineArgs
from gateway.admission import behind_flow_control
from gateway.config import GatewayConfig

from ..backends.deepseek.test_image_fetch import HoldingListener, ImageHost
from ..conftest import MODEL, RunningGateway, start_gateway, stop_gateway, wait_until
from ..image_files import data_url, png

LOOPBACK = "loopback-allowed"
LOOPBACK_SPELLINGS = ("localhost", "127.0.0.1", "2130706433", "0177.0.0.1", "0x7f.1", "[::ffff:127.0.0.1]")
PART = "messages[0].content[1]"


@pytest.fixture
def listener() -> Iterator[HoldingListener]:
    running = HoldingListener()
    yield running
    running.close()


@pytest.fixture(scope="module")
def url_gateway() -> Iterator[RunningGateway]:
    """The default model (URLs off), and one whose allowlist names loopback in every spelling."""
    allowed = [host.strip("[]") for host in LOOPBACK_SPELLINGS]
    config = GatewayConfig(
        backends=[
            {"name": "reference", "kind": "reference"},
            {"name": "loopback", "kind": "reference", "image_urls": {"allowed_hosts": allowed}},
        ],
        models=[{"name": MODEL, "backends": ["reference"]}, {"name": LOOPBACK, "backends": ["loopback"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def sdk(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def with_image(url: str) -> list[Any]:
    parts = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def refused(client: openai.OpenAI, model: str, url: str) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=with_image(url), max_tokens=4)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == PART and caught.value.status_code == 400
    return body


def test_image_urls_are_off_by_default_on_every_api(url_gateway: RunningGateway, listener: HoldingListener) -> None:
    url = f"http://127.0.0.1:{listener.port}/cat.png"
    body = refused(sdk(url_gateway), MODEL, url)
    assert body["code"] == "image_url_disabled" and "not enabled" in body["message"]
    claude = anthropic.Anthropic(base_url=url_gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    block = {"type": "image", "source": {"type": "url", "url": url}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])
    assert "messages[0].content[0]" in caught.value.message and "not enabled" in caught.value.message
    part = {"type": "input_image", "image_url": url}
    with pytest.raises(openai.BadRequestError) as responses:
        sdk(url_gateway).responses.create(model=MODEL, input=[{"role": "user", "content": [part]}])
    assert isinstance(responses.value.body, dict) and responses.value.body["param"] == "input[0].content[0]"
    assert listener.accepted == 0


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_an_allowlisted_loopback_host_is_never_connected(
    url_gateway: RunningGateway, listener: HoldingListener, host: str
) -> None:
    body = refused(sdk(url_gateway), LOOPBACK, f"http://{host}:{listener.port}/cat.png")
    assert body["code"] == "image_url_refused"
    assert listener.accepted == 0


@pytest.fixture(scope="module")
def hooked() -> Iterator[tuple[RunningGateway, ImageResolution]]:
    """A gateway whose image URLs may reach 127.0.0.1 through the test-only hook (the real rule never lets them)."""
    resolution = ImageResolution(ImageSettings(), ImageUrlsConfig(allowed_hosts=["127.0.0.1"], fetch_timeout=0.5))
    resolution.urls.allow_destinations_for_tests(lambda host, address: address == "127.0.0.1")

    def engine() -> ReferenceEngine:
        return ReferenceEngine.from_engine_args(ReferenceEngineArgs())

    backend = EngineBackend("reference", "reference", engine, DeepSeekV41ChatTemplate(), images=resolution)
    config = GatewayConfig(
        backends=[{"name": "reference", "kind": "reference"}], models=[{"name": MODEL, "backends": ["reference"]}]
    )
    running = start_gateway(
        config, backends={"reference": behind_flow_control(backend, ReferenceBackendConfig(name="reference"))}
    )
    yield running, resolution
    stop_gateway(running)


def test_a_hung_image_host_is_bounded_by_the_fetch_timeout(
    hooked: tuple[RunningGateway, ImageResolution], listener: HoldingListener
) -> None:
    running, resolution = hooked
    body = refused(sdk(running), MODEL, f"http://127.0.0.1:{listener.port}/cat.png")
    assert body["code"] == "image_url_timeout" and "did not deliver" in body["message"]
    assert listener.accepted == 1 and resolution.urls.abandoned == 1
    listener.release()
    assert wait_until(lambda: resolution.urls.abandoned == 0)


def test_an_allowed_url_is_counted_like_the_same_image_inline(hooked: tuple[RunningGateway, ImageResolution]) -> None:
    running, _ = hooked
    host = ImageHost()
    client = sdk(running)
    try:
        fetched = client.chat.completions.create(
            model=MODEL, messages=with_image(f"http://127.0.0.1:{host.server_port}/png"), max_tokens=4
        )
    finally:
        host.shutdown()
    inline = client.chat.completions.create(model=MODEL, messages=with_image(data_url(png(16, 8))), max_tokens=4)
    assert fetched.usage is not None and inline.usage is not None
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
