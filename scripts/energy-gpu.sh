#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: read power and the energy counter for 30 s, check the per-request
# energy meter, and run the energy controller in dry run (no GPU setting is changed). Saves the log.
#   bash scripts/energy-gpu.sh [LOG_FILE] [extra arguments for scripts/energy_gpu.py]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT=${1:-energy-gpu-$(date +%Y%m%d-%H%M%S).log}
shift || true
PYTHON=python3
if [ -x .venv/bin/python ]; then
    PYTHON=.venv/bin/python
fi
if ! "$PYTHON" -c "import pynvml" 2>/dev/null; then
    "$PYTHON" -m pip install -q "nvidia-ml-py>=12.535" || {
        echo "energy-gpu: the nvidia-ml-py package is missing and could not be installed" >&2
        exit 2
    }
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=index,name,power.draw,power.limit,clocks.sm \
    --format=csv | tee "$OUT.nvidia-smi.txt" || true
exec "$PYTHON" scripts/energy_gpu.py --out "$OUT" "$@"
