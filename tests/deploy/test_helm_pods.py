"""helm/tpserve's pods: the pod settings of the head, of `worker` and of extra worker groups land
where Kubernetes reads them (ci/pod-settings-values.yaml sets every one); an extra group's
settings replace worker's; replica bounds; the probes."""

from __future__ import annotations

import json

import pytest

from helm_render import (CHART, KEY_FILE, by_name, ci_file, container, helm, only, pod_templates,
                         render, workers)

POD_NAMES = ("serviceAccountName", "priorityClassName", "runtimeClassName", "schedulerName")
POD_OBJECTS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints")


def groups_of(values) -> dict:
    return {g["groupName"]: g for g in workers(only(render(values), "RayService"))}


def test_every_pod_setting_reaches_the_pod():
    values = ci_file("pod-settings-values.yaml")
    service = only(render(values), "RayService")
    head, worker = pod_templates(service)[:2]
    for template, given in ((head, values["head"]), (worker, values["worker"])):
        spec, ray = template["spec"], container(template)
        assert given["labels"].items() <= template["metadata"]["labels"].items()
        assert template["metadata"]["annotations"] == given["annotations"]
        for field in POD_NAMES + POD_OBJECTS:
            assert spec[field] == given[field], field
        # Helm merges a map given for head or worker into the default (fsGroupChangePolicy).
        assert given["podSecurityContext"].items() <= spec["securityContext"].items()
        assert ray["securityContext"] == given["securityContext"]
        assert spec["initContainers"] == given["initContainers"]  # no model fetcher: a PVC
        assert spec["containers"][1:] == given["sidecarContainers"]
        assert ray["name"].startswith("ray-")  # the Ray container stays first
        assert ray["env"] == given["containerEnv"] and ray["envFrom"] == given["envFrom"]
        assert given["volumes"][0] in spec["volumes"]
        assert given["volumeMounts"][0] in ray["volumeMounts"]
    assert container(worker)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    limits = container(worker)["resources"]["limits"]
    assert (limits["rdma/ib"], limits["nvidia.com/gpu"]) == (1, 2)


def test_an_extra_group_replaces_what_it_gives_and_inherits_the_rest():
    values = ci_file("pod-settings-values.yaml")
    groups = groups_of(values)
    spot = groups["spot"]["template"]["spec"]
    assert "nodeSelector" not in spot  # `nodeSelector: {}` drops worker's
    assert spot["tolerations"] == values["additionalWorkerGroups"]["spot"]["tolerations"]
    assert spot["affinity"] == values["worker"]["affinity"]  # not given: worker's
    assert container(groups["spot"]["template"])["securityContext"] == {
        "capabilities": {"add": ["IPC_LOCK"]}}
    # A map given is not merged into worker's: only its own keys remain.
    (group,) = [g for g in groups_of({"additionalWorkerGroups": {"a100": {
        "nodeSelector": {"nvidia.com/gpu.product": "A100"}}},
        "worker": {"nodeSelector": {"pool": "gpu", "nvidia.com/gpu.product": "H100"}}}).values()
        if g["groupName"] == "a100"]
    assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "A100"}


def test_a_group_that_may_not_scale_up():
    groups = groups_of(ci_file("pod-settings-values.yaml"))
    reserve = groups["reserve"]
    assert (reserve["replicas"], reserve["minReplicas"], reserve["maxReplicas"]) == (0, 0, 0)
    spot = groups["spot"]
    assert (spot["replicas"], spot["minReplicas"], spot["maxReplicas"]) == (0, 0, 3)
    default = groups_of({"additionalWorkerGroups": {"extra": {}}})["extra"]
    assert (default["replicas"], default["minReplicas"], default["maxReplicas"]) == (0, 0, 1)


