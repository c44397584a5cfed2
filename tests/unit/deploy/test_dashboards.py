"""The Grafana dashboards and the compose file's `observability` profile: the committed JSON is what
scripts/gen_dashboards.py writes, it validates against Grafana's dashboard schema (vendored in
deploy/schemas/), every panel explains itself, and the profile's Prometheus and Grafana find what they
load."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from carbonforge_runtime.runtime.metrics.exposition import METRICS
from tests.support import REPO

OBSERVABILITY = REPO / "deploy" / "observability"
SCHEMA = REPO / "deploy" / "schemas" / "grafana-dashboard.jsonschema.json"
COMPOSE = REPO / "docker" / "compose.yaml"
PROMTOOL = shutil.which("promtool")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_dashboards", REPO / "scripts" / "gen_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _dashboards() -> list[Path]:
    return sorted((OBSERVABILITY / "dashboards").glob("*.json"))


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def test_the_committed_dashboards_are_what_the_generator_writes() -> None:
    assert gen.main(["--check"]) == 0
    assert [path.name for path in _dashboards()] == sorted(d.file for d in gen.DASHBOARDS)


def test_the_generator_check_names_a_stale_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gen, "DASHBOARDS_DIR", tmp_path)
    monkeypatch.setattr(gen, "REPO", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "carbonforge-overview.json is not what scripts/gen_dashboards.py writes" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # --check writes nothing
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
def test_every_dashboard_validates_against_grafanas_schema(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(doc)]
    assert errors == []


def test_the_schema_catches_what_grafana_would_refuse() -> None:
    doc = gen.render(gen.OVERVIEW)
    validator = _validator()
    assert validator.is_valid(doc)
    for breakage in ({"schemaVersion": "39"}, {"panels": [{"title": "no type"}]}, {"graphTooltip": 7}):
        broken = {**copy.deepcopy(doc), **breakage}
        assert not validator.is_valid(broken), breakage
    broken = copy.deepcopy(doc)
    del broken["templating"]
    assert not validator.is_valid(broken)


def test_every_panel_has_a_description_a_unit_queries_and_a_unique_place() -> None:
    for path in _dashboards():
        doc = json.loads(path.read_text(encoding="utf-8"))
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)), path.name
        cells = set()
        for panel in _panels(doc):
            assert len(panel["description"]) > 60, panel["title"]
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            grid = panel["gridPos"]
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                    cells.add((x, y))
        variables = [v["name"] for v in doc["templating"]["list"]]
        assert variables == ["datasource", "model"]


def test_the_panels_name_only_series_that_exist() -> None:
    """The runtime's names come from its metric table; vLLM's are checked against the installed vLLM."""
    ours = {spec.exposed_name for spec in METRICS}
    vllm_loggers = Path(importlib.util.find_spec("vllm").origin or "").parent / "v1" / "metrics" / "loggers.py"  # type: ignore[union-attr]
    vllm_source = vllm_loggers.read_text(encoding="utf-8") if vllm_loggers.exists() else ""
    seen = set()
    for dashboard in gen.DASHBOARDS:
        for row in dashboard.rows:
            for panel in row.panels:
                for query in panel.queries:
                    for name in re.findall(r"\b((?:carbonforge_|vllm:)[a-z0-9_:]+)", query.expr):
                        base = re.sub(r"_(bucket|count|sum)$", "", name)
                        seen.add(base)
                        if base.startswith("carbonforge_"):
                            assert base in ours, f"{panel.title}: {name} is not a runtime metric"
                        elif vllm_source:
                            assert f'"{base.removesuffix("_total")}"' in vllm_source, f"{panel.title}: {name}"
    assert "carbonforge_engine_max_num_seqs" in seen and "vllm:kv_cache_usage_perc" in seen


def test_the_vendored_dashboard_schema_is_recorded() -> None:
    readme = (REPO / "deploy" / "schemas" / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith(f"| `{SCHEMA.name}` |")]
    assert len(rows) == 1
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() in rows[0]
    assert re.search(r"\| grafana/grafana-foundation-sdk \| .* \| [0-9a-f]{40} \|", rows[0]), rows[0]


# ---- the compose profile --------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def test_the_observability_profile_is_optional_and_published_on_the_loopback_only() -> None:
    services = _compose()["services"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    assert "profiles" not in services["carbonforge"]  # a plain `up` still serves
    for name, service in services.items():
        for entry in service.get("ports") or []:
            assert str(entry).startswith("127.0.0.1:"), f"{name} publishes {entry} beyond the loopback"
        if name != "carbonforge":
            assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
            assert "no-new-privileges:true" in service["security_opt"], name


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of each bind mount (relative to docker/, as compose reads them)."""
    out = {}
    for entry in service.get("volumes") or []:
        source, target = str(entry).split(":")[:2]
        if source.startswith("."):
            out[target] = (COMPOSE.parent / source).resolve()
    return out


def test_the_profile_mounts_the_dashboards_the_provisioning_and_the_prometheus_config() -> None:
    services = _compose()["services"]
    grafana = _mounts(services["grafana"])
    provisioning = grafana["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "carbonforge.yaml").read_text())["providers"]
    dashboards_in_container = providers[0]["options"]["path"]
    assert grafana[dashboards_in_container] == (OBSERVABILITY / "dashboards").resolve()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (grafana[str(Path(home).parent)] / Path(home).name).is_file()
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert sources[0]["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]

    prometheus = _mounts(services["prometheus"])
    config = prometheus["/etc/prometheus/prometheus.yml"]
    assert config == (OBSERVABILITY / "prometheus.yml").resolve()
    parsed = yaml.safe_load(config.read_text())
    # the rule file's relative path names the same file in the container and in the repository
    assert parsed["rule_files"] == ["alerts/carbonforge-rules.yaml"]
    assert prometheus["/etc/prometheus/alerts"] == (OBSERVABILITY / "alerts").resolve()
    targets = sorted(t for job in parsed["scrape_configs"] for c in job["static_configs"] for t in c["targets"])
    assert targets == ["carbonforge:8000", "carbonforge:9105"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")
def test_promtool_accepts_the_profiles_prometheus_config(tmp_path: Path) -> None:
    config = OBSERVABILITY / "prometheus.yml"
    if not (OBSERVABILITY / "alerts" / "carbonforge-rules.yaml").exists():
        # the rules are another part's file: check the configuration with an empty rule file in its place
        shutil.copy(config, tmp_path / "prometheus.yml")
        (tmp_path / "alerts").mkdir()
        (tmp_path / "alerts" / "carbonforge-rules.yaml").write_text("groups: []\n")
        config = tmp_path / "prometheus.yml"
    checked = subprocess.run([str(PROMTOOL), "check", "config", str(config)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
