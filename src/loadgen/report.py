"""Puts a run's numbers where people and programs read them: the terminal, results.json, report.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from .client import RequestRecord
from .metrics import DEFINITIONS

SHORT_DEFINITIONS = (
    "TTFT: first chunk with non-empty content or reasoning (vllm bench serve stops at the first chunk with any "
    "choice: time_to_first_chunk_ms in results.json). TPOT: (last - first token) / (tokens - 1), as vllm's. "
    "ITL: gaps between content chunks, pooled, as vllm's. E2E: sent -> end of stream. Tokens: server usage. "
    "tok/s/user = 1000 / median TPOT."
)


def _ms(summary: dict[str, Any], *keys: str) -> str:
    values = [summary.get(k) for k in keys]
    present = [v for v in values if v is not None]
    if len(present) < len(values):
        return "-"
    return " / ".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in present)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


LATENCY_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms"))


def latency_table(runs: list[dict[str, Any]]) -> Table:
    """Rows of (model, load point, metric) with mean and percentiles: narrow enough for an 80-column terminal."""
    table = Table(title="latency (ms)", header_style="bold")
    for name in ("model", "load", "metric", "mean", "p50", "p90", "p95", "p99"):
        table.add_column(name, justify="left" if name in ("model", "load", "metric") else "right")
    for run in runs:
        for number, (label, key) in enumerate(LATENCY_ROWS):
            summary = run["metrics"][key]
            table.add_row(
                run["model"] if number == 0 else "",
                run["load_point"]["label"] if number == 0 else "",
                label,
                *(_ms(summary, k) for k in ("mean", "p50", "p90", "p95", "p99")),
                end_section=number == len(LATENCY_ROWS) - 1,
            )
    return table


def throughput_tables(runs: list[dict[str, Any]]) -> list[Table]:
    """Per model, one row per load point: requests, throughput, per-user speed, goodput (SLO attainment), cost."""
    tables: dict[str, Table] = {}
    for run in runs:
        table = tables.get(run["model"])
        if table is None:
            table = tables[run["model"]] = Table(title=f"{run['model']}: throughput", header_style="bold")
            for name in ("load", "ok/sent", "req/s", "tok/s", "tok/s/user", "cache hits", "goodput", "USD/Mtok"):
                table.add_column(name, justify="left" if name == "load" else "right")
        m = run["metrics"]
        goodput, cost = m["goodput"], m["cost"]
        table.add_row(
            run["load_point"]["label"],
            f"{m['requests']['completed']}/{m['requests']['sent']}",
            _num(m["request_throughput"], 2),
            _num(m["output_throughput"], 0),
            _num(m["tokens_per_second_per_user"], 1),
            _percent(m["prompt_cache_hit_rate"]),
            f"{goodput['request_goodput']:.2f} {100 * goodput['slo_attainment']:.0f}%" if goodput else "-",
            _num(cost["usd_per_million_output_tokens"], 3) if cost else "-",
        )
    return list(tables.values())


def print_summary(console: Console, results: dict[str, Any]) -> None:
    console.print(latency_table(results["runs"]))
    for table in throughput_tables(results["runs"]):
        console.print(table)
    console.print(f"[dim]{SHORT_DEFINITIONS}[/dim]")
    for warning in results["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def write_requests(path: Path, rows: list[tuple[str, int, RequestRecord]]) -> None:
    """Every request of every load point, one JSON line each (times in seconds since its load point started)."""
    with path.open("wb") as out:
        for model, point, record in rows:
            out.write(
                orjson.dumps(
                    {
                        "model": model,
                        "load_point": point,
                        "index": record.index,
                        "start": round(record.start, 6),
                        "end": round(record.end, 6),
                        "first_chunk": None if record.first_chunk is None else round(record.first_chunk, 6),
                        "token_times": [round(t, 6) for t in record.token_times],
                        "prompt_tokens": record.prompt_tokens,
                        "output_tokens": record.output_tokens,
                        "cached_prompt_tokens": record.cached_prompt_tokens,
                        "max_tokens": record.max_tokens,
                        "finish_reason": record.finish_reason,
                        "error": record.error,
                        "error_detail": record.error_detail,
                    }
                )
            )
            out.write(b"\n")


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_report(results: dict[str, Any]) -> str:
    """A self-contained report: configuration, results per model and load point, definitions, plots."""
    config = results["config"]
    lines = [
        "# deepinfer-gateway bench report",
        "",
        f"Run started {results['started_at']} against `{config['url']}`, finished in {results['wall_seconds']:.1f} s.",
        "",
        "## Configuration",
        "",
        _md_row(["setting", "value"]),
        _md_row(["---", "---"]),
    ]
    for key, value in config.items():
        lines.append(_md_row([f"`{key}`", f"`{orjson.dumps(value).decode()}`"]))
    lines += ["", "## Results", ""]
    header = [
        "model",
        "load",
        "ok/sent",
        "req/s",
        "out tok/s",
        "tok/s/user",
        "prompt cache hits",
        "TTFT ms p50/p95/p99",
        "TPOT ms p50/p95/p99",
        "ITL ms p50/p95/p99",
        "E2E ms p50/p95/p99",
        "goodput req/s",
        "SLO attainment",
        "USD/M out tok",
        "errors",
    ]
    lines += [_md_row(header), _md_row(["---"] * len(header))]
    for run in results["runs"]:
        m = run["metrics"]
        goodput, cost = m["goodput"], m["cost"]
        lines.append(
            _md_row(
                [
                    run["model"],
                    run["load_point"]["label"],
                    f"{m['requests']['completed']}/{m['requests']['sent']}",
                    _num(m["request_throughput"], 2),
                    _num(m["output_throughput"], 0),
                    _num(m["tokens_per_second_per_user"], 1),
                    _percent(m["prompt_cache_hit_rate"]),
                    _ms(m["ttft_ms"], "p50", "p95", "p99"),
                    _ms(m["tpot_ms"], "p50", "p95", "p99"),
                    _ms(m["itl_ms"], "p50", "p95", "p99"),
                    _ms(m["e2el_ms"], "p50", "p95", "p99"),
                    _num(goodput["request_goodput"], 2) if goodput else "-",
                    f"{100 * goodput['slo_attainment']:.1f}%" if goodput else "-",
                    _num(cost["usd_per_million_output_tokens"], 3) if cost else "-",
                    ", ".join(f"{k}: {v}" for k, v in m["errors"].items()) or "-",
                ]
            )
        )
    lines += ["", "Mean and p90 of every metric, token counts and per-process load-generator figures are in "]
    lines[-1] += "`results.json`; every request is in `requests.jsonl`."
    if results["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in results["warnings"]]
    lines += ["", "## Definitions", ""]
    lines += [f"- **{key}**: {text}" for key, text in DEFINITIONS.items()]
    lines += ["", "## Plots", ""]
    if results["plots"]:
        lines += [f"![{Path(p).stem}]({p})" for p in results["plots"]]
    else:
        lines.append(f"Plots skipped: {results['plots_skipped']}")
    return "\n".join(lines) + "\n"
