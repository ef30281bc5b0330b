"""Turns timed requests into the numbers operators compare: TTFT, TPOT, ITL, E2E, throughput, goodput, cost.

Pure functions over ``RequestRecord`` lists, so the definitions below are tested against synthetic event
streams with known answers. Percentiles use linear interpolation between order statistics (``numpy.percentile``'s
default), as ``vllm bench serve`` does. Latencies are reported in milliseconds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .client import RequestRecord

PERCENTILES = (50, 90, 95, 99)

DEFINITIONS: dict[str, str] = {
    "ttft": "time to first token: request sent -> first streamed chunk with non-empty content, reasoning or "
    "tool-call delta (role-only and empty chunks do not count). vllm bench serve stops its clock at the first "
    "chunk carrying any choice, even an empty one; that figure is reported here as time_to_first_chunk_ms.",
    "tpot": "time per output token, per request, excluding the first token: (last token chunk - first token "
    "chunk) / (output tokens - 1); requests with one output token have none and meet any TPOT SLO. Same as vllm "
    "bench serve's TPOT and AIPerf's 'inter token latency'; GuideLLM calls it ITL.",
    "itl": "inter-token latency: every gap between consecutive content chunks, pooled over all requests. Same as "
    "vllm bench serve's ITL (AIPerf: 'inter chunk latency'). With speculative decoding one chunk carries several "
    "tokens, so ITL exceeds TPOT.",
    "e2el": "end-to-end latency: request sent -> end of the response stream (after usage and [DONE]), client side. "
    "vllm bench serve ends at the last chunk received; the difference is the final frames.",
    "output_tokens": "the server's usage.completion_tokens (stream_options.include_usage is requested); when a "
    "server sends no usage, the number of content chunks (tokens.source counts which). vllm bench serve falls back "
    "to re-tokenising the text instead.",
    "throughput": "completed requests, and their output tokens, divided by the measured window: first request "
    "sent -> last response ended (warm-up excluded), as vllm bench serve's benchmark duration.",
    "goodput": "requests that completed without error and met every --slo bound, divided by the window (vllm bench "
    "serve --goodput, after DistServe); slo_attainment is their share of all requests sent (errors count as "
    "misses, as in GuideLLM).",
    "tokens_per_second_per_user": "1000 / median TPOT in ms: the decode speed a typical user sees.",
    "prompt_cache_hit_rate": "prompt tokens the server reported as prefix-cache hits (usage.prompt_cache_hit_tokens, "
    "else prompt_tokens_details.cached_tokens) over the prompt tokens of the requests that reported them; null when "
    "none did.",
    "cost": "USD per million output tokens = gpu_hour_price * gpus / 3600 / output tokens per second * 1e6, at "
    "this load point's throughput (and at its goodput, counting only tokens of requests that met the SLO).",
    "achieved_concurrency": "sum of end-to-end latencies / window: the mean number of requests in flight.",
}


def summarize(values: Sequence[float] | np.ndarray, scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, std, min, p50, p90, p95, p99, max of ``values * scale`` (None when there are none)."""
    data = np.asarray(values, dtype=np.float64) * scale
    if data.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    quantiles = np.percentile(data, PERCENTILES)
    return {
        "count": int(data.size),
        "mean": float(data.mean()),
        "std": float(data.std()),
        "min": float(data.min()),
        **{f"p{p}": float(q) for p, q in zip(PERCENTILES, quantiles, strict=True)},
        "max": float(data.max()),
    }


def ttft(record: RequestRecord) -> float | None:
    return record.token_times[0] - record.start if record.token_times else None


def tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first; None for fewer than two tokens."""
    tokens = record.tokens
    if tokens < 2 or not record.token_times:
        return None
    return (record.token_times[-1] - record.token_times[0]) / (tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    times = record.token_times
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def e2el(record: RequestRecord) -> float:
    return record.end - record.start


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """No error, and every given bound (milliseconds) met; a request without a TPOT meets the TPOT bound."""
    if not record.ok:
        return False
    if "ttft" in slo and (ttft(record) or 0.0) * 1000 > slo["ttft"]:
        return False
    if "tpot" in slo:
        value = tpot(record)
        if value is not None and value * 1000 > slo["tpot"]:
            return False
    return not ("e2el" in slo and e2el(record) * 1000 > slo["e2el"])


def window(records: Iterable[RequestRecord]) -> float:
    """Seconds from the first request sent to the last response ended."""
    records = list(records)
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def compute_metrics(
    records: Sequence[RequestRecord],
    *,
    slo: dict[str, float] | None = None,
    gpu_hour_price: float | None = None,
    gpus: int | None = None,
    duration: float | None = None,
) -> dict[str, Any]:
    """Every number of one (model, load point), as written into results.json."""
    slo = slo or {}
    ok = [r for r in records if r.ok]
    duration = window(records) if duration is None else duration
    per_second = 1.0 / duration if duration > 0 else 0.0
    output_tokens = sum(r.tokens for r in ok)
    input_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cache_known = [(r.prompt_tokens, r.cached_prompt_tokens) for r in ok if r.cached_prompt_tokens is not None]
    cache_hits = sum(hits for _, hits in cache_known)
    cache_prompt = sum(prompt or 0 for prompt, _ in cache_known)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    tpot_summary = summarize(tpots, 1000.0)
    errors = Counter(r.error for r in records if r.error)
    examples: dict[str, str] = {}
    for r in records:
        if r.error and r.error not in examples:
            examples[r.error] = r.error_detail or ""
    output_throughput = output_tokens * per_second
    result: dict[str, Any] = {
        "requests": {"sent": len(records), "completed": len(ok), "failed": len(records) - len(ok)},
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "duration_s": duration,
        "request_throughput": len(ok) * per_second,
        "output_throughput": output_throughput,
        "input_throughput": sum(input_known) * per_second,
        "total_token_throughput": (sum(input_known) + output_tokens) * per_second,
        "achieved_concurrency": sum(e2el(r) for r in records) * per_second,
        "tokens": {
            "input_total": sum(input_known),
            "input_cache_hit_total": cache_hits,
            "output_total": output_tokens,
            "input_per_request": summarize(input_known),
            "output_per_request": summarize([r.tokens for r in ok]),
            "target_input_per_request": summarize([r.target_input_len for r in ok if r.target_input_len]),
            "max_tokens_per_request": summarize([r.max_tokens for r in ok]),
            "source": {
                "usage": sum(1 for r in ok if r.output_tokens is not None),
                "chunks": sum(1 for r in ok if r.output_tokens is None),
            },
        },
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok)),
        "ttft_ms": summarize([t for r in ok if (t := ttft(r)) is not None], 1000.0),
        "time_to_first_chunk_ms": summarize([r.first_chunk - r.start for r in ok if r.first_chunk is not None], 1000.0),
        "tpot_ms": tpot_summary,
        "itl_ms": summarize([gap for r in ok for gap in itls(r)], 1000.0),
        "e2el_ms": summarize([e2el(r) for r in ok], 1000.0),
        "tokens_per_second_per_user": 1000.0 / tpot_summary["p50"] if tpot_summary["p50"] else None,
        "prompt_cache_hit_rate": cache_hits / cache_prompt if cache_prompt else None,
        "goodput": None,
        "cost": None,
    }
    if slo:
        good = [r for r in records if meets_slo(r, slo)]
        good_tokens = sum(r.tokens for r in good)
        result["goodput"] = {
            "slo_ms": dict(slo),
            "good_requests": len(good),
            "request_goodput": len(good) * per_second,
            "output_goodput": good_tokens * per_second,
            "slo_attainment": len(good) / len(records) if records else 0.0,
        }
    if gpu_hour_price is not None and gpus:
        usd_per_second = gpu_hour_price * gpus / 3600.0

        def per_million(tokens_per_second: float) -> float | None:
            return usd_per_second / tokens_per_second * 1e6 if tokens_per_second > 0 else None

        result["cost"] = {
            "gpu_hour_price": gpu_hour_price,
            "gpus": gpus,
            "output_tokens_per_second_per_gpu": output_throughput / gpus,
            "usd_per_million_output_tokens": per_million(output_throughput),
            "usd_per_million_good_output_tokens": per_million(result["goodput"]["output_goodput"])
            if result["goodput"]
            else None,
        }
    return result
