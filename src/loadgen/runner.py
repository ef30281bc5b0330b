"""Runs a whole benchmark: every load point for every model, side by side, then the report in every format."""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from gateway import __version__

from . import plots, report
from .arrivals import ShareResult, run_event_loop, run_shares
from .client import RequestRecord
from .config import BenchConfig, LoadPoint
from .metrics import DEFINITIONS, compute_metrics, summarize
from .workload import DatasetRow, load_dataset

SCHEMA_VERSION = 1
CLIENT_BUSY = 0.8
"""A load-generator process busier than this (CPU seconds per second) may be what limits the measurement."""
LATE_ARRIVALS_MS = 10.0
"""Open loop: a p99 send lag above this means arrivals were not offered on schedule."""


async def _served_models(config: BenchConfig) -> list[str] | None:
    """The server's ``/v1/models`` list, or None when it does not answer one (not every server has it)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"{config.base_url}/v1/models", headers=headers) as response,
        ):
            if response.status != 200:
                return None
            return [m.get("id") for m in orjson.loads(await response.read()).get("data", [])]
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
        return None


def _load_point_json(config: BenchConfig, point: LoadPoint) -> dict[str, Any]:
    return {
        "index": point.index,
        "label": point.label,
        "x": point.x,
        "concurrency": point.concurrency,
        "request_rate": point.request_rate
        if point.request_rate is None or math.isfinite(point.request_rate)
        else "inf",
        "max_concurrency": point.max_concurrency,
        "num_requests": config.requests_for(point),
        "duration_s": config.duration,
        "warmup_requests": config.warmup_for(point),
        "workers": config.workers_for(point),
    }


def _load_generator_json(shares: list[ShareResult]) -> dict[str, Any]:
    busy = [s.cpu_seconds / s.wall_seconds if s.wall_seconds > 0 else 0.0 for s in shares]
    lags = [lag for s in shares for lag in s.send_lags]
    return {
        "processes": len(shares),
        "cpu_utilisation": busy,
        "max_cpu_utilisation": max(busy),
        "send_lag_ms": summarize(lags, 1000.0) if lags else None,
        "warmup_failures": sum(s.warmup_failures for s in shares),
    }


def _warnings(model: str, point: LoadPoint, metrics: dict[str, Any], generator: dict[str, Any]) -> list[str]:
    where = f"{model} {point.label}"
    out: list[str] = []
    if generator["max_cpu_utilisation"] > CLIENT_BUSY:
        out.append(
            f"{where}: a load-generator process was {100 * generator['max_cpu_utilisation']:.0f}% busy; the client "
            "may be the bottleneck (raise --workers, or run the client on other cores)"
        )
    lag = generator["send_lag_ms"]
    if lag and lag["p99"] > LATE_ARRIVALS_MS:
        out.append(f"{where}: arrivals were sent late (p99 lag {lag['p99']:.1f} ms): the offered rate was not met")
    if metrics["tokens"]["source"]["chunks"]:
        out.append(
            f"{where}: {metrics['tokens']['source']['chunks']} responses carried no usage; their output tokens are "
            "counted as content chunks, which undercounts when a chunk holds several tokens"
        )
    if metrics["requests"]["failed"]:
        kinds = ", ".join(f"{kind}: {count}" for kind, count in metrics["errors"].items())
        requests = metrics["requests"]
        out.append(f"{where}: {requests['failed']} of {requests['sent']} requests failed ({kinds})")
    if generator["warmup_failures"]:
        out.append(f"{where}: {generator['warmup_failures']} warm-up requests failed")
    return out


class BenchRun:
    """One invocation of ``deepinfer-gateway bench``."""

    def __init__(self, config: BenchConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.dataset: list[DatasetRow] | None = (
            load_dataset(config.dataset, config.endpoint) if config.dataset is not None else None
        )
        self.rows: list[tuple[str, int, RequestRecord]] = []

    async def _measure(self, progress: Progress) -> tuple[list[dict[str, Any]], list[str]]:
        config = self.config
        runs: list[dict[str, Any]] = []
        warnings: list[str] = []
        served = await _served_models(config)
        if served is not None:
            warnings += [
                f"model {m!r} is not in the server's /v1/models list {served}" for m in config.models if m not in served
            ]
        for point in config.load_points():  # models side by side at each load point, so drift hits them alike
            for model in config.models:
                total = config.requests_for(point)
                unit = "requests" if total is not None else "s"
                task = progress.add_task(f"{model} {point.label}", total=total or config.duration, unit=unit)
                started = time.perf_counter()

                def on_progress(
                    done: int,
                    task: Any = task,
                    total: int | None = total,
                    label: str = f"{model} {point.label}",
                    started: float = started,
                ) -> None:
                    if total is not None:
                        progress.update(task, completed=done)
                    else:
                        elapsed = min(time.perf_counter() - started, config.duration or 0.0)
                        progress.update(task, completed=elapsed, description=f"{label} ({done} done)")

                shares = await run_shares(config, self.dataset, model, point, on_progress)
                progress.update(task, completed=total or config.duration)
                records = sorted((r for s in shares for r in s.records), key=lambda r: r.start)
                self.rows += [(model, point.index, r) for r in records]
                metrics = compute_metrics(
                    records, slo=config.slo, gpu_hour_price=config.gpu_hour_price, gpus=config.gpus
                )
                generator = _load_generator_json(shares)
                warnings += _warnings(model, point, metrics, generator)
                runs.append(
                    {
                        "model": model,
                        "load_point": _load_point_json(config, point),
                        "metrics": metrics,
                        "load_generator": generator,
                    }
                )
        return runs, warnings

    def run(self) -> dict[str, Any]:
        """Measures, then writes results.json, report.md, requests.jsonl and the plots into ``config.out``."""
        config = self.config
        config.out.mkdir(parents=True, exist_ok=True)
        started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        wall0 = time.perf_counter()
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} {task.fields[unit]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        with progress:
            runs, warnings = run_event_loop(self._measure(progress))
        results: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "tool": "deepinfer-gateway bench",
            "version": __version__,
            "started_at": started_at,
            "wall_seconds": time.perf_counter() - wall0,
            "environment": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "aiohttp": aiohttp.__version__,
            },
            "config": config.to_json(),
            "definitions": DEFINITIONS,
            "runs": runs,
            "warnings": warnings,
            "plots": [],
            "plots_skipped": None,
            "files": {"results": "results.json", "report": "report.md", "requests": "requests.jsonl"},
        }
        missing = plots.matplotlib_missing()
        if missing:
            results["plots_skipped"] = missing
        else:
            results["plots"] = plots.write_plots(results, config.out)
        report.write_requests(config.out / "requests.jsonl", self.rows)
        report.write_json(config.out / "results.json", results)
        (config.out / "report.md").write_text(report.markdown_report(results))
        report.print_summary(self.console, results)
        if missing:
            self.console.print(f"[yellow]plots skipped:[/yellow] {missing}")
        written = ["results.json", "report.md", "requests.jsonl", *results["plots"]]
        self.console.print(f"wrote {', '.join(str(Path(config.out) / name) for name in written)}")
        return results
