"""Prometheus metrics: Counter, Gauge and Histogram with labels, callback metrics read at collect
time, and a Registry exposed through `prometheus_client` (its text exposition, its types, its
`process_*` collector).

The hot path never touches a lock: a metric's values are plain slotted objects (`_Value`,
`_HistogramChild`) updated with an add; `prometheus_client` reads them only when /metrics is
scraped, through one collector per Registry that turns every metric into a metric family. So a
component either updates metric objects it registered (`registry.counter(...)`), or registers a
callback (`registry.callback(...)`) that reads its own state at scrape time, and state that already
exists (queue lengths, per-worker counts) is never mirrored into a gauge on the hot path.

A labelled child is best looked up once (`counter.labels("chat", "200")`) and kept when reused.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

# Latency buckets in seconds, close to vLLM's for TTFT and inter-token latency.
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03,
                                  0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                                  60.0, 120.0, 300.0)
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)

    def family(self) -> Metric:
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

    def family(self) -> Metric:
        fam = _new_family(self.kind, self.name, self.help, self.labelnames)
        for values, child in sorted(self._children.items()):
            fam.add_metric(list(values), child.value)
        return fam


def _new_family(kind: str, name: str, help: str,
                labelnames: Sequence[str]) -> CounterMetricFamily | GaugeMetricFamily:
    if kind == "counter":
        return CounterMetricFamily(name, help, labels=list(labelnames))
    return GaugeMetricFamily(name, help, labels=list(labelnames))


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

    def observe_n(self, value: float, n: int) -> None:
        """`n` observations of `value` at the cost of one (tokens that arrived together)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n


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

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.help, labels=list(self.labelnames))
        les = [floatToGoString(b) for b in (*self.bounds, math.inf)]
        for values, child in sorted(self._children.items()):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(les, child.counts):
                cumulative += count
                buckets.append((le, cumulative))
            fam.add_metric(list(values), buckets, child.sum)
        return fam


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

    def family(self) -> Metric:
        fam = _new_family(self.kind, self.name, self.help, self.labelnames)
        for values, value in self.collect():
            fam.add_metric(list(values), value)
        return fam


class _Collector:
    """What prometheus_client's registry calls at scrape time: every metric as a family."""

    def __init__(self, metrics: dict[str, _Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for m in list(self._metrics.values()):
            yield m.family()


class Registry:
    """Owns a set of metrics; `render()` is prometheus_client's text exposition of them (in
    registration order), plus `process_*` once `add_process_metrics()` was called."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self.prometheus = CollectorRegistry(auto_describe=False)
        self.prometheus.register(_Collector(self._metrics))
        self._process = False

    def add_process_metrics(self) -> None:
        """Add the `process_*` series (CPU, memory, open fds, start time) of this process."""
        if not self._process:
            self._process = True
            ProcessCollector(registry=self.prometheus)

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
        return generate_latest(self.prometheus).decode()
