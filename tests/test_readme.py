"""The README is product: its commands and its configuration example stay true."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_serve_and_test_commands_and_ci_runs_the_test_one() -> None:
    first_block = re.search(r"```sh\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make serve", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci.splitlines()[-1]


def test_readme_configuration_example_is_a_valid_config() -> None:
    section = README[README.index("## Configure") :]
    example = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert example is not None
    config = GatewayConfig(**yaml.safe_load(example.group(1)))
    assert config.models[0].name == "deepinfer-reference"


def test_every_doc_the_readme_links_exists() -> None:
    for target in re.findall(r"\]\(((?:docs|deploy)/[^)#]+)\)", README):
        assert (ROOT / target).exists(), target
