"""The evaluator's intervals: a hand-worked example, agreement with scipy's bootstrap over windows, the 95%
interval's coverage on simulated evaluations with a known change, and pairing's gain over unpaired errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from genomelm.run.uncertainty import Ratio, combine, ratio_estimate, slope_weights


def test_paired_relative_change_hand_computed() -> None:
    # 3 windows of 1, 2 and 4 tokens: loss sums 2, 3, 8 before and 1, 3, 6 after
    before, after, tokens = np.array([2.0, 3.0, 8.0]), np.array([1.0, 3.0, 6.0]), np.array([1, 2, 4])
    change = ratio_estimate(Ratio.of(after, before, tokens), offset=-1.0)
    assert change.value == pytest.approx(10 / 13 - 1)
    # residuals after - (10/13) before = -7/13, 9/13, -2/13, each over the before total 13
    se = math.sqrt(3 / 2 * ((-7 / 13) ** 2 + (9 / 13) ** 2 + (-2 / 13) ** 2) / 13**2)
    assert change.se == pytest.approx(se)
    half = 4.302652729749464 * se  # t(2 d.f.) at 0.975
    assert (change.low, change.high) == pytest.approx((change.value - half, change.value + half))
    assert change.windows == 3 and change.note == "" and not change.excludes_zero
    # the change in nats: (sum after - sum before) / tokens = -3/7, residuals (a - b) + 3/7 n over 7
    nats = ratio_estimate(Ratio.of(after - before, tokens, tokens))
    residuals = (after - before) + 3 / 7 * tokens
    assert nats.value == pytest.approx(-3 / 7)
    assert nats.se == pytest.approx(math.sqrt(3 / 2 * float((residuals**2).sum()) / 7**2))


def test_too_few_windows_or_tokens_are_not_available() -> None:
    one = ratio_estimate(Ratio.of(np.array([2.0, 0.0]), np.array([4.0, 0.0]), np.array([4, 0])))
    assert one.value == 0.5 and math.isnan(one.se) and math.isnan(one.low)
    assert one.windows == 1 and one.note == "1 window with tokens" and not one.excludes_zero
    none = ratio_estimate(Ratio.of(np.zeros(3), np.zeros(3), np.zeros(3)))
    assert math.isnan(none.value) and none.note == "no tokens"


def simulated_windows(rng: np.random.Generator, n: int, change: float, shared: float = 0.9) -> dict:
    """Per-window totals of n windows of unequal valid counts, whose difficulty the before and after models
    share (`shared`: the correlation of their per-token noise), after = before x (1 + change) in
    expectation, each window's own change scattered by 3% around it."""
    tokens = rng.integers(500, 2000, n)
    difficulty = 1.3 * rng.lognormal(0.0, 0.25, n)
    own_change = (1 + change) * (1 + rng.normal(0.0, 0.03, n))
    noise_before = rng.normal(size=n)
    noise_after = shared * noise_before + math.sqrt(1 - shared**2) * rng.normal(size=n)
    before = tokens * difficulty + 0.8 * np.sqrt(tokens) * noise_before
    after = tokens * difficulty * own_change + 0.8 * np.sqrt(tokens) * noise_after
    return {"before": before, "after": after, "tokens": tokens}


@pytest.mark.parametrize("n", [8, 40])
def test_delta_method_agrees_with_scipy_bootstrap_over_windows(n: int) -> None:
    data = simulated_windows(np.random.default_rng(n), n, change=-0.05)
    before, after, tokens = data["before"], data["after"], data["tokens"]
    change = ratio_estimate(Ratio.of(after, before, tokens), offset=-1.0)

    def relative(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        return a.sum(axis) / b.sum(axis) - 1

    boot = stats.bootstrap(
        (after, before), relative, paired=True, n_resamples=4000, rng=np.random.default_rng(0)
    )
    # the bootstrap's s.e. is the plug-in one (divisor n, not n - 1); 4000 resamples: about 1% Monte-Carlo
    # error, and with 8 windows the bootstrap distribution is itself coarse
    plug_in = change.se * math.sqrt((n - 1) / n)
    assert boot.standard_error == pytest.approx(plug_in, rel=0.08 if n < 10 else 0.05)

    # a contrast of two ratios (late minus early) resampled the same way, by window
    early = simulated_windows(np.random.default_rng(100 + n), n, change=0.0)
    late_minus_early = combine(
        [(1.0, Ratio.of(after, before, tokens)), (-1.0, Ratio.of(early["after"], early["before"], tokens))]
    )

    def contrast(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray, axis: int = -1) -> np.ndarray:
        return relative(a, b, axis) - relative(c, d, axis)

    boot = stats.bootstrap(
        (after, before, early["after"], early["before"]),
        contrast,
        paired=True,
        n_resamples=4000,
        rng=np.random.default_rng(1),
    )
    plug_in = late_minus_early.se * math.sqrt((n - 1) / n)
    assert boot.standard_error == pytest.approx(plug_in, rel=0.08 if n < 10 else 0.05)


@pytest.mark.parametrize("n", [8, 30])
def test_interval_covers_a_known_change_about_95_percent_of_the_time(n: int) -> None:
    rng, true_change, trials = np.random.default_rng(7), -0.04, 400
    covered = 0
    for _ in range(trials):
        data = simulated_windows(rng, n, change=true_change)
        estimate = ratio_estimate(Ratio.of(data["after"], data["before"], data["tokens"]), offset=-1.0)
        covered += estimate.low <= true_change <= estimate.high
    assert 0.90 <= covered / trials <= 0.99, covered / trials


def test_paired_interval_is_narrower_than_unpaired_when_windows_are_correlated() -> None:
    data = simulated_windows(np.random.default_rng(3), 20, change=-0.05)
    before, after, tokens = data["before"], data["after"], data["tokens"]
    paired = ratio_estimate(Ratio.of(after, before, tokens), offset=-1.0)
    # unpaired: each mean's own error, combined as if the two models had scored different windows
    mean_before = ratio_estimate(Ratio.of(before, tokens, tokens))
    mean_after = ratio_estimate(Ratio.of(after, tokens, tokens))
    ratio = mean_after.value / mean_before.value
    unpaired = ratio * math.hypot(mean_after.se / mean_after.value, mean_before.se / mean_before.value)
    assert paired.se < unpaired / 3  # the windows' difficulty (lognormal, 25%) cancels in the pair
    assert paired.excludes_zero


def test_slope_weights_recover_a_line() -> None:
    x = np.log2([16.0, 48.0, 80.0, 112.0])
    weights = slope_weights(x)
    assert float(weights @ (0.5 - 0.25 * x)) == pytest.approx(-0.25)
    assert float(weights.sum()) == pytest.approx(0.0, abs=1e-12)
