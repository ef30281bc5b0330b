"""What a forced tool call's grammar costs: building it, compiling it, and the per-token mask while decoding.

For a flat tool and a nested Pydantic tool (``$ref``/``$defs``, ``anyOf`` with null, enums, bounded numbers and
text), times on the reference engine's grammar library (llguidance):

- ``build``: ``tool_call_grammar`` (the JSON-Schema -> GBNF compilation, on the event loop per request);
- ``compile``: GBNF -> Lark -> llguidance matcher (the engine caches it per distinct grammar);
- ``mask``: one next-token mask while the matcher walks a valid call, token by token (median and max).

Usage: ``python bench/forced_call_grammar.py [--rounds 50]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from enum import StrEnum
from typing import Any, Literal

import deepseek_recipe as recipe
import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from pydantic import BaseModel, Field

from backends.deepseek.tool_call_grammar import tool_call_grammar
from backends.reference import load_or_build


class Unit(StrEnum):
    C = "c"
    F = "f"


class Place(BaseModel):
    city: str = Field(max_length=10)
    unit: Unit
    zoom: int = Field(ge=1, le=20)


class Trip(BaseModel):
    dest: Place
    via: Place | None = None
    score: float = Field(ge=1, le=5)
    mode: Literal["fast", "safe"]
    label: str = Field(max_length=6)


FLAT = {
    "type": "object",
    "properties": {"mode": {"enum": ["fast", "safe"]}, "on": {"type": "boolean"}},
    "required": ["mode", "on"],
}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flat (enum, boolean)": ({"name": "set_mode", "parameters": FLAT}, {"mode": "fast", "on": True}),
    "nested Pydantic model": (
        {"name": "plan_trip", "parameters": Trip.model_json_schema()},
        {"dest": {"city": "Oslo", "unit": "c", "zoom": 12}, "via": None, "score": 4.5, "mode": "fast", "label": "a"},
    ),
}


def dsml_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in DSML as deepseek-recipe's V4.1 encoding writes it (cut from a rendered assistant turn)."""
    call = recipe.ToolCall("", name, json.dumps(arguments, ensure_ascii=False))
    turns = [recipe.UserMessage("q"), recipe.AssistantMessage("", None, [call])]
    prompt = recipe.DeepseekV41Encoding().render_conversation(recipe.Conversation(turns, thinking_mode=False)).prompt
    start = prompt.index("\n\n<｜DSML｜ calls>")
    end = "</｜DSML｜ calls>"
    return prompt[start : prompt.index(end, start) + len(end)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    rounds = parser.parse_args().rounds
    artifacts = load_or_build()
    vocab = artifacts.model.vocab_size
    tokenizer = llguidance.LLTokenizer(artifacts.tokenizer.to_str(), n_vocab=vocab, eos_token=1)
    print("| tool schema | build (ms) | compile (ms) | mask per token (us, median / max) | tokens |")
    print("| --- | --- | --- | --- | --- |")
    for label, (function, arguments) in CASES.items():
        start = time.perf_counter()
        for _ in range(rounds):
            grammar = tool_call_grammar([function], parallel=False)
        build = (time.perf_counter() - start) / rounds * 1e3
        start = time.perf_counter()
        for _ in range(max(rounds // 10, 1)):
            matcher = llguidance.LLMatcher(
                tokenizer, llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar)), log_level=0
            )
        compile_ms = (time.perf_counter() - start) / max(rounds // 10, 1) * 1e3
        text = dsml_call(function["name"], arguments)
        ids = artifacts.tokenizer.encode(text, add_special_tokens=False).ids
        mask = np.empty((vocab + 31) // 32, dtype=np.int32)
        times = []
        for token in ids:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append(time.perf_counter() - start)
            if not matcher.consume_token(token):
                raise SystemExit(f"{label}: the grammar refused a valid call at token {token}")
        mask_us = f"{statistics.median(times) * 1e6:.0f} / {max(times) * 1e6:.0f}"
        print(f"| {label} | {build:.2f} | {compile_ms:.1f} | {mask_us} | {len(ids)} |")


if __name__ == "__main__":
    main()
