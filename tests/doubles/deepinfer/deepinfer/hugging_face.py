"""TEST DOUBLE of ``deepinfer.hugging_face``: loads a local tokenizer and applies the release-policy checks."""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"


class HFTokenizer:
    """Stands in for the HF ``LlamaTokenizerFast`` DeepInfer loads; ``backend_tokenizer`` is the Rust tokenizer."""

    def __init__(self, backend_tokenizer: Tokenizer) -> None:
        self.backend_tokenizer = backend_tokenizer
        self.bos_token_id = 0
        self.eos_token_id = 1
        self.pad_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def get_hf_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> HFTokenizer:
    """Local files only; raises ``FileNotFoundError`` / ``ValueError`` as DeepInfer's loader does."""
    for filename in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(tokenizer_name, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"HF tokenizer file not found: {path}")
    backend = Tokenizer.from_file(os.path.join(tokenizer_name, "tokenizer.json"))
    for token, expected in ((BOS, 0), (EOS, 1), (PAD, 2)):
        if backend.token_to_id(token) != expected:
            raise ValueError(f"Unsupported HF tokenizer: {token} must have id {expected}")
    return HFTokenizer(backend)
