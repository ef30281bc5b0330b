"""deploy/kubernetes/deepinfer-multinode: one DeepInfer DP group over several nodes, as a LeaderWorkerSet.

Offline, like the other manifests. kubernetes-validate knows no custom resources, so the LeaderWorkerSet object is
checked against the fields of the ``leaderworkerset.x-k8s.io/v1`` API it may use (written down here, ``LWS_FIELDS``),
and its two pod templates, which are core ``PodTemplateSpec``s, are validated strictly by kubernetes-validate. The
manifest is then tied to the code: its config validates, its ``ranks`` command lines parse with the real CLI and
give each pod the ranks, ports and devices its containers declare.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml
import zmq

from backends.config import DeepInferBackendConfig
from backends.deepinfer.ranks import node_worker_plan
from backends.workers.driver import STOP_TIMEOUT_SECONDS
from backends.workers.keys import GATEWAY_KEY, PUBLIC_SUFFIX, RANK_KEY, SECRET_SUFFIX, RankKeys, create_keys, keys_for
from backends.workers.launch import WorkerPlan
from backends.workers.node import NodeShare, bind_address
from gateway.cli import app
from gateway.config import load_config

from .test_deploy import (  # noqa: F401
    CONFIG_DIR,
    KUBERNETES_DIR,
    KUBERNETES_VERSIONS,
    assert_probes_use_the_probe_listener,
    configured_server,
    load_resources,
    no_network,
)

MULTINODE_DIR = KUBERNETES_DIR / "deepinfer-multinode"
CONFIG = CONFIG_DIR / "deepinfer-multinode.yaml"
NAMESPACE = "serving"

LWS_FIELDS: dict[str, Any] = {
    "spec": {"replicas", "startupPolicy", "rolloutStrategy", "networkConfig", "leaderWorkerTemplate"},
    "leaderWorkerTemplate": {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"},
    "networkConfig": {"subdomainPolicy"},
    "restartPolicy": {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"},
    "startupPolicy": {"LeaderCreated", "LeaderReady"},
    "subdomainPolicy": {"Shared", "UniquePerReplica"},
}
"""The LeaderWorkerSet v1 fields this check knows (facts of the API, in our words): keys allowed at each level and
the values of its enumerations. A field outside these fails the check, as strict validation fails a typo."""
LWS_ENVIRONMENT = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
"""The variables the LWS controller sets in every container of a group's pods."""


def check_leader_worker_set(item: dict[str, Any]) -> list[str]:
    """What is wrong with a LeaderWorkerSet object, field by field (empty: nothing)."""
    errors: list[str] = []
    if item.get("apiVersion") != "leaderworkerset.x-k8s.io/v1" or item.get("kind") != "LeaderWorkerSet":
        errors.append(f"not a leaderworkerset.x-k8s.io/v1 LeaderWorkerSet: {item.get('apiVersion')} {item.get('kind')}")
    if set(item) - {"apiVersion", "kind", "metadata", "spec"}:
        errors.append(f"unknown top-level fields {sorted(set(item) - {'apiVersion', 'kind', 'metadata', 'spec'})}")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", item.get("metadata", {}).get("name", "")):
        errors.append("metadata.name must be a DNS label (the pods and the headless Service are named after it)")
    spec = item.get("spec", {})
    errors += [f"spec.{key}: unknown field" for key in set(spec) - LWS_FIELDS["spec"]]
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        errors.append(f"spec.replicas: {replicas!r} is not a count")
    if spec.get("startupPolicy", "LeaderCreated") not in LWS_FIELDS["startupPolicy"]:
        errors.append(
            f"spec.startupPolicy: {spec['startupPolicy']!r} is not one of {sorted(LWS_FIELDS['startupPolicy'])}"
        )
    network = spec.get("networkConfig", {})
    errors += [f"spec.networkConfig.{key}: unknown field" for key in set(network) - LWS_FIELDS["networkConfig"]]
    if network.get("subdomainPolicy", "Shared") not in LWS_FIELDS["subdomainPolicy"]:
        errors.append(f"spec.networkConfig.subdomainPolicy: {network['subdomainPolicy']!r} is not a policy")
    template = spec.get("leaderWorkerTemplate")
    if not isinstance(template, dict):
        return [*errors, "spec.leaderWorkerTemplate is required"]
    errors += [
        f"spec.leaderWorkerTemplate.{key}: unknown field" for key in set(template) - LWS_FIELDS["leaderWorkerTemplate"]
    ]
    size = template.get("size", 1)
    if not isinstance(size, int) or size < 1:
        errors.append(f"spec.leaderWorkerTemplate.size: {size!r} is not a group size")
    if template.get("restartPolicy", "RecreateGroupOnPodRestart") not in LWS_FIELDS["restartPolicy"]:
        errors.append(f"spec.leaderWorkerTemplate.restartPolicy: {template['restartPolicy']!r} is not a policy")
    if "workerTemplate" not in template:
        errors.append("spec.leaderWorkerTemplate.workerTemplate is required")
    return errors


