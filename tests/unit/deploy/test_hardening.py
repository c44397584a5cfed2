"""The hardened defaults of deploy/ and docker/compose.yaml: each rule of scripts/check_manifests.py
that enforces them catches a manifest broken in that one way (a copy of the rendered documents, or of
the compose file in tmp_path; never the files themselves)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO
from tests.unit.deploy.test_manifests import DEPLOY, _lws_templates, _one, _problems, cm

COMPOSE = REPO / "docker" / "compose.yaml"

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def schemas() -> Any:
    return cm.Schemas(DEPLOY / "schemas")


@pytest.fixture(scope="module")
def rendered() -> dict[str, Docs]:
    return {name: cm.render(DEPLOY / name) for name in ("single-host", "multi-host", "inference-pool")}


def _pod(docs: Docs) -> dict[str, Any]:
    pod: dict[str, Any] = _one(docs, "Deployment")["spec"]["template"]["spec"]
    return pod


def _container(docs: Docs) -> dict[str, Any]:
    container: dict[str, Any] = _pod(docs)["containers"][0]
    return container


def _env(docs: Docs, name: str) -> dict[str, Any]:
    return next(var for var in _container(docs)["env"] if var["name"] == name)


def _drop_mount(docs: Docs, path: str) -> None:
    container = _container(docs)
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != path]


def _mount(docs: Docs, path: str) -> dict[str, Any]:
    return next(m for m in _container(docs)["volumeMounts"] if m["mountPath"] == path)


def _policy(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = _one(docs, "NetworkPolicy")["spec"]
    return spec


def _set(target: dict[str, Any], key: str, value: Any) -> None:
    target[key] = value


POD = "Deployment/carbonforge: spec.template.spec"
CONTAINER = f"{POD}.containers[0]"

#: (what is broken, how, the line the check prints for it), on the single-host layout.
BROKEN: list[tuple[str, Callable[[Docs], None], str]] = [
    ("service account token", lambda d: _pod(d).pop("automountServiceAccountToken"),
     f"{POD}.automountServiceAccountToken: must be false"),
    ("token mounted on purpose", lambda d: _set(_pod(d), "automountServiceAccountToken", True),
     f"{POD}.automountServiceAccountToken: must be false"),
    ("root user", lambda d: _set(_pod(d)["securityContext"], "runAsUser", 0),
     f"{POD}.securityContext.runAsUser: is 0 (root)"),
    ("no runAsNonRoot", lambda d: _pod(d)["securityContext"].pop("runAsNonRoot"),
     f"{POD}.securityContext.runAsNonRoot: must be true"),
    ("writable root filesystem", lambda d: _container(d)["securityContext"].pop("readOnlyRootFilesystem"),
     f"{CONTAINER}.securityContext.readOnlyRootFilesystem: must be true"),
    ("privilege escalation", lambda d: _set(_container(d)["securityContext"], "allowPrivilegeEscalation", True),
     f"{CONTAINER}.securityContext.allowPrivilegeEscalation: must be false"),
    ("privileged", lambda d: _set(_container(d)["securityContext"], "privileged", True),
     f"{CONTAINER}.securityContext.privileged: must not be true"),
    ("capabilities kept", lambda d: _container(d)["securityContext"].pop("capabilities"),
     f"{CONTAINER}.securityContext.capabilities.drop: must drop ALL"),
    ("a capability added", lambda d: _set(_container(d)["securityContext"]["capabilities"], "add", ["SYS_ADMIN"]),
     f"{CONTAINER}.securityContext.capabilities.add: adds SYS_ADMIN"),
    ("no /tmp volume", lambda d: _drop_mount(d, "/tmp"),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /tmp"),
    ("no HOME volume", lambda d: _drop_mount(d, "/home/carbonforge"),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /home/carbonforge"),
    ("no log volume", lambda d: _drop_mount(d, "/var/log/carbonforge"),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /var/log/carbonforge"),
    ("no compile cache volume", lambda d: _drop_mount(d, "/var/cache/carbonforge"),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /var/cache/carbonforge"),
    ("no weights volume", lambda d: _drop_mount(d, "/var/cache/huggingface"),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /var/cache/huggingface"),
    ("logs moved off their volume", lambda d: _container(d)["env"].append({"name": "CF_LOG_DIR", "value": "/srv/log"}),
     f"{CONTAINER}.volumeMounts: nothing is mounted at /srv/log"),
    ("a read-only log volume", lambda d: _set(_mount(d, "/var/log/carbonforge"), "readOnly", True),
     f"{CONTAINER}.volumeMounts: /var/log/carbonforge, vllm.log"),
    ("no CPU limit", lambda d: _container(d)["resources"]["limits"].pop("cpu"),
     f"{CONTAINER}.resources.limits.cpu: missing"),
    ("no memory limit", lambda d: _container(d)["resources"]["limits"].pop("memory"),
     f"{CONTAINER}.resources.limits.memory: missing"),
    ("no CPU request", lambda d: _container(d)["resources"]["requests"].pop("cpu"),
     f"{CONTAINER}.resources.requests.cpu: missing"),
    ("no memory request", lambda d: _container(d)["resources"]["requests"].pop("memory"),
     f"{CONTAINER}.resources.requests.memory: missing"),
    ("request above limit", lambda d: _set(_container(d)["resources"]["requests"], "memory", "200Gi"),
     f"{CONTAINER}.resources.requests.memory: above the limit (96Gi)"),
    ("shared memory above the memory limit",
     lambda d: _set(_container(d)["resources"]["limits"], "memory", "16Gi"),
     "the in-memory emptyDir 'dshm' (16Gi) counts against the memory limit (16Gi)"),
    ("unbounded shared memory",
     lambda d: next(v for v in _pod(d)["volumes"] if v["name"] == "dshm")["emptyDir"].pop("sizeLimit"),
     "the in-memory emptyDir 'dshm' has no sizeLimit"),
    ("API key as a variable from a Secret",
     lambda d: _container(d)["env"].append({"name": "CF_API_KEY", "valueFrom": {"secretKeyRef": {
         "name": "carbonforge-api-key", "key": "api-key"}}}),
     "CF_API_KEY takes a Secret into the environment, which every process of the pod and `kubectl describe` show: "
     "mount the Secret as a file (readOnly) and set CF_API_KEY_FILE"),
    ("Hugging Face token as a variable from a Secret",
     lambda d: _container(d)["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
         "name": "carbonforge-hf-token", "key": "token"}}}),
     "HF_TOKEN takes a Secret into the environment"),
    ("a whole Secret as variables",
     lambda d: _set(_container(d), "envFrom", [{"secretRef": {"name": "carbonforge-api-key"}}]),
     f"{CONTAINER}.envFrom[0].secretRef: takes a Secret into the environment"),
    ("a literal group secret", lambda d: _container(d)["env"].append({"name": "CF_GROUP_SECRET", "value": "x" * 32}),
     "CF_GROUP_SECRET as a literal value"),
    ("no API key", lambda d: _container(d)["env"].remove(_env(d, "CF_API_KEY_FILE")),
     f"{CONTAINER}.env: CF_API_KEY_FILE is not set: the API would answer anyone"),
    ("API key file outside the Secret", lambda d: _set(_env(d, "CF_API_KEY_FILE"), "value", "/tmp/api-key"),
     "CF_API_KEY_FILE=/tmp/api-key is in no Secret volume mounted into this container"),
    ("a Secret volume mounted writable", lambda d: _mount(d, "/run/secrets/carbonforge").pop("readOnly"),
     "the Secret volume 'secrets' must be mounted readOnly: true"),
    ("no NetworkPolicy", lambda d: d.remove(_one(d, "NetworkPolicy")),
     "Deployment/carbonforge: spec.template: no NetworkPolicy selects these pods for Ingress"),
    ("a NetworkPolicy for ingress only", lambda d: _set(_policy(d), "policyTypes", ["Ingress"]),
     "Deployment/carbonforge: spec.template: no NetworkPolicy selects these pods for Egress"),
    ("the API open to every source", lambda d: _policy(d)["ingress"][0].pop("from"),
     "NetworkPolicy/carbonforge: spec.ingress[0]: has no 'from': it lets every source in"),
    ("the metrics port open to the namespace",
     lambda d: _policy(d)["ingress"][0]["ports"].append({"port": "metrics", "protocol": "TCP"}),
     "NetworkPolicy/carbonforge: spec.ingress[0].from: lets unlabelled peers reach the metrics port"),
    ("the metrics port open to an address range",
     lambda d: _policy(d)["ingress"][1]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
     "NetworkPolicy/carbonforge: spec.ingress[1].from: lets unlabelled peers reach the metrics port"),
    ("every port of the pod open to the namespace", lambda d: _policy(d)["ingress"][0].pop("ports"),
     "NetworkPolicy/carbonforge: spec.ingress[0].from: lets unlabelled peers reach the metrics port"),
    ("every port open outwards", lambda d: _policy(d)["egress"].append({}),
     "NetworkPolicy/carbonforge: spec.egress[2]: allows every port to every destination"),
    ("every port open to every namespace",
     lambda d: _policy(d)["egress"].append({"to": [{"namespaceSelector": {}}]}),
     "NetworkPolicy/carbonforge: spec.egress[2]: allows every port to every destination"),
]


def test_the_committed_layouts_pass(schemas: Any, rendered: dict[str, Docs]) -> None:
    for layout, docs in rendered.items():
        assert _problems(schemas, layout, docs) == [], layout


@pytest.mark.parametrize(("what", "breaks", "message"), BROKEN, ids=[case[0] for case in BROKEN])
def test_a_manifest_without_a_hardened_default_fails(schemas: Any, rendered: dict[str, Docs], what: str,
                                                     breaks: Callable[[Docs], None], message: str) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    breaks(docs)
    problems = _problems(schemas, "single-host", docs)
    assert any(message in p for p in problems), problems


def test_the_lws_pods_are_held_to_the_same_defaults(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    for template in ("leaderTemplate", "workerTemplate"):
        spec = _lws_templates(docs)[template]["spec"]
        spec.pop("automountServiceAccountToken")
        spec["containers"][0]["securityContext"].pop("readOnlyRootFilesystem")
    problems = _problems(schemas, "multi-host", docs)
    for template in ("leaderTemplate", "workerTemplate"):
        where = f"LeaderWorkerSet/carbonforge-multihost: spec.leaderWorkerTemplate.{template}.spec"
        assert any(f"{where}.automountServiceAccountToken: must be false" in p for p in problems), problems
        assert any(f"{where}.containers[0].securityContext.readOnlyRootFilesystem: must be true" in p
                   for p in problems), problems


def test_the_lws_pods_get_the_group_secret_as_a_file(rendered: dict[str, Docs]) -> None:
    for template in ("leaderTemplate", "workerTemplate"):
        spec = _lws_templates(rendered["multi-host"])[template]["spec"]
        env = {var["name"]: var.get("value") for var in spec["containers"][0]["env"]}
        assert env["CF_GROUP_SECRET_FILE"] == "/run/secrets/carbonforge/group-secret"
        secrets = next(v for v in spec["volumes"] if v["name"] == "secrets")
        names = [s["secret"]["name"] for s in secrets["projected"]["sources"]]
        assert "carbonforge-group-secret" in names


def test_a_group_without_egress_rules_fails(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs = copy.deepcopy(rendered["multi-host"])
    _policy(docs)["policyTypes"] = ["Ingress"]
    problems = _problems(schemas, "multi-host", docs)
    assert sum("no NetworkPolicy selects the" in p and "pods for Egress" in p for p in problems) == 2, problems


def test_the_metrics_port_moved_by_its_variable_is_still_guarded(schemas: Any, rendered: dict[str, Docs]) -> None:
    docs = copy.deepcopy(rendered["single-host"])
    _container(docs)["env"].append({"name": "CF_METRICS_PORT", "value": "9200"})
    _policy(docs)["ingress"][0]["ports"].append({"port": 9200, "protocol": "TCP"})
    problems = _problems(schemas, "single-host", docs)
    assert any("spec.ingress[0].from: lets unlabelled peers reach the metrics port" in p for p in problems), problems


def test_quantities() -> None:
    assert cm.quantity("16Gi") == 16 * 2**30
    assert cm.quantity("500m") == 0.5
    assert cm.quantity(8) == 8
    assert cm.quantity("1.5G") == 1.5e9
    assert cm.quantity("lots") is None and cm.quantity(None) is None


def test_the_writable_paths_follow_the_image_and_the_pod() -> None:
    image = cm.image_env()
    assert image["HOME"] == "/home/carbonforge" and image["HF_HOME"] == "/var/cache/huggingface"
    paths = [path for path, _ in cm.writable_paths([{"name": "CF_LOG_DIR", "value": "/srv/log"}])]
    assert paths == ["/tmp", "/home/carbonforge", "/srv/log", "/var/cache/carbonforge", "/var/cache/huggingface",
                     "/dev/shm"]


# ---- docker/compose.yaml --------------------------------------------------------------------------------


def _compose_problems(tmp_path: Path, breaks: Callable[[dict[str, Any]], None]) -> list[str]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    breaks(data)
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return [str(problem) for problem in cm.compose_problems(path)]


def _service(data: dict[str, Any]) -> dict[str, Any]:
    service: dict[str, Any] = data["services"]["carbonforge"]
    return service


def test_the_compose_file_passes() -> None:
    assert [str(p) for p in cm.compose_problems(COMPOSE)] == []


COMPOSE_BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("API on every interface", lambda d: _set(_service(d), "ports", ["8000:8000", "127.0.0.1:9105:9105"]),
     "services.carbonforge.ports[0]: publishes 8000:8000 on every address of the host"),
    ("metrics on every interface", lambda d: _set(_service(d), "ports", ["127.0.0.1:8000:8000", "0.0.0.0:9105:9105"]),
     "services.carbonforge.ports[1]: publishes 0.0.0.0:9105:9105 on every address of the host"),
    ("long syntax without an address",
     lambda d: _set(_service(d), "ports", [{"target": 8000, "published": "8000"}]),
     "services.carbonforge.ports[0]: publishes 8000 on every address of the host"),
    ("writable root filesystem", lambda d: _service(d).pop("read_only"),
     "services.carbonforge.read_only: must be true"),
    ("capabilities kept", lambda d: _service(d).pop("cap_drop"),
     "services.carbonforge.cap_drop: must drop ALL"),
    ("a capability added", lambda d: _set(_service(d), "cap_add", ["SYS_ADMIN"]),
     "services.carbonforge.cap_add: adds SYS_ADMIN"),
    ("privileged", lambda d: _set(_service(d), "privileged", True),
     "services.carbonforge.privileged: must not be true"),
    ("privilege escalation", lambda d: _service(d).pop("security_opt"),
     "services.carbonforge.security_opt: must hold no-new-privileges:true"),
    ("no /tmp", lambda d: _set(_service(d), "tmpfs", [t for t in _service(d)["tmpfs"] if not t.startswith("/tmp")]),
     "services.carbonforge: nothing is mounted at /tmp"),
    ("no log volume",
     lambda d: _set(_service(d), "volumes", [v for v in _service(d)["volumes"] if "/var/log" not in v]),
     "services.carbonforge: nothing is mounted at /var/log/carbonforge"),
    ("no memory limit", lambda d: _service(d)["deploy"]["resources"]["limits"].pop("memory"),
     "services.carbonforge.deploy.resources.limits.memory: missing"),
    ("no CPU limit", lambda d: _service(d)["deploy"]["resources"]["limits"].pop("cpus"),
     "services.carbonforge.deploy.resources.limits.cpus: missing"),
    ("API key as a variable", lambda d: _set(_service(d)["environment"], "CF_API_KEY", "${CF_API_KEY}"),
     "services.carbonforge.environment.CF_API_KEY: a secret as a variable"),
    ("licence as a variable",
     lambda d: _set(_service(d)["environment"], "CARBONFORGE_LICENSE_KEY", "${CARBONFORGE_LICENSE_KEY:-}"),
     "services.carbonforge.environment.CARBONFORGE_LICENSE_KEY: a secret as a variable"),
    ("no API key", lambda d: _service(d)["environment"].pop("CF_API_KEY_FILE"),
     "services.carbonforge.environment: CF_API_KEY_FILE is not set"),
    ("API key file not a secret of the service", lambda d: _service(d).pop("secrets"),
     "services.carbonforge.environment.CF_API_KEY_FILE: /run/secrets/api-key is no secret of this service"),
]


@pytest.mark.parametrize(("what", "breaks", "message"), COMPOSE_BROKEN, ids=[case[0] for case in COMPOSE_BROKEN])
def test_a_compose_file_without_a_hardened_default_fails(tmp_path: Path, what: str,
                                                         breaks: Callable[[dict[str, Any]], None],
                                                         message: str) -> None:
    problems = _compose_problems(tmp_path, breaks)
    assert any(message in p for p in problems), problems


def test_the_check_script_reports_the_compose_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text(encoding="utf-8").replace('"127.0.0.1:8000:8000"', '"8000:8000"'),
                      encoding="utf-8")
    code = cm.main(["--compose", str(broken)])
    output = "".join(capsys.readouterr())
    assert code == 1
    assert "publishes 8000:8000 on every address of the host" in output, output
