"""Metrics sources for the anomaly loop: Prometheus HTTP API (default) or direct pod scrapes.

Both implement `MetricsSource.observe(targets, window_seconds) -> Observation`: per-pod
`PodSignals` (windowed counter increases and latest gauges) plus a source-wide error when the
source itself is down. Nothing here decides anything; `anomaly.detect` and `autoscale` do.
"""

from cas_operator.observe.prometheus import PrometheusSource
from cas_operator.observe.scrape import ScrapeSource
from cas_operator.observe.types import MetricsSource, Observation, PodTarget

__all__ = ["MetricsSource", "Observation", "PodTarget", "PrometheusSource", "ScrapeSource"]
