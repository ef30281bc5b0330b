"""The image pieces below the HTTP layer: the header sizes the pixel limit reads before decoding, and the token
bound budgets reserve per image, checked against deepseek-recipe's own rule."""

from __future__ import annotations

import struct
import urllib.parse

import deepseek_recipe as recipe
import pytest

from backends.config import ImageSettings
from backends.deepseek.image_headers import pixel_size
from backends.deepseek.images import ImageResolution
from backends.errors import PayloadTooLargeError
from backends.interface import IMAGE_TOKENS_BOUND

from ...image_files import declared_png, png


def test_header_sizes_of_every_format_the_library_takes() -> None:
    assert pixel_size(png(37, 21)) == (37, 21)
    assert pixel_size(declared_png(50_000, 40_000)) == (50_000, 40_000)
    assert pixel_size(b"GIF89a" + struct.pack("<HH", 300, 200) + b"\x00" * 8) == (300, 200)
    vp8x = b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x00" * 8 + (1919).to_bytes(3, "little") + (1079).to_bytes(3, "little")
    assert pixel_size(vp8x) == (1920, 1080)
    bits = (640 - 1) | ((480 - 1) << 14)
    vp8l = b"RIFF\x00\x00\x00\x00WEBPVP8L" + b"\x00" * 5 + bits.to_bytes(4, "little")
    assert pixel_size(vp8l) == (640, 480)
    app1 = b"\xff\xe1" + struct.pack(">H", 2 + 1000) + b"\x00" * 1000  # metadata before the frame header
    sof0 = b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 3000, 4000)
    assert pixel_size(b"\xff\xd8" + app1 + sof0) == (4000, 3000)


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\nnot an image", b"GIF8", b"\xff\xd8\x00\x00", b"BM1234"])
def test_an_unreadable_header_is_left_to_the_library(data: bytes) -> None:
    assert pixel_size(data) is None


@pytest.mark.parametrize("size", [(640, 480), (4096, 4096), (16384, 64), (64, 16384), (8192, 8192)])
def test_no_image_takes_more_tokens_than_the_bound_budgets_reserve(size: tuple[int, int]) -> None:
    tokens = recipe.MultiModalData([recipe.ImageInfo(b"", *size)]).image_token_adjustment() + 1
    assert tokens <= IMAGE_TOKENS_BOUND


def test_a_percent_encoded_data_url_declares_its_decoded_bytes() -> None:
    image = png(64, 48)
    url = "data:image/png," + urllib.parse.quote_from_bytes(image)
    settings = ImageSettings(max_image_bytes=len(image))
    resolved = ImageResolution(settings).resolve([recipe.DataUrlImageSource(url, "low", path="messages[0].content[0]")])
    assert resolved.image_sizes and resolved.extra_tokens >= 0
    with pytest.raises(PayloadTooLargeError) as refused:
        ImageResolution(ImageSettings(max_image_bytes=len(image) - 1)).resolve(
            [recipe.DataUrlImageSource(url, "low", path="messages[0].content[0]")]
        )
    assert refused.value.param == "messages[0].content[0]"
