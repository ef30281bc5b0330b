"""Whether an LMDeploy node serves a vision model, as the node itself answers it.

LMDeploy publishes no modality: ``/v1/models`` lists names, ``/health`` the engine's state. But every node decides
it in one place, before any engine work: a chat request with an image part, on a text-only model, fails in
preprocessing with a 400 "Multimodal input is not supported by this model." So each node is asked once, after a
good health probe, with a 1x1 PNG and ``max_tokens: 1``: a 200 means a vision model (the price is one image
encoding and one token), that 400 a text-only one; any other answer leaves it unknown, to be asked again at the
next probe. A proxy is asked the same way (it forwards the request to one of its nodes).
"""

from __future__ import annotations

import logging

import aiohttp
import orjson

logger = logging.getLogger(__name__)

TEXT_ONLY_MESSAGE = "Multimodal input is not supported"
"""The start of the message a text-only LMDeploy node answers an image part with (``serve/processors``)."""

PROBE_IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNocFAAAAIkAOGrWWInAAAAAElFTkSuQmCC"
)
"""A 1x1 PNG."""


def probe_body(model: str) -> dict[str, object]:
    """The smallest chat request with an image: one text part, one 1x1 image, one output token."""
    content = [{"type": "text", "text": "."}, {"type": "image_url", "image_url": {"url": PROBE_IMAGE}}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "stream": False}


def read_answer(status: int, body: bytes) -> bool | None:
    """True for a vision model, False for a text-only one, None when the answer says neither."""
    if TEXT_ONLY_MESSAGE.encode() in body:
        return False  # as a 400, or as the 200-wrapped error of a proxy
    if status != 200:
        return None
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return True if isinstance(answer, dict) and answer.get("choices") else None


async def probe_vision(
    session: aiohttp.ClientSession, url: str, model: str, headers: dict[str, str], limit: aiohttp.ClientTimeout
) -> bool | None:
    """Asks the node at ``url`` whether it takes images (see the module docstring)."""
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=probe_body(model), headers=headers, timeout=limit
        ) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        logger.info("lmdeploy node %s: vision probe failed (%s); asked again at the next probe", url, exc)
        return None
    answer = read_answer(status, body)
    if answer is None:
        logger.info("lmdeploy node %s: vision probe answered HTTP %d %r; asked again later", url, status, body[:200])
    return answer
