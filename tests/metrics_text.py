"""Reading a /metrics page in tests: prometheus_client's own parser, so names, types and values are
checked as a scraper sees them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> dict[str, str]:
    """metric family name -> type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def value(text: str, sample: str, **labels: str) -> float | None:
    """The value of the sample named `sample` whose labels include `labels`; None if absent."""
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
