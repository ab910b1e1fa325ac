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


def test_the_design_effect_is_the_cluster_size_when_clusters_agree_within_and_1_when_each_value_stands_alone():
    import random  # noqa: PLC0415

    from flywheel.stats import design_effect, welch_interval  # noqa: PLC0415

    rng = random.Random(0)
    per_cluster = [rng.random() for _ in range(40)]
    values = [v for v in per_cluster for _ in range(5)]  # 40 clusters of 5 equal values
    clusters = [c for c in range(40) for _ in range(5)]
    assert design_effect(values, clusters) == pytest.approx(5 * 40 * 199 / (39 * 200))  # k(n-1)/((k-1)n) x 5
    assert design_effect(values, list(range(200))) == 1.0  # each value its own cluster
    assert design_effect(values, [0] * 200) == 200.0  # one cluster: one draw
    assert design_effect([1.0] * 10, [0, 1] * 5) == 1.0  # constant: nothing to widen
    independent = [rng.random() for _ in range(200)]  # clusters that do not agree within: about 1
    assert 1.0 <= design_effect(independent, clusters) < 1.6
    with pytest.raises(ValueError, match="one label per value"):
        design_effect(values, clusters[:-1])
    a, b = [rng.gauss(0, 1) for _ in range(200)], [rng.gauss(0.3, 1) for _ in range(200)]
    plain, clustered = welch_interval(a, b), welch_interval(a, b, design=(4.0, 4.0))
    assert clustered.estimate == plain.estimate
    assert 1.95 < (clustered.high - clustered.low) / (plain.high - plain.low) < 2.1  # sqrt(4), a t a little wider
