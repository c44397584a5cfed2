"""vLLM's own V1 scheduler built in-process (CPU config, the tiny model's tokenizer) around the
CarbonForge scheduler, and driven step by step with hand-made model outputs, the way vLLM's
scheduler tests do. No engine process and no model run."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract, Ordering, TraceConfig

BLOCK = 16


class Engine:
    """A scheduler plus a fake model that samples ``token`` for every scheduled request."""

    def __init__(self, parts: dict[str, Any], max_num_seqs: int, async_scheduling: bool = False) -> None:
        from carbonforge_runtime.engine.scheduler import make_scheduler

        config, kv, som = parts["build"](max_num_seqs, async_scheduling)
        self.hasher = parts["hasher"]
        self.scheduler = make_scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=som,
                                        block_size=BLOCK, log_stats=False)
        self.tokenizer = som.tokenizer
        #: Every request added, by engine id (vLLM forgets finished ones).
        self.added: dict[str, Any] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 2, arrival: float | None = None,
            **sampling: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling), None,
                          arrival_time=arrival if arrival is not None else time.time(), block_hasher=self.hasher)
        self.scheduler.add_request(request)
        self.added[rid] = request
        return request

    def step(self, token: int = 7) -> tuple[Any, dict[int, Any]]:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[token] for _ in ids], logprobs=None,
                                   prompt_logprobs_dict={}, pooler_output=[])
        return out, self.scheduler.update_from_output(out, runner)

    def timed_step(self, clock: Any, forward_s: float, host_s: float) -> Any:
        """One synchronous step on a fake clock (an object with a ``now`` in seconds): the forward pass
        takes ``forward_s``, the host work after the output ``host_s``; a request part-way through its
        prompt samples nothing. The step's ``SchedulerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        out = scheduler.schedule()
        clock.now += forward_s
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[r].is_prefill_chunk else [7] for r in ids]
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
        scheduler.update_from_output(out, runner)
        clock.now += host_s
        return out

    def run(self, steps: int = 50, token: int = 7) -> list[list[str]]:
        """Step until idle; the engine ids admitted at each step."""
        admitted = []
        for _ in range(steps):
            if not self.scheduler.has_requests():
                break
            out, _ = self.step(token)
            admitted.append([new.req_id for new in out.scheduled_new_reqs])
        return admitted


def configure(monkeypatch: pytest.MonkeyPatch, path: Path | None, level: str = "standard", family: str = "fcfs",
              params: Mapping[str, Any] | None = None) -> None:
    trace = TraceConfig(level=level, file=str(path), flush_timeout_s=5.0) if path else None
    monkeypatch.setenv(CONTRACT_ENV, EngineContract(Ordering(family, dict(params or {})), trace).to_json())


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def build_vllm_parts(tiny_model: str) -> dict[str, Any]:
    """The configuration factory and block hasher :class:`Engine` needs."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)

    def build(max_num_seqs: int, async_scheduling: bool = False) -> tuple[Any, Any, Any]:
        model = ModelConfig(model=tiny_model, tokenizer=tiny_model, dtype="bfloat16", seed=0, max_model_len=512)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=512,
                                is_encoder_decoder=False)
        cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
        cache.num_gpu_blocks = 200
        config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                            device_config=DeviceConfig("cpu"))
        config.scheduler_config.async_scheduling = async_scheduling
        kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                                                            dtype=torch.bfloat16))])
        return config, kv, StructuredOutputManager(config)

    return {"build": build, "hasher": get_request_block_hasher(BLOCK, sha256)}
