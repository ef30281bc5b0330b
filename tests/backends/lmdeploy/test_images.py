"""Image parts through the LMDeploy backend: a text-only node (LMDeploy's real api_server) is recognised from its own
answer and images keep their clear 400; a vision node (a test double: none runs on a CPU) gets them, as base64
data URLs only, which LMDeploy's own parser reads; URL images obey the gateway's rule and never reach a node as
URLs."""

from __future__ import annotations

import base64
import http.server
import itertools
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from backends.deepseek.image_fetch import ImageUrlFetcher, ImageUrlSettings
from backends.errors import InvalidRequestError
from backends.interface import Delta, GenerateRequest
from backends.lmdeploy.images import base64_data_url, node_messages

from ...conftest import RunningGateway
from ...image_files import png
from ..deepseek.test_image_fetch import HoldingListener, ImageHost
from .conftest import PUBLIC_MODEL, running_backend
from .harness.server import MODEL_NAME, HarnessNode
from .harness.venv import ensure_harness_venv

_ids = itertools.count()
PNG = png(4, 2)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
PART = "messages[0].content[1]"


def image_chat(url: str, **part: Any) -> GenerateRequest:
    content = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": url, **part}}]
    return GenerateRequest(f"img{next(_ids)}", PUBLIC_MODEL, messages=[{"role": "user", "content": content}])


class VisionNodeDouble(http.server.ThreadingHTTPServer):
    """Test double of an LMDeploy api_server serving a vision model (no vision model runs on a CPU): /health,
    /v1/models, the vision probe, and a chat stream in LMDeploy's SSE shape that says how many images it got.
    Every chat body it receives is kept."""

    def __init__(self) -> None:
        self.chat_bodies: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _VisionNodeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def streamed_bodies(self) -> list[dict[str, Any]]:
        return [body for body in self.chat_bodies if body.get("stream")]


