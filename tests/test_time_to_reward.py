"""The statistics of bench/time_to_reward.py: Student's t quantiles against the published table,
time to reach a target on a hand-built curve, and the paired seed bootstrap of the time-to-target
ratio against the probabilities of its resamples counted by hand."""
import math

import pytest

from bench.time_to_reward import (markdown_tables, ratio_interval, student_t_cdf, student_t_quantile, summarize,
                                  t_interval, time_to_reach)

# Two-sided 95% critical values t(0.975, df), NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.2
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_published_table(df):
    assert student_t_quantile(0.975, df) == pytest.approx(T_TABLE[df], abs=5e-4)
    assert student_t_quantile(0.025, df) == pytest.approx(-T_TABLE[df], abs=5e-4)
    assert student_t_cdf(0.0, df) == pytest.approx(0.5)


def test_t_interval_of_three_seeds():
    # mean 2, sample sd 1: 2 +- t(0.975, 2) / sqrt(3)
    low, high = t_interval([1.0, 2.0, 3.0])
    assert (low, high) == pytest.approx((2 - T_TABLE[2] / math.sqrt(3), 2 + T_TABLE[2] / math.sqrt(3)), abs=1e-3)
    assert t_interval([1.0]) is None


def test_time_to_reach_interpolates_and_says_not_reached():
    curve = [dict(iteration=0, wall=0.0, eval=-4.0), dict(iteration=2, wall=10.0, eval=-3.0),
             dict(iteration=4, wall=20.0, eval=-3.5)]
    assert time_to_reach(curve, -3.5) == pytest.approx(5.0)  # halfway up the first segment
    assert time_to_reach(curve, -3.5, "iteration") == pytest.approx(1.0)
    assert time_to_reach(curve, -4.5) == 0.0
    assert time_to_reach(curve, -2.9) is None


def _run(final, k, seconds):
    """A run evaluated at 0 (reward 0) and at K (reward `final`), `seconds` per iteration."""
    return ([dict(iteration=0, wall=0.0, eval=0.0)]
            + [dict(iteration=i, wall=i * seconds, seconds=seconds, **(dict(eval=final) if i == k else {}))
               for i in range(1, k + 1)])


def test_bootstrap_ratio_counts_resamples_that_do_not_reach():
    # The target is 1 in every resample (both full runs end at 1). The mode, twice as slow per
    # iteration, ends at 2 (seed 0) or 0.5 (seed 1), linearly from 0: a resample of mean m reaches 1
    # after K / m iterations, ratio 2 / m. Resamples (0, 0): m = 2, ratio 1, probability 1/4;
    # (0, 1) and (1, 0): m = 1.25, ratio 1.6, probability 1/2; (1, 1): m = 0.5, not reached, 1/4.
    k = 4
    results = {"full": [_run(1.0, k, 1.0), _run(1.0, k, 1.0)], "slow": [_run(2.0, k, 2.0), _run(0.5, k, 2.0)]}
    summary = summarize(results, k)
    row = summary["rows"]["slow"]
    assert row["ratio"] == pytest.approx(1.6)  # both seeds: m = 1.25
    assert row["cost_vs_full"] == pytest.approx(2.0)
    assert row["reached_share"] == pytest.approx(0.75, abs=0.04)  # binomial sd over 2000 resamples ~0.01
    assert row["ratio_interval"][0] == pytest.approx(1.0)
    assert row["ratio_interval"][1] is None  # a quarter of the resamples never reach
    assert row["reach_iteration_per_seed"] == [pytest.approx(2.0), None]
    table, why = markdown_tables(summary)
    assert "| slow |" in table and "not reached]" in table and "| slow |" in why


def test_bootstrap_resamples_seeds_paired_across_modes():
    # Seed by seed the mode ends 0.5 above the full mode: drawing the same seeds for both (paired),
    # every resample reaches. Drawn independently, a resample of the mode's seed 0 (1.5) against
    # the full mode's seed 1 (3.0) would not.
    k = 2
    results = {"full": [_run(1.0, k, 1.0), _run(3.0, k, 1.0)], "mode": [_run(1.5, k, 1.0), _run(3.5, k, 1.0)]}
    row = summarize(results, k)["rows"]["mode"]
    assert row["reached_share"] == 1.0


def test_ratio_interval_percentiles():
    draws = [None] * 10 + [0.1 * i for i in range(1, 91)]  # 100 draws, 10% not reached
    low, high, share = ratio_interval(draws)
    assert (low, high, share) == (pytest.approx(0.3), None, 0.9)  # the 3rd smallest; the top 10% infinite
