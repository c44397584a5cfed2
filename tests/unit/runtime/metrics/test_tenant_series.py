"""Per-tenant series on the runtime's /metrics: what each counts, and a label set bounded whatever the
tenants (the first N distinct names, then ``other``; ``default`` for requests without a tenant)."""

from __future__ import annotations

import pytest

from carbonforge_runtime.core.feed_protocol import RequestSample
from carbonforge_runtime.core.tenant_labels import (
    DEFAULT_TENANT,
    MAX_TENANT_LABELS,
    OTHER_TENANT,
    tenant_group,
    tenant_label,
)
from carbonforge_runtime.runtime.metrics.exposition import exposition, make_registry
from carbonforge_runtime.runtime.metrics.state import RuntimeState
from tests.unit.runtime.metrics.test_metrics import needs_promtool, promtool_check, total, values


def usage(tenant: str | None, reason: str = "stop", ttft: float | None = 0.05, e2e: float = 0.8,
          prompt: int = 100, cached: int = 40, output: int = 20, energy: float | None = 2.0) -> RequestSample:
    return RequestSample("fcfs", reason, 0.02, ttft, e2e, prompt, output, energy, cached, tenant)


def test_tenant_label_keeps_known_names_and_folds_the_rest_past_the_cap() -> None:
    assert tenant_label(None, set(), cap=2) == DEFAULT_TENANT
    assert tenant_label("", set(), cap=2) == DEFAULT_TENANT
    assert tenant_label("acme", set(), cap=2) == "acme"
    assert tenant_label("acme", {"acme", "beta"}, cap=2) == "acme"  # labelled before the cap was reached
    assert tenant_label("gamma", {"acme", "beta"}, cap=2) == OTHER_TENANT
    assert tenant_label(None, {"acme", "beta"}, cap=2) == DEFAULT_TENANT  # default never counts against the cap
    assert tenant_label("gamma", set(), cap=0) == OTHER_TENANT
    assert tenant_group(None) == tenant_group("") == tenant_group(7) == DEFAULT_TENANT
    assert tenant_group("acme") == "acme"


def test_per_tenant_counters_and_histograms() -> None:
    state = RuntimeState()
    state.on_records([usage("acme")] * 3 + [usage("acme", reason="error", ttft=None, output=0, energy=None)]
                     + [usage(None, e2e=30.0, cached=0)] * 2, dp_rank=0)
    state.on_records([usage("acme", reason="abort", ttft=None, output=0)], dp_rank=1)  # summed over ranks
    found = values(exposition(make_registry(state.snapshot)))
    assert total(found, "carbonforge_tenant_requests_total", tenant="acme") == 5
    assert total(found, "carbonforge_tenant_requests_total", tenant="acme", finish_reason="error") == 1
    assert total(found, "carbonforge_tenant_requests_total", tenant="acme", finish_reason="abort") == 1
    assert total(found, "carbonforge_tenant_requests_total", tenant=DEFAULT_TENANT, finish_reason="stop") == 2
    assert total(found, "carbonforge_tenant_prompt_tokens_total", tenant="acme") == 500
    assert total(found, "carbonforge_tenant_cached_prompt_tokens_total", tenant="acme") == 200
    assert total(found, "carbonforge_tenant_cached_prompt_tokens_total", tenant=DEFAULT_TENANT) == 0
    assert total(found, "carbonforge_tenant_output_tokens_total", tenant="acme") == 60
    assert total(found, "carbonforge_tenant_energy_joules_total", tenant="acme") == pytest.approx(8.0)
    assert total(found, "carbonforge_tenant_request_time_to_first_token_seconds_count", tenant="acme") == 3
    assert total(found, "carbonforge_tenant_request_e2e_latency_seconds_count", tenant="acme") == 5
    assert total(found, "carbonforge_tenant_request_e2e_latency_seconds_bucket", tenant=DEFAULT_TENANT,
                 le="20.0") == 0
    assert total(found, "carbonforge_tenant_request_e2e_latency_seconds_bucket", tenant=DEFAULT_TENANT,
                 le="30.0") == 2
    assert not [lab for lab, _ in found["carbonforge_tenant_prompt_tokens_total"] if "dp_rank" in lab]


def test_the_tenant_labels_are_bounded_by_the_cap() -> None:
    state = RuntimeState(max_tenants=3)
    state.on_records([usage(f"team-{i}") for i in range(10)] + [usage(None)])
    state.on_records([usage("team-1"), usage("team-7"), usage("default"), usage("other")])
    found = values(exposition(make_registry(state.snapshot)))
    counts = {lab["tenant"]: v for lab, v in found["carbonforge_tenant_requests_total"]}
    # the first three names seen keep their own label for good; later ones, and a key named "other", are other
    assert counts == {"team-0": 1, "team-1": 2, "team-2": 1, OTHER_TENANT: 9, DEFAULT_TENANT: 2}
    for name in ("carbonforge_tenant_output_tokens_total", "carbonforge_tenant_request_e2e_latency_seconds_count"):
        assert {lab["tenant"] for lab, _ in found[name]} == {"team-0", "team-1", "team-2", OTHER_TENANT,
                                                             DEFAULT_TENANT}


def test_a_thousand_tenants_make_at_most_the_cap_plus_two_labels() -> None:
    state = RuntimeState()
    state.on_records([usage(f"key-{i:04d}") for i in range(1000)])
    tenants = {lab["tenant"] for lab, _ in values(exposition(make_registry(state.snapshot)))[
        "carbonforge_tenant_requests_total"]}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER_TENANT in tenants
    assert f"key-{MAX_TENANT_LABELS - 1:04d}" in tenants and f"key-{MAX_TENANT_LABELS:04d}" not in tenants


@needs_promtool
def test_the_tenant_series_pass_promtool() -> None:
    state = RuntimeState()
    state.on_records([usage("acme"), usage("Équipe \"données\""), usage(None, ttft=None)])
    text = exposition(make_registry(state.snapshot))
    checked = promtool_check(text)
    assert checked.returncode == 0 and checked.stdout == b"" and checked.stderr == b"", checked
    assert total(values(text), "carbonforge_tenant_requests_total", tenant="Équipe \"données\"") == 1


def test_the_keys_file_and_the_labels_agree_on_names() -> None:
    """Every name the keys file accepts is recorded as sent and can be a label; the names the labels keep for
    their own groups are the ones the keys file refuses."""
    from carbonforge_runtime.core.api_keys import NAME_PATTERN, RESERVED_NAMES
    from carbonforge_runtime.core.request_tags import MAX_TENANT_CHARS, tenant_from_arg
    from carbonforge_runtime.core.tenant_labels import RESERVED_TENANT_NAMES

    assert set(RESERVED_NAMES) == set(RESERVED_TENANT_NAMES)
    longest = "a" * MAX_TENANT_CHARS
    assert NAME_PATTERN.match(longest) and not NAME_PATTERN.match(longest + "a")
    for name in ("team-a", "A.b_c-9", longest):
        assert NAME_PATTERN.match(name) and tenant_from_arg(name) == name
