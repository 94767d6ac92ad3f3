"""helm/tpserve's RayService-level settings: the API key's Secret (nothing random: every render
is the same), upgradeStrategy, GCS fault tolerance, the Serve Service and the NetworkPolicy;
bad values fail the render naming the value."""

from __future__ import annotations

import base64

import pytest

from helm_render import (KEY_FILE, NOTES, app_args, by_name, ci_file, head, helm, kinds, only,
                         pod_templates, render, render_text)


def secret_names(service) -> set:
    return {by_name(t["spec"]["volumes"])["api-key"]["secret"]["secretName"]
            for t in pod_templates(service)}


# ----- the API key -----


def test_by_default_the_pods_read_a_secret_the_user_makes():
    docs = render()
    assert "Secret" not in kinds(docs)
    service = only(docs, "RayService")
    assert secret_names(service) == {"demo-tpserve-api-key"}
    args = app_args(service)
    assert args["api_key_file"] == KEY_FILE and "api_key_env" not in args
    # `helm install` says which Secret to make, and how.
    notes = render_text()[NOTES]
    assert "kubectl -n llm create secret generic demo-tpserve-api-key --from-literal=api-key=" \
        in notes
    assert "create secret" not in render_text(ci_file("ha-upgrade-values.yaml"))[NOTES]


def test_renders_are_the_same_every_time():
    """Argo CD and Flux render offline and compare: a random key would differ on each render."""
    for values in ({}, ci_file("ha-upgrade-values.yaml")):
        assert render(values) == render(values)


def test_a_key_given_as_a_value_becomes_the_charts_secret():
    docs = render(ci_file("ha-upgrade-values.yaml"))
    secret = only(docs, "Secret")
    assert secret["metadata"]["name"] == "demo-tpserve-api-key"
    assert base64.b64decode(secret["data"]["api-key"]) == b"sk-from-a-sealed-values-file"
    assert secret_names(only(docs, "RayService")) == {"demo-tpserve-api-key"}


def test_an_existing_secret_is_mounted_and_none_is_made():
    docs = render(ci_file("existing-secret-values.yaml"))
    assert "Secret" not in kinds(docs)
    service = only(docs, "RayService")
    assert secret_names(service) == {"llm-gateway-keys"}
    for template in pod_templates(service):
        volume = by_name(template["spec"]["volumes"])["api-key"]
        assert volume["secret"]["items"] == [{"key": "tpserve", "path": "key"}]


def test_without_a_key_nothing_is_mounted():
    service = only(render({"serve": {"apiKey": {"enabled": False}}}), "RayService")
    assert "api_key_file" not in app_args(service)
    for template in pod_templates(service):
        assert "api-key" not in by_name(template["spec"]["volumes"])


@pytest.mark.parametrize("key,words", [
    ({"existingSecret": "mine", "value": "sk"},
     r"serve.apiKey.existingSecret \(mine\) and serve.apiKey.value are both set"),
    ({"enabled": False, "existingSecret": "mine"},
     "serve.apiKey.existingSecret or serve.apiKey.value is set but serve.apiKey.enabled is false"),
])
def test_api_keys_the_templates_refuse(key, words):
    with pytest.raises(helm.HelmRenderError, match=words):
        render({"serve": {"apiKey": key}})


# ----- upgrades, GCS fault tolerance -----


def test_upgrades_start_a_new_cluster_by_default():
    assert only(render(), "RayService")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    spec = only(render({"upgradeStrategy": {"type": "None"}}), "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}


def test_incremental_upgrades_and_gcs_fault_tolerance():
    values = ci_file("ha-upgrade-values.yaml")
    spec = only(render(values), "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewClusterWithIncrementalUpgrade",
                                       "clusterUpgradeOptions": {
                                           "gatewayClassName": "istio", "stepSizePercent": 25,
                                           "intervalSeconds": 60, "maxSurgePercent": 50}}
    assert spec["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc.cluster.local:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-password",
                                                         "key": "password"}}}}
    assert "gcsFaultToleranceOptions" not in only(render(), "RayService")["spec"][
        "rayClusterConfig"]


