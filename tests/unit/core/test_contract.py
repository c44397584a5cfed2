"""The engine contract: one versioned tree, serialised once, parsed once, refused when it does not fit."""

from __future__ import annotations

import json

import pytest

from carbonforge_runtime.core.contract import (
    CONTRACT_ENV,
    CONTRACT_VERSION,
    ContractError,
    EnergyMetering,
    EngineContract,
    MetricsFeed,
    Ordering,
    OtlpTarget,
    TraceConfig,
)

FULL = EngineContract(
    ordering=Ordering("hybrid", {"aging_rate": 2.5, "weights": {"ltr": 1.0}}),
    tracing=TraceConfig(level="full", file="/var/log/carbonforge/t.jsonl",
                        otlp=OtlpTarget("http://c:4318/v1/traces", "http/protobuf"), queue_capacity=10),
    metrics_feed=MetricsFeed("/tmp/cf-metrics-x/feed.sock"),
    energy_meter=EnergyMetering(gpus=("GPU-1", "GPU-2"), fake_nvml=None),
)


def test_every_part_round_trips() -> None:
    assert EngineContract.from_json(FULL.to_json()) == FULL
    assert EngineContract.from_environ(FULL.env()) == FULL
    assert list(FULL.env()) == [CONTRACT_ENV]
    assert json.loads(FULL.to_json())["version"] == CONTRACT_VERSION


def test_absent_parts_stay_absent() -> None:
    bare = EngineContract()
    assert EngineContract.from_json(bare.to_json()) == bare
    assert bare.tracing is None and bare.metrics_feed is None and bare.energy_meter is None
    assert not bare.builds_records
    metrics_only = EngineContract(metrics_feed=MetricsFeed("/tmp/s"))
    assert metrics_only.builds_records and EngineContract.from_json(metrics_only.to_json()).tracing is None


@pytest.mark.parametrize("version", [0, CONTRACT_VERSION + 1, None, "1"])
def test_another_version_is_refused_with_the_fix(version: object) -> None:
    data = json.loads(FULL.to_json())
    data["version"] = version
    with pytest.raises(ContractError) as refused:
        EngineContract.from_json(json.dumps(data))
    assert "version mismatch" in refused.value.message and repr(version) in refused.value.message
    assert "same carbonforge-runtime installation" in refused.value.remedy


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(extra={"x": 1}), "unknown field(s) extra in the top level"),
    (lambda d: d["tracing"].update(level=3), "tracing.level has the wrong type"),
    (lambda d: d["tracing"].pop("level"), "tracing"),
    (lambda d: d["energy_meter"].update(gpus="GPU-1"), "energy_meter.gpus is not a list"),
    (lambda d: d.update(ordering=[]), "ordering is not an object"),
    (lambda d: d["metrics_feed"].update(socket=None), "metrics_feed.socket may not be null"),
])
def test_a_malformed_contract_names_the_field(change, message: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(FULL.to_json())
    change(data)
    with pytest.raises(ContractError, match="engine contract") as refused:
        EngineContract.from_json(json.dumps(data))
    assert message in refused.value.message


def test_not_json_is_refused() -> None:
    with pytest.raises(ContractError, match="is not JSON"):
        EngineContract.from_json("{nope")
