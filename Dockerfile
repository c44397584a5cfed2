# syntax=docker/dockerfile:1.7
# The CarbonForge serving image: the pinned vLLM OpenAI image with carbonforge-runtime as entrypoint.
# vLLM's scheduler interface is not public API; the runtime's scheduler shim is written for 0.32.0 only.
FROM vllm/vllm-openai:v0.32.0

ENV PYTHONUNBUFFERED=1 \
    CF_LOG_DIR=/var/log/carbonforge \
    CF_LICENSE_FILE=/etc/carbonforge/license.key \
    CF_COMPILE_CACHE_DIR=/var/cache/carbonforge \
    HF_HOME=/root/.cache/huggingface

WORKDIR /opt/carbonforge-runtime
COPY pyproject.toml README.md LICENSE ./
COPY carbonforge_runtime ./carbonforge_runtime
COPY recipes ./recipes
COPY docker/constraints.txt docker/healthcheck.py /opt/carbonforge/

# The constraints file keeps the base image's vLLM exactly where it is.
RUN uv pip install --system --no-cache --constraint /opt/carbonforge/constraints.txt \
        "dumb-init==1.2.5.post1" /opt/carbonforge-runtime \
    && mkdir -p /var/log/carbonforge /var/cache/carbonforge /etc/carbonforge \
    && carbonforge-runtime --version

# Weights, logs, and what the engine compiles on its first boot (later boots load it from there).
VOLUME ["/root/.cache/huggingface", "/var/log/carbonforge", "/var/cache/carbonforge"]
EXPOSE 8000 9105

# Weights download and engine warm-up can take many minutes on a first boot.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python3", "/opt/carbonforge/healthcheck.py"]

# dumb-init is PID 1: it forwards SIGTERM/SIGINT to the runtime, which drains vLLM.
ENTRYPOINT ["dumb-init", "--", "carbonforge-runtime"]
CMD []
