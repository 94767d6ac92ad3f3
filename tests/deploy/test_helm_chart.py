"""helm/tpserve: linted and rendered by Helm with the default values and every ci/*.yaml, each
render validated (helm_render.check_rendered); the shapes of the groups; Chart.yaml's stated
requirements; bad values fail the render with a message naming the value. Pod settings are in
test_helm_pods.py, the RayService's own settings and the API key in test_helm_service.py."""

from __future__ import annotations

import json

import pytest
import yaml

from helm_render import (CHART, CI_FILES, app_args, check_rendered, check_serve_config, ci_file,
                         ci_values, container, helm, kinds, only, render, workers)


@pytest.mark.parametrize("values_file", [None] + CI_FILES, ids=lambda p: p.name if p else "default")
def test_lint_is_clean(values_file):
    values = ci_values(values_file) if values_file else None
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("values_file", [None] + CI_FILES, ids=lambda p: p.name if p else "default")
def test_renders_valid_objects(values_file, tmp_path):
    docs = render(ci_values(values_file) if values_file else None)
    check_rendered(docs)
    check_serve_config(only(docs, "RayService"), tmp_path)


def test_default_values(tmp_path):
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
    args = check_serve_config(service, tmp_path)
    assert (args["tp"], args["groups"], args["kv_target_occupancy"]) == (2, "1:4", 0.7)
    # The image: the one deploy/docker/Dockerfile builds, tagged with the chart's appVersion.
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for template in (head["template"], group["template"]):
        assert container(template)["image"] == f"tpserve/tpserve:{app_version}"
    # Ports: the head Service KubeRay makes from the head's ports has no Ray Client port.
    head_ports = {p["name"]: p["containerPort"] for p in container(head["template"])["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "serve": 8000,
                          "serve-grpc": 9000, "metrics": 8080}
    worker = container(group["template"])
    assert {p["name"] for p in worker["ports"]} == {"serve", "serve-grpc", "metrics"}
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
    assert kinds(docs) == {"RayService", "NetworkPolicy"}  # monitoring is opt-in; no Secret


def test_tp1_fixed_groups():
    service = only(render(ci_file("tp1-fixed-values.yaml")), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    (group,) = workers(service)
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    assert app_args(service)["groups"] == "2:2"
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/data/models"


def test_tp8_autoscaling_with_tiers_and_monitoring():
    docs = render(ci_file("tp8-autoscaling-tiers-values.yaml"))
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
    assert args["ingress_replicas"] == "2:4"  # the default: two, autoscaled up to four
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


def test_groups_spanning_pods_and_an_init_container_model():
    docs = render(ci_file("multihost-initcontainer-values.yaml"))
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
    assert (groups["a100"]["replicas"], groups["a100"]["minReplicas"],
            groups["a100"]["maxReplicas"]) == (0, 0, 2)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert head["spec"]["initContainers"][0]["name"] == "fetch-model"


def test_several_groups_share_a_pod_when_it_holds_more_gpus_than_a_group():
    service = only(render({"serve": {"tpSize": 2, "groups": {"min": 3, "max": 8}},
                           "worker": {"gpusPerPod": 8}}), "RayService")
    (group,) = workers(service)
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 2)  # 4 groups per pod
    assert app_args(service)["groups"] == "3:8"


def test_chart_states_the_kuberay_it_needs():
    """gRPC through the Serve Service needs KubeRay 1.6 (it passes on `serve-*` ports from 1.6:
    ray-project/kuberay#4558); every field the chart renders is in 1.6.0's CRD (check_rendered),
    and the CRD's CEL validation rules need Kubernetes 1.25."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["tpserve.io/requires"] == "kuberay-operator>=1.6.0"
    assert chart["kubeVersion"] == ">=1.25.0-0"
    service = only(render(), "RayService")
    ports = {p["name"] for p in service["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"serve", "serve-grpc"}


# ----- bad values -----


@pytest.mark.parametrize("values,words", [
    ({"serve": {"tpSize": 3}}, "/serve/tpSize"),
    ({"serve": {"groups": {"min": 0, "max": 2}}}, "/serve/groups/min"),
    ({"serve": {"tpsize": 2}}, "tpsize"),  # a typo is not ignored
    ({"serve": {"tiers": {"eviction": "fifo"}}}, "/serve/tiers/eviction"),
    ({"serve": {"model": {"source": "s3"}}}, "/serve/model/source"),
    ({"alerts": {"kvUsage": 1.5}}, "/alerts/kvUsage"),
    ({"serve": {"apiKey": {"create": True}}}, "create"),  # the old switch: no random key now
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
    ({"serve": {"extraArgs": {"api_key_file": "/k"}}}, "serve.extraArgs.api_key_file is set"),
    ({"serve": {"model": {"path": "/elsewhere/m"}}}, "serve.model.path"),
    ({"serve": {"model": {"pvc": {"claimName": ""}}}}, "serve.model.pvc.claimName"),
])
def test_values_the_templates_refuse(values, words):
    with pytest.raises(helm.HelmRenderError, match=words):
        render(values)
