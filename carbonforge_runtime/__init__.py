"""carbonforge-runtime: the entrypoint of the CarbonForge self-hosted serving container."""

__version__ = "0.2.0"

#: The vLLM release whose (non-public) scheduler interface the shim is written against.
PINNED_VLLM_VERSION = "0.32.0"
