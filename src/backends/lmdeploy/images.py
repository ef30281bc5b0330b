"""The image parts of a chat, as an LMDeploy node may receive them: base64 data URLs only, and only for vision models.

LMDeploy's api_server loads an ``image_url`` part's URL itself, and reads more than a gateway would let it: http(s)
URLs (with a check of its own that resolves the host apart from the fetch, so a name that resolves differently the
second time gets through), data URLs, and ``file:`` URLs or bare paths on the node's own disk. So the gateway sends
nothing a node could fetch or read:

- a data URL is sent as ``data:<image type>;base64,<payload>`` (percent-encoded ones re-encoded; LMDeploy takes
  base64 only, and reads one parameter at most), once its payload is checked to decode;
- an http(s) URL is fetched by the gateway under the rule every backend uses (``deepseek/image_fetch.py``: off
  unless hosts are allowlisted, public addresses only at every redirect, bounded in bytes and time), and its bytes
  sent as a data URL;
- anything else is a 400 naming the part.

``detail`` is not forwarded: LMDeploy's vision models take no such option. A backend whose nodes serve no vision
model refuses image parts with today's clear 400, naming the first one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any
from urllib.parse import unquote_to_bytes

from backends.deepseek.image_fetch import ImageUrlFetcher, refusal
from backends.errors import InvalidRequestError

IMAGE_PART = "image_url"
IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)

Position = tuple[int, int]
"""(message, part) of an image part."""


def image_positions(messages: list[dict[str, Any]]) -> list[Position]:
    """Where the image parts are; a cheap scan that touches only list contents."""
    found: list[Position] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            found.extend((i, j) for j, part in enumerate(content) if part.get("type") == IMAGE_PART)
    return found


def path_of(messages: list[dict[str, Any]], position: Position) -> str:
    """The part's place in the client's request: the ``path`` a translated part carries, else its chat place."""
    path = messages[position[0]]["content"][position[1]].get("path")
    return path if isinstance(path, str) else f"messages[{position[0]}].content[{position[1]}]"


def refuse_images(messages: list[dict[str, Any]], position: Position) -> InvalidRequestError:
    message = "image inputs are not supported by this model (its LMDeploy nodes serve a text-only model); send text"
    return refusal(path_of(messages, position), message, "unsupported_value")


async def node_messages(
    messages: list[dict[str, Any]], positions: list[Position], fetcher: ImageUrlFetcher
) -> list[dict[str, Any]]:
    """The messages with every image part as a base64 data URL (URLs fetched concurrently); others untouched."""
    urls = await asyncio.gather(*(_node_url(messages, position, fetcher) for position in positions))
    copied = [dict(message) for message in messages]
    for i in {i for i, _ in positions}:
        copied[i]["content"] = list(copied[i]["content"])
    for (i, j), url in zip(positions, urls, strict=True):
        copied[i]["content"][j] = {"type": IMAGE_PART, "image_url": {"url": url}}
    return copied


async def _node_url(messages: list[dict[str, Any]], position: Position, fetcher: ImageUrlFetcher) -> str:
    param = path_of(messages, position)
    url = image_url(messages[position[0]]["content"][position[1]], param)
    if url[:5].lower() == "data:":
        return await asyncio.to_thread(base64_data_url, url, param)  # decoding a large payload: off the event loop
    data = await fetcher.fetch_async(url, param)  # refuses what the gateway would not fetch, URLs off included
    return await asyncio.to_thread(data_url_of, data)


def image_url(part: dict[str, Any], param: str) -> str:
    """The URL of an OpenAI ``image_url`` part (``{"url": ...}`` or the bare string)."""
    value = part.get(IMAGE_PART)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise refusal(f"{param}.image_url.url", "an image_url part needs a URL", "invalid_image_url")
    return url


def base64_data_url(url: str, param: str) -> str:
    """A client's data URL as ``data:<image type>;base64,<payload>``; a 400 if it is not an image that decodes."""
    header, comma, payload = url[5:].partition(",")
    kind, *parameters = header.split(";")
    kind = kind.strip().lower()
    if not comma or not kind.startswith("image/"):
        raise refusal(param, "an image data URL must read data:image/<type>;base64,<data>", "invalid_image_url")
    if parameters and parameters[-1].strip().lower() == "base64":
        try:
            base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise refusal(param, "the image data URL's base64 payload does not decode", "invalid_image_url") from None
        return f"data:{kind};base64,{payload}"
    return f"data:{kind};base64,{base64.b64encode(unquote_to_bytes(payload)).decode()}"


def data_url_of(data: bytes) -> str:
    """Fetched bytes as a base64 data URL, typed by their signature (LMDeploy decodes whatever the type says)."""
    kind = next((k for signature, k in IMAGE_SIGNATURES if data.startswith(signature)), None)
    if kind is None:
        kind = "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"