class _VisionNodeHandler(http.server.BaseHTTPRequestHandler):
    server: VisionNodeDouble
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({"status": "healthy", "message": ""})
        else:
            self._json({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.chat_bodies.append(body)
        images = sum(
            1
            for message in body["messages"]
            if isinstance(message["content"], list)
            for part in message["content"]
            if part["type"] == "image_url"
        )
        if not body.get("stream"):
            self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]})
            return
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": f"{images} image(s)"}}]},
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
        ]
        frames = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(frames)))
        self.end_headers()
        self.wfile.write(frames)

    def _json(self, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def vision_node() -> Iterator[VisionNodeDouble]:
    double = VisionNodeDouble()
    yield double
    double.shutdown()


@pytest.fixture
def listener() -> Iterator[HoldingListener]:
    running = HoldingListener()
    yield running
    running.close()


async def answer(backend: Any, request: GenerateRequest) -> str:
    return "".join([e.text async for e in backend.generate(request) if isinstance(e, Delta)])


async def refusal(backend: Any, request: GenerateRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await answer(backend, request)
    return caught.value


async def test_a_text_only_node_is_recognised_and_images_keep_the_clear_400(node: HarnessNode) -> None:
    async with running_backend([node.url]) as backend:
        assert backend.pool.nodes[0].vision is False  # LMDeploy's own answer to the probe
        error = await refusal(backend, image_chat(DATA_URL))
        assert error.param == PART and "not supported by this model" in error.message
        text = GenerateRequest("text", PUBLIC_MODEL, messages=[{"role": "user", "content": "Hello there"}])
        assert await answer(backend, text) == "Hello there"  # text is served as before


def test_through_the_gateway_a_text_only_node_keeps_the_clear_400(lm_gateway: RunningGateway) -> None:
    client = openai.OpenAI(base_url=f"{lm_gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages: Any = image_chat(DATA_URL).messages
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=PUBLIC_MODEL, messages=messages, max_tokens=4)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == PART and "not supported by this model" in body["message"]


async def test_images_go_only_to_the_node_that_serves_a_vision_model(
    node: HarnessNode, vision_node: VisionNodeDouble
) -> None:
    async with running_backend([node.url, vision_node.url]) as backend:
        assert [n.vision for n in backend.pool.nodes] == [False, True]
        for _ in range(3):
            assert await answer(backend, image_chat(DATA_URL, detail="low")) == "1 image(s)"
    assert len([body for body in vision_node.chat_bodies if not body.get("stream")]) == 1  # asked once
    sent = vision_node.streamed_bodies()
    assert len(sent) == 3
    assert sent[0]["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": DATA_URL}}


async def test_vision_off_refuses_images_without_asking_the_nodes(vision_node: VisionNodeDouble) -> None:
    async with running_backend([vision_node.url], vision="off") as backend:
        assert (await refusal(backend, image_chat(DATA_URL))).param == PART
    assert vision_node.chat_bodies == []


async def test_an_image_url_is_refused_while_urls_are_off(
    vision_node: VisionNodeDouble, listener: HoldingListener
) -> None:
    async with running_backend([vision_node.url]) as backend:
        error = await refusal(backend, image_chat(f"http://127.0.0.1:{listener.port}/a.png"))
    assert (error.param, error.code) == (PART, "image_url_disabled")
    assert listener.accepted == 0 and vision_node.streamed_bodies() == []


async def test_an_allowlisted_host_that_is_loopback_is_never_fetched_nor_forwarded(
    vision_node: VisionNodeDouble, listener: HoldingListener
) -> None:
    urls = {"allowed_hosts": ["localhost"]}
    async with running_backend([vision_node.url], image_urls=urls) as backend:
        error = await refusal(backend, image_chat(f"http://localhost:{listener.port}/a.png"))
    assert (error.param, error.code) == (PART, "image_url_refused")
    assert listener.accepted == 0 and vision_node.streamed_bodies() == []


async def test_an_allowed_url_is_fetched_by_the_gateway_and_sent_as_bytes(vision_node: VisionNodeDouble) -> None:
    host = ImageHost()
    urls = {"allowed_hosts": ["127.0.0.1"]}
    try:
        async with running_backend([vision_node.url], image_urls=urls) as backend:
            backend.images.allow_destinations_for_tests(lambda name, address: address == "127.0.0.1")
            assert await answer(backend, image_chat(f"http://127.0.0.1:{host.server_port}/png")) == "1 image(s)"
    finally:
        host.shutdown()
    (sent,) = vision_node.streamed_bodies()
    url = sent["messages"][0]["content"][1]["image_url"]["url"]
    assert url == "data:image/png;base64," + base64.b64encode(png(16, 8)).decode()


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("file:///etc/passwd", "invalid_image_url"),
        ("/etc/passwd", "invalid_image_url"),
        ("data:text/plain;base64,aGk=", "invalid_image_url"),
        ("data:image/png;base64,not base64!", "invalid_image_url"),
        ("http://images.example.com/a.png", "image_url_disabled"),
    ],
)
async def test_what_a_node_would_read_or_fetch_is_refused(url: str, code: str) -> None:
    messages = image_chat(url).messages
    assert messages is not None
    with pytest.raises(InvalidRequestError) as caught:
        await node_messages(messages, [(0, 1)], ImageUrlFetcher(ImageUrlSettings()))
    assert (caught.value.param, caught.value.code) == (PART, code)


def test_data_urls_are_sent_as_plain_base64() -> None:
    payload = base64.b64encode(PNG).decode()
    assert base64_data_url(DATA_URL, PART) == DATA_URL
    assert base64_data_url(f"data:IMAGE/PNG;name=a.png;base64,{payload}", PART) == DATA_URL
    assert base64_data_url("data:image/png," + "".join(f"%{b:02x}" for b in PNG), PART) == DATA_URL


def test_lmdeploys_own_parser_reads_the_translated_parts() -> None:
    """The translation against the shape LMDeploy documents, read by LMDeploy 0.18.0's own message parser (its
    ``MultimodalProcessor``, in the harness virtualenv): the image decodes to its real size."""
    messages = json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}])
    script = (
        "import json, sys\n"
        "from lmdeploy.serve.processors.multimodal import MultimodalProcessor as P\n"
        "out = [None]\n"
        "P._parse_multimodal_item(0, json.loads(sys.argv[1]), out, {})\n"
        "part = out[0]['content'][0]\n"
        "print(part['type'], *part['data'].size)\n"
    )
    result = subprocess.run(
        [str(ensure_harness_venv()), "-c", script, messages], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split() == ["image", "4", "2"]