def pod_template(item: dict[str, Any], role: str) -> dict[str, Any]:
    """``leaderTemplate`` or ``workerTemplate`` (the leader uses the worker's when it has none of its own)."""
    templates = item["spec"]["leaderWorkerTemplate"]
    return templates.get(f"{role}Template") or templates["workerTemplate"]


def as_pod_template(template: dict[str, Any], role: str) -> dict[str, Any]:
    """A pod template of the LeaderWorkerSet as the core ``v1/PodTemplate`` object kubernetes-validate checks."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{role}"}, "template": template}


def multinode(kind: str) -> dict[str, Any]:
    found = [r for p in sorted(MULTINODE_DIR.glob("*.yaml")) for r in load_resources(p) if r.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {MULTINODE_DIR}, found {len(found)}"
    return found[0]


def container(role: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_template(multinode("LeaderWorkerSet"), role)["spec"]["containers"] if c["name"] == name]
    return found


def backend() -> DeepInferBackendConfig:
    (configured,) = load_config(CONFIG).backends
    assert isinstance(configured, DeepInferBackendConfig)
    return configured


POD_IP = "10.8.3.17"
"""The address the downward API gives a container as ``status.podIP`` (any pod address would do)."""


def lws_environment(worker_index: int) -> dict[str, str]:
    """What the LWS controller sets in pod ``worker_index`` of group 0 (0: the leader)."""
    lws = multinode("LeaderWorkerSet")
    name = lws["metadata"]["name"]
    return {
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": str(worker_index),
    }


def container_environment(of: dict[str, Any], worker_index: int) -> dict[str, str]:
    """The LWS variables plus the container's own, the downward API's pod address resolved."""
    environment = lws_environment(worker_index)
    for variable in of.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = variable["value"]
        elif variable["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            environment[variable["name"]] = POD_IP
    return environment


def expand(argv: list[str], environment: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's command line."""
    return [re.sub(r"\$\((\w+)\)", lambda m: environment[m.group(1)], arg) for arg in argv]


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parses a ``deepinfer-gateway ...`` command line with the real CLI: the subcommand and its options."""
    assert argv[0] == "deepinfer-gateway", argv
    group = typer.main.get_command(app)
    command = group.commands[argv[1]]  # type: ignore[attr-defined]
    with command.make_context(argv[1], argv[2:]) as context:
        return argv[1], dict(context.params)


def ports(of: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in of.get("ports", [])}


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_multinode_manifests_validate_offline(version: str) -> None:
    kustomization = yaml.safe_load((MULTINODE_DIR / "kustomization.yaml").read_text())
    shipped = sorted(p.name for p in MULTINODE_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == shipped
    for name in shipped:
        for item in load_resources(MULTINODE_DIR / name):
            if item["kind"] == "LeaderWorkerSet":
                assert check_leader_worker_set(item) == []
                for role in ("leader", "worker"):
                    kubernetes_validate.validate(as_pod_template(pod_template(item, role), role), version, strict=True)
            else:
                kubernetes_validate.validate(item, version, strict=True)


def test_the_checks_reject_a_misspelt_field_in_the_group_and_in_a_pod_template() -> None:
    lws = multinode("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["restartpolicy"] = "RecreateGroupOnPodRestart"
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"
    errors = check_leader_worker_set(lws)
    assert any("restartpolicy: unknown field" in e for e in errors) and any("not a policy" in e for e in errors)
    template = pod_template(multinode("LeaderWorkerSet"), "worker")
    template["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_pod_template(template, "worker"), KUBERNETES_VERSIONS[-1], strict=True)


def test_the_configmap_is_the_multinode_config_and_validates() -> None:
    data = multinode("ConfigMap")["data"]["config.yaml"]
    assert yaml.safe_load(data) == yaml.safe_load(CONFIG.read_text()), "drifted from deploy/config"
    configured = backend()
    assert configured.kind == "deepinfer" and configured.master_port is not None
    assert len(configured.worker_endpoints) == configured.data_parallel_size


@pytest.mark.parametrize("worker_index", [0, 1])
def test_each_pod_runs_its_share_of_the_ranks_on_the_ports_and_gpus_it_declares(worker_index: int) -> None:
    """The ``ranks`` command line of each pod, expanded as Kubernetes does and parsed by the real CLI, runs the ranks
    whose endpoints name this pod, binds the ports the container declares, and splits the GPUs it requests."""
    lws = multinode("LeaderWorkerSet")
    name = lws["metadata"]["name"]
    role = "leader" if worker_index == 0 else "worker"
    ranks = container(role, "ranks")
    own = {variable["name"] for variable in ranks.get("env", [])}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(ranks["command"]))) <= LWS_ENVIRONMENT | own
    environment = container_environment(ranks, worker_index)
    command, options = parse(expand(ranks["command"], environment))
    assert command == "ranks"
    config_mount = next(m for m in ranks["volumeMounts"] if options["config"].parent == Path(m["mountPath"]))
    assert config_mount["name"] == "config"
    configured = backend()
    assert options["backend"] == configured.name
    share = NodeShare(len(configured.worker_endpoints), options["nodes"], options["node"])
    assert options["nodes"] == lws["spec"]["leaderWorkerTemplate"]["size"]
    # The endpoints of this pod's ranks name this pod: the loopback for the leader's (the gateway shares its network),
    # <pod>.<subdomain> for a worker's (subdomainPolicy Shared: the Service is named after the LeaderWorkerSet).
    host = "127.0.0.1" if worker_index == 0 else f"{name}-0-{worker_index}.{name}"
    bound = [bind_address(configured.worker_endpoints[rank], options["host"]) for rank in share.ranks]
    assert [configured.worker_endpoints[rank].split("//")[1].split(":")[0] for rank in share.ranks] == [host] * len(
        bound
    )
    declared = {port for key, port in ports(ranks).items() if key.startswith("rank-")}
    assert {int(address.rsplit(":", 1)[1]) for address in bound} == declared
    # The leader's ranks listen on the loopback (its gateway is beside them); the worker's on the pod's address, which
    # the ranks accept only with rank_keys (the check the CLI makes before it starts them).
    assert options["host"] == ("127.0.0.1" if worker_index == 0 else POD_IP)
    for address in bound:
        keys_for(address, configured.rank_keys)
    # Devices: the pod's GPUs, split between its ranks; every rank meets at the leader's rendezvous.
    gpus = int(ranks["resources"]["limits"]["nvidia.com/gpu"])
    plan = node_worker_plan(configured, share.ranks, {}, options["master_addr"])
    assert plan.rank_env is not None
    devices = [plan.rank_env(rank)["CUDA_VISIBLE_DEVICES"].split(",") for rank in share.ranks]
    assert sum(len(d) for d in devices) == gpus == configured.context_parallel_size * len(share.ranks)
    assert len({d for group in devices for d in group}) == gpus, "no GPU shared by two ranks"
    rendezvous = {(plan.rank_env(rank)["MASTER_ADDR"], plan.rank_env(rank)["MASTER_PORT"]) for rank in share.ranks}
    assert rendezvous == {(environment["LWS_LEADER_ADDRESS"], str(configured.master_port))}
    if worker_index == 0:
        assert ports(ranks)["rendezvous"] == configured.master_port - 50, "DeepInfer listens on master_port - 50"


def test_the_leader_serves_the_api_from_the_config_and_the_service_reaches_only_it() -> None:
    gateway = container("leader", "gateway")
    command, options = parse(gateway["command"])
    assert command == "serve"
    mount = next(m for m in gateway["volumeMounts"] if options["config"].parent == Path(m["mountPath"]))
    assert mount["name"] == "config"
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {}), "the engines live in the ranks container"
    served = load_config(CONFIG).server
    assert ports(gateway)["http"] == served.port
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    if served.workers > 1:  # front ends answer nothing, /health included, before every rank is up
        startup = gateway["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= WorkerPlan(1, "").start_timeout
    model = backend().model
    assert any(model.startswith(m["mountPath"] + "/") for m in gateway["volumeMounts"]), "the tokenizer is read here"
    service = multinode("Service")
    lws = multinode("LeaderWorkerSet")
    leader_labels = pod_template(lws, "leader")["metadata"]["labels"]
    worker_labels = pod_template(lws, "worker")["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= leader_labels.items() and not selector.items() <= worker_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_ranks_outlive_the_gateway_drain_and_the_pod_outlives_both(role: str) -> None:
    drain = float(
        next(e["value"] for e in container("leader", "gateway")["env"] if e["name"].endswith("DRAIN_SECONDS"))
    )
    gateway_pre_stop = int(container("leader", "gateway")["lifecycle"]["preStop"]["exec"]["command"][-1])
    ranks_pre_stop = int(container(role, "ranks")["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert ranks_pre_stop >= drain + gateway_pre_stop, "the ranks must serve the requests the gateway drains"
    pod = pod_template(multinode("LeaderWorkerSet"), role)["spec"]
    assert pod["terminationGracePeriodSeconds"] > ranks_pre_stop + STOP_TIMEOUT_SECONDS
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = next(m for m in container(role, "ranks")["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert multinode("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def rank_ports() -> set[int]:
    return {int(endpoint.rsplit(":", 1)[1]) for endpoint in backend().worker_endpoints}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and In expressions) selects pods with ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_only_the_gateway_reaches_the_rank_ports_and_only_the_group_the_rest() -> None:
    """The NetworkPolicy, tied to the config: the rank ports it names are the worker_endpoints' ports, only the
    leader pods (the gateway) may reach them, every other port of the group's pods only from the group (DeepInfer's
    rendezvous among them), and the API port from anywhere."""
    policy = multinode("NetworkPolicy")["spec"]
    lws = multinode("LeaderWorkerSet")
    leader = pod_template(lws, "leader")["metadata"]["labels"]
    worker = pod_template(lws, "worker")["metadata"]["labels"]
    assert selects(policy["podSelector"], leader) and selects(policy["podSelector"], worker)
    assert policy["policyTypes"] == ["Ingress"]
    by_ports: dict[frozenset[tuple[int, int]], list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        spans = frozenset((p["port"], p.get("endPort", p["port"])) for p in rule["ports"])
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        by_ports[spans] = rule.get("from", [])

    def reaching(port: int) -> list[list[dict[str, Any]]]:
        return [sources for spans, sources in by_ports.items() if any(low <= port <= high for low, high in spans)]

    for port in rank_ports() | {p for k, p in ports(container("worker", "ranks")).items() if k.startswith("rank-")}:
        (sources,) = reaching(port)  # one rule opens a rank port
        assert sources and all(selects(s["podSelector"], leader) for s in sources), "only the gateway's pods"
        assert not any(selects(s["podSelector"], worker) for s in sources), "not another rank's pod"
    rendezvous = backend().master_port - 50
    assert ports(container("leader", "ranks"))["rendezvous"] == rendezvous
    for port in (rendezvous, 1, 32768, 65535):  # the rendezvous, gloo's and NCCL's own ports
        (sources,) = reaching(port)
        assert all(selects(s["podSelector"], leader) or selects(s["podSelector"], worker) for s in sources)
        assert any(selects(s["podSelector"], worker) for s in sources)
    served = load_config(CONFIG).server.http.port
    assert ports(container("leader", "gateway"))["http"] == served
    assert [] in reaching(served), "the API is open to every client, as the Service exposes it"
    probe_port = configured_server(container("leader", "gateway"), CONFIG).probe_port
    assert probe_port is not None and [] in reaching(probe_port), "Prometheus scrapes the probe listener"
    covered = {port for spans in by_ports for low, high in spans for port in range(low, high + 1)}
    assert covered == set(range(1, 65536)), "no port of the group is left closed to its own ranks"


def test_the_gateways_probes_and_scrapes_go_to_its_probe_listener() -> None:
    lws = multinode("LeaderWorkerSet")
    served = load_config(CONFIG).server.http.port
    assert_probes_use_the_probe_listener(pod_template(lws, "leader"), container("leader", "gateway"), CONFIG, served)


def test_each_container_mounts_the_rank_keys_it_needs_where_rank_keys_points(tmp_path: Path) -> None:
    """The Secret's files as each container sees them (its volume's items, at its mount path), loaded by the real
    key code: the ranks can serve CURVE and admit the gateway, the gateway can present its key and check theirs."""
    configured = backend()
    assert configured.rank_keys is not None
    lws = multinode("LeaderWorkerSet")
    source = tmp_path / "secret"
    create_keys(source)  # what `deepinfer-gateway rank-keys` writes, and `kubectl create secret --from-file` takes
    secrets: set[str] = set()
    for role, name in (("leader", "gateway"), ("leader", "ranks"), ("worker", "ranks")):
        volumes = {v["name"]: v for v in pod_template(lws, role)["spec"]["volumes"]}
        (mount,) = [m for m in container(role, name)["volumeMounts"] if m["mountPath"] == configured.rank_keys]
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        secrets.add(secret["secretName"])
        assert secret["defaultMode"] & 0o007 == 0, "key files are not world-readable"
        assert pod_template(lws, role)["spec"]["securityContext"]["fsGroup"], "group-readable by the image's user"
        seen = tmp_path / f"{role}-{name}"
        seen.mkdir()
        for item in secret["items"]:
            (seen / item["path"]).write_bytes((source / item["key"]).read_bytes())
        keys = RankKeys(seen)
        if name == "ranks":
            assert not (seen / f"{GATEWAY_KEY}{SECRET_SUFFIX}").exists(), "the ranks never hold the gateway's secret"
            server = zmq.Context()
            try:
                authenticator = keys.serve(server.socket(zmq.ROUTER), server)
                authenticator.stop()
            finally:
                server.destroy(linger=0)
            admitted = {path.name for path in seen.glob(f"*{PUBLIC_SUFFIX}")}
            assert f"{GATEWAY_KEY}{PUBLIC_SUFFIX}" in admitted
        else:
            assert not (seen / f"{RANK_KEY}{SECRET_SUFFIX}").exists(), "the gateway never holds the ranks' secret"
            public, _ = keys.client_pair()
            assert public == (source / f"{GATEWAY_KEY}{PUBLIC_SUFFIX}").read_bytes().split(b'"')[1]
            assert keys.rank_public() == (source / f"{RANK_KEY}{PUBLIC_SUFFIX}").read_bytes().split(b'"')[1]
    assert secrets == {"deepinfer-dp-rank-keys"}
