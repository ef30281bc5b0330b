"""The ``deepinfer-gateway`` command: ``serve``, ``ranks`` (a node's rank workers), ``rank-keys`` (their CURVE keys),
``bench`` and ``config check``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gateway.config import ConfigError, load_config

if TYPE_CHECKING:
    from loadgen.config import BenchConfig

app = typer.Typer(help="OpenAI-compatible gateway for DeepInfer engines and LMDeploy servers.", no_args_is_help=True)
config_app = typer.Typer(help="Work with configuration files.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML configuration file; GATEWAY_* environment variables override it."),
]


@app.command()
def serve(
    config: ConfigOption = None,
    host: Annotated[str | None, typer.Option(help="Bind address (overrides server.http.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (overrides server.http.port).")] = None,
    log_level: Annotated[str | None, typer.Option(help="critical, error, warning, info or debug.")] = None,
) -> None:
    """Serve the OpenAI API. With no configuration, serves the CPU reference engine on 127.0.0.1:8000."""
    from gateway.server import run_server

    try:
        settings = load_config(config, host=host, port=port, log_level=log_level)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    problem = settings.server.tracing.unavailable()
    if problem is not None:
        typer.echo(problem, err=True)
        raise typer.Exit(2)
    run_server(settings)


@app.command()
def ranks(
    backend: Annotated[str, typer.Option(help="Name of the backend whose ranks to run (kind deepinfer or reference).")],
    config: ConfigOption = None,
    nodes: Annotated[int, typer.Option(help="Nodes the backend's ranks are shared by, equally.")] = 1,
    node: Annotated[int, typer.Option(help="This node's index, 0..nodes-1 (node 0 runs rank 0).")] = 0,
    host: Annotated[
        str,
        typer.Option(
            help="Address the ranks bind (each at its worker_endpoints port). Beyond the loopback (another host's "
            "gateway, 0.0.0.0, a pod IP) the backend needs rank_keys: the ranks admit only dispatchers with a key."
        ),
    ] = "127.0.0.1",
    master_addr: Annotated[
        str | None, typer.Option(help="Host of DeepInfer's rendezvous, rank 0's node (overrides master_addr).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="critical, error, warning, info or debug.")] = "info",
) -> None:
    """Run this node's share of a backend's rank workers, for gateways that list them in worker_endpoints.

    Exits 1 when a rank fails (its group restarts whole, by whatever runs the nodes), 0 on SIGTERM or when the
    group stopped together."""
    from backends.registry import rank_node
    from gateway.logs import configure_logging

    try:
        settings = load_config(config)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    configure_logging(log_level)
    chosen = next((b for b in settings.backends if b.name == backend), None)
    try:
        if chosen is None:
            raise ValueError(f"no backend {backend!r} (declared: {[b.name for b in settings.backends]})")
        node_share = rank_node(chosen, nodes, node, host, master_addr)
    except ValueError as exc:
        typer.echo(f"ranks: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(node_share.run())


@app.command("rank-keys")
def rank_keys(
    directory: Annotated[Path, typer.Argument(help="Where to write the key files (created if missing).")],
) -> None:
    """Create the rank plane's CURVE keys: the ranks' and the gateway's key pairs, for a backend's rank_keys.

    Make a Kubernetes Secret of the directory (kubectl create secret generic NAME --from-file=DIR) and mount it
    where rank_keys points, on the gateway and on every rank node. Existing key files are never overwritten."""
    from backends.errors import RankKeysError
    from backends.registry import create_rank_keys

    try:
        written = create_rank_keys(directory)
    except (RankKeysError, OSError) as exc:
        typer.echo(f"rank-keys: {exc}", err=True)
        raise typer.Exit(2) from exc
    for path in written:
        typer.echo(str(path))


REDACTED = "<redacted>"
SECRET_FIELDS = frozenset({"api_key", "admin_api_key", "thinking_signature_key"})
"""Configuration fields holding secrets: the admin key, upstream bearer tokens and the thinking-signature key
(client keys: ``api_keys``)."""


URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:]*):[^/@]*@", re.IGNORECASE)
"""The password in a URL's user info (``redis://:password@host``)."""


