#!/usr/bin/env bash
# Pin the image's base by digest: resolve the tag in the Dockerfile's VLLM_BASE_IMAGE to the digest
# the registry serves for it and write TAG@sha256:DIGEST back into that line.
#
#   scripts/pin-base-image.sh [DOCKERFILE]      (default: the repository's Dockerfile)
#
# Needs `docker buildx` and access to the registry. Exit 0 pinned, 1 failed, 2 usage.
set -euo pipefail

dockerfile="${1:-$(dirname "$0")/../Dockerfile}"
if [[ $# -gt 1 || ! -f "$dockerfile" ]]; then
    echo "usage: $0 [DOCKERFILE]  (no Dockerfile at ${dockerfile})" >&2
    exit 2
fi
line="$(grep -E '^ARG VLLM_BASE_IMAGE=' "$dockerfile" || true)"
if [[ -z "$line" ]]; then
    echo "error: no 'ARG VLLM_BASE_IMAGE=' line in $dockerfile" >&2
    exit 1
fi
image="${line#ARG VLLM_BASE_IMAGE=}"
tag_ref="${image%%@*}"   # drop an older digest: the tag is resolved again
if ! digest="$(docker buildx imagetools inspect "$tag_ref" --format '{{json .Manifest.Digest}}' | tr -d '"')"; then
    echo "error: cannot resolve $tag_ref (is docker buildx installed and the registry reachable?)" >&2
    exit 1
fi
if [[ ! "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "error: $tag_ref resolved to '$digest', not a sha256 digest" >&2
    exit 1
fi
sed -i "s|^ARG VLLM_BASE_IMAGE=.*|ARG VLLM_BASE_IMAGE=${tag_ref}@${digest}|" "$dockerfile"
echo "pinned: ${tag_ref}@${digest}"
