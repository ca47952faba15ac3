"""vLLM's metric objects (``vllm.v1.metrics.reader``), read from a prometheus-client registry.

`LLM.get_metrics()` returns these for the engine's own registry (disable_log_stats=False):

    from tokenmill.metrics.reader import Counter, Gauge, Histogram, Vector
    for metric in llm.get_metrics():
        if isinstance(metric, Counter): print(metric.name, metric.labels, metric.value)

Each engine keeps its own registry, so several engines in one process never share counts;
``get_metrics_snapshot()`` without a registry reads prometheus-client's global one, as vLLM's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

PREFIX = "vllm:"
# The one counter vLLM reads as a vector: a count per position, its 'position' label.
_VECTOR_COUNTERS = ("vllm:spec_decode_num_accepted_tokens_per_pos",)


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """``buckets``: upper bound (the 'le' label, '+Inf' included) -> cumulative count."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class Vector(Metric):
    values: list[int]


def get_metrics_snapshot(registry: "CollectorRegistry | None" = None) -> list[Metric]:
    """Every ``vllm:`` metric of ``registry`` (prometheus-client's global one when None)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    found: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            found += [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
        elif family.type == "counter" and family.name in _VECTOR_COUNTERS:
            found += [Vector(family.name, labels, values) for labels, values in _by_position(_samples(family, "_total"))]
        elif family.type == "counter":
            found += [Counter(family.name, s.labels, int(s.value)) for s in _samples(family, "_total")]
        elif family.type == "histogram":
            found += _histograms(family)
        else:
            raise ValueError(f"metric {family.name!r} has type {family.type!r}; expected a counter, gauge or histogram")
    return found


def _samples(family: Any, suffix: str) -> list[Any]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict[str, str], *drop: str) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels.items() if k not in drop)


def _histograms(family: Any) -> list[Histogram]:
    buckets: dict[frozenset, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    counts = {_key(s.labels): int(s.value) for s in _samples(family, "_count")}
    sums = {_key(s.labels): float(s.value) for s in _samples(family, "_sum")}
    return [Histogram(family.name, dict(key), counts[key], sums[key], found) for key, found in buckets.items()]


def _by_position(samples: list[Any]) -> list[tuple[dict[str, str], list[int]]]:
    series: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        series.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    width = 1 + max((p for values in series.values() for p in values), default=-1)
    return [(dict(key), [values.get(p, 0) for p in range(width)]) for key, values in series.items()]