def redact_secrets(value: Any) -> Any:
    """The dumped configuration with every key replaced by ``REDACTED``: client keys (plain or with limits), the
    admin key, upstream ``api_key``s, the OTLP exporter's headers and passwords in URLs, wherever they came from
    (file, ``GATEWAY_*`` or ``OTEL_*`` variables)."""
    if isinstance(value, str):
        return URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for name, item in value.items():
        if name in SECRET_FIELDS and item is not None:
            out[name] = REDACTED
        elif name == "api_keys" and isinstance(item, list):
            out[name] = [REDACTED if isinstance(k, str) else {**k, "key": REDACTED} for k in item]
        elif name == "headers" and isinstance(item, dict):  # server.tracing.headers: collector credentials
            out[name] = dict.fromkeys(item, REDACTED)
        else:
            out[name] = redact_secrets(item)
    return out


@config_app.command("check")
def config_check(
    config: Annotated[Path, typer.Argument(help="YAML configuration file.")],
    show_secrets: Annotated[
        bool, typer.Option("--show-secrets", help="Print API keys in clear text (they are redacted by default).")
    ] = False,
) -> None:
    """Validate a configuration file (with the environment applied) and print the result, keys redacted."""
    import yaml

    try:
        settings = load_config(config)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    dumped = settings.model_dump(mode="json")
    typer.echo(yaml.safe_dump(dumped if show_secrets else redact_secrets(dumped), sort_keys=False))


def _positive_int(text: str, option: str) -> int:
    from loadgen.config import BenchConfigError

    if not text.isdigit() or int(text) < 1:
        raise BenchConfigError(f"{option}: {text!r} is not a positive integer or auto")
    return int(text)


def _require_loadgen() -> None:
    """Exits with a clear message where the load generator (a package of its own) is not installed, as in the
    server image."""
    try:
        import loadgen.runner  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "loadgen":
            raise
        typer.echo("bench needs the loadgen package, which this installation (the server image) leaves out", err=True)
        raise typer.Exit(2) from exc


def _checked_bench_options(
    extra_body: str | None, concurrency: str | None, request_rate: str | None, endpoint: str
) -> dict[str, Any]:
    """The options ``BenchConfig`` cannot check alone; the parsed ``--extra-body``."""
    import json

    from loadgen.config import BenchConfigError

    extra = json.loads(extra_body) if extra_body else {}
    if not isinstance(extra, dict):
        raise BenchConfigError("--extra-body must be a JSON object")
    if concurrency and request_rate:
        raise BenchConfigError("give --concurrency or --request-rate, not both")
    if endpoint not in ("chat", "completions"):
        raise BenchConfigError("--endpoint must be chat or completions")
    return extra


