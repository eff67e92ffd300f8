"""The planner benchmark's admission (`bench.planner.with_admission`, and the candidate changes
`bench/admission_variants.py` measures): it sizes the limit for the request shape as the
product keeps it (`autoscale.signals.kept_shape`), so the benchmark measures the product."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.fleetsim.engine import Metrics
from bench.planner import PRODUCT, SLO, AdmissionVariant, _declared, scenarios, with_admission
from cas_operator.desired.admission import in_flight_at, sustainable_rate

SC = next(s for s in scenarios(True) if s.name == "output-shift")
P, D = SC.profiles()


class _Hold:
    """A policy that keeps the pools as they are (the variants change only admission)."""

    prefill, decode = P, D

    def __call__(self, now: float, m: Metrics, view: Any) -> tuple[int, int]:
        return 20, 8


def _metrics(inp: float, out: float) -> Metrics:
    return Metrics(5.0, 0.9, 1.0, 15.0, inp, 1.8 * inp, out, 0.05, 20.0, 0.0, 0.5, 0)


def _rate(inp: float, out: float) -> float:
    wl = replace(_declared(SC), avg_input_tokens=inp, avg_output_tokens=out)
    return sustainable_rate(wl, SLO, P, D, 20, 8)


def _limits_after(variant: AdmissionVariant, seen: list[tuple[float, float]]) -> list[Any]:
    observing, admission = with_admission(_Hold(), _declared(SC), True, variant)
    limits = []
    for inp, out in seen:
        observing(0.0, _metrics(inp, out), None)
        limits.append(admission(20, 8))
    return limits


def test_the_bench_holds_the_shape_within_the_products_band() -> None:
    """Guards the bench measuring the product: the first measurement replaces the declared
    shape (as in the operator, which keeps nothing before it measures); a measured length at
    most 3% longer or 10% shorter than the kept one leaves the limit alone; one beyond that
    moves the limit to it."""
    first, inside, outside = _limits_after(
        PRODUCT, [(70_600.0, 1_578.0), (66_000.0, 1_620.0), (70_600.0, 1_700.0)]
    )
    assert first.rate == _rate(70_600.0, 1_578.0)
    assert inside.rate == first.rate
    assert outside.rate == _rate(70_600.0, 1_700.0)


def test_a_prefill_allowance_variant_changes_only_smgs_bound() -> None:
    """Guards the variant the note measured: smg's bound holds decode's KV-full requests plus
    the rate times the allowance instead of times the TTFT target; the rate is the product's."""
    (product,) = _limits_after(PRODUCT, [(75_000.0, 1_600.0)])
    (short,) = _limits_after(AdmissionVariant(prefill_allowance_s=0.75), [(75_000.0, 1_600.0)])
    wl = replace(_declared(SC), avg_input_tokens=75_000.0, avg_output_tokens=1_600.0)
    assert short.rate == product.rate
    assert product.in_flight == in_flight_at(product.rate, wl, SLO, D, 8)
    assert short.in_flight == product.in_flight - product.rate * (SLO.ttft_s - 0.75)
