"""``carbonforge-runtime tune --jobs``: the candidates run in spawned worker processes, and how many
run at once does not change the result. Each worker imports vLLM afresh, which is why this lives
here and not in tests/unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from tests.unit.cli.test_tune_cli import KEY, long_prompts

runner = CliRunner()


def test_jobs_do_not_change_the_result(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    trace = long_prompts(tmp_path / "t.jsonl", 40, seed=3)
    outputs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"r{jobs}.json"
        result = runner.invoke(cli.app, ["tune", str(trace), "--context-key", KEY, "--goal", "throughput",
                                         "--slo", "ttft_p99=60s", "--budget", "5", "--jobs", jobs, "-o", str(out),
                                         "-q"])
        assert result.exit_code == 0, result.output
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert len(json.loads(outputs[0])["candidates"]) == 5
