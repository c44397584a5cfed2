"""Which of the runtime's environment variables the engine sees.

vLLM's processes get only what a serving engine reads: the system basics, the families of variables
that vLLM, PyTorch, CUDA/NCCL, the Hugging Face libraries and OpenTelemetry read, proxies and CA
bundles for a download, and cloud-storage credentials for weights streamed from a bucket. Anything
else (the runtime's own settings, the licence key, unrelated secrets a container was given) stays
in the runtime, out of ``/proc/<pid>/environ`` of every vLLM process. An operator who needs more
names them in ``CF_ENGINE_ENV_PASS``. Pure: plain mappings in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Whole names the engine may see.
ENGINE_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "VIRTUAL_ENV", "CC", "CXX", "DO_NOT_TRACK",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    # torch.distributed's own rendezvous variables
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
})

#: Name prefixes the engine may see: the variable families of the libraries it runs.
ENGINE_PREFIXES = (
    "VLLM_", "HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_",
    "TORCH", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_", "CUDA_", "CUBLAS", "CUDNN_", "NCCL_", "NVIDIA_", "NV_",
    "GLOO_", "UCX_", "NVSHMEM_", "FLASHINFER_", "ROCM_", "HIP_", "HSA_", "OMP_", "KMP_", "MKL_", "GOMP_",
    "DNNL_", "ONEDNN_", "LD_", "MALLOC_", "PYTHON", "LC_", "XDG_", "SSL_", "OTEL_",
    # weights streamed from object storage (vLLM's run:ai streamer, s3:// and gs:// models)
    "AWS_", "RUNAI_", "GOOGLE_", "AZURE_",
)

#: The variable in which the operator names more variables to pass.
PASS_VARIABLE = "CF_ENGINE_ENV_PASS"


def parse_pass_list(text: str | None) -> tuple[str, ...]:
    """``CF_ENGINE_ENV_PASS``: names separated by commas or spaces; ``NAME*`` passes a prefix."""
    if not text:
        return ()
    return tuple(part for part in text.replace(",", " ").split() if part)


def _passes(name: str, extra: Iterable[str]) -> bool:
    if name in ENGINE_NAMES or name.startswith(ENGINE_PREFIXES):
        return True
    return any(name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])) for pattern in extra)


def engine_environment(environ: Mapping[str, str], extra: Iterable[str] = (),
                       never: Iterable[str] = ()) -> dict[str, str]:
    """The part of ``environ`` the engine may see: the engine's own families plus ``extra``
    (:func:`parse_pass_list`), never a name in ``never`` (secrets only the runtime reads)."""
    extra = tuple(extra)
    withheld = frozenset(never)
    return {name: value for name, value in environ.items()
            if name not in withheld and _passes(name, extra)}


def withheld_names(environ: Mapping[str, str], engine_env: Mapping[str, str]) -> list[str]:
    """Names of the runtime's variables the engine does not get (for the dry run; never values)."""
    return sorted(name for name in environ if name not in engine_env)
