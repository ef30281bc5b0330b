"""The reference engine takes ``multi_modal_data`` as DeepInfer does: placeholders expand into each image's tokens
before the ids are checked, the expanded length is the prompt's, and the images' bytes steer sampling."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from backends.reference import ReferenceEngine
from backends.reference.images import expand_images, image_token_count
from backends.reference.tokenizer import IMAGE

from .test_engine import run

MakeEngine = Callable[..., ReferenceEngine]


def prompt_with_images(engine: ReferenceEngine, count: int) -> np.ndarray:
    placeholder = engine.tokenizer.token_to_id(IMAGE)
    text = engine.tokenizer.encode("Look at these.", add_special_tokens=True).ids
    return np.array(text + [placeholder] * count + [5], dtype=np.int32)


def images(*sizes: tuple[int, int], data: bytes = b"image") -> dict[str, object]:
    return {"image_bytes": [data + bytes([n]) for n in range(len(sizes))], "image_sizes": list(sizes)}


def test_each_placeholder_becomes_its_images_tokens(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=8192)
    prompt = prompt_with_images(engine, 2)
    expanded = expand_images(
        prompt, engine.tokenizer.token_to_id(IMAGE), engine.vocab_size, images((630, 476), (64, 64))
    )
    first, second = image_token_count(630, 476), image_token_count(64, 64)
    assert first == 194  # deepseek-recipe's count for a 640x480 image at detail low, resized to 630x476
    assert expanded.tokens.size == prompt.size - 2 + first + second
    image_ids = expanded.tokens[expanded.tokens >= engine.vocab_size]
    assert image_ids.tolist() == [engine.vocab_size + 2] + [engine.vocab_size + 1] * (first - 1) + [
        engine.vocab_size + 2
    ] + [engine.vocab_size + 1] * (second - 1)
    assert expanded.text.tolist() == [t for t in prompt.tolist() if t < engine.vocab_size]
    seq = engine.add_request("u", "r", {"max_tokens": 1}, prompt, images((630, 476), (64, 64)))
    assert seq is not None and seq.prompt_len == expanded.tokens.size
    assert run(engine)["r"][-1].finished


def test_an_image_prompt_past_the_context_is_refused_by_its_expanded_length(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=100)
    engine.add_request("u", "r", {"max_tokens": 1}, prompt_with_images(engine, 1), images((630, 476)))
    (out,) = run(engine)["r"]
    assert out.finish_reason == "prompt_length_exceeded"


def test_without_multi_modal_data_a_placeholder_is_out_of_range(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert engine.add_request("u", "r", {"max_tokens": 1}, prompt_with_images(engine, 1)) is None


@pytest.mark.parametrize("data", [{"image_bytes": None, "image_sizes": []}, {"image_bytes": [b"x"], "image_sizes": []}])
def test_malformed_multi_modal_data_is_refused(make_engine: MakeEngine, data: dict[str, object]) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="multi_modal_data"):
        engine.add_request("u", "r", {"max_tokens": 1}, prompt_with_images(engine, 1), data)


def test_the_images_bytes_steer_sampling(make_engine: MakeEngine) -> None:
    def reply(data: bytes) -> list[int]:
        engine = make_engine(max_model_len=8192)
        params = {"max_tokens": 16, "temperature": 1.0, "seq_seed": 3, "ignore_eos": True}
        engine.add_request("u", "r", params, prompt_with_images(engine, 1), images((64, 64), data=data))
        return [out.token_id for out in run(engine)["r"]]

    assert reply(b"cat") == reply(b"cat")
    assert reply(b"cat") != reply(b"dog")
