"""``deepinfer-gateway bench`` end to end against a real gateway on the reference engine with known step times.

The reference engine's timing model makes every step last at least its modelled time (it sleeps off the rest of
the step), so measured latencies can only exceed the model. The tests check that lower bound (5% below the model
for clock granularity and percentile interpolation), which load cannot break but a bench that counts tokens as
chunks (ITL half the model, two tokens per step here) or misplaces a timestamp does. How far above the model the
latencies land is a speed claim: it belongs to ``bench/``, not to the suite.
"""

from __future__ import annotations

import io
import math
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import orjson
import pytest
from PIL import Image
from rich.console import Console

import loadgen
from gateway.config import GatewayConfig
from loadgen import plots
from loadgen.config import BenchConfig, LengthSpec
from loadgen.runner import BenchRun

from ..conftest import RunningGateway, start_gateway, stop_gateway

MODEL = "timed-reference"
SECOND_NAME = "timed-reference-b"  # the same backend under another name, to compare "two models"
PREFILL_S_PER_TOKEN = 0.002
DECODE_S_PER_STEP = 0.02
TOKENS_PER_STEP = 2
OUTPUT_TOKENS = 25  # first token at prefill, then 24 tokens in 12 decode steps of 20 ms: TPOT 10 ms, ITL 20 ms
LOW = 0.95
SCHEMA = Path(loadgen.__file__).with_name("results.schema.json")


