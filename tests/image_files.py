"""Real image files for the image tests, written here byte by byte (PNG: signature, IHDR, one IDAT, IEND), so the
suite needs no imaging library: deepseek-recipe decodes them as it would any client's."""

from __future__ import annotations

import base64
import random
import struct
import zlib


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png(width: int, height: int, rgb: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    """A solid-colour RGB PNG of ``width`` x ``height`` pixels."""
    row = b"\x00" + bytes(rgb) * width  # filter byte 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(row * height, 9))
        + _chunk(b"IEND", b"")
    )


def noisy_png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of random pixels: it does not compress, so its size is about ``3 * width * height`` bytes."""
    noise = random.Random(seed)
    rows = b"".join(b"\x00" + noise.randbytes(3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` pixels but carries almost no data (a decompression bomb's
    header): only a limit read from the header stops it before a decoder allocates the frame."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")


def data_url(image: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(image).decode()}"


def b64(image: bytes) -> str:
    return base64.b64encode(image).decode()
