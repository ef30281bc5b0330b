"""The ``deepinfer-gateway`` command: ``serve``, and ``config check``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gateway.config import ConfigError, load_config

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
    host: Annotated[str | None, typer.Option(help="Bind address (overrides server.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (overrides server.port).")] = None,
    log_level: Annotated[str | None, typer.Option(help="critical, error, warning, info or debug.")] = None,
) -> None:
    """Serve the OpenAI API. With no configuration, serves the CPU reference engine on 127.0.0.1:8000."""
    from gateway.server import run_server

    try:
        settings = load_config(config, host=host, port=port, log_level=log_level)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    run_server(settings)


@config_app.command("check")
def config_check(config: Annotated[Path, typer.Argument(help="YAML configuration file.")]) -> None:
    """Validate a configuration file (with the environment applied) and print the result."""
    import yaml

    try:
        settings = load_config(config)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    typer.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))


def main() -> None:
    app(prog_name="deepinfer-gateway")


if __name__ == "__main__":
    sys.exit(main())