@pytest.mark.parametrize("values,words", [
    ({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}},
     "upgradeStrategy.clusterUpgradeOptions.gatewayClassName must be set"),
    ({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {
        "gatewayClassName": "istio", "stepSizePercent": 60, "intervalSeconds": 30,
        "maxSurgePercent": 50}}},
     r"stepSizePercent \(60\) must not exceed maxSurgePercent \(50\)"),
    ({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"},
      "autoscaling": {"enabled": False}, "serve": {"groups": {"min": 2, "max": 2}}},
     "NewClusterWithIncrementalUpgrade needs autoscaling.enabled=true"),
    ({"upgradeStrategy": {"clusterUpgradeOptions": {"gatewayClassName": "istio"}}},
     "upgradeStrategy.clusterUpgradeOptions is used only by NewClusterWithIncrementalUpgrade"),
    ({"gcsFaultTolerance": {"enabled": True}}, "gcsFaultTolerance.enabled needs "
                                               "gcsFaultTolerance.redisAddress"),
    ({"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"},
      "head": {"rayStartParams": {"redis-password": "x"}}}, "head.rayStartParams.redis-password"),
    ({"networkPolicy": {"dashboardFrom": []}}, "networkPolicy.dashboardFrom is empty"),
])
def test_cluster_settings_the_templates_refuse(values, words):
    with pytest.raises(helm.HelmRenderError, match=words):
        render(values)


@pytest.mark.parametrize("values,words", [
    ({"upgradeStrategy": {"type": "Recreate"}}, "/upgradeStrategy/type"),
    ({"gcsFaultTolerance": {"redisPassword": {"value": "plain"}}},
     "/gcsFaultTolerance/redisPassword"),  # from a Secret only
    ({"gcsFaultTolerance": {"redisAddress": "redis://r:6379"}}, "/gcsFaultTolerance/redisAddress"),
    ({"serveService": {"type": "ExternalName"}}, "/serveService/type"),
    ({"networkPolicy": {"serveFrom": [{"cidr": "10.0.0.0/8"}]}}, "/networkPolicy/serveFrom/0"),
])
def test_cluster_settings_the_schema_refuses(values, words):
    with pytest.raises(helm.HelmValuesError, match=words):
        render(values)


# ----- Services and the NetworkPolicy -----


def test_the_serve_service_carries_http_and_grpc_and_the_head_stays_internal():
    service = only(render(ci_file("ha-upgrade-values.yaml")), "RayService")
    serve = service["spec"]["serveService"]
    assert serve["spec"]["type"] == "LoadBalancer"
    assert serve["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert serve["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}
    assert serve["metadata"]["labels"]["exposure"] == "internal"
    ports = by_name(serve["spec"]["ports"])
    assert (ports["serve"]["port"], ports["serve"]["targetPort"]) == (80, "serve")
    assert (ports["serve-grpc"]["port"], ports["serve-grpc"]["targetPort"]) == (9000,
                                                                                "serve-grpc")
    assert ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # KubeRay gives the head Service headGroupSpec.serviceType: left unset, it stays internal.
    assert "serviceType" not in head(service)


def rules_by_port(policy) -> dict:
    found = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule.get("ports", [{"port": "any"}]):
            found.setdefault(port["port"], []).append(rule.get("from", "anyone"))
    return found


def test_the_network_policy_keeps_rays_own_ports_inside():
    policy = only(render(), "NetworkPolicy")
    selector = {"app.kubernetes.io/name": "tpserve", "app.kubernetes.io/instance": "demo"}
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = rules_by_port(policy)
    assert rules["any"] == [[{"podSelector": {"matchLabels": selector}}]]
    assert "anyone" in rules[8000] and rules[9000] == ["anyone"] and rules[8080] == ["anyone"]
    operator = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "kuberay-operator"}}}]
    assert rules[8265] == [operator] and operator in rules[8000]
    assert 6379 not in rules and 10001 not in rules  # GCS, Ray Client: the release's pods only
    assert "NetworkPolicy" not in kinds(render({"networkPolicy": {"enabled": False}}))


def test_the_network_policy_narrows_serve_and_metrics_to_the_peers_given():
    values = ci_file("ha-upgrade-values.yaml")
    rules = rules_by_port(only(render(values), "NetworkPolicy"))
    serve_from = values["networkPolicy"]["serveFrom"]
    metrics_from = values["networkPolicy"]["metricsFrom"]
    assert rules[9000] == [serve_from]
    assert rules[8080] == [metrics_from]
    assert "anyone" not in rules[8000] and metrics_from in rules[8000]  # tpserve's /metrics
