"""Images in the reference engine, taken as DeepInfer takes V4.1's ``multi_modal_data``.

DeepInfer's multimodal processor replaces each image placeholder of the prompt, in order, by the image's tokens:
one ``vocab_size + 2`` followed by ``N - 1`` times ``vocab_size + 1``, N by V4.1's image token rule for the image's
size (deepseek-recipe computes it: ``image_token_adjustment`` plus the placeholder). Placeholders beyond the images
stay as they are. The reference engine does the same, so a prompt's length, its context check and its prefill
time count every image token.

The n-gram model cannot see pixels. The images reach the output through sampling instead: a digest of their bytes
is mixed into the request's seed, so the same images give the same output and different ones a different one.
The prefix cache keys an image's tokens by the image's digest, so two prompts that differ only in an image share
no cached block past it.
"""

from __future__ import annotations

from collections.abc import Mapping
from hashlib import blake2b
from typing import Any, NamedTuple

import deepseek_recipe as recipe
import numpy as np

IMAGE_TOKEN_SLACK = 5
"""Ids up to ``vocab_size + 5`` are in range for a prompt with images (DeepInfer's check)."""


class ImagePrompt(NamedTuple):
    """A prompt with its images expanded."""

    tokens: np.ndarray  # int32: the expanded prompt, as the engine counts it
    text: np.ndarray  # int32: the prompt's tokens the model reads (image tokens and stray placeholders left out)
    cache_keys: np.ndarray  # int32: ``tokens`` with each image's tokens standing for its digest (prefix cache)
    digest: int  # 64 bits of the images' bytes, for the sampler's seed


def image_token_count(width: int, height: int) -> int:
    """The prompt tokens of one image of this (preprocessed) size, by V4.1's rule."""
    return recipe.MultiModalData([recipe.ImageInfo(b"", width, height)]).image_token_adjustment() + 1


def expand_images(
    prompt: np.ndarray, placeholder: int | None, vocab_size: int, multi_modal_data: Mapping[str, Any]
) -> ImagePrompt:
    """``prompt`` with each placeholder, in order, replaced by its image's tokens; raises ``ValueError`` when the
    data is malformed (DeepInfer fails such a request)."""
    image_bytes = multi_modal_data.get("image_bytes")
    sizes = multi_modal_data.get("image_sizes") or []
    if image_bytes is None or len(image_bytes) != len(sizes):
        raise ValueError("multi_modal_data needs image_bytes and image_sizes, one of each per image")
    if image_bytes and placeholder is None:
        raise ValueError("this engine's tokenizer has no image placeholder")
    positions = np.flatnonzero(prompt == placeholder)[: len(image_bytes)].tolist() if image_bytes else []
    pieces: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    whole = blake2b(digest_size=8)
    start = 0
    for at, data, (width, height) in zip(positions, image_bytes, sizes, strict=False):
        digest = blake2b(bytes(data), digest_size=8).digest()
        whole.update(digest)
        count = image_token_count(int(width), int(height))
        block = np.full(count, vocab_size + 1, dtype=np.int32)
        block[0] = vocab_size + 2
        key = vocab_size + IMAGE_TOKEN_SLACK + int.from_bytes(digest[:4], "little") % (2**31 - vocab_size - 8)
        pieces += [prompt[start:at], block]
        keys += [prompt[start:at], np.full(count, key, dtype=np.int32)]
        start = at + 1
    pieces.append(prompt[start:])
    keys.append(prompt[start:])
    tokens = np.ascontiguousarray(np.concatenate(pieces), dtype=np.int32)
    text = np.ascontiguousarray(tokens[tokens < vocab_size])
    cache_keys = np.ascontiguousarray(np.concatenate(keys), dtype=np.int32)
    combined = int.from_bytes(whole.digest(), "little") if positions else 0
    return ImagePrompt(tokens, text, cache_keys, combined)
