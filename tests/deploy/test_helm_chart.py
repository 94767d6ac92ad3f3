"""helm/tpserve: linted and rendered by Helm itself (the `helm-python-sdk` package embeds Helm's Go
SDK; no helm binary), with the default values and every ci/*.yaml. Each RayService is validated
against KubeRay's CRD schema (tests/data/kuberay, KubeRay v1.7.0) and checked for fields the CRD
does not know (it does not forbid them), each pod template and core object with
`kubernetes-validate` (strict), and serveConfigV2 with Serve's own schema and tpserve's own
args parser. Bad values fail the render with a message naming the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tpserve"
CI_FILES = sorted((CHART / "ci").glob("*.yaml"))
RAYSERVICE_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "kuberay" / \
    "rayservice_v1.schema.json"
K8S_VERSION = "1.33.0"
CORE_KINDS = {"Secret", "ConfigMap"}
CRD_KINDS = {"RayService", "PodMonitor", "PrometheusRule"}


def render(values: Optional[Dict] = None, name: str = "demo") -> List[Dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name=name, namespace="llm")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def ci_values(path: Path) -> Dict:
    return yaml.safe_load(path.read_text())


def only(docs: List[Dict], kind: str) -> Dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def workers(service: Dict) -> List[Dict]:
    return service["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def container(pod_template: Dict) -> Dict:
    return pod_template["spec"]["containers"][0]


def serve_config(service: Dict) -> Dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def app_args(service: Dict) -> Dict:
    (app,) = serve_config(service)["applications"]
    return app["args"]


def unknown_fields(doc, schema: Dict, path: str = "") -> List[str]:
    """Keys of ``doc`` that the (structural, OpenAPI) schema does not define."""
    found = []
    if isinstance(doc, dict) and "properties" in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key, value in doc.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(doc, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in doc.items():
            found += unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def check_rendered(docs: List[Dict]) -> None:
    schema = json.loads(RAYSERVICE_SCHEMA.read_text())
    for doc in docs:
        assert doc["kind"] in CORE_KINDS | CRD_KINDS, doc["kind"]
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    service = only(docs, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    jsonschema.validate(service, schema)
    assert unknown_fields(service, schema) == []
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in workers(service)]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def check_serve_config(service: Dict) -> Dict:
    """serveConfigV2 is a Serve config file that Serve accepts and whose tpserve application
    tpserve's own parser accepts; returns the application's args."""
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve_config import IMPORT_PATH, serve_config_from_args

    config = serve_config(service)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == IMPORT_PATH
    serve_config_from_args(app["args"], {"TPSERVE_API_KEY": "from-the-secret"})
    return app["args"]


# ----- lint and render -----


@pytest.mark.parametrize("values_file", [None] + CI_FILES, ids=lambda p: p.name if p else "default")
def test_lint_is_clean(values_file):
    values = ci_values(values_file) if values_file else None
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("values_file", [None] + CI_FILES, ids=lambda p: p.name if p else "default")
def test_renders_valid_objects(values_file):
    docs = render(ci_values(values_file) if values_file else None)
    check_rendered(docs)
    check_serve_config(only(docs, "RayService"))


def test_default_values():
    docs = render()
    service = only(docs, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    (group,) = workers(service)
    resources = container(group["template"])["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2 == resources["requests"]["nvidia.com/gpu"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 4)
    assert "numOfHosts" not in group
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]
    args = check_serve_config(service)
    assert (args["tp"], args["groups"], args["kv_target_occupancy"]) == (2, "1:4", 0.7)
    assert args["api_key_env"] == "TPSERVE_API_KEY" and "api_key" not in args
    # The API key: a Secret the chart creates, referenced by every Ray container.
    secret = only(docs, "Secret")
    for template in [head["template"], group["template"]]:
        (env,) = [e for e in container(template)["env"] if e["name"] == "TPSERVE_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                   "key": "api-key"}
    assert len(secret["data"]["api-key"]) > 0
    # Ports, probes, /dev/shm, the model volume.
    head_ports = {p["name"]: p["containerPort"] for p in container(head["template"])["ports"]}
    assert {"serve": 8000, "serve-grpc": 9000, "metrics": 8080}.items() <= head_ports.items()
    worker = container(group["template"])
    assert {p["name"] for p in worker["ports"]} == {"serve", "serve-grpc", "metrics"}
    # Started once its raylet is healthy: Serve runs a proxy only on nodes that host a replica,
    # so a pod holding ranks alone (a multi-host group's second pod) never answers /health on
    # 8000, and a startup probe there would restart it, and kill its group, every 20 minutes.
    startup = worker["startupProbe"]
    assert "httpGet" not in startup and "local_raylet_healthz" in " ".join(
        startup["exec"]["command"])
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 10 * 60  # image pulls
    # Ready (in the Serve Service) once its proxy answers /health: a TP group serves there.
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    # Ray's object store fits in /dev/shm (Ray's default, 30% of the pod's memory, would not,
    # and Ray would put it on disk); the head's too.
    head_shm = {v["name"]: v for v in head["template"]["spec"]["volumes"]}["dshm"]
    for params, shm in ((group["rayStartParams"], volumes["dshm"]),
                        (head["rayStartParams"], head_shm)):
        size_gib = int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi"))
        assert 0 < int(params["object-store-memory"]) < size_gib << 30
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "tpserve-models"
    assert {m["mountPath"] for m in worker["volumeMounts"]} >= {"/dev/shm", "/models"}
    assert {d["kind"] for d in docs} == {"RayService", "Secret"}  # monitoring is opt-in


def test_tp1_fixed_groups():
    service = only(render(ci_values(CHART / "ci" / "tp1-fixed-values.yaml")), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    (group,) = workers(service)
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    assert app_args(service)["groups"] == "2:2"
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/data/models"


def test_tp8_autoscaling_with_tiers_and_monitoring():
    values = ci_values(CHART / "ci" / "tp8-autoscaling-tiers-values.yaml")
    docs = render(values)
    service = only(docs, "RayService")
    (group,) = workers(service)
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)
    autoscaler = service["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert autoscaler == {"upscalingMode": "Conservative", "idleTimeoutSeconds": 600}
    args = app_args(service)
    assert (args["tp"], args["groups"], args["host_kv_gb"], args["disk_kv_gb"]) == (8, "1:4", 96,
                                                                                  1500)
    assert args["disk_kv_dir"] == "/mnt/nvme/tpserve-kv" and args["kv_eviction"] == "hotness"
    assert args["kv_write_policy"] == "write_back"
    assert args["max_num_seqs"] == 256
    mounts = {m["name"]: m["mountPath"] for m in container(group["template"])["volumeMounts"]}
    assert mounts["kv-disk"] == "/mnt/nvme/tpserve-kv"
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    claim = volumes["kv-disk"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme"
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    endpoints = [e for m in monitors for e in m["spec"]["podMetricsEndpoints"]]
    assert {"port": "serve", "path": "/metrics", "interval": "15s",  # the job TPServeDown watches
            "relabelings": [{"targetLabel": "job", "replacement": "demo-tpserve"}]} in endpoints
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    rule = only(docs, "PrometheusRule")
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert exprs["TPServeTTFTHigh"].endswith("> 5")  # alerts.ttftP99Seconds
    dashboard = only(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tpserve.json"]) == json.loads(
        (CHART / "files" / "tpserve.json").read_text())


def test_existing_secret_is_referenced_and_none_is_created():
    docs = render(ci_values(CHART / "ci" / "existing-secret-values.yaml"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    service = only(docs, "RayService")
    for template in [service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + \
            [g["template"] for g in workers(service)]:
        (env,) = [e for e in container(template)["env"] if e["name"] == "TPSERVE_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "llm-gateway-keys", "key": "tpserve"}


def test_groups_spanning_pods_and_an_init_container_model():
    docs = render(ci_values(CHART / "ci" / "multihost-initcontainer-values.yaml"))
    service = only(docs, "RayService")
    groups = {g["groupName"]: g for g in workers(service)}
    assert set(groups) == {"gpu-group", "a100"}  # "spare" is disabled
    for group in groups.values():
        assert group["numOfHosts"] == 2  # TP 16 over 8-GPU pods
        assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 8
        (init,) = group["template"]["spec"]["initContainers"]
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    assert groups["a100"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert (groups["gpu-group"]["minReplicas"], groups["gpu-group"]["maxReplicas"]) == (1, 2)
    args = app_args(service)
    assert "api_key_env" not in args and args["tp"] == 16
    assert not [d for d in docs if d["kind"] == "Secret"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert "env" not in container(head)
    assert head["spec"]["initContainers"][0]["name"] == "fetch-model"


def test_several_groups_share_a_pod_when_it_holds_more_gpus_than_a_group():
    service = only(render({"serve": {"tpSize": 2, "groups": {"min": 3, "max": 8}},
                           "worker": {"gpusPerPod": 8}}), "RayService")
    (group,) = workers(service)
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 2)  # 4 groups per pod
    assert app_args(service)["groups"] == "3:8"


# ----- bad values -----


@pytest.mark.parametrize("values,words", [
    ({"serve": {"tpSize": 3}}, "/serve/tpSize"),
    ({"serve": {"groups": {"min": 0, "max": 2}}}, "/serve/groups/min"),
    ({"serve": {"tpsize": 2}}, "tpsize"),  # a typo is not ignored
    ({"serve": {"tiers": {"eviction": "fifo"}}}, "/serve/tiers/eviction"),
    ({"serve": {"model": {"source": "s3"}}}, "/serve/model/source"),
    ({"alerts": {"kvUsage": 1.5}}, "/alerts/kvUsage"),
])
def test_values_the_schema_refuses(values, words):
    with pytest.raises(helm.HelmValuesError, match=words):
        render(values)


@pytest.mark.parametrize("values,words", [
    ({"serve": {"groups": {"min": 4, "max": 2}}},
     r"serve.groups.min \(4\) must not exceed serve.groups.max \(2\)"),
    ({"autoscaling": {"enabled": False}},
     r"serve.groups.min \(1\) and serve.groups.max \(4\) differ"),
    ({"worker": {"gpusPerPod": 3}}, r"worker.gpusPerPod \(3\) must be a multiple or a divisor"),
    ({"serve": {"tiers": {"disk": {"enabled": True}}}},
     "serve.tiers.disk.enabled needs a host tier"),
    ({"serve": {"extraArgs": {"tp": 4}}}, "serve.extraArgs.tp is set by the chart"),
    ({"serve": {"model": {"path": "/elsewhere/m"}}}, "serve.model.path"),
    ({"serve": {"model": {"pvc": {"claimName": ""}}}}, "serve.model.pvc.claimName"),
])
def test_values_the_templates_refuse(values, words):
    with pytest.raises(helm.HelmRenderError, match=words):
        render(values)
