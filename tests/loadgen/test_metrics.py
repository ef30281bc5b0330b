"""Metric definitions checked against hand-built event streams whose answers are worked out in the comments."""

from __future__ import annotations

import pytest

from loadgen.client import RequestRecord
from loadgen.metrics import compute_metrics, meets_slo, summarize, tpot

# Four requests of one load point (times in seconds since the point started):
# A: 7 tokens (server usage) in 4 chunks at 0.10, 0.12, 0.14, 0.16 after a role-only chunk at 0.05; ends 0.17.
#    TTFT 100 ms (the empty chunk does not count), TPOT (0.16 - 0.10) / 6 = 10 ms, ITL 20, 20, 20 ms, E2E 170 ms.
# B: no usage, 2 content chunks at 0.35 and 0.40 after starting at 0.05; ends 0.41.
#    TTFT 300 ms, 2 tokens (counted as chunks), TPOT 50 ms, ITL 50 ms, E2E 360 ms.
# C: HTTP 503 between 0.20 and 0.21.
# D: one token at 0.20 after starting at 0.10; ends 0.25. TTFT 100 ms, no TPOT, E2E 150 ms.
A = RequestRecord(0, 7, start=0.0, end=0.17, first_chunk=0.05, token_times=[0.10, 0.12, 0.14, 0.16], output_tokens=7)
B = RequestRecord(1, 8, start=0.05, end=0.41, first_chunk=0.35, token_times=[0.35, 0.40])
C = RequestRecord(2, 8, start=0.20, end=0.21, error="http_503", error_detail="overloaded")
D = RequestRecord(3, 1, start=0.10, end=0.25, first_chunk=0.20, token_times=[0.20], output_tokens=1, prompt_tokens=9)
WINDOW = 0.41  # first send (A at 0) -> last end (B at 0.41)


@pytest.fixture(scope="module")
def metrics() -> dict:
    return compute_metrics([A, B, C, D], slo={"ttft": 200, "tpot": 20}, gpu_hour_price=2.0, gpus=4)


def test_percentiles_interpolate_linearly_between_order_statistics() -> None:
    summary = summarize([100.0, 300.0, 100.0])
    assert summary["count"] == 3
    assert summary["mean"] == pytest.approx(500 / 3)
    assert summary["p50"] == pytest.approx(100.0)
    assert summary["p90"] == pytest.approx(260.0)  # rank 0.9 * 2 = 1.8: 100 + 0.8 * (300 - 100)
    assert summary["p99"] == pytest.approx(296.0)
    assert summary["min"] == 100.0 and summary["max"] == 300.0


def test_summary_of_nothing_is_nulls_not_zeros() -> None:
    summary = summarize([])
    assert summary["count"] == 0
    assert summary["p50"] is None and summary["mean"] is None


