"""Workloads and arrivals: the distributions asked for, repeatable by seed, and command-line specs parsed strictly."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import orjson
import pytest

from loadgen.arrivals import arrival_times
from loadgen.config import BenchConfig, BenchConfigError, LengthSpec, LoadPoint, parse_levels, parse_slo
from loadgen.workload import Workload, load_dataset, request_body


def config(**kwargs: object) -> BenchConfig:
    settings: dict = {"url": "http://127.0.0.1:1", "models": ("m",), "out": Path("unused"), **kwargs}
    return BenchConfig(**settings)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("128", LengthSpec("fixed", 128)),
        ("fixed:64", LengthSpec("fixed", 64)),
        ("uniform:10,20", LengthSpec("uniform", 10, 20)),
        ("normal:256,32", LengthSpec("normal", 256, 32)),
    ],
)
def test_length_specs_parse(text: str, expected: LengthSpec) -> None:
    assert LengthSpec.parse(text, "--input-len") == expected


@pytest.mark.parametrize("text", ["0", "uniform:20,10", "normal:5", "gamma:1,2", "many"])
def test_bad_length_specs_name_the_option(text: str) -> None:
    with pytest.raises(BenchConfigError, match="--output-len"):
        LengthSpec.parse(text, "--output-len")


def test_slo_and_levels_parse_strictly() -> None:
    assert parse_slo("ttft=200, tpot=50,e2el=5000") == {"ttft": 200.0, "tpot": 50.0, "e2el": 5000.0}
    with pytest.raises(BenchConfigError, match="--slo"):
        parse_slo("itl=5")
    assert parse_levels("1,8,64", "--concurrency", integer=True) == [1, 8, 64]
    assert parse_levels("0.5,inf", "--request-rate", integer=False) == [0.5, math.inf]
    with pytest.raises(BenchConfigError, match="--concurrency"):
        parse_levels("1,2.5", "--concurrency", integer=True)


def test_options_that_go_together_are_checked() -> None:
    with pytest.raises(BenchConfigError, match="--gpus"):
        config(gpu_hour_price=2.0)
    with pytest.raises(BenchConfigError, match="not both"):
        config(num_requests=10, duration=5.0)
    assert config(url="http://h:1/v1/").base_url == "http://h:1"


def test_auto_workers_grow_with_streams_and_chunk_rate_up_to_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    run = config()
    assert run.workers_for(LoadPoint(0, concurrency=256)) == 1
    assert run.workers_for(LoadPoint(0, concurrency=257)) == 2
    assert run.workers_for(LoadPoint(0, concurrency=100_000)) == 8
    assert config(workers=3).workers_for(LoadPoint(0, concurrency=1)) == 3
    # with a rate: one process per 20,000 expected chunks/s (rate x mean output length)
    assert run.workers_for(LoadPoint(0, request_rate=100.0)) == 1  # 100 x 128 tokens
    assert run.workers_for(LoadPoint(0, request_rate=200.0)) == 2  # 25,600 chunks/s


def test_synthetic_lengths_follow_their_distributions() -> None:
    fixed = Workload(config(input_len=LengthSpec("fixed", 40), output_len=LengthSpec("fixed", 7)))
    request = fixed.request(0, 0)
    assert request.max_tokens == 7
    assert len(request.messages[-1]["content"].split()) == 40

    uniform = Workload(config(output_len=LengthSpec("uniform", 10, 20)))
    budgets = [uniform.request(0, i).max_tokens for i in range(400)]
    assert min(budgets) == 10 and max(budgets) == 20  # both ends reached, nothing outside

    normal = Workload(config(input_len=LengthSpec("normal", 100, 10)))
    lengths = [normal.request(0, i).target_input_len for i in range(400)]
    assert statistics.mean(lengths) == pytest.approx(100, abs=2.5)
    assert statistics.stdev(lengths) == pytest.approx(10, rel=0.2)


def test_workloads_repeat_by_seed_and_differ_between_load_points() -> None:
    first, again = Workload(config(seed=7)), Workload(config(seed=7))
    assert [first.request(0, i) for i in range(5)] == [again.request(0, i) for i in range(5)]
    assert first.request(0, 0) != first.request(1, 0)  # no replay of point 0's prompts at point 1
    assert first.request(0, 0) != Workload(config(seed=8)).request(0, 0)
    assert first.request(0, 0) != first.request(0, 0, warmup=True)


def test_shared_prefix_groups_start_prompts_with_one_of_g_system_prompts() -> None:
    workload = Workload(config(prefix_groups=3, prefix_len=50, input_len=LengthSpec("fixed", 10)))
    requests = [workload.request(0, i) for i in range(60)]
    prefixes = {r.messages[0]["content"] for r in requests}
    assert len(prefixes) == 3
    assert all(len(p.split()) == 50 for p in prefixes)
    assert all(r.messages[0]["role"] == "system" and r.target_input_len == 60 for r in requests)
    assert len({r.messages[1]["content"] for r in requests}) == 60  # the rest of each prompt is its own


def test_dataset_rows_become_requests_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "two"}]}\n')
    rows = load_dataset(path, "chat")
    workload = Workload(config(output_len=LengthSpec("fixed", 9)), rows)
    first, second, third = (workload.request(0, i) for i in range(3))
    assert first.messages == [{"role": "user", "content": "one"}] and first.max_tokens == 3
    assert second.messages == [{"role": "user", "content": "two"}] and second.max_tokens == 9
    assert third.messages == first.messages  # cycles


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(BenchConfigError, match=r"bad\.jsonl:2"):
        load_dataset(path, "chat")


def test_request_body_asks_for_usage_and_streaming() -> None:
    request = Workload(config(output_len=LengthSpec("fixed", 5))).request(0, 0)
    body = orjson.loads(request_body(request, "m", ignore_eos=True, extra={"temperature": 0}))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0


def test_poisson_arrivals_have_the_asked_rate_and_repeat_by_seed() -> None:
    point = LoadPoint(0, request_rate=50.0)
    times = arrival_times(3, point, 20_000, None)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: std equals mean
    assert arrival_times(3, point, 100, None) == times[:100]
    within = arrival_times(3, point, None, 2.0)
    assert within and max(within) < 2.0 and len(within) == pytest.approx(100, rel=0.35)
    assert arrival_times(3, LoadPoint(0, request_rate=math.inf), 5, None) == [0.0] * 5
