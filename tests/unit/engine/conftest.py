from __future__ import annotations

from typing import Any

import pytest

from tests.support.scheduler_harness import build_vllm_parts


@pytest.fixture(scope="module")
def vllm_parts(tiny_model: str) -> dict[str, Any]:
    pytest.importorskip("vllm")
    return build_vllm_parts(tiny_model)
