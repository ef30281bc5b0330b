"""Every kustomization in deploy/ renders with kustomize itself (``kubectl kustomize``, offline), the rendered objects
validate strictly, and every ``kubectl apply -k`` the docs show names one of them: what an operator runs, not the
files one by one (an overlay inside the base it includes passes file checks and fails ``kubectl apply -k``)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .test_deepinfer_multinode import as_pod_template, check_leader_worker_set, pod_template
from .test_deploy import KUBERNETES_VERSIONS, ROOT, no_network  # noqa: F401

DEPLOY_DIR = ROOT / "deploy"
KUSTOMIZATIONS = sorted(path.parent for path in DEPLOY_DIR.rglob("kustomization.yaml"))
DOCUMENTED_IN = [
    ROOT / "README.md",
    DEPLOY_DIR / "README.md",
    *(path / "kustomization.yaml" for path in KUSTOMIZATIONS),
]
APPLY = re.compile(r"kubectl apply -k ([^\s`)]+)")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize DIR`` builds (kustomize as ``kubectl apply -k`` runs it)."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is missing: the machine image ships it (Debian's kubectl); CI must install it"
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, f"kubectl kustomize {_name(directory)} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def validation_errors(item: dict[str, Any], version: str) -> list[str]:
    """What strict validation finds wrong with one rendered object (a LeaderWorkerSet, which kubernetes-validate
    has no schema for, is checked field by field and its pod templates as core PodTemplates)."""
    objects = [item]
    errors: list[str] = []
    if item.get("kind") == "LeaderWorkerSet":
        errors += check_leader_worker_set(item)
        objects = [as_pod_template(pod_template(item, role), role) for role in ("leader", "worker")]
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}: {'.'.join(str(p) for p in exc.path)}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    return errors


def test_deploy_ships_the_kustomizations_the_docs_describe() -> None:
    assert {_name(path) for path in KUSTOMIZATIONS} >= {
        "deploy/kubernetes/base",
        "deploy/kubernetes/scale-out",
        "deploy/kubernetes/deepinfer-node",
        "deploy/kubernetes/deepinfer-multinode",
    }


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_name)
def test_each_kustomization_renders_with_kustomize(directory: Path) -> None:
    objects = render(directory)
    assert objects, f"{_name(directory)} renders no object"
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), f"{_name(directory)} renders an object twice: {names}"


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_name)
def test_each_rendered_object_validates_strictly(directory: Path, version: str) -> None:
    errors = [
        f"{o['kind']}/{o['metadata']['name']}: {e}" for o in render(directory) for e in validation_errors(o, version)
    ]
    assert not errors, f"{_name(directory)} renders objects that are not valid Kubernetes {version}:\n" + "\n".join(
        errors
    )


def test_the_checks_reject_a_rendered_object_with_a_misspelt_field() -> None:
    """Guards the check above: a typo in what kustomize renders must fail, not pass silently."""
    (deployment,) = [o for o in render(DEPLOY_DIR / "kubernetes" / "base") if o["kind"] == "Deployment"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert validation_errors(broken, KUBERNETES_VERSIONS[-1])


def test_the_scale_out_overlay_renders_the_base_with_its_patch_applied() -> None:
    """The overlay is the base plus its own objects, and its patch reaches the base's Deployment."""
    base = {(o["kind"], o["metadata"]["name"]) for o in render(DEPLOY_DIR / "kubernetes" / "base")}
    scale_out = render(DEPLOY_DIR / "kubernetes" / "scale-out")
    assert base <= {(o["kind"], o["metadata"]["name"]) for o in scale_out}
    (deployment,) = [o for o in scale_out if o["kind"] == "Deployment" and o["metadata"]["name"] == "deepinfer-gateway"]
    env = {e["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
    assert "GATEWAY_SERVER__STORES__STATE_STORE" in env


@pytest.mark.parametrize("document", DOCUMENTED_IN, ids=_name)
def test_every_documented_kubectl_apply_k_names_a_kustomization_that_renders(document: Path) -> None:
    named = APPLY.findall(document.read_text())
    for target in named:
        directory = (ROOT / target).resolve()
        assert directory in KUSTOMIZATIONS, f"{_name(document)}: `kubectl apply -k {target}` is no kustomization"
        assert render(directory)


def test_the_docs_show_an_apply_command_for_every_kustomization() -> None:
    documented = {(ROOT / t).resolve() for doc in DOCUMENTED_IN for t in APPLY.findall(doc.read_text())}
    assert set(KUSTOMIZATIONS) <= documented, f"undocumented: {sorted(map(_name, set(KUSTOMIZATIONS) - documented))}"
