"""docs/k8s/gguf-prefill.yaml: the Deployment, Service and HPA reference each other correctly
and the container runs a `serve` that this project's flag parser accepts."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

DOC = Path(__file__).resolve().parents[1] / "docs" / "k8s" / "gguf-prefill.yaml"


@pytest.fixture(scope="module")
def objects():
    docs = [d for d in yaml.safe_load_all(DOC.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Deployment", "HorizontalPodAutoscaler", "Service"]
    return by_kind


def test_service_selects_the_deployments_pods_on_its_port(objects):
    dep, svc = objects["Deployment"], objects["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in ports
    args = container["args"]
    assert int(args[args.index("--port") + 1]) == ports[svc_port["targetPort"]]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and int(ann["prometheus.io/port"]) == ports["http"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_container_args_are_valid_serve_flags(objects):
    from server.main import build_parser
    from server.settings import ENV_PREFIX, Settings

    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    ns = build_parser().parse_args(container["args"])     # an unknown flag would exit 2
    env = {e["name"]: e["value"] for e in container["env"]}
    assert all(name.startswith(ENV_PREFIX) for name in env)
    s = Settings.from_namespace(ns, environ=env)
    assert s.device == "gpu" and s.port == 8080 and s.model.startswith("/models/")
    mounts = container["volumeMounts"]
    assert any(s.model.startswith(m["mountPath"] + "/") for m in mounts)
    grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert s.shutdown_timeout < grace                     # drained before the kubelet kills


def test_hpa_scales_the_deployment_on_queue_depth(objects):
    from server.metrics import Metrics

    hpa, dep = objects["HorizontalPodAutoscaler"], objects["Deployment"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"], ref["apiVersion"]) == ("Deployment", dep["metadata"]["name"],
                                                            dep["apiVersion"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "Pods"
    name = m["pods"]["metric"]["name"]
    assert name == "gguf_prefill_queue_depth"
    exported = Metrics().render().decode()                 # the server really exports it
    assert f"# TYPE {name} gauge" in exported
    assert m["pods"]["target"]["type"] == "AverageValue" and float(m["pods"]["target"]["averageValue"]) > 0
