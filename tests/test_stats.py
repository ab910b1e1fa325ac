"""Paired proportions: the interval the gate's non-inferiority test and the demo's lift both rest on."""

from __future__ import annotations

import pytest

from flywheel.stats import paired_proportion_interval


def test_no_disagreement_is_a_zero_difference_with_a_narrow_two_sided_interval():
    diff, low, high = paired_proportion_interval(0, 0, 100)
    assert diff == 0 and -0.05 < low < 0 < high < 0.05


def test_the_interval_is_symmetric_under_swapping_the_two_versions_and_stays_in_range():
    d1, l1, h1 = paired_proportion_interval(12, 3, 40)
    d2, l2, h2 = paired_proportion_interval(3, 12, 40)
    assert d1 == pytest.approx(-d2) and l1 == pytest.approx(-h2, abs=1e-9) and h1 == pytest.approx(-l2, abs=1e-9)
    assert 0 < l1 < d1 < h1 <= 1
    _, low, high = paired_proportion_interval(40, 0, 40)
    assert high <= 1 and low > 0.8


def test_more_confidence_widens_it_and_bad_counts_are_refused():
    _, l90, h90 = paired_proportion_interval(8, 2, 50, confidence=0.90)
    _, l99, h99 = paired_proportion_interval(8, 2, 50, confidence=0.99)
    assert l99 < l90 and h99 > h90
    with pytest.raises(ValueError, match="wins \\+ losses <= n"):
        paired_proportion_interval(30, 30, 50)
