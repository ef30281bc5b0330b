"""Which requests a run sends: synthetic prompts from length distributions, or a JSONL file; repeatable by seed.

Every request is a pure function of (seed, load point, index), so a worker process can build its own share
without receiving the list, every model sees the same prompts at a load point, and different load points get
different prompts (a server's prefix cache cannot turn a later point into a replay of an earlier one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .config import BenchConfig, BenchConfigError, LengthSpec

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education foot boy age policy process music "
    "market sense nation plan college interest death experience effect use class control care field development "
    "role effort rate heart drug show leader light voice wife police mind price report decision son view "
    "relationship town road arm difference value building action model season society tax director position player "
    "record paper space ground form event official matter center couple site project activity star table need court "
    "oil situation cost industry figure street image phone data picture practice piece land product doctor wall "
    "patient worker news test movie north love support technology step baby computer type attention film tree "
    "source organization hair window evidence population truth song energy"
)
WORDS = tuple(_WORD_TEXT.split())
"""Common English words: each is one token, or close to it, in most BPE vocabularies, so N words ~ N tokens."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: a chat conversation or a completion prompt, and its output budget."""

    index: int
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    target_input_len: int | None = None  # what the synthetic generator aimed for, in words


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """One line of a ``--dataset`` file: ``prompt`` or ``messages``, optionally ``max_tokens``/``output_len``."""

    messages: list[dict[str, str]] | None
    prompt: str | None
    max_tokens: int | None


def load_dataset(path: Path, endpoint: str) -> list[DatasetRow]:
    """Reads a JSONL file of prompts; fails early, naming the line, on anything the run could not send."""
    rows: list[DatasetRow] = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise BenchConfigError(f"--dataset: cannot read {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise BenchConfigError(f"--dataset: {path}:{number}: not JSON ({exc})") from exc
        if not isinstance(item, dict):
            raise BenchConfigError(f"--dataset: {path}:{number}: expected an object")
        messages, prompt = item.get("messages"), item.get("prompt")
        if (messages is None) == (prompt is None):
            raise BenchConfigError(f"--dataset: {path}:{number}: give exactly one of 'prompt' or 'messages'")
        if prompt is not None and not isinstance(prompt, str):
            raise BenchConfigError(f"--dataset: {path}:{number}: 'prompt' must be a string")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise BenchConfigError(f"--dataset: {path}:{number}: 'messages' must be a list of objects")
            if endpoint == "completions":
                raise BenchConfigError(f"--dataset: {path}:{number}: 'messages' needs --endpoint chat")
        budget = item.get("max_tokens", item.get("output_len"))
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise BenchConfigError(f"--dataset: {path}:{number}: 'max_tokens' must be a positive integer")
        rows.append(DatasetRow(messages, prompt, budget))
    if not rows:
        raise BenchConfigError(f"--dataset: {path} has no prompts")
    return rows


def sample_length(spec: LengthSpec, rng: random.Random) -> int:
    if spec.kind == "fixed":
        return max(1, round(spec.a))
    if spec.kind == "uniform":
        return rng.randint(round(spec.a), round(spec.b))
    return max(1, round(rng.gauss(spec.a, spec.b)))


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


class Workload:
    """Builds request ``i`` of load point ``p`` on demand, identically in every process."""

    def __init__(self, config: BenchConfig, dataset: list[DatasetRow] | None = None) -> None:
        self.seed = config.seed
        self.input_len = config.input_len
        self.output_len = config.output_len
        self.endpoint = config.endpoint
        self.dataset = dataset
        self.prefixes = [
            words(random.Random(f"{config.seed}:prefix:{g}"), config.prefix_len) for g in range(config.prefix_groups)
        ]

    def request(self, point: int, index: int, *, warmup: bool = False) -> BenchRequest:
        rng = random.Random(f"{self.seed}:{'warmup' if warmup else 'measure'}:{point}:{index}")
        if self.dataset is not None:
            row = self.dataset[index % len(self.dataset)]
            budget = row.max_tokens or sample_length(self.output_len, rng)
            if row.messages is not None:
                return BenchRequest(index, budget, messages=row.messages)
            if self.endpoint == "chat":
                return BenchRequest(index, budget, messages=[{"role": "user", "content": row.prompt or ""}])
            return BenchRequest(index, budget, prompt=row.prompt)
        length = sample_length(self.input_len, rng)
        budget = sample_length(self.output_len, rng)
        text = words(rng, length)
        prefix = self.prefixes[rng.randrange(len(self.prefixes))] if self.prefixes else None
        total = length + (len(prefix.split()) if prefix else 0)
        if self.endpoint == "chat":
            messages = [{"role": "user", "content": text}]
            if prefix:
                messages.insert(0, {"role": "system", "content": prefix})
            return BenchRequest(index, budget, messages=messages, target_input_len=total)
        return BenchRequest(index, budget, prompt=f"{prefix} {text}" if prefix else text, target_input_len=total)


def request_body(request: BenchRequest, model: str, *, ignore_eos: bool, extra: dict[str, Any]) -> bytes:
    """The JSON body of one streamed request; asks for usage so token counts come from the server."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.messages is not None:
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra)
    return orjson.dumps(body)
