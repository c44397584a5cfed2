"""The autoscaling overlays (deploy/autoscaling, deploy/inference-pool-autoscaling): a KEDA ScaledObject
that scales the runtime's Deployment on vLLM's own load signals, and the checks scripts/check_manifests.py
makes of it. Broken variants are made in a copy of deploy/ under tmp_path, or on rendered copies."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO
from tests.unit.deploy.test_manifests import cm

DEPLOY = REPO / "deploy"
OVERLAYS = ("autoscaling", "inference-pool-autoscaling")
SCALED_OBJECT = Path("components") / "autoscaling" / "scaledobject.yaml"
Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def schemas() -> Any:
    return cm.Schemas(DEPLOY / "schemas")


@pytest.fixture(scope="module")
def rendered() -> dict[str, Docs]:
    return {name: cm.render(DEPLOY / name) for name in OVERLAYS}


def _scaled_object(docs: Docs) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == "ScaledObject"]
    assert len(found) == 1
    return found[0]


def _deployment(docs: Docs) -> dict[str, Any]:
    return next(doc for doc in docs if doc["kind"] == "Deployment")


def _problems(schemas: Any, docs: Docs) -> list[str]:
    return [str(problem) for problem in cm.check_documents("deploy/autoscaling", docs, schemas)]


def _broken(rendered: dict[str, Docs]) -> tuple[Docs, dict[str, Any]]:
    docs = copy.deepcopy(rendered["autoscaling"])
    return docs, _scaled_object(docs)


# ---- the committed overlays ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlays_pass(schemas: Any, rendered: dict[str, Docs], overlay: str) -> None:
    assert _problems(schemas, rendered[overlay]) == []
    assert schemas.validator("keda.sh/v1alpha1", "ScaledObject") is not None
    assert ("keda.sh/v1alpha1", "ScaledObject") in schemas.crds


@pytest.mark.parametrize(("overlay", "ceiling", "extra"), [("autoscaling", 4, set()),
                                                           ("inference-pool-autoscaling", 8, {"InferencePool"})])
def test_the_scaled_object_scales_the_deployment_on_the_engines_signals(rendered: dict[str, Docs], overlay: str,
                                                                         ceiling: int, extra: set[str]) -> None:
    docs = rendered[overlay]
    assert {doc["kind"] for doc in docs} == {"Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim",
                                             "NetworkPolicy", "ScaledObject"} | extra
    scaled = _scaled_object(docs)
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "carbonforge"}
    assert spec["minReplicaCount"] == 1 and spec["maxReplicaCount"] == ceiling
    assert "idleReplicaCount" not in spec
    assert scaled["metadata"]["annotations"][cm.SCALE_TO_ZERO_ANNOTATION] == "false"
    queries = {trigger["name"]: trigger["metadata"]["query"] for trigger in spec["triggers"]}
    assert set(queries) == {"waiting-requests", "kv-cache-usage"}
    assert "vllm:num_requests_waiting{" in queries["waiting-requests"]
    assert "vllm:kv_cache_usage_perc{" in queries["kv-cache-usage"]
    namespace = scaled["metadata"]["namespace"]
    assert all(doc["metadata"]["namespace"] == namespace for doc in docs)
    for query in queries.values():
        assert f'namespace="{namespace}"' in query and 'service="carbonforge"' in query
    # The HPA owns the replica count; the Deployment sets none.
    assert "replicas" not in _deployment(docs)["spec"]


def test_scale_down_is_slower_than_scale_up(rendered: dict[str, Docs]) -> None:
    behavior = _scaled_object(rendered["autoscaling"])["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert down["stabilizationWindowSeconds"] > up["stabilizationWindowSeconds"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert max(p["value"] for p in down["policies"]) == 1  # one pod at a time


def test_the_scaled_out_pods_share_the_weights_and_not_the_compile_cache(rendered: dict[str, Docs]) -> None:
    docs = rendered["autoscaling"]
    claims = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"}
    assert set(claims) == {"carbonforge-hf-cache"}
    assert claims["carbonforge-hf-cache"]["spec"]["accessModes"] == ["ReadWriteMany"]
    deployment = _deployment(docs)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["compile-cache"] and "persistentVolumeClaim" not in volumes["compile-cache"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


# ---- a broken ScaledObject fails -----------------------------------------------------------------------


def _copy_deploy(tmp_path: Path) -> Path:
    target = tmp_path / "deploy"
    shutil.copytree(DEPLOY, target)
    return target


def _run_main(deploy: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cm.main(["--deploy", str(deploy), "--schemas", str(DEPLOY / "schemas")])
    out, err = capsys.readouterr()
    return code, out + err


WAITING_QUERY = 'query: sum(vllm:num_requests_waiting{namespace="carbonforge", service="carbonforge"})'


@pytest.mark.parametrize(("old", "new", "field", "message"), [
    ("    - type: prometheus\n      name: waiting-requests", "    - type: cpu\n      name: waiting-requests",
     "spec.triggers[0].type", "'cpu': the runtime scales on the engine's own series"),
    ("        serverAddress: http://prometheus-operated.monitoring.svc:9090\n        query: sum(vllm:num_requests_w",
     "        query: sum(vllm:num_requests_w",
     "spec.triggers[0].metadata.serverAddress", "missing: a prometheus trigger needs serverAddress"),
    (f"        {WAITING_QUERY}\n", "",
     "spec.triggers[0].metadata.query", "missing: a prometheus trigger needs serverAddress, query"),
    ("vllm:num_requests_waiting{", "vllm:num_requests_queued{",
     "spec.triggers[0].metadata.query", "names 'vllm:num_requests_queued', which neither vLLM nor the runtime"),
])
def test_a_broken_trigger_fails_naming_the_object_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            old: str, new: str, field: str, message: str) -> None:
    deploy = _copy_deploy(tmp_path)
    path = deploy / SCALED_OBJECT
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")
    code, output = _run_main(deploy, capsys)
    assert code == 1
    lines = [line for line in output.splitlines() if f": {field}: " in line]
    # Both overlays include the component: each reports it, naming the ScaledObject and its file.
    assert len(lines) == len(OVERLAYS), output
    for overlay, line in zip(OVERLAYS, sorted(lines), strict=True):
        assert line.startswith(f"{deploy / overlay}: ScaledObject/carbonforge ({path}): {field}: ")
        assert message in line
    assert f"manifests: {len(lines)} problem(s)" in output


def test_a_field_outside_the_crd_fails_against_its_schema(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, scaled = _broken(rendered)
    scaled["spec"]["maxReplicas"] = 4
    scaled["spec"]["pollingInterval"] = "15s"
    assert _problems(schemas, docs) == [
        "deploy/autoscaling: ScaledObject/carbonforge: spec.maxReplicas: unknown field 'maxReplicas'",
        "deploy/autoscaling: ScaledObject/carbonforge: spec.pollingInterval: '15s' is not of type 'integer'",
    ]


@pytest.mark.parametrize("field", ["minReplicaCount", "idleReplicaCount"])
def test_scale_to_zero_needs_its_annotation(schemas: Any, rendered: dict[str, Docs], field: str) -> None:
    docs, scaled = _broken(rendered)
    scaled["spec"][field] = 0
    problems = _problems(schemas, docs)
    assert len(problems) == 1 and f"ScaledObject/carbonforge: spec.{field}: is 0: " in problems[0]
    assert cm.SCALE_TO_ZERO_ANNOTATION in problems[0]
    scaled["metadata"]["annotations"][cm.SCALE_TO_ZERO_ANNOTATION] = "true"
    assert _problems(schemas, docs) == []


def test_keda_s_default_floor_of_zero_counts_too(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, scaled = _broken(rendered)
    del scaled["spec"]["minReplicaCount"]
    assert [p for p in _problems(schemas, docs) if "spec.minReplicaCount: is 0 (KEDA default)" in p]


def test_no_ceiling_fails(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, scaled = _broken(rendered)
    del scaled["spec"]["maxReplicaCount"]
    assert _problems(schemas, docs) == [
        "deploy/autoscaling: ScaledObject/carbonforge: spec.maxReplicaCount: missing: KEDA's default is 100 "
        "replicas, each with its GPUs; set a ceiling"]


def test_a_target_that_is_not_the_overlays_deployment_fails(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, scaled = _broken(rendered)
    scaled["spec"]["scaleTargetRef"]["name"] = "vllm"
    assert _problems(schemas, docs) == [
        "deploy/autoscaling: ScaledObject/carbonforge: spec.scaleTargetRef.name: 'vllm' is no Deployment of this "
        "kustomization (carbonforge)"]
    scaled["spec"]["scaleTargetRef"] = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "carbonforge"}
    assert [p for p in _problems(schemas, docs) if "spec.scaleTargetRef: targets apps/v1 StatefulSet" in p]


@pytest.mark.parametrize(("query", "message"), [
    ('sum(vllm:num_requests_waiting{namespace="default", service="carbonforge"})',
     'not scoped to the namespace: every selector needs namespace="carbonforge"'),
    ('sum(vllm:num_requests_waiting{service="carbonforge"})', "not scoped to the namespace"),
    ('sum(vllm:num_requests_waiting{namespace="carbonforge"})', "not scoped to the deployment"),
    ('sum(vllm:num_requests_waiting{namespace="carbonforge", service="other"})', "not scoped to the deployment"),
    ("sum(vllm:num_requests_waiting)", "not scoped to the namespace"),
    ("vector(1)", "names no series"),
])
def test_a_query_not_scoped_to_the_deployment_fails(schemas: Any, rendered: dict[str, Docs], query: str,
                                                    message: str) -> None:
    docs, scaled = _broken(rendered)
    scaled["spec"]["triggers"][0]["metadata"]["query"] = query
    problems = _problems(schemas, docs)
    assert len(problems) == 1, problems
    assert "ScaledObject/carbonforge: spec.triggers[0].metadata.query: " in problems[0] and message in problems[0]


# ---- the series a trigger may name -----------------------------------------------------------------------


def test_the_known_vllm_series_are_vllms() -> None:
    found = importlib.util.find_spec("vllm")  # where vLLM is installed, without importing it
    assert found is not None and found.submodule_search_locations
    loggers = Path(next(iter(found.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    families = set(re.findall(r'name="(vllm:[a-z0-9_]+)"', loggers.read_text(encoding="utf-8")))
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= families
    for series in cm.VLLM_SERIES:
        family = re.sub(r"_(total|bucket|sum|count)$", "", series)
        assert family in families, f"{series}: vLLM exports no family {family}"


def test_the_runtimes_own_series_may_be_named(schemas: Any, rendered: dict[str, Docs]) -> None:
    assert {"carbonforge_requests_waiting", "carbonforge_request_queue_wait_seconds_bucket"} <= cm.runtime_series()
    docs, scaled = _broken(rendered)
    scaled["spec"]["triggers"][0]["metadata"]["query"] = (
        'histogram_quantile(0.9, sum by (le) (rate(carbonforge_request_queue_wait_seconds_bucket'
        '{namespace="carbonforge", job="carbonforge"}[2m])))')
    assert _problems(schemas, docs) == []


def test_promql_series_reads_names_and_matchers() -> None:
    names, selectors = cm.promql_series(
        'avg_over_time(vllm:kv_cache_usage_perc{namespace="a", service="b", pod=~"x-.*"}[5m]) > bool 0.5 '
        'or on(pod) carbonforge_requests_waiting{namespace="a", job="c"}')
    assert names == ["vllm:kv_cache_usage_perc", "carbonforge_requests_waiting"]
    assert selectors == [{"namespace": "a", "service": "b"}, {"namespace": "a", "job": "c"}]


def test_a_floor_above_the_ceiling_fails(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, scaled = _broken(rendered)
    scaled["spec"]["minReplicaCount"] = 5
    assert _problems(schemas, docs) == [
        "deploy/autoscaling: ScaledObject/carbonforge: spec.minReplicaCount: minReplicaCount must be less than or "
        "equal to maxReplicaCount"]


def test_two_autoscalers_on_one_deployment_fail(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs, _ = _broken(rendered)
    docs.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "cpu"},
                 "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "carbonforge"},
                          "minReplicas": 1, "maxReplicas": 2}})
    assert _problems(schemas, docs) == [
        "deploy/autoscaling: ScaledObject/carbonforge: spec.scaleTargetRef.name: HorizontalPodAutoscaler/cpu scales "
        "the same Deployment: the autoscalers would fight over its replica count; keep one"]