@pytest.fixture(scope="module")
def timed_gateway() -> Iterator[RunningGateway]:
    config = GatewayConfig(
        server={"runtime": {"access_log": False}},
        backends=[
            {
                "name": "timed",
                "kind": "reference",
                "timing": {
                    "prefill_seconds_per_token": PREFILL_S_PER_TOKEN,
                    "decode_seconds_per_step": DECODE_S_PER_STEP,
                    "tokens_per_step": TOKENS_PER_STEP,
                },
            }
        ],
        models=[{"name": MODEL, "backends": ["timed"]}, {"name": SECOND_NAME, "backends": ["timed"]}],
    )
    running = start_gateway(config)
    yield running
    stop_gateway(running)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in its own process, so its client does not share a GIL with the gateway under test."""
    command = [sys.executable, "-m", "gateway.cli", "bench", *args]
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env=env)


def read_requests(out: Path) -> list[dict]:
    return [orjson.loads(line) for line in (out / "requests.jsonl").read_bytes().splitlines()]


def not_below(measured: float, expected: float) -> bool:
    return measured >= LOW * expected


@pytest.fixture(scope="module")
def sweep(timed_gateway: RunningGateway, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("sweep")
    done = bench(
        "--url", f"{timed_gateway.base_url}/v1", "--model", MODEL, "--concurrency", "1,3", "--num-requests", "6",
        "--input-len", "24", "--output-len", str(OUTPUT_TOKENS), "--slo", "ttft=2000,tpot=100",
        "--gpu-hour-price", "2.5", "--gpus", "8", "--warmup", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    return out, done.stdout


def test_measured_latencies_never_undercut_the_engine_timing_model(sweep: tuple[Path, str]) -> None:
    out, _ = sweep
    results = orjson.loads((out / "results.json").read_bytes())
    single = next(r for r in results["runs"] if r["load_point"]["concurrency"] == 1)["metrics"]
    requests = [r for r in read_requests(out) if r["load_point"] == 0]
    assert len(requests) == 6 and all(r["error"] is None for r in requests)
    assert all(r["output_tokens"] == OUTPUT_TOKENS for r in requests)  # ignore_eos: every answer is max_tokens
    assert single["tokens"]["source"] == {"usage": 6, "chunks": 0}

    # alone on the engine, a request's first token comes after its prefill: prompt tokens x 2 ms
    ttft_ratios = [(r["token_times"][0] - r["start"]) / (r["prompt_tokens"] * PREFILL_S_PER_TOKEN) for r in requests]
    assert not_below(statistics.median(ttft_ratios), 1.0), ttft_ratios
    decode_steps = math.ceil((OUTPUT_TOKENS - 1) / TOKENS_PER_STEP)
    e2e_ratios = [
        (r["end"] - r["start"]) / (r["prompt_tokens"] * PREFILL_S_PER_TOKEN + decode_steps * DECODE_S_PER_STEP)
        for r in requests
    ]
    assert not_below(statistics.median(e2e_ratios), 1.0), e2e_ratios
    # two tokens per 20 ms step: TPOT counts tokens (10 ms), ITL counts chunk gaps (20 ms)
    assert not_below(single["tpot_ms"]["p50"], 1000 * DECODE_S_PER_STEP / TOKENS_PER_STEP), single["tpot_ms"]
    assert not_below(single["itl_ms"]["p50"], 1000 * DECODE_S_PER_STEP), single["itl_ms"]
    assert not_below(1000 / single["tokens_per_second_per_user"], 1000 * DECODE_S_PER_STEP / TOKENS_PER_STEP)
    assert single["goodput"]["slo_attainment"] == 1.0
    cost = single["cost"]
    assert cost["usd_per_million_output_tokens"] == pytest.approx(2.5 * 8 / 3600 / single["output_throughput"] * 1e6)


def test_a_higher_concurrency_runs_its_requests_side_by_side(sweep: tuple[Path, str]) -> None:
    out, _ = sweep
    runs = orjson.loads((out / "results.json").read_bytes())["runs"]
    by_concurrency = {r["load_point"]["concurrency"]: r["metrics"] for r in runs}
    assert set(by_concurrency) == {1, 3}
    assert by_concurrency[3]["requests"] == {"sent": 6, "completed": 6, "failed": 0}
    # three streams share the engine's steps (how much throughput that buys is a speed claim for bench/)
    assert by_concurrency[3]["achieved_concurrency"] > 1.5
    assert by_concurrency[1]["achieved_concurrency"] <= 1.0 + 1e-6


def test_results_json_matches_its_schema_and_records_the_configuration(sweep: tuple[Path, str]) -> None:
    out, _ = sweep
    results = orjson.loads((out / "results.json").read_bytes())
    schema = orjson.loads(SCHEMA.read_bytes())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(results)
    config = results["config"]
    assert config["models"] == [MODEL] and config["concurrency"] == [1, 3] and config["output_len"] == "fixed:25"
    assert config["slo"] == {"ttft": 2000.0, "tpot": 100.0} and config["gpus"] == 8
    assert "vllm bench serve" in results["definitions"]["ttft"]
    # The gateway reports its engine's cache hits (none: no prefix cache there), so the rate is known and 0.
    assert all(run["metrics"]["prompt_cache_hit_rate"] == 0.0 for run in results["runs"])


def test_schema_rejects_results_missing_a_metric(sweep: tuple[Path, str]) -> None:
    out, _ = sweep
    results = orjson.loads((out / "results.json").read_bytes())
    del results["runs"][0]["metrics"]["tpot_ms"]
    with pytest.raises(jsonschema.ValidationError, match="tpot_ms"):
        jsonschema.validate(results, orjson.loads(SCHEMA.read_bytes()))


def test_plots_are_valid_png_images(sweep: tuple[Path, str]) -> None:
    out, _ = sweep
    results = orjson.loads((out / "results.json").read_bytes())
    assert results["plots"] == [plots.LATENCY_PNG, plots.THROUGHPUT_PNG, plots.PER_USER_PNG]
    for name in results["plots"]:
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.width >= 400 and image.height >= 300
            image.verify()


def test_terminal_and_markdown_reports_show_the_results(sweep: tuple[Path, str]) -> None:
    out, stdout = sweep
    for text in ("latency (ms)", f"{MODEL}: throughput", "c=1", "c=3", "TPOT", "vllm", "results.json"):
        assert text in stdout
    report = (out / "report.md").read_text()
    assert "## Definitions" in report and "| timed-reference | c=3 |" in report
    assert f"]({plots.LATENCY_PNG})" in report


def test_poisson_arrivals_split_over_two_processes_with_a_dataset(
    timed_gateway: RunningGateway, tmp_path: Path
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "The module reads", "max_tokens": 3}\n{"prompt": "Return it", "max_tokens": 5}\n')
    out = tmp_path / "out"
    done = bench(
        "--url", timed_gateway.base_url, "--model", MODEL, "--request-rate", "25", "--num-requests", "10",
        "--workers", "2", "--dataset", str(dataset), "--endpoint", "completions", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    run = orjson.loads((out / "results.json").read_bytes())["runs"][0]
    assert run["load_generator"]["processes"] == 2
    assert run["load_generator"]["send_lag_ms"]["count"] == 10
    requests = read_requests(out)
    assert sorted(r["index"] for r in requests) == list(range(10))  # every request once, across both processes
    assert [r["output_tokens"] for r in sorted(requests, key=lambda r: r["index"])] == [3, 5] * 5
    assert run["metrics"]["requests"]["failed"] == 0


def test_without_matplotlib_a_timed_two_model_run_still_writes_json_and_markdown(
    timed_gateway: RunningGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plots, "matplotlib_missing", lambda: "matplotlib is not installed (test)")
    console = Console(file=io.StringIO(), width=100)
    config = BenchConfig(
        url=timed_gateway.base_url,
        models=(MODEL, SECOND_NAME),
        out=tmp_path,
        concurrency=(1, 2),
        duration=0.6,
        input_len=LengthSpec("uniform", 2, 30),
        output_len=LengthSpec("fixed", 3),
        warmup=0,
    )
    results = BenchRun(config, console).run()
    assert results["plots"] == [] and results["plots_skipped"] == "matplotlib is not installed (test)"
    # side by side: both models at c=1, then both at c=2
    assert [(r["model"], r["load_point"]["label"]) for r in results["runs"]] == [
        (MODEL, "c=1"),
        (SECOND_NAME, "c=1"),
        (MODEL, "c=2"),
        (SECOND_NAME, "c=2"),
    ]
    for run in results["runs"]:
        assert run["metrics"]["requests"]["completed"] >= 2 and run["metrics"]["requests"]["failed"] == 0
        assert run["load_point"]["num_requests"] is None  # bounded by duration
        assert 0.5 < run["metrics"]["duration_s"] < 5  # sends stop at 0.6 s; those in flight finish after
    # the same prompts for both models at a load point (same token counts, request by request)
    prompts: dict[tuple[str, int], dict[int, int]] = {}
    for request in read_requests(tmp_path):
        prompts.setdefault((request["model"], request["load_point"]), {})[request["index"]] = request["prompt_tokens"]
    for point in (0, 1):
        first, second = prompts[(MODEL, point)], prompts[(SECOND_NAME, point)]
        shared = set(first) & set(second)
        assert len(shared) >= 2 and all(first[i] == second[i] for i in shared)
    assert not list(tmp_path.glob("*.png"))
    assert (tmp_path / "results.json").exists()
    assert "Plots skipped: matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert "plots skipped" in console.file.getvalue()  # type: ignore[attr-defined]


def test_bad_options_exit_with_a_message_naming_them(tmp_path: Path) -> None:
    done = bench("--url", "http://127.0.0.1:9", "--model", "m", "--input-len", "uniform:9,3", "--out", str(tmp_path))
    assert done.returncode == 2 and "--input-len" in done.stderr


def test_a_run_where_nothing_completes_fails_but_still_reports_why(tmp_path: Path) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        done = bench("--url", url, "--model", "m", "--num-requests", "2", "--warmup", "0", "--out", str(tmp_path))
    assert done.returncode == 1 and "no request completed" in done.stderr
    run = orjson.loads((tmp_path / "results.json").read_bytes())["runs"][0]
    assert run["metrics"]["errors"] == {"connect": 2}
