"""The Kubernetes manifests under deploy/: every kustomization renders and validates offline, and
scripts/check_manifests.py catches what it promises to catch (each broken variant is made in tmp_path
or on a copy of the rendered documents, never in deploy/)."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO

DEPLOY = REPO / "deploy"
LAYOUTS = ("single-host", "multi-host", "inference-pool", "autoscaling", "inference-pool-autoscaling")
#: Every kustomization: the serving layouts and the alert rules (a PrometheusRule alone).
KUSTOMIZATIONS = (*LAYOUTS, "observability")
LEADER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_manifests", REPO / "scripts" / "check_manifests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


cm = _load_checker()


@pytest.fixture(scope="module")
def schemas() -> Any:
    return cm.Schemas(DEPLOY / "schemas")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: cm.render(DEPLOY / name) for name in LAYOUTS}


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _lws_templates(docs: list[dict[str, Any]]) -> dict[str, Any]:
    templates: dict[str, Any] = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return templates


def _problems(schemas: Any, layout: str, docs: list[dict[str, Any]]) -> list[str]:
    return [str(problem) for problem in cm.check_documents(f"deploy/{layout}", docs, schemas)]


def _copy_deploy(tmp_path: Path) -> Path:
    target = tmp_path / "deploy"
    shutil.copytree(DEPLOY, target)
    return target


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _run_main(deploy: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cm.main(["--deploy", str(deploy), "--schemas", str(DEPLOY / "schemas")])
    out, err = capsys.readouterr()
    return code, out + err


# ---- the committed manifests pass ----------------------------------------------------------------------


def test_discovery_finds_the_layouts_and_skips_components() -> None:
    assert [path.relative_to(DEPLOY).as_posix() for path in cm.discover(DEPLOY)] == sorted(KUSTOMIZATIONS)


def test_every_kustomization_renders_and_validates(schemas: Any) -> None:
    problems, directories, documents = cm.check_tree(DEPLOY, schemas)
    assert [str(p) for p in problems] == []
    assert directories == len(KUSTOMIZATIONS)
    assert documents >= 10


def test_the_check_script_passes_on_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _run_main(DEPLOY, capsys)
    assert code == 0, output
    assert f"{len(KUSTOMIZATIONS)} kustomization(s)" in output and "Kubernetes 1.37" in output
    assert "LeaderWorkerSet" in output and "InferencePool" in output and "ServiceMonitor" in output
    assert "PodMonitor" in output and "PrometheusRule" in output


@pytest.mark.parametrize(("layout", "kinds"), [
    ("single-host", {"Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim", "NetworkPolicy"}),
    ("multi-host", {"LeaderWorkerSet", "Service", "ServiceMonitor", "PodMonitor", "NetworkPolicy"}),
    ("inference-pool", {"Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim", "InferencePool",
                        "NetworkPolicy"}),
])
def test_each_layout_renders_its_objects(rendered: dict[str, list[dict[str, Any]]], layout: str,
                                         kinds: set[str]) -> None:
    assert {doc["kind"] for doc in rendered[layout]} == kinds


def test_every_kind_is_checked_against_a_schema(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            assert schemas.validator(doc["apiVersion"], doc["kind"]) is not None, doc["kind"]
    assert ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet") in schemas.crds
    assert ("inference.networking.k8s.io/v1", "InferencePool") in schemas.crds
    assert ("monitoring.coreos.com/v1", "ServiceMonitor") in schemas.crds
    assert ("monitoring.coreos.com/v1", "PodMonitor") in schemas.crds


def test_kubectl_comes_from_the_virtual_environment() -> None:
    path = Path(cm.kubectl())
    assert path.is_file()
    assert path.parent == Path(sys.executable).parent


# ---- broken variants fail, each with a line that names the problem -------------------------------------


def test_a_wrong_field_in_a_copied_overlay_fails_with_its_path_and_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deploy = _copy_deploy(tmp_path)
    _edit(deploy / "multi-host" / "leaderworkerset.yaml", "    size: 2\n", "    sise: 2\n")
    code, output = _run_main(deploy, capsys)
    assert code == 1
    lines = [line for line in output.splitlines() if "sise" in line]
    assert len(lines) == 1, output
    assert "multi-host" in lines[0] and "LeaderWorkerSet/carbonforge-multihost" in lines[0]
    assert "leaderworkerset.yaml" in lines[0]  # the file the document comes from
    assert "spec.leaderWorkerTemplate.sise: unknown field 'sise'" in lines[0]
    # without its size the group has one pod, which the recipe's two hosts also catch
    problems = [line for line in output.splitlines() if not line.startswith("manifests:")]
    assert all("sise" in line or "LeaderWorkerSet's size is 1" in line for line in problems), output


def test_a_wrong_field_in_a_core_kind_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    container = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGett"] = container["readinessProbe"].pop("httpGet")
    problems = _problems(schemas, "single-host", docs)
    assert any("containers[0].readinessProbe.httpGett: unknown field 'httpGett'" in p for p in problems), problems


def test_a_wrong_type_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["inference-pool"])
    _one(docs, "Deployment")["spec"]["replicas"] = "two"
    problems = _problems(schemas, "inference-pool", docs)
    assert problems == ["deploy/inference-pool: Deployment/carbonforge: spec.replicas: "
                        "'two' is not of type 'integer', 'null'"]


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe", "startupProbe"])
def test_a_missing_probe_on_the_lws_leader_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]],
                                                  probe: str) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    del _lws_templates(docs)["leaderTemplate"]["spec"]["containers"][0][probe]
    problems = _problems(schemas, "multi-host", docs)
    assert any(f"leaderTemplate.spec.containers[0].{probe}: the LeaderWorkerSet leader serves the API: "
               f"it needs a {probe}" in p for p in problems), problems


def test_a_probe_on_an_lws_worker_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    templates = _lws_templates(docs)
    leader = templates["leaderTemplate"]["spec"]["containers"][0]
    templates["workerTemplate"]["spec"]["containers"][0]["livenessProbe"] = copy.deepcopy(leader["livenessProbe"])
    problems = _problems(schemas, "multi-host", docs)
    assert any("workerTemplate.spec.containers[0].livenessProbe: LeaderWorkerSet workers run vLLM headless" in p
               for p in problems), problems


def test_an_api_key_in_args_of_a_copied_overlay_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deploy = _copy_deploy(tmp_path)
    _edit(deploy / "single-host" / "deployment.yaml", '"--metrics"]', '"--metrics", "--api-key", "sk-live-123"]')
    code, output = _run_main(deploy, capsys)
    assert code == 1
    lines = [line for line in output.splitlines() if "--api-key in the command line" in line]
    # every layout but multi-host renders that Deployment
    assert len(lines) == len(LAYOUTS) - 1, output
    assert all("Deployment/carbonforge" in line and "containers[0].args[3]" in line for line in lines)
    assert any(line.startswith(str(deploy / "single-host")) for line in lines)


def test_a_secret_variable_expanded_into_args_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    container = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    container["args"] += ["--", "--api-key=$(CF_API_KEY)"]
    problems = _problems(schemas, "single-host", docs)
    assert any("args[4]: --api-key in the command line" in p for p in problems), problems
    assert any("args[4]: $(CF_API_KEY) puts a Secret value in the command line" in p for p in problems), problems


def test_runtime_flags_without_the_context_key_fail(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"] = ["--metrics"]
    problems = _problems(schemas, "single-host", docs)
    assert any("containers[0].args: runtime flags without --context-key are refused" in p for p in problems), problems


def test_args_that_name_an_undefined_variable_fail(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    container = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [var for var in container["env"] if var["name"] != "CF_CONTEXT_KEY"]
    problems = _problems(schemas, "single-host", docs)
    assert any("containers[0].args[1]: $(CF_CONTEXT_KEY) names no variable" in p for p in problems), problems


def test_a_literal_api_key_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    env = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "CF_API_KEY", "value": "sk-live-123"})
    index = len(env) - 1
    problems = _problems(schemas, "single-host", docs)
    assert any(f"env[{index}].value: CF_API_KEY as a literal value" in p for p in problems), problems


def test_a_secret_object_in_the_manifests_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = [*copy.deepcopy(rendered["single-host"]),
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "carbonforge-api-key"},
             "stringData": {"api-key": "sk-live-123"}}]
    problems = _problems(schemas, "single-host", docs)
    assert any(p.startswith("deploy/single-host: Secret/carbonforge-api-key: (document): a Secret in the manifests")
               for p in problems), problems


def test_another_lws_restart_policy_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _lws_templates(docs)["restartPolicy"] = "None"
    problems = _problems(schemas, "multi-host", docs)
    assert any("spec.leaderWorkerTemplate.restartPolicy: is 'None'; must be RecreateGroupOnPodRestart" in p
               for p in problems), problems


def test_a_leader_ready_startup_policy_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _one(docs, "LeaderWorkerSet")["spec"]["startupPolicy"] = "LeaderReady"
    problems = _problems(schemas, "multi-host", docs)
    assert any("spec.startupPolicy: LeaderReady waits for the leader's readiness" in p for p in problems), problems


def test_a_multi_host_service_that_selects_workers_fails(schemas: Any,
                                                         rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    del _one(docs, "Service")["spec"]["selector"][LEADER_INDEX_LABEL]
    problems = _problems(schemas, "multi-host", docs)
    assert any("Service/carbonforge-multihost-leader: spec.selector: selects LeaderWorkerSet workers" in p
               for p in problems), problems


def test_a_service_named_like_the_lws_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _one(docs, "Service")["metadata"]["name"] = "carbonforge-multihost"
    problems = _problems(schemas, "multi-host", docs)
    assert any("metadata.name: LeaderWorkerSet carbonforge-multihost creates a headless Service" in p
               for p in problems), problems


def test_leader_and_worker_containers_must_match(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _lws_templates(docs)["workerTemplate"]["spec"]["containers"][0]["image"] = "carbonforge-runtime:0.1.0"
    problems = _problems(schemas, "multi-host", docs)
    assert any("workerTemplate.spec.containers[0].image: differs from the leader's" in p for p in problems), problems


@pytest.mark.parametrize("grace", [None, 30])
def test_a_short_termination_grace_period_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]],
                                                grace: int | None) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    if grace is None:
        del pod["terminationGracePeriodSeconds"]
    else:
        pod["terminationGracePeriodSeconds"] = grace
    problems = _problems(schemas, "single-host", docs)
    assert any("spec.template.spec.terminationGracePeriodSeconds: " in p and "needs at least" in p
               for p in problems), problems


def test_a_startup_probe_shorter_than_the_ready_timeout_fails(schemas: Any,
                                                              rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureThreshold"] = 30
    problems = _problems(schemas, "single-host", docs)
    assert any("containers[0].startupProbe: allows 300 s" in p and "3600 s" in p for p in problems), problems


def test_a_probe_on_an_unnamed_port_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "api"
    problems = _problems(schemas, "single-host", docs)
    assert any("readinessProbe.httpGet.port: port 'api' is not a named port" in p for p in problems), problems


def test_a_pool_that_selects_no_pod_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["inference-pool"])
    _one(docs, "InferencePool")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] = "other"
    problems = _problems(schemas, "inference-pool", docs)
    assert any("InferencePool/carbonforge: spec.selector.matchLabels: selects no pod" in p for p in problems), problems


def test_a_kustomize_error_is_one_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deploy = _copy_deploy(tmp_path)
    _edit(deploy / "multi-host" / "kustomization.yaml", "  - service.yaml\n", "  - services.yaml\n")
    code, output = _run_main(deploy, capsys)
    assert code == 1
    assert re.search(r"multi-host: Kustomization/multi-host: \(document\): kustomize failed: .*services\.yaml",
                     output), output


# ---- what the manifests promise ------------------------------------------------------------------------


def _pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [pod.spec for doc in docs for pod in cm.pods_of(doc)]


def test_the_startup_probe_covers_the_ready_timeout(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from carbonforge_runtime.settings import VARIABLES

    default = next(var.default for var in VARIABLES if var.name == "CF_READY_TIMEOUT_S")
    assert cm.READY_TIMEOUT_S == default == 3600
    probed = 0
    for layout in LAYOUTS:
        for pod in _pods(rendered[layout]):
            for container in pod["containers"]:
                probe = container.get("startupProbe")
                if probe is None:
                    continue
                probed += 1
                assert probe["httpGet"] == {"path": "/health", "port": "http"}
                assert probe.get("initialDelaySeconds", 0) + probe["failureThreshold"] * probe["periodSeconds"] >= 3600
    assert probed == len(LAYOUTS)  # one Deployment's pod per layout, the leader in multi-host


def test_readiness_and_liveness_probe_health_on_the_api_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for layout in ("single-host", "inference-pool"):
        container = _one(rendered[layout], "Deployment")["spec"]["template"]["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    leader = _lws_templates(rendered["multi-host"])["leaderTemplate"]["spec"]["containers"][0]
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_single_host_deployment_mounts_the_licence_secret_read_only(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = _one(rendered["single-host"], "Deployment")["spec"]["template"]["spec"]
    volumes = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "carbonforge-licence"]
    assert len(volumes) == 1
    secret = volumes[0]["secret"]
    assert secret["optional"] is True  # free recipes run without a licence
    container = pod["containers"][0]
    mounts = [m for m in container["volumeMounts"] if m["name"] == volumes[0]["name"]]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    files = {f"{mounts[0]['mountPath'].rstrip('/')}/{item['path']}": item["key"] for item in secret["items"]}
    if "subPath" in mounts[0]:
        files = {mounts[0]["mountPath"]: mounts[0]["subPath"]}
    assert files == {"/etc/carbonforge/license.key": "license.key"}
    # the runtime reads CF_LICENSE_FILE, /etc/carbonforge/license.key unless the pod changes it
    assert all(var["name"] != "CF_LICENSE_FILE" for var in container["env"])


def test_secrets_are_files_of_secret_volumes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for layout in LAYOUTS:
        for pod in _pods(rendered[layout]):
            volumes = {v["name"]: v for v in pod["volumes"]}
            for container in pod["containers"]:
                env = {var["name"]: var for var in container["env"]}
                assert not any("valueFrom" in var and "secretKeyRef" in var["valueFrom"] for var in env.values())
                assert not set(cm.SECRET_VARIABLES) & set(env)
                files = {}
                for mount in container["volumeMounts"]:
                    for source in cm._secret_sources(volumes.get(mount["name"], {})):
                        assert mount["readOnly"] is True
                        for item in source["items"]:
                            name = source.get("name", source.get("secretName"))
                            files[f"{mount['mountPath']}/{item['path']}"] = (name, source.get("optional"))
                assert files[env["CF_API_KEY_FILE"]["value"]] == ("carbonforge-api-key", None)  # required
                assert files[env["HF_TOKEN_PATH"]["value"]] == ("carbonforge-hf-token", True)
                assert not any("api-key" in arg or "CF_API_KEY" in arg for arg in container["args"])
                assert container["args"] == ["--context-key", "$(CF_CONTEXT_KEY)", "--metrics"]


def test_the_single_host_pod(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = _one(rendered["single-host"], "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {pod["securityContext"][k] for k in ("runAsUser", "runAsGroup", "fsGroup")} == {10001}
    container = pod["containers"][0]
    assert container["image"] == "carbonforge-runtime:0.2.0"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {("http", 8000), ("metrics", 9105)}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    hf = volumes[mounts["/var/cache/huggingface"]]["persistentVolumeClaim"]["claimName"]
    assert hf in {doc["metadata"]["name"] for doc in rendered["single-host"] if doc["kind"] == "PersistentVolumeClaim"}
    assert "/var/log/carbonforge" in mounts and "/var/cache/carbonforge" in mounts
    service = _one(rendered["single-host"], "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("http", 8000), ("metrics", 9105)}
    monitor = _one(rendered["single-host"], "ServiceMonitor")
    assert "metrics" in [e["port"] for e in monitor["spec"]["endpoints"]]


def test_the_multi_host_group(rendered: dict[str, list[dict[str, Any]]]) -> None:
    templates = _lws_templates(rendered["multi-host"])
    assert templates["size"] == 2
    assert templates["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = templates["leaderTemplate"]["spec"]["containers"][0]
    worker = templates["workerTemplate"]["spec"]["containers"][0]
    assert leader["image"] == worker["image"]
    for container in (leader, worker):
        env = {var["name"]: var.get("value") for var in container["env"]}
        assert env["CF_CONTEXT_KEY"] == "qwen3.6-27b:fp8:agentic:2xh100x8"
        assert env["CF_MASTER_PORT"] == "29500"
        assert not {"LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"} & set(env)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    service = _one(rendered["multi-host"], "Service")
    assert service["spec"]["selector"][LEADER_INDEX_LABEL] == "0"
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == \
        _one(rendered["multi-host"], "LeaderWorkerSet")["metadata"]["name"]


def test_the_runtime_metrics_of_every_pod_of_the_group_are_scraped(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["multi-host"]
    lws = _one(docs, "LeaderWorkerSet")
    pods = cm.pods_of(lws)
    assert {pod.role for pod in pods} == {"leader", "worker"}
    monitor = _one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert all(cm._selects(monitor["spec"]["selector"]["matchLabels"], pod.labels) for pod in pods)
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")]
    assert LEADER_INDEX_LABEL in monitor["spec"]["podTargetLabels"]  # each series says which pod it is from
    # vLLM's own page is on the leaders only: the ServiceMonitor scrapes it there, and not 9105 a second time
    service_monitor = _one(docs, "ServiceMonitor")
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == ["http"]


def test_the_group_ports_are_open_to_the_pods_of_the_set_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["multi-host"]
    policy = _one(docs, "NetworkPolicy")
    pods = cm.pods_of(_one(docs, "LeaderWorkerSet"))
    assert all(cm._selects(policy["spec"]["podSelector"]["matchLabels"], pod.labels) for pod in pods)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    inside, clients, prometheus = policy["spec"]["ingress"]
    assert "ports" not in inside and all(cm._selects(inside["from"][0]["podSelector"]["matchLabels"], pod.labels)
                                         for pod in pods)
    assert clients["from"] and {p["port"] for p in clients["ports"]} == {"http"}
    assert prometheus["from"] == [{"namespaceSelector": {},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert {p["port"] for p in prometheus["ports"]} == {"http", "metrics"}


def test_without_a_pod_monitor_the_workers_metrics_are_lost(schemas: Any,
                                                           rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = [doc for doc in copy.deepcopy(rendered["multi-host"]) if doc["kind"] != "PodMonitor"]
    problems = _problems(schemas, "multi-host", docs)
    assert problems == ["deploy/multi-host: LeaderWorkerSet/carbonforge-multihost: "
                        "spec.leaderWorkerTemplate.workerTemplate.spec.containers[0]: the workers' metrics page "
                        "(--metrics, port metrics) is scraped by no PodMonitor: the series of their data-parallel "
                        "ranks would be lost; add a PodMonitor that selects every pod of the set "
                        "(deploy/multi-host/podmonitor.yaml)"], problems


def test_a_pod_monitor_that_selects_the_leaders_only_fails(schemas: Any,
                                                           rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _one(docs, "PodMonitor")["spec"]["selector"]["matchLabels"][LEADER_INDEX_LABEL] = "0"
    problems = _problems(schemas, "multi-host", docs)
    assert len(problems) == 1 and "is scraped by no PodMonitor" in problems[0], problems


@pytest.mark.parametrize(("port", "message"), [
    ("http", "PodMonitor/carbonforge-multihost: spec.podMetricsEndpoints[0].port: port 'http' is the API, which "
             "LeaderWorkerSet workers do not serve"),
    ("metricz", "PodMonitor/carbonforge-multihost: spec.podMetricsEndpoints[0].port: the selected leader and "
                "worker pods have no port named 'metricz'"),
])
def test_a_pod_monitor_on_a_port_the_pods_do_not_serve_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]],
                                                             port: str, message: str) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] = port
    problems = _problems(schemas, "multi-host", docs)
    assert any(message in p for p in problems), problems


def test_a_wrong_field_in_the_pod_monitor_fails_against_its_crd(schemas: Any,
                                                                rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    monitor = _one(docs, "PodMonitor")
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    problems = _problems(schemas, "multi-host", docs)
    assert any("PodMonitor/carbonforge-multihost: spec.podMetricEndpoints: unknown field 'podMetricEndpoints'" in p
               for p in problems), problems


def test_a_wrong_field_in_the_network_policy_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _one(docs, "NetworkPolicy")["spec"]["ingres"] = []
    problems = _problems(schemas, "multi-host", docs)
    assert any("NetworkPolicy/carbonforge-multihost-group: spec.ingres: unknown field 'ingres'" in p
               for p in problems), problems


def test_without_a_network_policy_the_watch_port_is_open(schemas: Any,
                                                         rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = [doc for doc in copy.deepcopy(rendered["multi-host"]) if doc["kind"] != "NetworkPolicy"]
    problems = _problems(schemas, "multi-host", docs)
    ingress = [p for p in problems if "for Egress" not in p]
    assert len(ingress) == 2, problems  # the leaders and the workers
    assert all("no NetworkPolicy selects the group's" in p and "watch port (CF_GROUP_PORT) has no authentication"
               in p for p in ingress), problems


@pytest.mark.parametrize(("ports", "message"), [
    ([{"port": 29499, "protocol": "TCP"}], "opens port 29499, the runtimes' watch port (CF_GROUP_PORT), to every "
                                           "source"),
    ([{"port": "master", "protocol": "TCP"}], "opens port 29500, where the group meets (CF_MASTER_PORT), to every "
                                              "source"),
    (None, "opens every port of the group's pods to every source"),
    ([{"port": "api", "protocol": "TCP"}], "no selected pod has a port named 'api'"),
])
def test_a_network_policy_that_opens_the_group_ports_to_anyone_fails(
        schemas: Any, rendered: dict[str, list[dict[str, Any]]], ports: Any, message: str) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    anyone = _one(docs, "NetworkPolicy")["spec"]["ingress"][1]
    del anyone["from"]
    if ports is None:
        del anyone["ports"]
    else:
        anyone["ports"] += ports
    problems = _problems(schemas, "multi-host", docs)
    assert any(message in p for p in problems), problems


def test_a_network_policy_that_cuts_the_group_apart_fails(schemas: Any,
                                                          rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    inside = _one(docs, "NetworkPolicy")["spec"]["ingress"][0]
    inside["ports"] = [{"port": "master", "protocol": "TCP"}]  # vLLM's own ports between hosts stay shut
    problems = _problems(schemas, "multi-host", docs)
    assert any("no rule lets the pods of the group reach each other on every port" in p for p in problems), problems


def test_the_inference_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["inference-pool"]
    deployment, pool = _one(docs, "Deployment"), _one(docs, "InferencePool")
    assert deployment["spec"]["replicas"] == 4
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{pool['metadata']['name']}-epp"
    # no surge: a surge pod would need GPUs that the old pods still hold
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_the_grace_period_rule_follows_the_recipes_and_the_runtime() -> None:
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir
    from carbonforge_runtime.runtime.process.drain import SHUTDOWN_GRACE_S, stop_timeout_s

    assert cm.SHUTDOWN_GRACE_S == SHUTDOWN_GRACE_S
    assert cm.required_grace_s() >= 60
    # The runtime's own stop timeout (what the dry run and `fetch` print) for the longest drain, read
    # here through the package's recipe loader.
    longest = max(recipe.drain_timeout_s for recipe in load_recipes([shipped_recipes_dir()]).values())
    assert cm.longest_drain_s() == longest
    assert cm.required_grace_s() == max(60, stop_timeout_s(longest))


def test_a_grace_period_below_the_stop_timeout_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The drain plus the stop grace is not enough: the runtime's own exit comes after it."""
    docs = copy.deepcopy(rendered["single-host"])
    _one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = (
        int(cm.longest_drain_s() + cm.SHUTDOWN_GRACE_S))
    problems = _problems(schemas, "single-host", docs)
    assert any(f"needs at least {cm.required_grace_s()} s" in p for p in problems), problems


