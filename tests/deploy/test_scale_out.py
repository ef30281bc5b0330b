"""The scale-out overlay: replicas sharing budgets and stored responses through two Valkey instances, a password
from a Secret, a NetworkPolicy around the stores, and an autoscaler on the gateway's own metric.

The manifests are tied to the gateway's real config keys (the patch's environment goes through ``load_config``)
and to a real ``valkey-server``: each Valkey container's own command and arguments are run, with Kubernetes'
``$(VAR)`` expansion, and the gateway's budget and response-store code talks to it as the manifests connect it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import redis
import yaml

from gateway.budgets import Draw, RedisBudgets, bucket_key
from gateway.config import load_config
from gateway.responses.records import StoredResponse
from gateway.responses.redis_store import RedisResponseStore

from ..conftest import wait_until
from ..valkey import VALKEY_SERVER
from .test_deploy import (
    CONFIG_DIR,
    KUBERNETES_DIR,
    KUBERNETES_VERSIONS,
    gateway_container,
    load_resources,
    no_gateway_environment,  # noqa: F401  (autouse: the files must validate on their own)
    no_network,  # noqa: F401
    resource,
)

SCALE_OUT_DIR = KUBERNETES_DIR / "scale-out"
GATEWAY_POD = ("deepinfer-gateway", "gateway")
"""The gateway pods' (app.kubernetes.io/name, app.kubernetes.io/component) labels in the base."""


def _overlay() -> dict[str, Any]:
    return yaml.safe_load((SCALE_OUT_DIR / "kustomization.yaml").read_text())


def _overlay_resources() -> list[Path]:
    return [SCALE_OUT_DIR / name for name in _overlay()["resources"] if not name.startswith("..")]