@contextlib.contextmanager
def _bench_errors() -> Iterator[None]:
    """A configuration the load generator refuses exits with status 2 and its reason."""
    from loadgen.config import BenchConfigError

    try:
        yield
    except (BenchConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


ConcurrencyOption = Annotated[
    str | None, typer.Option(help="Closed-loop concurrency levels, comma-separated (a sweep); default 1.")
]
RequestRateOption = Annotated[
    str | None, typer.Option(help="Open-loop Poisson arrival rates in req/s, comma-separated; 'inf' = all at once.")
]
NumRequestsOption = Annotated[
    int | None,
    typer.Option(help="Measured requests per model and load point; default max(50, 10 x c), 100 with a rate."),
]
InputLenOption = Annotated[str, typer.Option(help="Prompt words: N, fixed:N, uniform:LOW,HIGH or normal:MEAN,STD.")]
DatasetOption = Annotated[
    Path | None, typer.Option(help="JSONL prompts: {'prompt': ...} or {'messages': [...]}, optional 'max_tokens'.")
]
EndpointOption = Annotated[str, typer.Option(help="chat (/v1/chat/completions) or completions (/v1/completions).")]
GpuHourPriceOption = Annotated[float | None, typer.Option(help="USD per accelerator-hour, for cost per 1M tokens.")]
WarmupOption = Annotated[
    int | None, typer.Option(help="Warm-up requests per model and load point; default c, 8 with a rate.")
]


def _parsed_bench_fields(
    *, concurrency: str | None, request_rate: str | None, input_len: str, output_len: str, slo: str | None
) -> dict[str, Any]:
    """The load points, lengths and SLO bounds of a ``BenchConfig``, parsed from their command-line strings."""
    from loadgen.config import LengthSpec, parse_levels, parse_slo

    return {
        "concurrency": tuple(int(c) for c in parse_levels(concurrency or "1", "--concurrency", integer=True)),
        "request_rate": tuple(parse_levels(request_rate, "--request-rate", integer=False)) if request_rate else (),
        "input_len": LengthSpec.parse(input_len, "--input-len"),
        "output_len": LengthSpec.parse(output_len, "--output-len"),
        "slo": parse_slo(slo),
    }


def _run_bench(config: BenchConfig) -> None:
    """Run the benchmark; a run in which no request completed measured nothing and exits with status 1."""
    from loadgen.runner import BenchRun

    results = BenchRun(config).run()
    if not any(run["metrics"]["requests"]["completed"] for run in results["runs"]):
        typer.echo("error: no request completed", err=True)
        raise typer.Exit(1)


@app.command()
def bench(
    url: Annotated[str, typer.Option(help="Server root or its /v1 URL (this gateway or any OpenAI-compatible one).")],
    model: Annotated[list[str], typer.Option("--model", help="Model to load; repeat to compare side by side.")],
    out: Annotated[Path, typer.Option(help="Directory for results.json, report.md, requests.jsonl and PNG plots.")],
    concurrency: ConcurrencyOption = None,
    request_rate: RequestRateOption = None,
    max_concurrency: Annotated[int | None, typer.Option(help="Cap on requests in flight with --request-rate.")] = None,
    num_requests: NumRequestsOption = None,
    duration: Annotated[float | None, typer.Option(help="Seconds per model and load point instead.")] = None,
    input_len: InputLenOption = "256",
    output_len: Annotated[str, typer.Option(help="max_tokens, same forms as --input-len.")] = "128",
    dataset: DatasetOption = None,
    prefix_groups: Annotated[int, typer.Option(help="Shared-prefix groups: each prompt starts with one of G.")] = 0,
    prefix_len: Annotated[int, typer.Option(help="Words in each shared prefix (a system message for chat).")] = 0,
    endpoint: EndpointOption = "chat",
    ignore_eos: Annotated[bool, typer.Option(help="Send ignore_eos so outputs run to max_tokens.")] = True,
    slo: Annotated[str | None, typer.Option(help="Goodput bounds in ms, any of ttft=200,tpot=50,e2el=5000.")] = None,
    gpu_hour_price: GpuHourPriceOption = None,
    gpus: Annotated[int | None, typer.Option(help="Accelerators serving the model.")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token sent to the server.")] = None,
    warmup: WarmupOption = None,
    seed: Annotated[int, typer.Option(help="Seed for prompts, lengths and arrivals.")] = 0,
    workers: Annotated[str, typer.Option(help="Load-generator processes: N, or auto (1 per 256 streams).")] = "auto",
    timeout: Annotated[float, typer.Option(help="Seconds before one request counts as a timeout.")] = 600.0,
    extra_body: Annotated[str | None, typer.Option(help="JSON object merged into every request body.")] = None,
) -> None:
    """Benchmark OpenAI-compatible servers: TTFT, TPOT, ITL, E2E percentiles, throughput, goodput and cost."""
    _require_loadgen()
    from loadgen.config import BenchConfig

    with _bench_errors():
        extra = _checked_bench_options(extra_body, concurrency, request_rate, endpoint)
        parsed = _parsed_bench_fields(
            concurrency=concurrency, request_rate=request_rate, input_len=input_len, output_len=output_len, slo=slo
        )
        config = BenchConfig(
            url=url,
            models=tuple(model),
            out=out,
            max_concurrency=max_concurrency,
            num_requests=num_requests,
            duration=duration,
            dataset=dataset,
            prefix_groups=prefix_groups,
            prefix_len=prefix_len,
            endpoint=endpoint,  # type: ignore[arg-type]
            ignore_eos=ignore_eos,
            gpu_hour_price=gpu_hour_price,
            gpus=gpus,
            api_key=api_key,
            warmup=warmup,
            seed=seed,
            workers=None if workers == "auto" else _positive_int(workers, "--workers"),
            timeout=timeout,
            extra_body=extra,
            **parsed,
        )
        _run_bench(config)


def main() -> None:
    app(prog_name="deepinfer-gateway")


if __name__ == "__main__":
    main()
