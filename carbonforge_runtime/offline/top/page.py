"""A Prometheus text page read into plain data: metric name to its samples. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

#: One sample: its labels and its value.
Sample = tuple[Mapping[str, str], float]
#: A page: every sample by its exposed name (``..._total``, ``..._bucket`` included).
Samples = Mapping[str, tuple[Sample, ...]]


def parse_page(text: str) -> Samples:
    """Every sample of ``text``. Raises ValueError when it is not Prometheus text."""
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return {name: tuple(samples) for name, samples in found.items()}


def total(samples: Samples, name: str, **match: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``match``; None when there are none."""
    values = [value for labels, value in samples.get(name, ())
              if all(labels.get(k) == v for k, v in match.items()) and not math.isnan(value)]
    return sum(values) if values else None


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` (samples without it are left out)."""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, ()):
        if label in labels and not math.isnan(value):
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def info(samples: Samples, name: str) -> Mapping[str, str]:
    """The labels of an info metric's one sample (empty when absent)."""
    found = samples.get(name, ())
    return found[0][0] if found else {}


def buckets(samples: Samples, histogram: str) -> tuple[tuple[float, float], ...]:
    """A histogram's cumulative buckets, summed over its other labels: (upper bound, count) by bound."""
    counts: dict[float, float] = {}
    for labels, value in samples.get(histogram + "_bucket", ()):
        bound = float(labels.get("le", "nan"))
        if not math.isnan(bound):
            counts[bound] = counts.get(bound, 0.0) + value
    return tuple(sorted(counts.items()))
