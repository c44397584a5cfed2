#!/usr/bin/env bash
# The test command: install everything (vLLM CPU build included), lint, type-check, test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

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
echo "== hadolint"
.venv/bin/hadolint Dockerfile
if ! command -v promtool >/dev/null 2>&1; then
    # The metrics tests scrape the runtime with a real Prometheus and lint the page with promtool.
    echo "== installing Debian's prometheus (promtool)"
    apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
fi
echo "== pytest"
.venv/bin/python -m pytest -p no:cacheprovider -q "$@"
