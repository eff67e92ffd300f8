"""`autoscale.signals.kept_shape`: the request shape the routers' admission limits are sized
for, held in an asymmetric band."""

from __future__ import annotations

from cas_operator.autoscale.signals import SHAPE_BAND, SHAPE_GROW_BAND, kept_shape

KEPT = (60_000.0, 1_500.0)


def test_a_longer_request_moves_the_kept_shape_sooner_than_a_shorter_one() -> None:
    """Regression (issue 18, planner benchmark's output shift, 3 of 12 seeds collapsing): with
    one 10% band both ways, prompts measured while the routers refused (short: first turns
    over-represented) were kept while the returning sessions' prompts grew back 4-9%, and the
    limit sized for the short ones admitted what 14 prefill instances could not serve (TTFT p90
    10-15 s for 8 minutes). A kept length too short sizes a limit too high; too long refuses a
    little servable load. So growth beyond 3% is taken, shrinkage only beyond 10%."""
    assert SHAPE_GROW_BAND < SHAPE_BAND
    grown = kept_shape(KEPT, (64_000.0, 1_500.0))  # prompts 6.7% longer
    assert grown == (64_000.0, 1_500.0)
    shrunk = kept_shape(KEPT, (56_000.0, 1_400.0))  # both 6.7% shorter: held
    assert shrunk == KEPT
    assert kept_shape(KEPT, (61_500.0, 1_530.0)) == KEPT  # 2.5% / 2% longer: held
    assert kept_shape(KEPT, (53_000.0, 1_650.0)) == (53_000.0, 1_650.0)  # -11.7%, +10%


def test_without_a_measurement_the_kept_shape_stays_and_the_first_one_is_taken() -> None:
    assert kept_shape(KEPT, None) == KEPT
    assert kept_shape(None, (70_000.0, 400.0)) == (70_000.0, 400.0)
    assert kept_shape(None, None) is None
