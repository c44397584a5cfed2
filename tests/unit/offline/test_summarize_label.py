"""``trace summarize`` says where its figures come from: predicted for sim's virtual-time records,
the engine's own (measured or emulated) for a trace an engine wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.trace_record import LEVEL_STANDARD, Completion, build_record

runner = CliRunner()


def trace(path: Path, origin_s: float) -> Path:
    rows = []
    for i in range(20):
        t = origin_s + i * 0.5
        rows.append(build_record(Completion(
            engine_request_id=f"r-{i}", t_arrival=t, t_scheduled=t + 0.1, t_first_token=t + 0.2,
            t_completion=t + 1.0, prompt_tokens=100, output_tokens=20, finish_reason="stop"),
            family="fcfs", level=LEVEL_STANDARD))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("origin_s", "kind", "words"), [
    (0.0, "predicted", "figures: predicted by the twin (virtual-time records written by sim"),
    (1_764_900_000.0, "measured or emulated", "figures: from the engine that wrote the trace: measured on its host, "
     "or emulated if it was served with --emulate"),
])
def test_summarize_labels_its_figures(tmp_path: Path, origin_s: float, kind: str, words: str) -> None:
    path = trace(tmp_path / "t.jsonl", origin_s)
    text = runner.invoke(cli.app, ["trace", "summarize", str(path)])
    assert text.exit_code == 0, text.output
    assert text.output.splitlines()[1].startswith(words)
    data = runner.invoke(cli.app, ["trace", "summarize", str(path), "--json"])
    assert data.exit_code == 0, data.output
    assert json.loads(data.output)["label"]["kind"] == kind
