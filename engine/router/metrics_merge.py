"""The replicas' /metrics as one exposition: each series summed over the replicas that answered
(a counter, a histogram's buckets, sum and count, a queue-length gauge), except ratio gauges
(`*_perc`, acceptance rates and lengths), which are averaged, and `*_info` gauges, which are
the same on every replica and are kept once. `*_created` series (a replica's start time) have
no sum and are left out.

This is the fleet at a glance for a caller that knows only the router. Prometheus should still
scrape each replica (a restarted replica resets its counters, which a sum cannot show as a
reset); the dashboards sum by model_name either way."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Series:
    total: float = 0.0
    count: int = 0
    peak: float = float("-inf")


@dataclass(slots=True)
class _Family:
    name: str
    documentation: str
    kind: str
    series: dict[tuple[str, tuple[tuple[str, str], ...]], _Series] = field(default_factory=dict)


def _averaged(family: _Family) -> bool:
    name = family.name
    return family.kind == "gauge" and (
        name.endswith("_perc") or name.endswith("_rate") or "mean_" in name
    )


def merge_expositions(texts: list[str]) -> list[Metric]:
    """The metric families of several Prometheus text expositions, merged as above."""
    families: dict[str, _Family] = {}
    for text in texts:
        for parsed in _parsed(text):
            family = families.setdefault(
                parsed.name, _Family(parsed.name, parsed.documentation, parsed.type)
            )
            for sample in parsed.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                s = family.series.setdefault(key, _Series())
                s.total += sample.value
                s.count += 1
                s.peak = max(s.peak, sample.value)
    return [_metric(f) for f in families.values() if f.series]


def _parsed(text: str) -> list:
    """One replica's families; none when its text is not an exposition (a proxy's error page):
    one bad scrape must not take the others' series with it."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        log.warning("a replica's /metrics is not Prometheus text; left out of the sum")
        return []


def _metric(family: _Family) -> Metric:
    metric = Metric(family.name, family.documentation, family.kind)
    info = family.kind == "gauge" and family.name.endswith("_info")
    for (name, labels), s in family.series.items():
        value = s.peak if info else s.total / s.count if _averaged(family) else s.total
        metric.add_sample(name, dict(labels), value)
    return metric
