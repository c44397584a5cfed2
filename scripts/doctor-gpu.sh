#!/usr/bin/env bash
# Run the doctor against the real NVML on a GPU machine and keep its reports.
#
#   scripts/doctor-gpu.sh [OUT_DIR] [doctor options, e.g. --context-key qwen2.5-0.5b:fp8:chat:l4x1]
#
# OUT_DIR defaults to $OUT when set, else ./doctor-gpu-out. Writes there:
#   doctor.json      the report as one JSON document (the point of the run)
#   doctor.txt       the same report as text
#   nvidia-smi.csv   what nvidia-smi says about the same GPUs, to compare with (when nvidia-smi exists)
#   summary.txt      exit codes, run time, and the gpu.nvml verdict
# Works from a source checkout without installing it (the repository is put on PYTHONPATH); uses
# $PYTHON, else .venv/bin/python, else python3. Wheels carried in .whl/ are installed to /tmp/site first.
# Exit status: 0 when NVML answered (gpu.nvml OK), 2 when it did not, 3 when the doctor could not run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=${OUT:-doctor-gpu-out}
if [[ $# -gt 0 && $1 != -* ]]; then
    out=$1
    shift
fi
mkdir -p "$out"

if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

python=${PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import carbonforge_runtime" 2>/dev/null; then
        python=.venv/bin/python
    else
        python=python3
    fi
fi

started_ns=$(date +%s%N)
"$python" -m carbonforge_runtime doctor --json "$@" >"$out/doctor.json" 2>"$out/doctor-json.stderr"
json_rc=$?
finished_ns=$(date +%s%N)
"$python" -m carbonforge_runtime doctor "$@" >"$out/doctor.txt" 2>&1
text_rc=$?
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version,compute_cap --format=csv \
        >"$out/nvidia-smi.csv" 2>&1
fi

nvml=$("$python" - "$out/doctor.json" <<'EOF'
import json, sys
try:
    document = json.load(open(sys.argv[1], encoding="utf-8"))
except (OSError, ValueError) as exc:
    print(f"NORUN unreadable report ({exc})")
    sys.exit(0)
check = next((c for c in document["checks"] if c["name"] == "gpu.nvml"), None)
print(f"{check['status']} {check['detail']}" if check else "no gpu.nvml check in the report")
EOF
)
{
    echo "python: $python ($("$python" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
    echo "doctor --json exit code: $json_rc; text exit code: $text_rc"
    echo "doctor --json wall time: $(( (finished_ns - started_ns) / 1000000 )) ms"
    echo "gpu.nvml: $nvml"
} | tee "$out/summary.txt"
cat "$out/doctor.txt"

if [[ $nvml == NORUN* ]]; then
    echo "the doctor did not run; see $out/doctor-json.stderr:" >&2
    tail -n 20 "$out/doctor-json.stderr" >&2
    exit 3
fi
[[ $nvml == OK* ]] && exit 0 || exit 2
