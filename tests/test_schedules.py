"""Schedules and lr_find suggestions: pure math against closed forms and synthetic curves."""
import math

import pytest

from tpu_utility.loop.suggest import (divergence_end, fell, for_one_cycle, minimum, slide,
                                      smooth_losses, steep, suggestions, valley)
from tpu_utility.schedules import no_special_scalar, one_cycle, sched_cos, sched_exp


def cosine(a, b, t):  # written out independently of sched_cos
    return b + (a - b) * (1 + math.cos(math.pi * t)) / 2


def test_one_cycle_matches_closed_form():
    max_lr, pct, div, div_final = 3e-3, 0.25, 25.0, 1e5
    lr, mom = one_cycle(max_lr, pct, div, div_final, (0.95, 0.85, 0.95))
    assert lr(0.0) == pytest.approx(max_lr / div)
    assert lr(pct) == pytest.approx(max_lr)
    assert lr(1.0) == pytest.approx(max_lr / div_final)
    for pos in (0.05, 0.125, 0.2):
        assert lr(pos) == pytest.approx(cosine(max_lr / div, max_lr, pos / pct))
        assert mom(pos) == pytest.approx(cosine(0.95, 0.85, pos / pct))
    for pos in (0.3, 0.625, 0.99):
        t = (pos - pct) / (1 - pct)
        assert lr(pos) == pytest.approx(cosine(max_lr, max_lr / div_final, t))
        assert mom(pos) == pytest.approx(cosine(0.85, 0.95, t))
    assert mom(0.0) == pytest.approx(0.95) and mom(pct) == pytest.approx(0.85)
    assert one_cycle(1e-3, moms=None)[1] is None


def test_exp_and_cos_endpoints():
    assert sched_exp(1e-7, 10, 0.0) == pytest.approx(1e-7)
    assert sched_exp(1e-7, 10, 0.5) == pytest.approx(math.sqrt(1e-7 * 10))
    assert sched_cos(2.0, 4.0, 0.5) == pytest.approx(3.0)


def test_no_special_scalar_moves_only_zero_and_plus_minus_one():
    for special in (0.0, 1.0, -1.0):
        moved = no_special_scalar(special)
        assert moved != special and abs(moved - special) < 1e-12
    for ordinary in (0.5, 1e-3, 0.95, 2.0):
        assert no_special_scalar(ordinary) == ordinary


def test_smoothing_is_a_debiased_ema():
    assert smooth_losses([2.0] * 5) == pytest.approx([2.0] * 5)  # debiasing: constant stays
    a, b, beta = 3.0, 1.0, 0.98
    expected = (beta * (1 - beta) * a + (1 - beta) * b) / (1 - beta ** 2)
    assert smooth_losses([a, b], beta)[1] == pytest.approx(expected)


def test_divergence_end_keeps_the_first_diverging_point():
    assert divergence_end([3.0, 2.0, 1.0, 3.9, 4.1, 9.0]) == 5
    assert divergence_end([3.0, float("nan"), 1.0]) == 2
    assert divergence_end([3.0, 2.0, 1.0]) == 3


LRS = [10 ** (-6 + 6 * i / 59) for i in range(60)]


def test_valley_is_in_the_middle_of_the_longest_descent():
    losses = [5.0] * 10 + [5.0 - 4.0 * k / 29 for k in range(30)] + [1.0 + 0.5 * k for k in range(20)]
    idx = LRS.index(valley(LRS, losses))
    assert 10 + 0.4 * 30 <= idx <= 10 + 0.6 * 30


def test_steep_is_the_steepest_drop():
    losses = [3.0 - 0.01 * i for i in range(60)]
    losses[21:] = [v - 1.0 for v in losses[21:]]  # a cliff between index 20 and 21
    assert steep(LRS, losses) == LRS[20]


def test_minimum_is_a_tenth_of_the_argmin_and_one_cycle_a_quarter():
    losses = [abs(i - 33) * 0.1 + 1 for i in range(60)]
    assert minimum(LRS, losses) == pytest.approx(LRS[33] / 10)
    assert for_one_cycle(LRS, losses) == pytest.approx(LRS[33] / 4)


def test_slide_stops_where_the_slope_stops_changing():
    rise = 45  # flat (slope 0) up to here, then a steepening rise
    losses = [1.0] * rise + [1.0 + 0.05 * k * k for k in range(1, 16)]
    idx = LRS.index(slide(LRS, losses))
    assert rise - 17 <= idx < rise  # 15 points (the rule's window) before the rise


def test_suggestions_drop_edges_and_report_too_short_curves():
    out = suggestions(LRS, [1.0 - i / 100 for i in range(60)], num_it=60)
    assert set(out) == {"one_cycle", "valley", "steep", "minimum", "slide"}
    # minimum on a falling curve: the last kept point (5 dropped from the end), / 10
    assert out["minimum"] == pytest.approx(LRS[-6] / 10)
    assert out["one_cycle"] == pytest.approx(LRS[-6] / 4)
    # the 10% dropped at the start: a lower point there is not the minimum
    early = [0.0] * 5 + [1.0 - i / 100 for i in range(55)]
    assert suggestions(LRS, early, num_it=60)["one_cycle"] == pytest.approx(LRS[-6] / 4)
    short = suggestions(LRS[:12], [1.0] * 12, num_it=60)
    assert short["slide"] is None and short["valley"] is None


def test_fell_is_the_share_the_curve_fell_past_its_first_tenth():
    curve = [9.0] * 10 + [2.0 - i / 100 for i in range(50)] + [5.0] * 40  # 100 points
    assert fell(curve, 100) == pytest.approx((2.0 - 1.51) / 2.0)  # the first 10 points ignored
    assert fell([1.0] * 30 + [1.2, float("nan")], 30) == 0.0  # flat, then rising: nothing fell
    assert fell([], 100) == 0.0