@pytest.mark.parametrize("group,words", [
    ({"minReplicas": 2, "maxReplicas": 1},
     r"additionalWorkerGroups.x.minReplicas \(2\) must not exceed "
     r"additionalWorkerGroups.x.maxReplicas \(1\)"),
    ({"replicas": 2, "maxReplicas": 0},
     r"additionalWorkerGroups.x.replicas \(2\) must lie within minReplicas \(0\) and "
     r"maxReplicas \(0\)"),
])
def test_replica_bounds_the_templates_refuse(group, words):
    with pytest.raises(helm.HelmRenderError, match=words):
        render({"additionalWorkerGroups": {"x": group}})


@pytest.mark.parametrize("values,words", [
    ({"worker": {"tolerations": "nvidia.com/gpu"}}, "/worker/tolerations"),
    ({"head": {"nodeSelector": {"pool": 3}}}, "/head/nodeSelector/pool"),
    ({"worker": {"sidecarContainers": [{"name": "x"}]}}, "/worker/sidecarContainers/0"),
    ({"worker": {"volumeMounts": [{"name": "x", "mountPath": "rel"}]}},
     "/worker/volumeMounts/0/mountPath"),
    ({"additionalWorkerGroups": {"x": {"containerSecurityContext": {}}}},
     "containerSecurityContext"),
    ({"additionalWorkerGroups": {"x": {"maxReplicas": -1}}},
     "/additionalWorkerGroups/x/maxReplicas"),
    ({"additionalWorkerGroups": {"Bad_Name": {}}}, "Bad_Name"),
])
def test_pod_settings_the_schema_refuses(values, words):
    with pytest.raises(helm.HelmValuesError, match=words):
        render(values)


def test_head_worker_and_extra_groups_take_the_same_pod_settings():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    head = set(schema["head"]["properties"])
    assert set(schema["worker"]["properties"]) - head == {"groupName", "gpusPerPod"}
    extra = set(schema["additionalWorkerGroups"]["additionalProperties"]["properties"])
    assert extra - head == {"disabled", "replicas", "minReplicas", "maxReplicas", "gpusPerPod"}
    assert set(POD_NAMES + POD_OBJECTS) <= head


def test_probes_check_each_pods_own_raylet_and_serve_proxy():
    service = only(render(), "RayService")
    head, worker = (container(t) for t in pod_templates(service))
    agent = {"path": "/api/healthz", "port": 52365}
    for ray in (head, worker):
        for probe in ("startupProbe", "livenessProbe"):
            assert ray[probe]["httpGet"] == agent, probe
        assert all(0 < ray[p]["timeoutSeconds"] <= ray[p]["periodSeconds"]
                   for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    # Ready, i.e. in the Serve Service, while the pod's own proxy is: not the ingress's /health,
    # answered by whichever replica the request lands on.
    assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": "serve"}
    assert worker["readinessProbe"]["failureThreshold"] == 1  # a draining proxy leaves at once
    assert head["readinessProbe"]["httpGet"] == agent
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 10 * 60  # image pulls
    # The agent's port follows rayStartParams, as KubeRay's own probes do.
    moved = only(render({"worker": {"rayStartParams": {"dashboard-agent-listen-port": "52400"}}}),
                 "RayService")
    assert container(pod_templates(moved)[1])["livenessProbe"]["httpGet"]["port"] == 52400


def test_the_api_key_is_a_read_only_file_in_every_pod():
    service = only(render(ci_file("multihost-initcontainer-values.yaml") | {
        "serve": {"apiKey": {"existingSecret": "keys", "secretKey": "tpserve"}}}), "RayService")
    templates = pod_templates(service)
    assert len(templates) == 3  # head, gpu-group, a100
    for template in templates:
        volume = by_name(template["spec"]["volumes"])["api-key"]
        assert volume["secret"] == {"secretName": "keys", "defaultMode": 0o440,
                                    "items": [{"key": "tpserve", "path": "key"}]}
        mount = by_name(container(template)["volumeMounts"])["api-key"]
        # A subPath mount would never see the Secret's updates.
        assert mount == {"name": "api-key", "mountPath": KEY_FILE.rsplit("/", 1)[0],
                         "readOnly": True}
        assert "fsGroup" in template["spec"]["securityContext"]  # 0440 for the non-root user
        assert "env" not in container(template)  # the key is in no environment variable
