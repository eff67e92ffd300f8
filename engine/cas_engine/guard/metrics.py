"""Prometheus metrics of the quality gate, registered on a caller-supplied registry.

Ownership: one :class:`GuardMetrics` per monitor; the engine process passes the registry its
``/metrics`` endpoint serves (prometheus-client's default ``REGISTRY`` in SGLang with
``--enable-metrics``), tests pass a fresh ``CollectorRegistry``. The operator reads
``cas_guard_trips_total`` / ``cas_guard_requests_checked_total`` as the pod anomaly rate and the
two histograms as the fleet baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from cas_engine.guard.config import GuardConfig
from cas_engine.guard.outcome import REASONS

ACCEPT_LENGTH_BUCKETS = (
    1.0,
    1.2,
    1.4,
    1.6,
    1.8,
    2.0,
    2.25,
    2.5,
    2.75,
    3.0,
    3.5,
    4.0,
    5.0,
    6.0,
    8.0,
)
ACCEPT_RATE_BUCKETS = (
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.85,
    0.9,
    0.94,
    0.96,
    0.98,
    0.99,
    1.0,
)


@dataclass(frozen=True, slots=True)
class GuardMetrics:
    """The metric objects; build with :meth:`create`."""

    trips: Counter
    checked: Counter
    invalid_steps: Counter
    kept_without_repetition: Counter
    accept_length: Histogram
    accept_rate: Histogram
    config: Info
    config_value: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, config: GuardConfig) -> GuardMetrics:
        """Register every metric on ``registry`` and publish ``config`` as an info metric."""
        trips = Counter(
            "cas_guard_trips_total",
            "Requests aborted by the quality gate",
            ["reason"],
            registry=registry,
        )
        for reason in REASONS:  # export zeros so rate() works before the first trip
            trips.labels(reason=reason)
        metrics = cls(
            trips=trips,
            checked=Counter(
                "cas_guard_requests_checked_total",
                "Requests that generated enough tokens to be judged",
                registry=registry,
            ),
            invalid_steps=Counter(
                "cas_guard_invalid_steps_total",
                "Verify steps ignored: NaN, negative or accepted > proposed",
                registry=registry,
            ),
            kept_without_repetition=Counter(
                "cas_guard_high_accept_kept_total",
                "Requests whose accept rate passed max_accept_rate while their output did not "
                "repeat (a verbatim copy, boilerplate): not aborted",
                registry=registry,
            ),
            accept_length=Histogram(
                "cas_guard_accept_length",
                "Per-request speculative accept length at completion",
                buckets=ACCEPT_LENGTH_BUCKETS,
                registry=registry,
            ),
            accept_rate=Histogram(
                "cas_guard_accept_rate",
                "Per-request speculative accept rate at completion",
                buckets=ACCEPT_RATE_BUCKETS,
                registry=registry,
            ),
            config=Info("cas_guard_config", "Quality gate configuration", registry=registry),
            # Info is dropped in prometheus-client's multiprocess mode (SGLang's); this is not
            config_value=Gauge(
                "cas_guard_config_value",
                "Quality gate configuration, one numeric series per parameter",
                ["parameter"],
                multiprocess_mode="max",
                registry=registry,
            ),
        )
        metrics.config.info(config.as_labels())
        for name, value in asdict(config).items():
            metrics.config_value.labels(parameter=name).set(float(value))
        return metrics
