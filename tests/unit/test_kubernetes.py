"""The Kubernetes manifests (deploy/kubernetes) render with kustomize, validate against
the Kubernetes schemas, and agree with kvmesh itself: every container's arguments
parse with kvmesh's CLI, every KVMESH_* variable is one kvmesh reads, probes hit
endpoints the frontend serves, and a worker's pod outlives its drain."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import kubernetes_validate
import yaml

from kvmesh.cli.main import build_parser
from kvmesh.engines.vllm import options as vllm_options



ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.32.0"
WORKLOADS = {"Deployment", "StatefulSet"}


def _kvmesh_env_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "src" / "kvmesh").rglob("*.py"):
        names.update(re.findall(r"KVMESH_[A-Z0-9_]+", path.read_text()))
    # the vLLM adapter reads KVMESH_VLLM_<OPTION> for each of its options
    names.update(vllm_options.ENV_PREFIX + f.name.upper() for f in dataclasses.fields(vllm_options.VllmOptions))
    return names


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (with its built-in kustomize) is needed to render deploy/kubernetes: apt-get install kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _render(request.param)


def _containers(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, c) for o in objs if o["kind"] in WORKLOADS for c in o["spec"]["template"]["spec"]["containers"]]


def _kvmesh_containers(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, c) for o, c in _containers(objs) if c["image"].split("/")[-1].startswith("kvmesh")]


def test_the_overlays_are_the_three_the_docs_name() -> None:
    assert OVERLAYS == ["aggregated-mocker", "disaggregated", "vllm-gpu"]


def test_every_object_validates_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    kinds = {o["kind"] for o in rendered}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in rendered:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error


def test_a_broken_object_is_caught_by_the_validator(rendered: list[dict[str, Any]]) -> None:
    # the check above can fail: a misspelt field is rejected in strict mode
    deployment = next(o for o in rendered if o["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_container_arguments_parse_with_kvmesh_cli(rendered: list[dict[str, Any]]) -> None:
    parser = build_parser()
    containers = _kvmesh_containers(rendered)
    assert {c["args"][0] for _, c in containers} == {"frontend", "worker"}
    for _, c in containers:
        parser.parse_args(c["args"])  # SystemExit (a test failure) on an unknown flag or bad value


def test_every_kvmesh_variable_is_one_kvmesh_reads(rendered: list[dict[str, Any]]) -> None:
    known = _kvmesh_env_names()
    config = {n for o in rendered if o["kind"] == "ConfigMap" for n in o["data"]}
    env = {e["name"] for _, c in _kvmesh_containers(rendered) for e in c.get("env", [])}
    used = {n for n in config | env if n.startswith("KVMESH_")}
    assert "KVMESH_ETCD_ENDPOINTS" in used
    assert used <= known, f"kvmesh reads none of {sorted(used - known)}"


def test_config_maps_and_selectors_resolve(rendered: list[dict[str, Any]]) -> None:
    maps = {o["metadata"]["name"] for o in rendered if o["kind"] == "ConfigMap"}
    for _, c in _kvmesh_containers(rendered):
        refs = {r["configMapRef"]["name"] for r in c.get("envFrom", [])}
        assert refs and refs <= maps
    pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o in rendered if o["kind"] in WORKLOADS]
    for o in rendered:
        if o["kind"] == "Service":
            selector = o["spec"]["selector"]
        elif o["kind"] == "PodDisruptionBudget":
            selector = o["spec"]["selector"]["matchLabels"]
        else:
            continue
        assert any(selector.items() <= labels.items() for labels in pod_labels), o["metadata"]["name"]


def test_probes_and_drain(rendered: list[dict[str, Any]]) -> None:
    for obj, c in _kvmesh_containers(rendered):
        assert c["resources"]["requests"], obj["metadata"]["name"]
        ns = build_parser().parse_args(c["args"])
        if c["args"][0] == "frontend":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["livenessProbe"]["httpGet"]["path"] == "/live"
            assert str(ns.http_host) == "0.0.0.0"
        else:
            # SIGTERM drains for --grace seconds; the pod must not be killed before that ends
            grace_period = obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace_period > float(ns.grace) + 5, obj["metadata"]["name"]
            env = {e["name"] for e in c["env"]}
            assert "KVMESH_HOST" in env  # a worker advertises its pod IP, not 127.0.0.1


def test_the_dockerfile_installs_kvmesh_as_the_readme_does() -> None:
    readme_first = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    assert "pip install -e ." in readme_first
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip install --no-cache-dir -e \.(\s|$)", dockerfile)
    assert 'ENTRYPOINT ["kvmesh"]' in dockerfile
