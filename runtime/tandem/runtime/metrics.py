"""A small Prometheus metrics kit: Counter, Gauge and Histogram with labels, callback metrics read
at collect time, and a Registry that renders the text exposition format (version 0.0.4). No
prometheus_client dependency.

This module owns rendering: nothing else in tandem writes exposition text. A component either
updates metric objects it registered (`registry.counter(...)`), or registers a callback
(`registry.callback(...)`) that reads its own state when /metrics is scraped, so state that already
exists (queue lengths, per-worker counts) is never mirrored into a gauge on the hot path.

Updating a metric is a dict lookup and an add, so it is cheap enough to do once per delta; a labelled
child is best looked up once (`counter.labels("chat", "200")`) and kept when it is reused.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

# Latency buckets in seconds, close to vLLM's for TTFT and inter-token latency.
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03,
                                  0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                                  60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    if x == -math.inf:
        return "-Inf"
    if isinstance(x, int) or x.is_integer():
        return str(int(x))
    return repr(x)


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Scalar(_Metric):
    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._children: dict[tuple[str, ...], _Value] = {}
        if not self.labelnames:
            self._children[()] = _Value()

    def labels(self, *values: str) -> _Value:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Value()
        return child

    @property
    def value(self) -> float:
        return self._children[()].value

    def inc(self, amount: float = 1.0) -> None:
        self._children[()].value += amount

    def render(self) -> list[str]:
        lines = self._header()
        for values, child in sorted(self._children.items()):
            lines.append(f"{self.name}{_labels_text(self.labelnames, values)} {_num(child.value)}")
        return lines


class Counter(_Scalar):
    kind = "counter"


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float) -> None:
        self._children[()].value = value

    def dec(self, amount: float = 1.0) -> None:
        self._children[()].value -= amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Iterable[float] = E2E_BUCKETS):
        super().__init__(name, help, labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets if b != math.inf))
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        if not self.labelnames:
            self._children[()] = _HistogramChild(self.bounds)

    def labels(self, *values: str) -> _HistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _HistogramChild(self.bounds)
        return child

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def child(self) -> _HistogramChild:
        """The unlabelled series, to keep and observe into on a hot path."""
        return self._children[()]

    def render(self) -> list[str]:
        lines = self._header()
        for values, child in sorted(self._children.items()):
            cumulative = 0
            for bound, count in zip((*self.bounds, math.inf), child.counts):
                cumulative += count
                le = 'le="' + _num(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels_text(self.labelnames, values, le)} "
                             f"{cumulative}")
            suffix = _labels_text(self.labelnames, values)
            lines.append(f"{self.name}_sum{suffix} {_num(child.sum)}")
            lines.append(f"{self.name}_count{suffix} {cumulative}")
        return lines


Samples = Iterable[tuple[Sequence[str], float]]
"""What a callback metric reports when collected: (label values, value) pairs."""


class Callback(_Metric):
    """A gauge or counter whose samples a callback reads at collect time."""

    def __init__(self, name: str, help: str, collect: Callable[[], Samples],
                 labelnames: Sequence[str] = (), kind: str = "gauge"):
        if kind not in ("gauge", "counter"):
            raise ValueError(f"a callback metric is a gauge or a counter, not {kind!r}")
        super().__init__(name, help, labelnames)
        self.kind = kind
        self.collect = collect

    def render(self) -> list[str]:
        lines = self._header()
        for values, value in self.collect():
            lines.append(f"{self.name}{_labels_text(self.labelnames, values)} {_num(value)}")
        return lines


class Registry:
    """Owns a set of metrics and renders them in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric

    def callback(self, name: str, help: str, collect: Callable[[], Samples],
                 labelnames: Sequence[str] = (), kind: str = "gauge") -> Callback:
        """A metric whose samples `collect()` returns when the registry renders."""
        c = Callback(name, help, collect, labelnames, kind)
        self._add(c)
        return c

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        c = Counter(name, help, labelnames)
        self._add(c)
        return c

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        g = Gauge(name, help, labelnames)
        self._add(g)
        return g

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Iterable[float] = E2E_BUCKETS) -> Histogram:
        h = Histogram(name, help, labelnames, buckets)
        self._add(h)
        return h

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n" if lines else ""
