"""Rendering helm/tpserve for the tests: Helm itself renders it (the `helm-python-sdk` package
embeds Helm's Go SDK; no helm binary), and `check_rendered` validates what comes out: each
RayService against KubeRay's CRD schema (tests/data/kuberay: v1.7.0, and v1.6.0 for fields the
oldest supported KubeRay lacks; a CRD does not forbid unknown fields, it drops them), each pod
template and core object with `kubernetes-validate` (strict), and serveConfigV2 with Serve's
own schema and tpserve's own args parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tpserve"
CI_FILES = sorted((CHART / "ci").glob("*.yaml"))
KUBERAY = REPO / "tests" / "data" / "kuberay"
RAYSERVICE_SCHEMA = KUBERAY / "rayservice_v1.schema.json"  # KubeRay v1.7.0
RAYSERVICE_SCHEMA_MIN = KUBERAY / "rayservice_v1.6.0.spec.schema.json"
K8S_VERSION = "1.33.0"
CORE_KINDS = {"Secret", "ConfigMap", "NetworkPolicy"}
CRD_KINDS = {"RayService", "PodMonitor", "PrometheusRule"}
KEY_FILE = "/etc/tpserve/api-key/key"


NOTES = "tpserve/templates/NOTES.txt"


def render_text(values: Optional[Dict] = None, name: str = "demo") -> Dict[str, str]:
    """Each template's output, NOTES.txt (what `helm install` prints) included."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values or {}, name=name, namespace="llm")


def render(values: Optional[Dict] = None, name: str = "demo") -> List[Dict]:
    manifests = render_text(values, name)
    return [doc for path, text in manifests.items() if path != NOTES
            for doc in yaml.safe_load_all(text) if doc]


def ci_values(path: Path) -> Dict:
    return yaml.safe_load(path.read_text())


def ci_file(name: str) -> Dict:
    return ci_values(CHART / "ci" / name)


def only(docs: List[Dict], kind: str) -> Dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def kinds(docs: List[Dict]) -> set:
    return {d["kind"] for d in docs}


def workers(service: Dict) -> List[Dict]:
    return service["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def head(service: Dict) -> Dict:
    return service["spec"]["rayClusterConfig"]["headGroupSpec"]


def pod_templates(service: Dict) -> List[Dict]:
    """The head's pod template, then each worker group's."""
    return [head(service)["template"]] + [g["template"] for g in workers(service)]


def container(pod_template: Dict) -> Dict:
    return pod_template["spec"]["containers"][0]


def by_name(items: List[Dict]) -> Dict[str, Dict]:
    return {item["name"]: item for item in items}


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
    for doc in docs:
        assert doc["kind"] in CORE_KINDS | CRD_KINDS, doc["kind"]
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    service = only(docs, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    for path in (RAYSERVICE_SCHEMA, RAYSERVICE_SCHEMA_MIN):
        schema = json.loads(path.read_text())
        jsonschema.validate(service, schema)
        assert unknown_fields(service, schema) == [], path.name
    for template in pod_templates(service):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    serve_service = {"apiVersion": "v1", "kind": "Service",
                     **service["spec"]["serveService"]}
    serve_service["metadata"] = {"name": "s", **serve_service["metadata"]}
    kubernetes_validate.validate(serve_service, K8S_VERSION, strict=True)


def check_serve_config(service: Dict, tmp_path: Path) -> Dict:
    """serveConfigV2 is a Serve config file that Serve accepts and whose tpserve application
    tpserve's own parser accepts, the API key file being where the pods mount it (here a file
    in ``tmp_path`` stands in for it); returns the application's args as rendered."""
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve_config import IMPORT_PATH, serve_config_from_args

    config = serve_config(service)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == IMPORT_PATH
    args = dict(app["args"])
    if "api_key_file" in args:
        assert args["api_key_file"] == KEY_FILE
        key_file = tmp_path / "key"
        key_file.write_text("from-the-secret\n")
        args["api_key_file"] = str(key_file)
    serve_config_from_args(args, {})
    return app["args"]
