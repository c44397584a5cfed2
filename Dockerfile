# syntax=docker/dockerfile:1.7
# The CarbonForge serving image: the pinned vLLM OpenAI image with carbonforge-runtime as entrypoint.
# vLLM's scheduler interface is not public API; the runtime's scheduler shim is written for 0.32.0 only.
#
# The base: scripts/pin-base-image.sh resolves the tag to its digest and writes it here as
# vllm/vllm-openai:v0.32.0@sha256:<digest>; build with that line in place for a reproducible image.
ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    HOME=/home/carbonforge \
    CF_LOG_DIR=/var/log/carbonforge \
    CF_LICENSE_FILE=/etc/carbonforge/license.key \
    CF_COMPILE_CACHE_DIR=/var/cache/carbonforge \
    HF_HOME=/var/cache/huggingface

WORKDIR /opt/carbonforge-runtime
COPY pyproject.toml README.md LICENSE ./
COPY carbonforge_runtime ./carbonforge_runtime
COPY recipes ./recipes
COPY docker/constraints.txt docker/healthcheck.py /opt/carbonforge/

# The constraints file pins every package added here and keeps the base image's vLLM where it is.
RUN uv pip install --system --no-cache --constraint /opt/carbonforge/constraints.txt \
        dumb-init /opt/carbonforge-runtime \
    && groupadd --gid 10001 carbonforge \
    && useradd --uid 10001 --gid 10001 --home-dir /home/carbonforge --create-home \
        --shell /usr/sbin/nologin carbonforge \
    && mkdir -p /var/log/carbonforge /var/cache/carbonforge /var/cache/huggingface /etc/carbonforge \
    && chown 10001:10001 /var/log/carbonforge /var/cache/carbonforge /var/cache/huggingface \
    && chmod 0755 /etc/carbonforge \
    && carbonforge-runtime --version

# Weights, logs, and what the engine compiles on its first boot (later boots load it from there).
# A new named volume takes the directory's owner (the carbonforge user); a bind mount must be
# writable by uid 10001.
VOLUME ["/var/cache/huggingface", "/var/log/carbonforge", "/var/cache/carbonforge"]
EXPOSE 8000 9105

# Everything, the engine and model code included, runs as this user: carbonforge, uid/gid 10001
# (numeric, so a runtime can check it is not root). docs/operations.md, "The image's user".
USER 10001:10001
WORKDIR /home/carbonforge

# Weights download and engine warm-up can take up to the ready timeout (CF_READY_TIMEOUT_S, 60 min
# by default) on a first boot: the start period covers all of it. The probe follows the address the
# runtime records in $CF_LOG_DIR/serve.json.
HEALTHCHECK --interval=30s --timeout=5s --start-period=61m --retries=3 \
    CMD ["python3", "/opt/carbonforge/healthcheck.py"]

# dumb-init is PID 1: it forwards SIGTERM/SIGINT to the runtime, which drains vLLM.
ENTRYPOINT ["dumb-init", "--", "carbonforge-runtime"]
CMD []