def _shipped(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        item
        for path in _overlay_resources()
        for item in load_resources(path)
        if item["kind"] == kind and (name is None or item["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {SCALE_OUT_DIR}, found {len(found)}"
    return found[0]


def _patch_container() -> dict[str, Any]:
    (patch_file,) = (entry["path"] for entry in _overlay()["patches"])
    patch = yaml.safe_load((SCALE_OUT_DIR / patch_file).read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    return container


def _secret_value(reference: dict[str, Any]) -> str:
    secret = _shipped("Secret", reference["name"])
    data = secret.get("stringData") or {}
    assert reference["key"] in data, f"the Secret {reference['name']} has no key {reference['key']!r}"
    return str(data[reference["key"]])


def _expand(env: list[dict[str, Any]], secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: values from Secrets, and ``$(NAME)`` replaced by a
    variable defined earlier in the list (later ones, or unknown names, stay as they are, as in Kubernetes)."""
    out: dict[str, str] = {}
    for entry in env:
        if "valueFrom" in entry:
            reference = entry["valueFrom"]["secretKeyRef"]
            key = (reference["name"], reference["key"])
            out[entry["name"]] = (secrets or {}).get(key) or _secret_value(reference)
        else:
            out[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), entry["value"])
    return out


def _expand_args(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def _stores() -> dict[str, dict[str, Any]]:
    """Each Valkey's workload (Deployment or StatefulSet) by the Service in front of it."""
    out = {}
    for service_name in ("deepinfer-gateway-budgets", "deepinfer-gateway-responses"):
        service = _shipped("Service", service_name)
        workloads = [
            item
            for path in _overlay_resources()
            for item in load_resources(path)
            if item["kind"] in ("Deployment", "StatefulSet")
            and service["spec"]["selector"].items() <= item["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(workloads) == 1, f"the Service {service_name} selects {len(workloads)} workloads"
        out[service_name] = workloads[0]
    return out


def _valkey(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _gateway_settings(password: str | None = None) -> tuple[dict[str, str], Any]:
    """The patched gateway's environment and the config it loads with it (the base's config file)."""
    container = _patch_container()
    secrets = None
    if password is not None:
        reference = next(e for e in container["env"] if "valueFrom" in e)["valueFrom"]["secretKeyRef"]
        secrets = {(reference["name"], reference["key"]): password}
    env = _expand(container["env"], secrets)
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("GATEWAY_"):
                mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        return env, load_config(CONFIG_DIR / "reference.yaml")


# --- the overlay as files --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_scale_out_manifests_validate_strictly_offline(version: str) -> None:
    for path in _overlay_resources():
        for item in load_resources(path):
            kubernetes_validate.validate(item, version, strict=True)


def test_scale_out_overlay_builds_on_the_base_and_lists_every_file_it_ships() -> None:
    overlay = _overlay()
    assert "../base" in overlay["resources"], "the overlay extends deploy/kubernetes/base"
    patches = [entry["path"] for entry in overlay["patches"]]
    shipped = sorted(p.name for p in SCALE_OUT_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted([p.name for p in _overlay_resources()] + patches) == shipped


# --- the gateway's side: real config keys ------------------------------------------------------------------------


def test_every_replica_reaches_its_two_valkeys_through_real_config_keys_with_the_secrets_password() -> None:
    container = _patch_container()
    assert container["name"] == gateway_container()["name"], "a strategic merge patch matches containers by name"
    env, config = _gateway_settings(password="0123abcd")
    server = config.server
    assert server.runtime.workers == 2
    for url, service_name in (
        (server.stores.state_store, "deepinfer-gateway-budgets"),
        (server.stores.responses_store, "deepinfer-gateway-responses"),
    ):
        assert url is not None
        parts = urlsplit(url)
        (port,) = _shipped("Service", service_name)["spec"]["ports"]
        assert parts.scheme == "redis" and (parts.hostname, parts.port) == (service_name, port["port"]), url
        assert (parts.username, parts.password) == ("gateway", "0123abcd"), "the Secret's password, expanded"
    assert server.stores.state_store != server.stores.responses_store, (
        "budgets and stored responses never share an instance"
    )
    assert "$(" not in " ".join(env.values()), "every $(VAR) is defined before it is used"


def test_budgets_and_responses_live_in_separate_valkeys_that_never_evict() -> None:
    _, config = _gateway_settings(password="0123abcd")
    stores = _stores()
    budgets, responses = (_valkey(stores[name])["args"] for name in stores)
    for args in (budgets, responses):
        assert _flag(args, "--maxmemory-policy") == "noeviction"
    assert _flag(budgets, "--appendonly") == "no" and _flag(budgets, "--save") == "", "budgets are not persisted"
    assert _flag(responses, "--appendonly") == "yes", "stored conversations survive a restart"
    responses_workload = stores["deepinfer-gateway-responses"]
    assert responses_workload["kind"] == "StatefulSet" and responses_workload["spec"]["volumeClaimTemplates"]
    maxmemory = _bytes(_flag(responses, "--maxmemory"))
    # every stored response also costs a key, an age-index entry and a size entry: room for that above the bound
    assert config.server.stores.responses_max_bytes * 1.25 <= maxmemory, "the gateway's bound keeps Valkey from filling"
    limit = _bytes(_valkey(responses_workload)["resources"]["limits"]["memory"])
    assert limit >= 2 * maxmemory, "rewriting the append-only file forks: room for the copy"


def _bytes(size: str) -> int:
    units = {"kb": 1000, "mb": 1000**2, "gb": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
    match = re.fullmatch(r"(\d+)([a-zA-Z]{2})?", size)
    assert match, size
    return int(match.group(1)) * units[(match.group(2) or "").lower()] if match.group(2) else int(match.group(1))


def test_the_password_comes_from_one_secret_and_only_gateway_pods_reach_the_stores() -> None:
    gateway_reference = next(e for e in _patch_container()["env"] if "valueFrom" in e)["valueFrom"]["secretKeyRef"]
    policy = _shipped("NetworkPolicy")
    expressions = {e["key"]: e for e in policy["spec"]["podSelector"]["matchExpressions"]}
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    (port,) = rule["ports"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for workload in _stores().values():
        container = _valkey(workload)
        env = {e["name"]: e for e in container["env"]}
        assert env["VALKEY_PASSWORD"]["valueFrom"]["secretKeyRef"] == gateway_reference
        assert ">$(VALKEY_PASSWORD)" in container["args"], "the gateway user's password is the Secret's"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for key, expression in expressions.items():
            assert expression["operator"] == "In" and labels[key] in expression["values"], "the policy covers it"
        assert port["port"] in {p["name"] for p in container["ports"]}
        assert not source["podSelector"]["matchLabels"].items() <= labels.items(), "a store cannot reach a store"
    pod_labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= pod_labels.items(), "the gateway's pods are let in"
    assert (pod_labels["app.kubernetes.io/name"], pod_labels["app.kubernetes.io/component"]) == GATEWAY_POD


# --- each Valkey as its manifest runs it ---------------------------------------------------------------------------


class ManifestValkey:
    """A Valkey container's command and arguments, run here on a unix socket in ``folder``: the port, the data
    directory and maxmemory (4 MB, so that filling it is quick) are the only changes."""

    def __init__(self, container: dict[str, Any], folder: Path, password: str) -> None:
        self.socket = folder / "valkey.sock"
        env = {"VALKEY_PASSWORD": password}
        args = _expand_args(container["args"], env)
        for flag, value in (("--port", "0"), ("--dir", str(folder)), ("--maxmemory", "4mb")):
            args[args.index(flag) + 1] = value
        command = [*container["command"], *args, "--unixsocket", str(self.socket)]
        path = f"{VALKEY_SERVER.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.process = subprocess.Popen(
            command, env={**env, "PATH": path}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    def client(self, **credentials: str) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), socket_connect_timeout=1, **credentials)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(params=["deepinfer-gateway-budgets", "deepinfer-gateway-responses"])
def manifest_valkey(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ManifestValkey, str]]:
    """(the Valkey of that Service, as its manifest runs it; the URL the gateway's patch gives for it)."""
    password = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    server = ManifestValkey(_valkey(_stores()[request.param]), tmp_path, password)
    try:
        assert wait_until(server.socket.exists, timeout=30), (
            server.process.stdout.read() if server.process.stdout else ""
        )
        _, config = _gateway_settings(password=password)
        url = (
            config.server.stores.state_store
            if request.param.endswith("budgets")
            else config.server.stores.responses_store
        )
        yield server, url
    finally:
        server.stop()


def _as_the_gateway(server: ManifestValkey, url: str) -> redis.Redis:
    parts = urlsplit(url)
    assert parts.username is not None and parts.password is not None
    return server.client(username=parts.username, password=parts.password)


def test_a_valkey_of_the_manifests_takes_only_the_gateway_user_and_never_evicts(
    manifest_valkey: tuple[ManifestValkey, str],
) -> None:
    server, url = manifest_valkey
    anonymous = server.client()
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    gateway = _as_the_gateway(server, url)
    try:
        assert gateway.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.flushall()  # dangerous commands are not the gateway's
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.set("someone-else:key", "x")  # nor keys outside gateway:*
        blob = b"x" * 256 * 1024
        stored = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            while stored < 1000:
                gateway.set(f"gateway:fill:{stored}", blob, ex=3600)  # evictable under volatile-* too
                stored += 1
        assert 0 < stored < 1000
        assert gateway.exists(*(f"gateway:fill:{i}" for i in range(stored))) == stored, "noeviction: nothing dropped"
    finally:
        gateway.close()


def test_the_gateways_budget_and_response_scripts_run_on_a_valkey_of_the_manifests(
    manifest_valkey: tuple[ManifestValkey, str],
) -> None:
    from redis.asyncio import Redis

    server, url = manifest_valkey
    parts = urlsplit(url)

    async def exercise() -> None:
        client = Redis(unix_socket_path=str(server.socket), username=parts.username, password=parts.password)
        try:
            budgets = RedisBudgets(client)
            draw = Draw(bucket_key("team", "tokens"), 100, 10, 10)
            assert (await budgets.take([draw])).granted
            await budgets.adjust(draw.key, 100, 5)
            store = RedisResponseStore(client, owns_client=False, max_age=60)
            record = StoredResponse("resp_1", time.time(), {"id": "resp_1"}, [], None, "name:team")
            assert await store.put(record) == 0
            found = await store.get("resp_1", "name:team")
            assert found is not None and found.response == {"id": "resp_1"}
            assert await store.delete("resp_1", "name:team")
        finally:
            await client.aclose()

    asyncio.run(exercise())


def test_a_valkey_of_the_manifests_refuses_to_start_with_the_placeholder_password(tmp_path: Path) -> None:
    assert _secret_value({"name": "deepinfer-gateway-valkey", "key": "password"}) == "CHANGE-ME"
    for workload in _stores().values():
        server = ManifestValkey(_valkey(workload), tmp_path, "CHANGE-ME")
        try:
            assert server.process.wait(timeout=30) != 0
            assert server.process.stdout is not None
            assert b"deepinfer-gateway-valkey" in server.process.stdout.read(), "it says which Secret to set"
            assert not server.socket.exists()
        finally:
            server.stop()


# --- the autoscaler ------------------------------------------------------------------------------------------------


def test_autoscaler_targets_the_gateway_on_a_metric_the_gateway_exports_and_the_adapter_serves() -> None:
    (hpa,) = load_resources(SCALE_OUT_DIR / "hpa.yaml")
    deployment = resource("Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    (rules_map,) = load_resources(SCALE_OUT_DIR / "prometheus-adapter-rules.yaml")
    (rule,) = yaml.safe_load(rules_map["data"]["rules.yaml"])["rules"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    from gateway.metrics import GatewayMetrics

    exported = {family.name for family in GatewayMetrics().registry.collect()}
    assert name in exported, f"the gateway exports no {name}"
