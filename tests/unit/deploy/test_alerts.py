"""The alert rules in deploy/observability/alerts/: promtool accepts them and their tests (a firing and
a quiet case per alert) pass; every alert carries what an operator needs; the PrometheusRule is the
generated copy and validates against the vendored CRD; and a broken rule is caught."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support import REPO

ALERTS = REPO / "deploy" / "observability" / "alerts"
RULES = ALERTS / "carbonforge-rules.yaml"
RULE_TESTS = ALERTS / "tests" / "carbonforge-rules.test.yaml"
OPERATIONS = REPO / "docs" / "operations.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load("gen_prometheusrule")
cm = _load("check_manifests")


def _alerts() -> list[dict[str, Any]]:
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False)


@needs_promtool
def test_rules_pass_promtool_check_and_their_tests() -> None:
    checked = _promtool("check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in checked.stdout
    tested = _promtool("test", "rules", RULE_TESTS)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases: dict[str, list[list[Any]]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    for alert in _alerts():
        name = alert["alert"]
        assert any(cases.get(name, [])), f"{name}: no promtool case where it fires"
        assert any(not expected for expected in cases.get(name, [])), f"{name}: no promtool case where it is quiet"


def test_every_alert_has_severity_annotations_and_a_runbook_entry() -> None:
    docs = OPERATIONS.read_text(encoding="utf-8")
    alerts_section = docs.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    anchors = {heading.strip().lower() for heading in re.findall(r"^### (.+)$", alerts_section, re.M)}
    for alert in _alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        url = alert["annotations"]["runbook_url"]
        assert url == f"docs/operations.md#{name.lower()}", f"{name}: runbook_url {url}"
        assert name.lower() in anchors, f"{name}: no '### {name}' entry under '## Alerts' in docs/operations.md"


def test_rules_name_only_series_the_runtime_or_vllm_export() -> None:
    from carbonforge_runtime.runtime.metrics.exposition import METRICS

    ours = {spec.exposed_name for spec in METRICS}
    loggers = (REPO / ".venv").glob("lib/python3*/site-packages/vllm/v1/metrics/loggers.py")
    vllm_source = "".join(path.read_text(encoding="utf-8") for path in loggers)
    for alert in _alerts():
        for name in set(re.findall(r"\b(carbonforge_[a-z_]+|vllm:[a-z_]+)", alert["expr"])):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith("carbonforge_"):
                assert base in ours, f"{alert['alert']}: the runtime exports no {name}"
            elif vllm_source:
                assert f'"{re.sub(r"_total$", "", name)}"' in vllm_source, f"{alert['alert']}: vLLM exports no {name}"


def test_prometheusrule_is_the_generated_copy_and_validates() -> None:
    assert gen.main(["--check"]) == 0
    rule = yaml.safe_load(gen.OUTPUT.read_text(encoding="utf-8"))
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    schemas = cm.Schemas(REPO / "deploy" / "schemas")
    docs = cm.render(REPO / "deploy" / "observability")
    assert [doc["kind"] for doc in docs] == ["PrometheusRule"]
    assert [str(p) for p in cm.check_documents("deploy/observability", docs, schemas)] == []


def test_a_broken_prometheusrule_fails_the_manifest_check() -> None:
    schemas = cm.Schemas(REPO / "deploy" / "schemas")
    doc = yaml.safe_load(gen.OUTPUT.read_text(encoding="utf-8"))
    doc["spec"]["groups"][0]["rules"][0]["severity"] = "critical"  # a label put beside, not under, labels
    problems = [str(p) for p in cm.check_documents("deploy/observability", [doc], schemas)]
    assert any("unknown field 'severity'" in p for p in problems), problems


def test_a_stale_prometheusrule_fails_the_generator_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(gen.OUTPUT.read_text(encoding="utf-8").replace("for: 2m", "for: 5m"), encoding="utf-8")
    monkeypatch.setattr(gen, "OUTPUT", stale)
    monkeypatch.setattr(gen, "REPO", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "is not what scripts/gen_prometheusrule.py writes" in capsys.readouterr().err


@needs_promtool
def test_bad_promql_or_a_changed_rule_fails_promtool(tmp_path: Path) -> None:
    text = RULES.read_text(encoding="utf-8")
    bad = tmp_path / "bad-rules.yaml"
    bad.write_text(text.replace("(carbonforge_engine_state_age_seconds) > 30",
                                "(carbonforge_engine_state_age_seconds) >> 30"), encoding="utf-8")
    checked = _promtool("check", "rules", bad)
    assert checked.returncode != 0
    assert "parse error" in (checked.stdout + checked.stderr)

    # A rule that no longer fires when it should: the tests, run against it, fail.
    (tmp_path / "tests").mkdir()
    (tmp_path / "carbonforge-rules.yaml").write_text(text.replace("> 0.95", "> 0.999"), encoding="utf-8")
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    tested = _promtool("test", "rules", tmp_path / "tests" / RULE_TESTS.name)
    assert tested.returncode != 0
    assert "CarbonforgeKvCacheSaturated" in tested.stdout + tested.stderr
