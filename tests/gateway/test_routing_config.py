"""The routing keys of ``models`` entries: old configs stay valid, new shapes parse, mistakes name their key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, TargetConfig, load_config

BACKENDS = [{"name": n, "kind": "reference"} for n in ("a", "b", "c")]


def _write(tmp_path: Path, model: dict[str, object]) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"backends": BACKENDS, "models": [{"name": "m", **model}]}))
    return path


def test_a_plain_list_of_backend_names_is_still_valid_and_means_an_even_weighted_split(tmp_path: Path) -> None:
    (model,) = load_config(_write(tmp_path, {"backends": ["a", "b"]})).models
    assert model.backends == ["a", "b"], "names stay names for code that reads them"
    assert model.targets() == [TargetConfig(backend="a", weight=1), TargetConfig(backend="b", weight=1)]
    assert model.policy == "weighted" and model.fallbacks == [] and model.shadow is None
    assert model.allow_pin_header is False


def test_every_routing_key_parses(tmp_path: Path) -> None:
    (model,) = load_config(
        _write(
            tmp_path,
            {
                "backends": ["a", {"backend": "b", "weight": 0.5}],
                "policy": "prefix_affinity",
                "fallbacks": ["c", "a"],
                "shadow": {"backend": "c", "fraction": 0.1, "max_concurrency": 2},
                "allow_pin_header": True,
                "affinity": {"prefix_chars": 512, "load_factor": 2, "load_slack": 0},
                "circuit_breaker": {"failure_threshold": 3, "cooldown_seconds": 2.5},
            },
        )
    ).models
    assert [t.weight for t in model.targets()] == [1.0, 0.5]
    assert model.fallbacks == ["c", "a"]
    assert model.shadow is not None and model.shadow.max_concurrency == 2
    assert model.affinity.prefix_chars == 512 and model.circuit_breaker.cooldown_seconds == 2.5


def test_routing_keys_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_BACKENDS", '[{"name": "a", "kind": "reference"}, {"name": "b", "kind": "reference"}]')
    monkeypatch.setenv(
        "GATEWAY_MODELS", '[{"name": "m", "backends": [{"backend": "a", "weight": 3}, "b"], "fallbacks": ["b"]}]'
    )
    (model,) = load_config().models
    assert [(t.backend, t.weight) for t in model.targets()] == [("a", 3.0), ("b", 1.0)]


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ({"backends": ["a", "zz"]}, "models[0].backends[1]: unknown backend 'zz'"),
        ({"backends": [{"backend": "zz", "weight": 2}]}, "models[0].backends[0]: unknown backend 'zz'"),
        ({"backends": ["a"], "fallbacks": ["b", "zz"]}, "models[0].fallbacks[1]: unknown backend 'zz'"),
        ({"backends": ["a"], "shadow": {"backend": "zz", "fraction": 1}}, "models[0].shadow.backend: unknown"),
        ({"backends": [{"backend": "a", "weight": -1}]}, "models[0].backends[0].weight:"),
        ({"backends": [{"backend": "a", "wieght": 1}]}, "models[0].backends[0].wieght: Extra inputs"),
        ({"backends": [7]}, "models[0].backends[0]:"),
        ({"backends": ["a", {"backend": "a"}]}, "models[0].backends: Value error, backend(s) ['a'] listed more"),
        ({"backends": [{"backend": "a", "weight": 0}]}, "models[0].backends: Value error, at least one backend"),
        ({"backends": ["a"], "fallbacks": ["b", "b"]}, "models[0].fallbacks: Value error, backend(s) ['b']"),
        ({"backends": ["a"], "policy": "round_robin"}, "models[0].policy:"),
        ({"backends": ["a"], "shadow": {"backend": "b", "fraction": 1.5}}, "models[0].shadow.fraction:"),
        ({"backends": ["a"], "shadow": {"backend": "b"}}, "models[0].shadow.fraction: Field required"),
        ({"backends": ["a"], "affinity": {"load_factor": 0.5}}, "models[0].affinity.load_factor:"),
        ({"backends": ["a"], "circuit_breaker": {"failure_threshold": 0}}, "models[0].circuit_breaker.failure"),
    ],
)
def test_a_routing_mistake_names_its_key(tmp_path: Path, model: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, model))
    assert key in str(error.value)
