#!/usr/bin/env bash
# Install, then serve the embedded default: a tiny model the runtime generates itself, on the CPU
# build of vLLM. No GPU and no network needed. Ctrl-C stops it cleanly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
export CF_LOG_DIR=${CF_LOG_DIR:-$PWD/logs}
export CF_CONTEXT_KEY=${CF_CONTEXT_KEY:-cf-tiny:bf16:chat:cpu}
echo "serving $CF_CONTEXT_KEY on port ${CF_PORT:-8000}; engine log in $CF_LOG_DIR/vllm.log"
exec .venv/bin/carbonforge-runtime