def test_ttft_waits_for_the_first_non_empty_chunk_not_the_role_chunk(metrics: dict) -> None:
    assert metrics["ttft_ms"]["count"] == 3  # A, B, D; the failed request has none
    assert metrics["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert metrics["ttft_ms"]["max"] == pytest.approx(300.0)
    # vLLM's TTFT (first chunk with any choice) is reported apart: A's role-only chunk came at 50 ms
    assert metrics["time_to_first_chunk_ms"]["min"] == pytest.approx(50.0)


def test_tpot_excludes_the_first_token_and_uses_server_token_counts() -> None:
    assert tpot(A) == pytest.approx(0.010)  # 60 ms over 6 tokens after the first, not over 3 chunk gaps
    assert tpot(B) == pytest.approx(0.050)  # no usage: 2 chunks count as 2 tokens
    assert tpot(D) is None  # a single token has no time per output token


def test_tpot_and_itl_summaries(metrics: dict) -> None:
    assert metrics["tpot_ms"]["count"] == 2
    assert metrics["tpot_ms"]["mean"] == pytest.approx(30.0)
    assert metrics["tpot_ms"]["p99"] == pytest.approx(49.6)  # 10 + 0.99 * 40
    # ITL pools chunk gaps of all requests: 20, 20, 20 (A) and 50 (B)
    assert metrics["itl_ms"]["count"] == 4
    assert metrics["itl_ms"]["p50"] == pytest.approx(20.0)
    assert metrics["itl_ms"]["p90"] == pytest.approx(41.0)  # rank 2.7: 20 + 0.7 * 30
    assert metrics["e2el_ms"]["count"] == 3
    assert metrics["e2el_ms"]["mean"] == pytest.approx((170 + 360 + 150) / 3)


def test_throughput_counts_completed_requests_over_the_window(metrics: dict) -> None:
    assert metrics["duration_s"] == pytest.approx(WINDOW)
    assert metrics["requests"] == {"sent": 4, "completed": 3, "failed": 1}
    assert metrics["request_throughput"] == pytest.approx(3 / WINDOW)
    assert metrics["output_throughput"] == pytest.approx((7 + 2 + 1) / WINDOW)
    assert metrics["tokens"]["source"] == {"usage": 2, "chunks": 1}
    assert metrics["tokens"]["input_total"] == 9
    assert metrics["tokens_per_second_per_user"] == pytest.approx(1000 / 30.0)  # 1000 / median TPOT
    # mean requests in flight: (170 + 360 + 10 + 150) ms of latency over the 410 ms window
    assert metrics["achieved_concurrency"] == pytest.approx(0.69 / WINDOW)


def test_errors_are_counted_by_kind(metrics: dict) -> None:
    assert metrics["errors"] == {"http_503": 1}
    assert metrics["error_examples"] == {"http_503": "overloaded"}


def test_goodput_counts_requests_meeting_every_slo(metrics: dict) -> None:
    slo = {"ttft": 200, "tpot": 20}
    assert [meets_slo(r, slo) for r in (A, B, C, D)] == [True, False, False, True]  # B: TTFT 300; C: failed
    goodput = metrics["goodput"]
    assert goodput["good_requests"] == 2
    assert goodput["request_goodput"] == pytest.approx(2 / WINDOW)
    assert goodput["output_goodput"] == pytest.approx((7 + 1) / WINDOW)
    assert goodput["slo_attainment"] == pytest.approx(0.5)  # errors count as misses


def test_e2e_slo_bounds_latency() -> None:
    assert meets_slo(A, {"e2el": 170.5})
    assert not meets_slo(A, {"e2el": 169.5})


def test_cost_per_million_output_tokens(metrics: dict) -> None:
    cost = metrics["cost"]
    # 2 USD/h x 4 GPUs = 8 USD/h; 10 tokens in 0.41 s: 8 / 3600 / (10 / 0.41) * 1e6 = 91.11 USD per million
    assert cost["usd_per_million_output_tokens"] == pytest.approx(8 / 3600 / (10 / WINDOW) * 1e6)
    assert cost["usd_per_million_output_tokens"] == pytest.approx(91.111, rel=1e-4)
    assert cost["usd_per_million_good_output_tokens"] == pytest.approx(8 / 3600 / (8 / WINDOW) * 1e6)
    assert cost["output_tokens_per_second_per_gpu"] == pytest.approx(10 / WINDOW / 4)


def test_no_slo_and_no_price_leave_goodput_and_cost_empty() -> None:
    metrics = compute_metrics([A, D])
    assert metrics["goodput"] is None and metrics["cost"] is None


def test_prompt_cache_hit_rate_counts_only_requests_whose_server_reported_hits(metrics: dict) -> None:
    assert metrics["prompt_cache_hit_rate"] is None  # no request reported cache hits: unknown, not 0
    assert metrics["tokens"]["input_cache_hit_total"] == 0
    warm = RequestRecord(4, 1, start=0.0, end=0.1, first_chunk=0.05, token_times=[0.05], prompt_tokens=64)
    warm.cached_prompt_tokens = 48
    cold = RequestRecord(5, 1, start=0.0, end=0.1, first_chunk=0.05, token_times=[0.05], prompt_tokens=64)
    cold.cached_prompt_tokens = 0
    silent = RequestRecord(6, 1, start=0.0, end=0.1, first_chunk=0.05, token_times=[0.05], prompt_tokens=64)
    found = compute_metrics([warm, cold, silent])
    assert found["tokens"]["input_cache_hit_total"] == 48
    assert found["prompt_cache_hit_rate"] == pytest.approx(48 / 128)  # the silent request's prompt is left out
