"""The held-out evaluation's bootstrap intervals (mm_grpo/training/intervals.py) against oracles
that do not share its code: coverage of a known truth by simulation, the exact distribution of
a bootstrap mean where one exists (a binomial), the two-stage bootstrap's variance in closed
form; and the evaluation's stats and before -> after line that carry them."""
import math
import re
from pathlib import Path

import pytest
import torch

from mm_grpo.training import intervals
from mm_grpo.training.evaluation import EvalResult, compare, eval_settings, with_intervals
from tests.fixtures import parallel_1proc  # noqa: F401

PROMPTS, NOISES = 11, 64  # the demo's reporting half


def simulated(reps, seed=0, prompts=PROMPTS, noises=NOISES):
    """`reps` evaluations before and after training of binary scores with a known truth: prompt
    success rates p ~ 0.8 Beta(2, 4) (mean 0.8 / 3; Beta(2, 4) is the 2nd smallest of 5 uniforms),
    raised by d ~ U(0, 0.2) (mean 0.1); the same noise u decides a cell before and after (success
    when u < rate), as the same initial noise does."""
    g = torch.Generator().manual_seed(seed)
    p = 0.8 * torch.rand(reps, prompts, 5, generator=g, dtype=torch.float64).sort(-1).values[..., 1:2]
    d = 0.2 * torch.rand(reps, prompts, 1, generator=g, dtype=torch.float64)
    u = torch.rand(reps, prompts, noises, generator=g, dtype=torch.float64)
    return (u < p).double(), (u < p + d).double()


def binomial_quantile(n, p, q):
    """Smallest k / n with P(Binomial(n, p) <= k) >= q (plain Python)."""
    cdf = 0.0
    for k in range(n + 1):
        cdf += math.comb(n, k) * p ** k * (1 - p) ** (n - k)
        if cdf >= q - 1e-12:
            return k / n
    return 1.0


# --- coverage -----------------------------------------------------------------------------
def test_the_intervals_cover_the_true_mean_and_gain_about_95_percent_of_the_time():
    """1,000 simulated evaluations of 11 prompts x 64 noises (200 would estimate the coverage to
    +-3 points, too coarse for the 90-99% bracket). Measured: 0.91-0.96 over 8 seeds (0.90-0.93 with
    skewer rates, 0.8 U^2): with 11 prompts the percentile bootstrap runs a little narrow (its
    variance over prompts is (P - 1) / P of the truth's, and it has no t-like widening)."""
    before, after = simulated(1000)
    low, high = intervals.percentile_interval(
        intervals.bootstrap_means(torch.stack([before, after, after - before]), resamples=2000))
    truth = torch.tensor([0.8 / 3, 0.8 / 3 + 0.1, 0.1], dtype=torch.float64)[:, None]
    coverage = ((low <= truth) & (truth <= high)).double().mean(1)
    assert ((0.90 <= coverage) & (coverage <= 0.99)).all(), coverage


def test_paired_gain_is_narrower_than_the_unpaired_difference():
    before, after = simulated(1, seed=1)
    before, after = before[0], after[0]
    paired = intervals.paired_gain_interval(before, after)
    unpaired = intervals.percentile_interval(
        intervals.bootstrap_means(after, seed=1) - intervals.bootstrap_means(before, seed=2))
    gain = float(after.mean() - before.mean())
    assert paired[0] < gain < paired[1]
    assert unpaired[0] < gain < unpaired[1]
    assert paired[1] - paired[0] < 0.8 * float(unpaired[1] - unpaired[0])


# --- the bootstrap's distribution against closed forms --------------------------------------
def test_bootstrap_variance_is_the_two_stage_formula():
    """Var* of the mean = (between-prompt variance of prompt means + mean within-prompt variance / K) / P
    (plug-in variances): prompts drawn with replacement, then noises within each draw. A one-stage
    bootstrap over prompts would give the first term only, one over all cells (between + within) / (P K)."""
    g = torch.Generator().manual_seed(2)
    table = torch.rand(PROMPTS, 1, generator=g, dtype=torch.float64) + torch.randn(PROMPTS, 8, generator=g,
                                                                                   dtype=torch.float64)
    p, k = table.shape
    between = table.mean(1).var(unbiased=False)
    within = table.var(1, unbiased=False).mean()
    means = intervals.bootstrap_means(table)
    assert float(means.mean()) == pytest.approx(float(table.mean()), abs=3 * float(means.std()) / 100)
    assert float(means.var()) == pytest.approx(float((between + within / k) / p), rel=0.05)


