"""The Kubernetes manifests: real schemas, probes, command lines, draining and the RayCluster's shape."""

from __future__ import annotations

import copy
import re
import stat
import subprocess

import kubernetes_validate
import pytest
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

from tests.deploy.common import (
    DOCKERFILES,
    container_raypaged_argv,
    dockerfile_instructions,
    drain_timeout_s,
    k8s_documents,
    k8s_object,
    parse_raypaged,
    pod_templates,
)

KUBERNETES_VERSION = "1.30.0"  # the oldest version the manifests support
NATIVE_KINDS = {"Deployment", "Service", "PersistentVolumeClaim"}


def _id(item) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


def _server_containers() -> list[tuple[str, dict, dict]]:
    """(description, pod spec, container) of every container that runs ``raypaged``."""
    found = []
    for name, template in pod_templates():
        for container in template["spec"]["containers"]:
            if container_raypaged_argv(container) is not None:
                found.append((name, template["spec"], container))
    return found


def _prestop_seconds(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command is None:
        return 0.0
    assert command[0] == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


def test_every_file_parses_and_names_its_objects():
    documents = k8s_documents()
    kinds = {doc["kind"] for _, doc in documents}
    assert {"RayCluster", "Deployment", "Service", "PodMonitor", "PersistentVolumeClaim"} <= kinds
    for path, doc in documents:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path


@pytest.mark.parametrize("item", [i for i in k8s_documents() if i[1]["kind"] in NATIVE_KINDS], ids=_id)
def test_native_objects_match_the_kubernetes_schema(item):
    _, doc = item
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name_template", pod_templates(), ids=lambda t: t[0])
def test_ray_pod_templates_match_the_kubernetes_schema(name_template):
    _, template = name_template
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    kubernetes_validate.validate(wrapper, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_rejects_a_misspelt_field():
    deployment = copy.deepcopy(k8s_object("Deployment", "raypaged-single"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _round_trip(model, doc: dict) -> dict:
    return model.model_validate(doc).model_dump(by_alias=True, exclude_unset=True, mode="json")


@pytest.mark.parametrize(
    "item", [i for i in k8s_documents() if i[1]["kind"] in ("PodMonitor", "ServiceMonitor")], ids=_id
)
def test_monitors_match_the_prometheus_operator_schema(item):
    # models generated from the operator's CRD schemas: a field they do not know is dropped
    _, doc = item
    model = getattr(prometheus_operator, doc["kind"])
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert _round_trip(model, doc) == doc
    misspelt = copy.deepcopy(doc)
    misspelt["spec"]["podMetricsEndpoints"][0]["pth"] = "/metrics"
    assert _round_trip(model, misspelt) != misspelt


def test_podmonitor_scrapes_metrics_of_every_server_pod():
    monitor = k8s_object("PodMonitor", "raypaged")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name, _spec, container in _server_containers():
        template = next(t for n, t in pod_templates() if n == name)
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name} is not scraped"
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
    for name, template in pod_templates():
        if not any(container_raypaged_argv(c) for c in template["spec"]["containers"]):
            assert not selector.items() <= template["metadata"]["labels"].items(), f"{name} serves no metrics"


@pytest.mark.parametrize("server", _server_containers(), ids=lambda s: s[0])
def test_container_runs_a_valid_raypaged_serve(server):
    _, _, container = server
    args = parse_raypaged(container_raypaged_argv(container))
    assert args.command == "serve"
    assert args.host == "0.0.0.0"
    assert all(model.startswith("/models/") for model in args.model)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["http"], ports["grpc"]) == (args.port, args.grpc_port)


@pytest.mark.parametrize("server", _server_containers(), ids=lambda s: s[0])
def test_grpc_beyond_loopback_only_with_an_api_key_from_a_secret(server):
    _, _, container = server
    args = parse_raypaged(container_raypaged_argv(container))
    if args.grpc_host in ("127.0.0.1", "localhost", "::1") or args.tenants:
        return
    assert args.api_key is None, "a key on the command line is visible to anyone who can list pods"
    sources = {item["name"]: item.get("valueFrom", {}) for item in container.get("env", [])}
    secret = sources.get("RAYPAGED_API_KEY", {}).get("secretKeyRef")
    assert secret is not None and secret.get("optional") is not True, (
        f"--grpc-host {args.grpc_host} needs --tenants or RAYPAGED_API_KEY from a Secret"
    )


@pytest.mark.parametrize("server", _server_containers(), ids=lambda s: s[0])
def test_probes_ask_for_health_on_the_served_port(server):
    _, _, container = server
    args = parse_raypaged(container_raypaged_argv(container))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health", probe
        assert ports.get(check["port"], check["port"]) == args.port, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading can take ten minutes"


@pytest.mark.parametrize("server", _server_containers(), ids=lambda s: s[0])
def test_grace_period_outlasts_prestop_and_drain(server):
    _, spec, container = server
    args = parse_raypaged(container_raypaged_argv(container))
    needed = _prestop_seconds(container) + drain_timeout_s(args)
    assert spec["terminationGracePeriodSeconds"] > needed


def test_security_context_is_non_root_everywhere():
    uid = int(next(rest for key, rest in dockerfile_instructions(DOCKERFILES["cuda"]) if key == "USER").split(":")[0])
    for name, template in pod_templates():
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid, name
        for container in template["spec"]["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


@pytest.mark.parametrize("service_name", ["raypaged", "raypaged-single"])
def test_service_selects_server_pods_and_their_named_ports(service_name):
    service = k8s_object("Service", service_name)
    selector = service["spec"]["selector"]
    selected = [(n, t) for n, t in pod_templates() if selector.items() <= t["metadata"]["labels"].items()]
    assert selected, f"Service {service_name} selects no pods"
    for name, template in selected:
        (container,) = [c for c in template["spec"]["containers"] if container_raypaged_argv(c)]
        names = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, name


# ---- the RayCluster: its CRD schema is not on PyPI, so its exact shape is asserted here ---------

RAYCLUSTER_SPEC_KEYS = {"rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs"}
HEAD_GROUP_KEYS = {"serviceType", "rayStartParams", "template"}
WORKER_GROUP_KEYS = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}


def _raycluster() -> dict:
    return k8s_object("RayCluster", "raypaged")


def test_raycluster_has_the_crd_fields_kuberay_reads():
    cluster = _raycluster()
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = cluster["spec"]
    assert set(spec) == RAYCLUSTER_SPEC_KEYS
    assert set(spec["headGroupSpec"]) == HEAD_GROUP_KEYS
    assert spec["headGroupSpec"]["serviceType"] in ("ClusterIP", "NodePort", "LoadBalancer")
    for group in spec["workerGroupSpecs"]:
        assert set(group) == WORKER_GROUP_KEYS
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for params in [spec["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in spec["workerGroupSpecs"]]:
        assert all(isinstance(value, str) for value in params.values()), "rayStartParams values are strings"
    # KubeRay runs the first container as the Ray node
    assert spec["headGroupSpec"]["template"]["spec"]["containers"][0]["name"] == "ray-head"


def test_raycluster_ray_version_is_the_image_ray():
    runs = "\n".join(rest for key, rest in dockerfile_instructions(DOCKERFILES["cuda"]) if key == "RUN")
    (pin,) = re.findall(r"ray\[default\]==([\d.]+)", runs)
    assert _raycluster()["spec"]["rayVersion"] == pin


def test_shards_fit_the_gpu_worker_group():
    spec = _raycluster()["spec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0", "no shard may land on the head"
    (container,) = head["template"]["spec"]["containers"]
    args = parse_raypaged(container_raypaged_argv(container))
    assert args.ray_address == "auto" and args.device == "cuda"
    num_gpus = 0
    num_pods = 0
    for group in spec["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        limits = worker["resources"]["limits"]
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        num_gpus += group["replicas"] * int(limits["nvidia.com/gpu"])
        num_pods += group["replicas"]
    assert args.tensor_parallel_size * args.pipeline_parallel_size == num_gpus
    if num_pods > 1:
        assert args.placement_strategy != "STRICT_PACK", "STRICT_PACK needs every shard on one node"


def test_workers_outlive_the_head_drain():
    spec = _raycluster()["spec"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    head_drain = _prestop_seconds(head) + drain_timeout_s(parse_raypaged(container_raypaged_argv(head)))
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (worker,) = pod["containers"]
        assert _prestop_seconds(worker) >= head_drain
        assert pod["terminationGracePeriodSeconds"] > _prestop_seconds(worker)


def _stub(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("role", ["head", "worker"])
def test_ray_container_scripts_run_under_bash(role, tmp_path):
    """The container's script with stub ray/python/raypaged: ray starts (head: without --block), then raypaged."""
    spec = _raycluster()["spec"]
    group = spec["headGroupSpec"] if role == "head" else spec["workerGroupSpecs"][0]
    (container,) = group["template"]["spec"]["containers"]
    log = tmp_path / "calls.log"
    _stub(tmp_path, "ray", f'echo "ray $*" >> {log}')
    _stub(tmp_path, "python", f'echo "python" >> {log}')
    _stub(tmp_path, "raypaged", f'echo "raypaged $*" >> {log}')
    env = {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}
    env.update(PATH=f"{tmp_path}:/usr/bin:/bin", KUBERAY_GEN_RAY_START_CMD="ray start  --block  --port=6379 ")
    result = subprocess.run(
        container["command"] + container["args"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    if role == "worker":
        assert calls == ["ray start --block --port=6379"]
        return
    assert calls[0] == "ray start --port=6379"
    assert calls[1] == "python"  # the wait for the GPU workers
    assert calls[2].split() == container_raypaged_argv(container)
