"""What turning one engine step's outputs into a delta costs per stream: ``Choice.consume`` and the V4.1 parser.

The front end pays this once per stream per engine step, so on the rank path (one token per step) it is a large part
of the gateway's Python per streamed token. This script times it alone: ``--streams`` choices of a reply in chat
mode (an answer; words only, as the reference engine writes, or with newlines) and in thinking mode (a reasoning,
``</think>``, an answer), with no tool call and no stop string, each fed one token per step as the engine driver
feeds them. It reports the median time per stream per step, for the whole ``consume`` and for the parser's ``push``
on the same text. It builds only what this tree and older ones construct the same way (the reference tokenizer's
``TokenTable``, ``Choice``, ``DeepSeekV41OutputParser``), so two trees can be compared:
``PYTHONPATH=src python bench/choice_step.py`` against ``PYTHONPATH=../other/src python bench/choice_step.py``,
alternating runs.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable, Sequence
from typing import Any

from backends.deepseek.parser import DeepSeekV41OutputParser
from backends.engine.choice import Choice
from backends.engine.detokenizer import TokenTable
from backends.engine.protocol import EngineOutput
from backends.reference.backend import load_tokenizer

REASONING = (
    "The user asks how the gateway streams a reply. Each engine step yields one token per request,\n\n"
    "and the front end turns it into a server-sent event frame. Let me check the order of the steps: "
    "detokenize, match stop strings, split reasoning from the answer, then format the chunk.\n"
)
ANSWER = (
    "The gateway streams each engine step to its client as one server-sent event frame.\n\n"
    "1. The engine's driver hands the step's outputs to the request.\n"
    "2. The choice detokenizes them and splits reasoning from content.\n"
    "3. The writer renders the chunk and sends it.\n"
)


def steps(tokens: list[int], streams: int) -> list[list[list[EngineOutput]]]:
    """Each step's outputs for every stream: one token each, the streams offset so their text differs."""
    return [
        [
            [EngineOutput(f"s{s}", tokens[(n + s) % len(tokens)], False, "", n + 1, 10, 0.0, (), ())]
            for s in range(streams)
        ]
        for n in range(len(tokens))
    ]


def us_per_stream_step(feeds: list[Callable[[Any], object]], steps: Sequence[Sequence[Any]]) -> float:
    """Microseconds per stream per step of handing each step's items to the streams' ``feeds``, one each."""

    def run() -> None:
        for step in steps:
            for feed, item in zip(feeds, step, strict=True):
                feed(item)

    return timeit.timeit(run, number=1) / (len(steps) * len(feeds)) * 1e6


def time_consume(
    table: TokenTable, batches: list[list[list[EngineOutput]]], end: int | None, thinking: bool, repeat: int
) -> float:
    """Microseconds per stream per step of ``Choice.consume`` (the median over ``repeat`` runs of the whole text)."""
    streams = len(batches[0])
    runs = []
    for _ in range(repeat):
        choices = [
            Choice(s, table, table.new_detokenizer(), [], False, DeepSeekV41OutputParser(in_reasoning=thinking), end)
            for s in range(streams)
        ]
        runs.append(us_per_stream_step([choice.consume for choice in choices], batches))
    return statistics.median(runs)


def time_push(pieces: list[list[str]], thinking: bool, repeat: int) -> float:
    """Microseconds per stream per step of the parser's ``push`` alone, on the same token texts."""
    streams = len(pieces[0])
    runs = []
    for _ in range(repeat):
        runs.append(
            us_per_stream_step([DeepSeekV41OutputParser(in_reasoning=thinking).push for _ in range(streams)], pieces)
        )
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    table = TokenTable(tokenizer, markers=("<think>", "</think>"))
    end_ids = tokenizer.encode("</think>", add_special_tokens=False).ids
    end = end_ids[0] if len(end_ids) == 1 else None
    scenarios = (
        ("chat, words only", False, " ".join(ANSWER.split())),  # as the reference engine writes (its corpus has none)
        ("chat", False, "\n\n" + ANSWER),
        ("thinking", True, "\n\n" + REASONING + "</think>\n\n" + ANSWER),
    )
    for mode, thinking, text in scenarios:
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        batches = steps(tokens, args.streams)
        pieces = [[table.bytes_of[o[0].token_id].decode("utf-8", "replace") for o in step] for step in batches]
        consume = time_consume(table, batches, end, thinking, args.repeat)
        push = time_push(pieces, thinking, args.repeat)
        print(
            f"{mode}: {len(tokens)} steps x {args.streams} streams, per stream-step: consume {consume:.2f} us, "
            f"push {push:.2f} us"
        )


if __name__ == "__main__":
    main()
