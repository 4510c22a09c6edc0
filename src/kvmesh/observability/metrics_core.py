"""The frontend's and the planner's metric types and their text exposition, without
``prometheus_client`` (issue 36: its package import pulls ``http.server``, ``email``,
``urllib.request`` and ``wsgiref`` into the process, ~1/3 of the frontend's import on
the way to its first completion).

What they write at ``/metrics`` is what ``prometheus_client.generate_latest`` writes for
the same samples, byte for byte (``tests/unit/test_metrics_exposition.py`` renders both):
a counter's family is ``NAME`` with samples ``NAME_total``, its HELP and TYPE lines name
``NAME_total``; a histogram's samples are its cumulative ``_bucket`` counts (``le`` as Go
writes a float), then ``_count`` and ``_sum``; no ``_created`` series. Families and
samples have the attributes ``prometheus_client``'s have (``name``, ``type``,
``documentation``, ``samples``; a sample's ``name``, ``labels``, ``value``,
``timestamp``), so either library's registry collects and renders the other's metrics.

:class:`Counter`, :class:`Gauge` and :class:`Histogram` take a lock per change, as
``prometheus_client``'s do (the few metrics changed off the request path); the request
path's own are :class:`~kvmesh.observability.metrics.LoopCounter` and ``LoopHistogram``.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = [
    "CONTENT_TYPE",
    "Sample",
    "Family",
    "counter_family",
    "gauge_family",
    "histogram_family",
    "Collector",
    "MetricsRegistry",
    "Counter",
    "Gauge",
    "Histogram",
    "go_float",
    "render",
]

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"  # prometheus_client's CONTENT_TYPE_LATEST


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None
    exemplar: Any = None


class Family:
    """One metric family as a collector yields it: name, type, help, samples."""

    __slots__ = ("name", "documentation", "type", "samples", "labelnames")

    def __init__(self, name: str, documentation: str, typ: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.labelnames = tuple(labelnames)
        self.samples: list[Sample] = []

    def add_value(self, values: Sequence[str], value: float) -> None:
        """A counter's or a gauge's sample for one label set."""
        suffix = "_total" if self.type == "counter" else ""
        self.samples.append(Sample(self.name + suffix, dict(zip(self.labelnames, values)), value))

    def add_buckets(self, values: Sequence[str], cumulative: Sequence[tuple[str, float]], total: float) -> None:
        """A histogram's samples for one label set: ``cumulative`` is ``(le, count)`` up
        to ``+Inf``; then the count (the last bucket's) and the sum."""
        pairs = list(zip(self.labelnames, values))
        for le, count in cumulative:
            self.samples.append(Sample(self.name + "_bucket", dict(pairs + [("le", le)]), count))
        self.samples.append(Sample(self.name + "_count", dict(pairs), cumulative[-1][1]))
        self.samples.append(Sample(self.name + "_sum", dict(pairs), total))


def counter_family(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family:
    return Family(name[:-6] if name.endswith("_total") else name, documentation, "counter", labelnames)


def gauge_family(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family:
    return Family(name, documentation, "gauge", labelnames)


def histogram_family(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family:
    return Family(name, documentation, "histogram", labelnames)


class Collector(Protocol):
    """Anything a registry collects: yields families (this module's or prometheus_client's)."""

    def collect(self) -> Iterable[Any]: ...


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ()}  # fmt: skip


class MetricsRegistry:
    """A set of collectors, each name at most once (a second collector with a name
    already taken raises ValueError, as ``prometheus_client.CollectorRegistry`` does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._collectors: dict[Collector, tuple[str, ...]] = {}
        self._names: set[str] = set()

    def register(self, collector: Collector) -> None:
        names = _names_of(collector)
        with self._lock:
            taken = self._names.intersection(names)
            if taken:
                raise ValueError(f"Duplicated timeseries in CollectorRegistry: {sorted(taken)}")
            self._collectors[collector] = names
            self._names.update(names)

    def unregister(self, collector: Collector) -> None:
        with self._lock:
            self._names.difference_update(self._collectors.pop(collector))

    def collect(self) -> Iterator[Any]:
        with self._lock:
            collectors = list(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of the sample ``name`` with exactly ``labels`` (None: no such sample)."""
        wanted = labels or {}
        for family in self.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == wanted:
                    return float(sample.value)
        return None


def _names_of(collector: Collector) -> tuple[str, ...]:
    describe = getattr(collector, "describe", None)
    families = describe() if describe is not None else collector.collect()
    names: list[str] = []
    for family in families:
        names.append(family.name)
        names.extend(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
    return tuple(names)


class _Child:
    """One label set's value (a counter's or a gauge's), changed under a lock."""

    __slots__ = ("_value", "_lock", "_read")

    def __init__(self) -> None:
        self._value = 0.0
        self._lock = threading.Lock()
        self._read: Callable[[], float] | None = None

    def inc(self, amount: float = 1) -> None:
        with self._lock:
            self._value += amount

    def get(self) -> float:
        if self._read is not None:
            return float(self._read())
        with self._lock:
            return self._value


class CounterChild(_Child):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        super().inc(amount)


class GaugeChild(_Child):
    __slots__ = ()

    def dec(self, amount: float = 1) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def set_function(self, read: Callable[[], float]) -> None:
        """The value is ``read()`` at each scrape from now on."""
        self._read = read


class HistogramChild:
    """One label set of a :class:`Histogram`: per-bucket counts and a sum, under a lock."""

    __slots__ = ("_bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0.0] * len(bounds)  # the last bound is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect_left(self._bounds, value)] += 1.0
            self._sum += value

    def read(self) -> tuple[list[float], float]:
        with self._lock:
            return list(self._counts), self._sum


class _Metric:
    """A named metric with label names; its children by label values (created on first
    use, in that order at scrape, as ``prometheus_client`` lists them)."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: MetricsRegistry | Any) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()
        if not self.labelnames:
            self._children[()] = self._new_child()
        registry.register(self)

    def _new_child(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: object) -> Any:
        if not self.labelnames:
            raise ValueError(f"{self.name}: no label names, labels() not allowed")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            with self._lock:
                child = self._children.setdefault(key, self._new_child())
        return child

    def _family(self) -> Family:
        return Family(self.name, self.documentation, self.kind, self.labelnames)

    def collect(self) -> Iterator[Family]:
        raise NotImplementedError

    def describe(self) -> Iterator[Family]:
        yield self._family()

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        with self._lock:
            return list(self._children.items())


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: MetricsRegistry | Any) -> None:  # fmt: skip
        super().__init__(name[:-6] if name.endswith("_total") else name, documentation, labelnames, registry)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1) -> None:
        self._children[()].inc(amount)

    def collect(self) -> Iterator[Family]:
        family = self._family()
        for values, child in self._items():
            family.add_value(values, child.get())
        yield family


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: MetricsRegistry | Any) -> None:  # fmt: skip
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def set(self, value: float) -> None:
        self._children[()].set(value)

    def inc(self, amount: float = 1) -> None:
        self._children[()].inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._children[()].dec(amount)

    def collect(self) -> Iterator[Family]:
        family = self._family()
        for values, child in self._items():
            family.add_value(values, child.get())
        yield family


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float],
                 registry: MetricsRegistry | Any) -> None:  # fmt: skip
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self._les = [go_float(b) for b in self.bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def collect(self) -> Iterator[Family]:
        family = self._family()
        for values, child in self._items():
            counts, total = child.read()
            cumulative, running = [], 0.0
            for le, count in zip(self._les, counts):
                running += count
                cumulative.append((le, running))
            family.add_buckets(values, cumulative, total)
        yield family


def go_float(value: float) -> str:
    """A float as the Prometheus text format writes it (Go's formatting): ``+Inf``,
    ``-Inf``, ``NaN``; a positive number of 1e6 or more with an exponent (``1e+06``);
    otherwise Python's shortest repr."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    dot = text.find(".")
    if value <= 0 or dot <= 6:  # also a repr with an exponent already (no dot, or early)
        return text
    digits = (text[:dot] + text[dot + 1 :]).rstrip("0")
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{mantissa}e+{dot - 1:02d}"


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _line(sample: Any) -> str:
    labels = sample.labels
    body = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items())) if labels else ""
    stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
    return f"{sample.name}{'{' + body + '}' if body else ''} {go_float(sample.value)}{stamp}\n"


_TYPE_AS = {"counter": "counter", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


def render(registry: MetricsRegistry | Any) -> bytes:
    """The text exposition of everything ``registry`` collects (metric and label names
    are kvmesh's own: plain ``[a-zA-Z_:][a-zA-Z0-9_:]*``, written as they are)."""
    out: list[str] = []
    for family in registry.collect():
        name, kind = family.name, family.type
        if kind == "counter":
            name += "_total"
        elif kind == "info":
            name += "_info"
        kind = _TYPE_AS.get(kind, kind)
        doc = _escape_help(family.documentation)
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
        extra: dict[str, list[str]] = {}
        for sample in family.samples:
            suffix = next((s for s in _OM_SUFFIXES if sample.name == family.name + s), None)
            if suffix is None:
                out.append(_line(sample))
            else:
                extra.setdefault(suffix, []).append(_line(sample))
        for suffix, lines in sorted(extra.items()):
            out.append(f"# HELP {family.name}{suffix} {doc}\n# TYPE {family.name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode("utf-8")
