"""PNG plots of a run; needs matplotlib (the ``bench`` extra), and the run still reports without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCY_PNG = "latency_percentiles.png"
THROUGHPUT_PNG = "throughput.png"
PER_USER_PNG = "per_user_vs_total.png"

_PERCENTILE_STYLES = (("p50", "-"), ("p95", "--"), ("p99", ":"))


def matplotlib_missing() -> str | None:
    """Why plots cannot be drawn here, or None when they can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'deepinfer-gateway[bench]')"
    return None


def _by_model(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    series: dict[str, list[dict[str, Any]]] = {}
    for run in results["runs"]:
        series.setdefault(run["model"], []).append(run)
    for runs in series.values():
        runs.sort(key=lambda r: r["load_point"]["x"])
    return series


def _x_label(results: dict[str, Any]) -> str:
    return "request rate (req/s)" if results["config"]["request_rate"] else "concurrency (streams)"


def _log_x_if_wide(axis: Any, xs: list[float]) -> None:
    positive = sorted({x for x in xs if x > 0})
    if positive and positive[-1] / positive[0] >= 4:
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        axis.set_xscale("log", base=2)
        axis.set_xticks(positive)
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Writes the three PNGs into ``out`` and returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _by_model(results)
    colors = {model: f"C{i % 10}" for i, model in enumerate(series)}
    xs = [run["load_point"]["x"] for run in results["runs"]]
    written: list[str] = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for axis, (key, title) in zip(
        axes.flat,
        (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL (chunk gaps)"), ("e2el_ms", "end-to-end latency")),
        strict=True,
    ):
        for model, runs in series.items():
            for percentile, style in _PERCENTILE_STYLES:
                points = [(r["load_point"]["x"], r["metrics"][key][percentile]) for r in runs]
                points = [(x, y) for x, y in points if y is not None]
                if points:
                    axis.plot(
                        *zip(*points, strict=True),
                        style,
                        marker="o",
                        color=colors[model],
                        label=f"{model} {percentile}",
                    )
        axis.set_title(f"{title} (ms)")
        axis.set_xlabel(_x_label(results))
        axis.grid(True, alpha=0.3)
        _log_x_if_wide(axis, xs)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle("Latency percentiles (p50 solid, p95 dashed, p99 dotted)")
    fig.savefig(out / LATENCY_PNG, dpi=100)
    plt.close(fig)
    written.append(LATENCY_PNG)

    fig, (tokens_axis, requests_axis) = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    for model, runs in series.items():
        x = [r["load_point"]["x"] for r in runs]
        tokens_axis.plot(x, [r["metrics"]["output_throughput"] for r in runs], "-o", color=colors[model], label=model)
        requests_axis.plot(
            x, [r["metrics"]["request_throughput"] for r in runs], "-o", color=colors[model], label=model
        )
        if all(r["metrics"]["goodput"] for r in runs):
            goodput = [r["metrics"]["goodput"]["request_goodput"] for r in runs]
            requests_axis.plot(x, goodput, "--s", color=colors[model], label=f"{model} goodput")
    tokens_axis.set_title("output tokens / s")
    requests_axis.set_title("requests / s")
    for axis in (tokens_axis, requests_axis):
        axis.set_xlabel(_x_label(results))
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
        axis.set_ylim(bottom=0)
        _log_x_if_wide(axis, xs)
    fig.savefig(out / THROUGHPUT_PNG, dpi=100)
    plt.close(fig)
    written.append(THROUGHPUT_PNG)

    per_gpu = bool(results["config"].get("gpus"))
    fig, axis = plt.subplots(figsize=(7, 5), constrained_layout=True)
    for model, runs in series.items():
        labelled = [
            (
                r["metrics"]["output_throughput"] / (results["config"]["gpus"] if per_gpu else 1),
                r["metrics"]["tokens_per_second_per_user"],
                r["load_point"]["label"],
            )
            for r in runs
            if r["metrics"]["tokens_per_second_per_user"]
        ]
        if not labelled:
            continue
        axis.plot([p[0] for p in labelled], [p[1] for p in labelled], "-o", color=colors[model], label=model)
        for total, user, label in labelled:
            axis.annotate(label, (total, user), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    axis.set_xlabel("output tokens / s per GPU" if per_gpu else "output tokens / s (total)")
    axis.set_ylabel("output tokens / s per user (1000 / median TPOT ms)")
    axis.set_title("Interactivity vs throughput")
    axis.set_xlim(left=0)
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    if series:
        axis.legend(fontsize="small")
    fig.savefig(out / PER_USER_PNG, dpi=100)
    plt.close(fig)
    written.append(PER_USER_PNG)
    return written
