#!/usr/bin/env python3
"""Write deploy/observability/prometheusrule.yaml (the alert rules as a PrometheusRule for the
Prometheus operator) from deploy/observability/alerts/carbonforge-rules.yaml, or check that it is current.

    python scripts/gen_prometheusrule.py            # rewrite the PrometheusRule
    python scripts/gen_prometheusrule.py --check    # exit 1 when it differs from the rules file; writes nothing

The rules file is the one source (the compose Prometheus loads it as is, promtool tests it); the
PrometheusRule carries its groups unchanged under ``spec.groups``. `kubectl apply -k deploy/observability`
installs it; scripts/check_manifests.py validates it against the vendored PrometheusRule CRD.
The output is deterministic: no timestamps, no machine-specific paths.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RULES = REPO / "deploy" / "observability" / "alerts" / "carbonforge-rules.yaml"
OUTPUT = REPO / "deploy" / "observability" / "prometheusrule.yaml"
HEADER = """\
# Written by scripts/gen_prometheusrule.py from deploy/observability/alerts/carbonforge-rules.yaml:
# edit that file and run the script, never this one. The Prometheus operator loads this rule when its
# Prometheus's ruleSelector (and ruleNamespaceSelector) match: add the labels your Prometheus selects on
# (a kube-prometheus-stack install often selects release: <its release name>) in an overlay.
"""


def prometheus_rule(rules: dict[str, Any]) -> dict[str, Any]:
    """The PrometheusRule that carries ``rules`` (a parsed Prometheus rules file)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "carbonforge",
            "labels": {"app.kubernetes.io/name": "carbonforge-runtime", "app.kubernetes.io/part-of": "carbonforge"},
        },
        "spec": {"groups": rules["groups"]},
    }


def text_of(rules_text: str) -> str:
    rules = yaml.safe_load(rules_text)
    if not isinstance(rules, dict) or not isinstance(rules.get("groups"), list):
        raise SystemExit(f"{RULES.relative_to(REPO)}: no list of groups at its top level")
    body = yaml.safe_dump(prometheus_rule(rules), sort_keys=False, width=120, allow_unicode=True)
    return HEADER + body


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed PrometheusRule differs from the rules file; write nothing")
    args = parser.parse_args(argv)
    text = text_of(RULES.read_text(encoding="utf-8"))
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
    shown = OUTPUT.relative_to(REPO)
    if current == text:
        if args.check:
            print(f"{shown} is current")
        return 0
    if args.check:
        print(f"{shown} is not what scripts/gen_prometheusrule.py writes: run it and commit the result",
              file=sys.stderr)
        return 1
    from carbonforge_runtime.files import write_text_atomic

    write_text_atomic(OUTPUT, text)
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