def test_all_equal_scores_give_a_zero_width_interval():
    low, high = intervals.interval(torch.full((PROMPTS, NOISES), 0.37, dtype=torch.float64))
    assert low == pytest.approx(0.37, abs=1e-12) and high - low <= 1e-12


@pytest.mark.parametrize("shape", [(1, NOISES), (PROMPTS, 1)], ids=["one_prompt", "one_noise"])
def test_a_single_prompt_or_noise_leaves_the_other_level_binomial(shape):
    """One prompt: the interval comes from its noises alone; one noise per prompt: from the prompts
    alone. With 0/1 scores the bootstrap mean of n cells is then Binomial(n, observed rate) / n."""
    g = torch.Generator().manual_seed(3)
    table = (torch.rand(*shape, generator=g) < 0.3).double()
    n, rate = table.numel(), float(table.mean())
    low, high = intervals.interval(table)
    assert low == pytest.approx(binomial_quantile(n, rate, 0.025), abs=1 / n)
    assert high == pytest.approx(binomial_quantile(n, rate, 0.975), abs=1 / n)
    assert high - low > 0


def test_the_same_scores_give_the_same_interval_and_another_seed_another():
    g = torch.Generator().manual_seed(4)
    before, after = (torch.rand(PROMPTS, NOISES, generator=g, dtype=torch.float64) for _ in range(2))  # no ties
    interval = intervals.paired_gain_interval(before, after)
    assert interval == intervals.paired_gain_interval(before, after)
    assert interval != intervals.paired_gain_interval(before, after, seed=1)


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda: intervals.interval(torch.tensor([[0.1, float("nan")], [0.2, 0.3]])), "1 of 4 values are not finite"),
    (lambda: intervals.interval(torch.ones(5)), r"need a table \[prompts, noises\], got shape \(5,\)"),
    (lambda: intervals.interval(torch.ones(1, 1)), "1 prompt\\(s\\) x 1 noise\\(s\\) cannot be resampled"),
    (lambda: intervals.paired_gain_interval(torch.ones(3, 4), torch.ones(4, 3)), "same prompts x noises"),
    (lambda: intervals.interval(torch.ones(3, 4), level=95), r"level must be in \(0, 1\)"),
    (lambda: eval_settings({"eval_samples_per_prompt": "sixty"}), "eval_samples_per_prompt must be a whole number"),
    (lambda: eval_settings({"eval_samples_per_prompt": 0}), "must be a whole number >= 1, got 0"),
    (lambda: eval_settings({"eval_seed": "-1"}), "eval_seed must be a whole number >= 0, got '-1'"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_eval_settings_read_environment_strings_as_numbers():
    assert eval_settings({}) == (1, 0)
    from mm_grpo.settings import Expanded  # what "$EVAL_SAMPLES" in data.json becomes once expanded
    assert eval_settings({"eval_samples_per_prompt": Expanded("64", "$EVAL_SAMPLES"),
                          "eval_seed": Expanded("1", "$EVAL_SEED")}) == (64, 1)


# --- what the evaluation logs and reports ------------------------------------------------
def result(table, noises):
    flat = table.reshape(-1).float()
    stats = {"eval/reward_mean": flat.mean().item(), "eval/accuracy": flat.mean().item()}
    res = EvalResult(stats, ["p"] * flat.numel(), torch.zeros(flat.numel(), 3, 1, 1), {"accuracy": flat}, flat, noises)
    res.stats = with_intervals(stats, res.tables())
    return res


def test_stats_carry_each_means_interval_after_it():
    before, _ = simulated(1, seed=5)
    stats = result(before[0], NOISES).stats
    assert list(stats) == ["eval/reward_mean", "eval/reward_mean_ci_low", "eval/reward_mean_ci_high",
                           "eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high"]
    assert stats["eval/accuracy_ci_low"] < stats["eval/accuracy"] < stats["eval/accuracy_ci_high"]


def test_before_after_line_states_the_paired_gain_and_its_interval():
    before, after = simulated(1, seed=6)
    old, new = result(before[0], NOISES), result(after[0], NOISES)
    line = compare(old.stats, new.stats, old, new)
    gain = new.stats["eval/accuracy"] - old.stats["eval/accuracy"]
    low, high = intervals.paired_gain_interval(before[0], after[0])
    s = old.stats
    assert (f"accuracy {s['eval/accuracy']:.4f} [{s['eval/accuracy_ci_low']:.3f}, {s['eval/accuracy_ci_high']:.3f}] "
            f"-> {new.stats['eval/accuracy']:.4f} [") in line
    assert f", gain {gain:+.4f} [{low:+.3f}, {high:+.3f}]" in line
    assert line.endswith(f"(95% bootstrap over {PROMPTS} prompts x {NOISES} noises)")
    resumed = compare(old.stats, new.stats, None, new)  # iteration 0's samples were in an earlier run
    assert f"gain {gain:+.4f};" in resumed and "the gain without interval" in resumed


# --- the trainer -------------------------------------------------------------------------------
def test_the_trainer_logs_intervals_and_reports_the_gain(parallel_1proc, tiny_pipeline_dir, tmp_path, capsys,
                                                         monkeypatch):
    """mm-grpo's trainer, 2 held-out prompts x 2 noises ("$EVAL_SAMPLES" from the environment, as
    grpo_flux.sh passes it): TensorBoard gets eval/<name>_ci_low / _ci_high at each evaluation, the
    last line the paired gain's interval; resumed after iteration 0, the gain without one, saying why."""
    import glob
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mm_grpo.training.train_grpo import main
    from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, write_configs
    model_json, data_json = write_configs(tmp_path / "cfg", tiny_pipeline_dir, reward=SMOOTH_REWARD)
    data = json.loads(Path(data_json).read_text())
    data["dataset_param"].update(eval_samples_per_prompt="$EVAL_SAMPLES", eval_seed=1)
    Path(data_json).write_text(json.dumps(data))
    monkeypatch.setenv("EVAL_SAMPLES", "2")
    evaluate = ["--eval-interval", "2", "--eval-prompts", "2", "--num-inference-steps", "3",
                "--save", str(tmp_path / "ckpt")]
    main(grpo_argv(model_json, data_json, iters=2, extra=[*evaluate, "--tensorboard-dir", str(tmp_path / "tb")]))
    first = capsys.readouterr().out
    main(grpo_argv(model_json, data_json, iters=3, extra=[*evaluate, "--load", str(tmp_path / "ckpt")]))
    resumed = capsys.readouterr().out
    logged = {}
    for path in glob.glob(str(tmp_path / "tb" / "events.*")):
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            logged[tag] = {e.step: e.value for e in events.Scalars(tag)}
    for name in ("reward_mean", "test_smooth"):
        assert set(logged[f"eval/{name}_ci_low"]) == set(logged[f"eval/{name}_ci_high"]) == {0, 2}
        assert all(logged[f"eval/{name}_ci_low"][i] <= logged[f"eval/{name}"][i] <= logged[f"eval/{name}_ci_high"][i]
                   for i in (0, 2))
    line = [x for x in first.splitlines() if "held-out evaluation (4 samples" in x][-1]
    assert line.startswith("[mm-grpo] held-out evaluation (4 samples, ODE, fixed noise), iteration 0 -> 2: "
                           "reward_mean ")
    assert line.count(", gain ") == line.count("] -> ") == 2  # the total and the one reward
    assert re.search(r"test_smooth \S+ \[\S+, \S+\] -> \S+ \[\S+, \S+\], gain [+-]\S+ \[[+-]\S+, [+-]\S+\] "
                     r"\(95% bootstrap over 2 prompts x 2 noises\)$", line), line
    line = [x for x in resumed.splitlines() if "held-out evaluation (4 samples" in x][-1]
    assert "iteration 0 -> 3: " in line and "the gain without interval: the first evaluation's samples" in line
