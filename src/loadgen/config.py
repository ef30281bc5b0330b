"""What a benchmark run does, parsed once from the command line and written whole into ``results.json``."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SLO_KEYS = ("ttft", "tpot", "e2el")

STREAMS_PER_PROCESS = 256
"""``--workers auto`` starts one load-generator process per this many concurrent streams (see docs/bench.md)."""

CHUNKS_PER_PROCESS = 20_000.0
"""... and one per this many expected chunks per second of Poisson arrivals (rate x mean output length): under half
the 45,000-50,000 chunks per CPU-second one process reads when every chunk is its own network read."""


class BenchConfigError(ValueError):
    """A command-line value the benchmark cannot use; the message names the option."""


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token-length distribution: ``fixed:N`` (or ``N``), ``uniform:LOW,HIGH`` or ``normal:MEAN,STD``."""

    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, option: str) -> LengthSpec:
        kind, _, rest = text.strip().partition(":")
        if not rest:
            kind, rest = "fixed", kind
        try:
            numbers = [float(x) for x in rest.split(",")]
        except ValueError:
            raise BenchConfigError(f"{option}: {text!r} is not fixed:N, uniform:LOW,HIGH or normal:MEAN,STD") from None
        if kind == "fixed" and len(numbers) == 1 and numbers[0] >= 1:
            return cls("fixed", numbers[0])
        if kind == "uniform" and len(numbers) == 2 and 1 <= numbers[0] <= numbers[1]:
            return cls("uniform", numbers[0], numbers[1])
        if kind == "normal" and len(numbers) == 2 and numbers[0] >= 1 and numbers[1] >= 0:
            return cls("normal", numbers[0], numbers[1])
        raise BenchConfigError(
            f"{option}: {text!r} is not fixed:N, uniform:LOW,HIGH (1 <= LOW <= HIGH) or normal:MEAN,STD (MEAN >= 1)"
        )

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=200,tpot=50,e2el=5000`` (milliseconds) into a dict; keys as in ``vllm bench serve --goodput``."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or not ms > 0:
            raise BenchConfigError(f"--slo: {part!r} is not KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        slo[key] = ms
    return slo


def parse_levels(text: str, option: str, *, integer: bool) -> list[float]:
    """A comma-separated list of positive numbers (``inf`` allowed for request rates)."""
    levels: list[float] = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise BenchConfigError(f"{option}: {part!r} is not a number") from None
        if not value > 0 or (integer and (math.isinf(value) or value != int(value))):
            raise BenchConfigError(f"{option}: {part!r} must be a positive {'integer' if integer else 'number'}")
        levels.append(int(value) if integer else value)
    if not levels:
        raise BenchConfigError(f"{option}: give at least one value")
    return levels


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One offered load: a closed loop of ``concurrency`` streams, or Poisson arrivals at ``request_rate``."""

    index: int
    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        rate = "inf" if self.request_rate is not None and math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"rate={rate}/s" + (f" (max c={self.max_concurrency})" if self.max_concurrency else "")

    @property
    def x(self) -> float:
        """The value plots put on their x axis (0 for an infinite rate, which has no place on it)."""
        value = float(self.concurrency if self.concurrency is not None else self.request_rate or 0.0)
        return value if math.isfinite(value) else 0.0


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything that determines a run; serialised verbatim into ``results.json``."""

    url: str
    models: tuple[str, ...]
    out: Path
    concurrency: tuple[int, ...] = (1,)
    request_rate: tuple[float, ...] = ()
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None
    input_len: LengthSpec = LengthSpec("fixed", 256)
    output_len: LengthSpec = LengthSpec("fixed", 128)
    dataset: Path | None = None
    prefix_groups: int = 0
    prefix_len: int = 0
    endpoint: Literal["chat", "completions"] = "chat"
    ignore_eos: bool = True
    slo: dict[str, float] = field(default_factory=dict)
    gpu_hour_price: float | None = None
    gpus: int | None = None
    api_key: str | None = None
    warmup: int | None = None
    seed: int = 0
    workers: int | None = None  # None: auto
    timeout: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.models:
            raise BenchConfigError("--model: give at least one model name")
        if not self.url.startswith(("http://", "https://")):
            raise BenchConfigError(f"--url: {self.url!r} is not an http(s) URL")
        if self.num_requests is not None and self.duration is not None:
            raise BenchConfigError("give --num-requests or --duration, not both")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchConfigError("--num-requests must be at least 1")
        if self.duration is not None and not self.duration > 0:
            raise BenchConfigError("--duration must be positive")
        if (self.gpu_hour_price is None) != (self.gpus is None):
            raise BenchConfigError("--gpu-hour-price and --gpus go together")
        if self.gpu_hour_price is not None and (self.gpu_hour_price < 0 or (self.gpus or 0) < 1):
            raise BenchConfigError("--gpu-hour-price must be >= 0 and --gpus >= 1")
        if (self.prefix_groups > 0) != (self.prefix_len > 0):
            raise BenchConfigError("--prefix-groups and --prefix-len go together")
        if self.dataset is not None and self.prefix_groups:
            raise BenchConfigError("--prefix-groups applies to synthetic prompts, not to --dataset")
        if self.workers is not None and self.workers < 1:
            raise BenchConfigError("--workers must be at least 1 (or auto)")
        if self.warmup is not None and self.warmup < 0:
            raise BenchConfigError("--warmup must be >= 0")
        if self.max_concurrency is not None and not self.request_rate:
            raise BenchConfigError("--max-concurrency caps --request-rate runs; use --concurrency otherwise")

    @property
    def base_url(self) -> str:
        """The server root: accepts ``http://host:port`` and ``http://host:port/v1`` alike."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def load_points(self) -> list[LoadPoint]:
        if self.request_rate:
            return [
                LoadPoint(i, request_rate=r, max_concurrency=self.max_concurrency)
                for i, r in enumerate(self.request_rate)
            ]
        return [LoadPoint(i, concurrency=c) for i, c in enumerate(self.concurrency)]

    def requests_for(self, point: LoadPoint) -> int | None:
        """Measured requests per model at a load point; None when the run is bounded by ``duration``."""
        if self.duration is not None:
            return None
        if self.num_requests is not None:
            return self.num_requests
        if point.concurrency is not None:
            return max(50, 10 * point.concurrency)
        return 100

    def warmup_for(self, point: LoadPoint) -> int:
        if self.warmup is not None:
            return self.warmup
        return point.concurrency if point.concurrency is not None else min(8, point.max_concurrency or 8)

    def workers_for(self, point: LoadPoint) -> int:
        """Load-generator processes: as asked, else enough to stay well under one process's measured ceiling."""
        if self.workers is not None:
            return self.workers
        if point.concurrency is not None:
            need = math.ceil(point.concurrency / STREAMS_PER_PROCESS)
        else:
            rate = point.request_rate or 0.0
            need = math.ceil(rate * self.output_len.mean / CHUNKS_PER_PROCESS) if math.isfinite(rate) else 1
        return max(1, min(need, os.cpu_count() or 1))

    def to_json(self) -> dict[str, Any]:
        """The full configuration, as recorded next to the results (the API key is redacted)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LengthSpec | Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        out["request_rate"] = [r if math.isfinite(r) else "inf" for r in self.request_rate]
        out["api_key"] = "***" if self.api_key else None
        out["workers"] = self.workers if self.workers is not None else "auto"
        return out
