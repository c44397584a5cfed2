"""CF_TRACE_RETENTION in the plan: it reaches the engine contract of the trace file (every rank's),
the dry run says how the file rotates and for how long it is kept, and without a file it says why it
has nothing to do."""

from __future__ import annotations

from carbonforge_runtime.core.contract import EngineContract
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan, describe_plan
from carbonforge_runtime.settings import load_settings

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def test_the_retention_reaches_the_engine_with_every_rank() -> None:
    options = ServeOptions(vllm_args=[MODEL, "--data-parallel-size", "2"], request_trace="full",
                           trace_file="/var/log/carbonforge/requests.jsonl")
    plan = build_plan(options, load_settings({"CF_TRACE_RETENTION": "7d"}), SHIPPED, {})
    assert plan.trace is not None and plan.trace.retention_s == 7 * 86400 and plan.trace.data_parallel_size == 2
    engine = EngineContract.from_environ(plan.launch.engine_env())
    assert engine.tracing == plan.trace
    lines = describe_plan(plan, options, {})
    assert ("request trace:      full -> file /var/log/carbonforge/requests.dp<rank>.jsonl (rotated hourly, segments "
            "deleted 7d after their newest record: CF_TRACE_RETENTION)") in lines


def test_without_a_retention_nothing_changes() -> None:
    options = ServeOptions(vllm_args=[MODEL], request_trace="standard", trace_file="/tmp/t.jsonl")
    plan = build_plan(options, load_settings({}), SHIPPED, {})
    assert plan.trace is not None and plan.trace.retention_s is None
    assert "request trace:      standard -> file /tmp/t.jsonl" in describe_plan(plan, options, {})


def test_a_retention_without_a_trace_file_says_it_has_nothing_to_do() -> None:
    options = ServeOptions(vllm_args=[MODEL], request_trace="standard", trace_endpoint="http://collector:4317")
    plan = build_plan(options, load_settings({"CF_TRACE_RETENTION": "12h"}), SHIPPED, {})
    assert plan.trace is not None and plan.trace.retention_s is None
    assert any("CF_TRACE_RETENTION applies to trace files, and there is none" in m.text for m in plan.messages)
    off = build_plan(ServeOptions(vllm_args=[MODEL]), load_settings({"CF_TRACE_RETENTION": "12h"}), SHIPPED, {})
    assert off.trace is None