def test_the_vendored_crds_are_recorded() -> None:
    readme = (DEPLOY / "schemas" / "README.md").read_text(encoding="utf-8")
    files = sorted((DEPLOY / "schemas").glob("*.yaml"))
    assert len(files) >= 5  # every file, however many, must have its row below
    for path in files:
        rows = [line for line in readme.splitlines() if line.startswith(f"| `{path.name}` |")]
        assert len(rows) == 1, f"deploy/schemas/README.md has no row for {path.name}"
        assert hashlib.sha256(path.read_bytes()).hexdigest() in rows[0], f"{path.name} differs from its recorded sha256"
        assert re.search(r"\| v\d+\.\d+\.\d+ \| [0-9a-f]{40} \|", rows[0]), rows[0]


# ---- the pods match the recipes they serve -------------------------------------------------------------


def test_every_context_key_names_a_shipped_recipe(rendered: dict[str, list[dict[str, Any]]]) -> None:
    keys = {var["value"] for layout in LAYOUTS for pod in _pods(rendered[layout]) for c in pod["containers"]
            for var in c["env"] if var["name"] == "CF_CONTEXT_KEY"}
    assert keys == {"qwen3-32b:fp8:chat:a100-80x1", "qwen3.6-27b:fp8:agentic:2xh100x8"}
    assert keys <= set(cm.shipped_recipes())


def test_a_gpu_count_other_than_the_recipes_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    for template in ("leaderTemplate", "workerTemplate"):
        resources = _lws_templates(docs)[template]["spec"]["containers"][0]["resources"]
        resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = 4
    problems = _problems(schemas, "multi-host", docs)
    assert sum("asks for 4 nvidia.com/gpu per pod; the recipe qwen3.6-27b:fp8:agentic:2xh100x8 runs on 8" in p
               for p in problems) == 2, problems


def test_a_group_size_other_than_the_recipes_hosts_fails(schemas: Any,
                                                         rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _lws_templates(docs)["size"] = 3
    problems = _problems(schemas, "multi-host", docs)
    assert any("spans 2 host(s) but the LeaderWorkerSet's size is 3" in p for p in problems), problems


def test_a_node_rank_set_by_hand_in_a_group_fails(schemas: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    worker = _lws_templates(docs)["workerTemplate"]["spec"]["containers"][0]
    worker["env"].append({"name": "CF_NODE_RANK", "value": "1"})
    problems = _problems(schemas, "multi-host", docs)
    assert any("CF_NODE_RANK would win over LeaderWorkerSet's variables" in p for p in problems), problems
