"""The one percentile rule of the benchmarks and the model: NumPy's linear interpolation."""

from __future__ import annotations

import statistics

import pytest

from jupyter_vgpu.testing.percentiles import percentile, percentile_or_none


def test_the_95th_of_32_values_lies_between_the_third_and_the_second_largest():
    values = [float(v) for v in range(32)]  # 0 .. 31
    # rank 0.95 * 31 = 29.45: 0.45 of the way from 29 (third largest) to 30
    assert percentile(values, 95) == pytest.approx(29.45)
    assert percentile(values, 99) == pytest.approx(30.69)
    assert percentile(values, 50) == pytest.approx(15.5)


def test_it_is_the_standard_librarys_inclusive_method_and_its_median():
    values = [1.09, 1.1, 1.35, 1.39, 1.75, 1.9, 1.05, 2.4, 1.2]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (10, 50, 90, 95, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile(values, 50) == pytest.approx(statistics.median(values))


def test_order_does_not_matter_and_ends_are_the_extremes():
    values = [3.0, 1.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 3.0
    assert percentile(reversed(values), 25) == pytest.approx(1.5)


@pytest.mark.parametrize(("values", "q", "says"), [([], 50, "no values"), ([1.0], 101, "within 0-100")])
def test_bad_arguments_are_refused(values, q, says):
    with pytest.raises(ValueError, match=says):
        percentile(values, q)


def test_none_for_no_values_where_a_run_measured_nothing():
    assert percentile_or_none([], 95) is None
    assert percentile_or_none([2.0], 95) == 2.0
