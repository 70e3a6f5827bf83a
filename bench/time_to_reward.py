"""Time to reward: every objective and rollout mode against DanceGRPO's full mode, with intervals over seeds.

    python -m bench.time_to_reward [--preset tiny --iters 40 --window-iters 60 --seeds 1 2 3
                                    --eval-every 4 --lr 3e-3 --window-size 2 --modes ...
                                    --png docs/time_to_reward.png --json results.json]

Each (mode, seed) trains the preset's pipeline from the same weights with mm-grpo's GRPO
schedule (JPEG compressibility; tiny: lr 3e-3, G = 8, 16 images, N = 8; bench: see
bench/grpo_setup.py, where training dominates the iteration), one learning rate for every mode
(as Flow-GRPO's and DiffusionNFT's configs do: `-lr5` / `-lr10` modes scale it and say so), every
mode with the same initial noise within a group (DanceGRPO's init_same_noise, which branching
needs), except the awm and nft modes, which roll out with ODE (a group then differs by its initial
noises). Training rewards are not comparable between modes: window mode samples with ODE steps
outside its window, which alone makes images smoother. So every `--eval-every` iterations (and
at K) every run is scored the same way, outside the timed clock: deterministic ODE sampling of a
fixed set (the 8 prompts x 2 fixed noises). Time = iterations x the mode's median iteration time
(the machine is shared: load spikes hit single iterations; the measured cumulative times are kept
as "raw").

K = the full mode's last iteration, the target = the full mode's mean evaluation reward at K
(mean over seeds), the ratio = the time a mode's mean curve (linearly interpolated) first reaches
the target over the full mode's time for K iterations. Intervals (95%): the evaluation reward at
K, Student's t over seeds; the ratio, a paired percentile bootstrap over seeds (every mode ran
the same seeds: a resample draws seed indices with replacement and recomputes the target, every
mean curve and every ratio from them; a resample whose curve never reaches its target counts as
not reached, i.e. an infinite ratio, so an interval's upper end is "not reached" when more than
2.5% of the resamples do not reach). The time per iteration is held fixed (not resampled).
"""
import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import time

import torch

from bench.grpo_setup import PRESETS, PROMPTS, build_mm_grpo, default_workdir, iteration_prompts, prepare
from mm_grpo.families.flux.transformer.lora import LoRAConfig
from mm_grpo.grpo.draws import draw_noise

ODE_ROLLOUT = dict(sampler="ode", init_same_noise=False)  # awm / nft: a group differs by its initial noises
MODES = {
    "full": dict(timestep_selection="random"),  # DanceGRPO: dance_sde at every step, PPO
    "flow_sde": dict(sampler="flow_sde"),  # Flow-GRPO's SDE step, PPO
    "cps": dict(sampler="cps"),  # Flow-GRPO's coefficients-preserving sampler (its log-prob), PPO
    "window": dict(timestep_selection="window", window_shift_every=25),  # MixGRPO; + --window-size
    "window+reuse": dict(timestep_selection="window", window_shift_every=25, ode_reuse=2),
    "branch": dict(timestep_selection="branch"),  # Flow-GRPO-Fast
    "branch+reuse": dict(timestep_selection="branch", ode_reuse=2),
    "awm": dict(policy_loss="awm", **ODE_ROLLOUT),
    "nft": dict(policy_loss="nft", **ODE_ROLLOUT),  # DiffusionNFT (no EMA: the old policy is the rollout's)
    "ppo+rationorm": dict(ratio_norm=True),
    "ppo+guard": dict(ratio_norm=True, step_reweight=True),  # GRPO-Guard: RatioNorm and 1/|dt| step weights
    "nft-lr5": dict(policy_loss="nft", lr_scale=5.0, **ODE_ROLLOUT),
    # 4 optimizer updates per rollout (a quarter of the images each; micro-batch 4 so they split)
    "full-x4": dict(updates_per_rollout=4, micro_batch_size=4),
    "ppo+rationorm-x4": dict(ratio_norm=True, updates_per_rollout=4, micro_batch_size=4),
    "awm-x4": dict(policy_loss="awm", updates_per_rollout=4, micro_batch_size=4, **ODE_ROLLOUT),
    "nft-x4": dict(policy_loss="nft", updates_per_rollout=4, micro_batch_size=4, **ODE_ROLLOUT),
    # LoRA (r = 8, alpha = 16, attention and MLP linears: docs/lora.md) on the frozen base, the same
    # schedule and learning rate as "full"
    "full-lora": dict(lora_config=LoRAConfig()),
    "awm-lora": dict(policy_loss="awm", lora_config=LoRAConfig(), **ODE_ROLLOUT),
    # ... and with 10x the learning rate (LoRA's usual setting: its B starts at zero)
    "full-lora-lr10": dict(lora_config=LoRAConfig(), lr_scale=10.0),
    "awm-lora-lr10": dict(policy_loss="awm", lora_config=LoRAConfig(), lr_scale=10.0, **ODE_ROLLOUT),
}
# Issue 29's target: the best mode at <= 0.1x the full mode's time (the authors of DiffusionNFT and
# AWM report 20-34x fewer steps than Flow-GRPO).
TARGET_RATIO = 0.1
LEVEL = 0.95
RESAMPLES = 2000  # the share of resamples that reach is then known to about +-1% (binomial sd)
BOOTSTRAP_SEED = 0  # fixed: the same results give the same intervals
# The schedule's and the trainer's split of a step: "time_reward" is everything between the rollout and
# the updates (decode, reward, advantages, and the old policy's velocities for nft and RatioNorm).
TIMES = ("time_rollout", "time_reward", "time_train")


@torch.no_grad()
def evaluate(schedule, samples_per_prompt=2):
    """Mean reward of deterministic ODE samples of every prompt with fixed noise."""
    from mm_grpo.families.flux.chunks import make_velocity_fn
    from mm_grpo.rollout import rollout
    prompts = [p for p in PROMPTS for _ in range(samples_per_prompt)]
    cond = schedule.conditioning(prompts)
    # the same evaluation noise for every run, a different one for every sample (not per group)
    fixed = dataclasses.replace(schedule.s, seed=0, init_same_noise=False)
    x0, _ = draw_noise(fixed, 0, range(len(prompts)), schedule.denoiser.latent_shape)
    x0 = x0.to(schedule.device)
    traj = rollout(make_velocity_fn(schedule.policy, cond, len(prompts)), x0, schedule.sigmas, "ode")
    _, total, _ = schedule.score(traj.x0_hat, prompts)
    return total.mean().item()


def run(preset, paths, mode, seed, iters, eval_every, window_size, k):
    """One (mode, seed) run: a point per iteration (its time split too), evaluated every `eval_every`
    iterations, at K and at the end."""
    overrides = {"init_same_noise": True, **MODES[mode]}
    preset = dataclasses.replace(preset, lr=preset.lr * overrides.pop("lr_scale", 1.0))
    schedule, step = build_mm_grpo(preset, paths, torch.device("cpu"), seed=seed, window_size=window_size,
                                   **overrides)
    curve = [dict(iteration=0, wall=0.0, eval=evaluate(schedule))]
    wall = 0.0
    for it in range(iters):
        start = time.perf_counter()
        stats = step(it, iteration_prompts(preset, it))
        seconds = time.perf_counter() - start
        wall += seconds
        point = dict(iteration=it + 1, wall=wall, seconds=seconds, train=stats["reward/mean"],
                     **{name: stats[name] for name in TIMES if name in stats})
        if (it + 1) % eval_every == 0 or it + 1 in (k, iters):
            point["eval"] = evaluate(schedule)
        curve.append(point)
    print(f"[time-to-reward] {mode} seed {seed}: {iters} iterations in {wall:.1f} s, eval "
          f"{curve[0]['eval']:.3f} -> {curve[-1]['eval']:.3f}", flush=True)
    return curve


# --- statistics (pure functions of the curves: tests/test_time_to_reward.py) ----------------------
def seconds_per_iteration(curves, key="seconds"):
    """Median of `key` over all iterations of a mode's runs but each run's first (it warms up; runs of
    one iteration: that one): robust to the load spikes of a shared machine, which hit single iterations."""
    values = [p[key] for c in curves for p in c[2:] if key in p] or [p[key] for c in curves for p in c[1:] if key in p]
    return statistics.median(values) if values else None


def mean_curve(curves, per_iteration):
    """Per evaluated iteration: mean evaluation reward over the runs `curves` (seeds, repeats allowed),
    the time as iterations x `per_iteration` ("wall"), the mean measured cumulative time ("raw"), and
    the lowest and highest run's reward (the plot's band)."""
    points = [[p for p in c if "eval" in p] for c in curves]
    return [dict(iteration=ps[0]["iteration"], wall=ps[0]["iteration"] * per_iteration,
                 raw=statistics.fmean(p["wall"] for p in ps), eval=statistics.fmean(p["eval"] for p in ps),
                 low=min(p["eval"] for p in ps), high=max(p["eval"] for p in ps))
            for ps in zip(*points)]


def time_to_reach(curve, target, key="wall"):
    """`key` (time, or "iteration") at which the linearly interpolated curve first reaches `target`;
    None if it never does."""
    if curve[0]["eval"] >= target:
        return curve[0][key]
    for a, b in zip(curve, curve[1:]):
        if b["eval"] >= target:
            return a[key] + (target - a["eval"]) / (b["eval"] - a["eval"]) * (b[key] - a[key])
    return None


def eval_at(curve, iteration):
    """A run's evaluation reward at `iteration` (every run is evaluated at K)."""
    return next(p["eval"] for p in curve if p["iteration"] == iteration and "eval" in p)


def student_t_cdf(t, df):
    """P(T <= t) for Student's t with an integer number of degrees of freedom: Abramowitz & Stegun
    26.7.3 (df odd) and 26.7.4 (df even), finite series in cos^2 of theta = atan(t / sqrt(df))."""
    if df < 1 or df != int(df):
        raise ValueError(f"degrees of freedom must be a positive integer, got {df!r}")
    theta = math.atan2(t, math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2 == 0:
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        a = math.sin(theta) * total  # P(|T| < t), signed with t
    else:
        for k in range(3, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        a = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))
    return (1 + a) / 2


def student_t_quantile(p, df, tolerance=1e-10):
    """The t with student_t_cdf(t, df) = p (bisection: the cdf is monotone)."""
    if not 0 < p < 1:
        raise ValueError(f"probability must be in (0, 1), got {p!r}")
    if p < 0.5:
        return -student_t_quantile(1 - p, df, tolerance)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, 2 * high
    while high - low > tolerance * high:
        mid = (low + high) / 2
        low, high = (mid, high) if student_t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def t_interval(values, level=LEVEL):
    """Student's t interval of the mean of `values` (seeds); None with fewer than 2."""
    if len(values) < 2:
        return None
    half = student_t_quantile((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.fmean(values)
    return mean - half, mean + half


def percentile(sorted_values, q):
    """Nearest-rank percentile of a sorted list (infinite values, i.e. "not reached", allowed)."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def ratios(results, per_iteration, k, seeds):
    """The ratio to the full mode of every mode, from the runs of seed indices `seeds` (repeats
    allowed): the time its mean curve first reaches the full mode's mean reward at K, over the full
    mode's time for K iterations; None = not reached."""
    target = statistics.fmean(eval_at(results["full"][i], k) for i in seeds)
    full_time = k * per_iteration["full"]
    out = {}
    for mode, curves in results.items():
        reached = time_to_reach(mean_curve([curves[i] for i in seeds], per_iteration[mode]), target)
        out[mode] = None if reached is None else reached / full_time
    return out


def bootstrap_ratios(results, per_iteration, k, resamples=RESAMPLES, seed=BOOTSTRAP_SEED):
    """Per mode, the ratios of `resamples` paired resamples of the seeds (ratios(), None = not reached)."""
    n = len(results["full"])
    rng = random.Random(seed)
    draws = [ratios(results, per_iteration, k, [rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    return {mode: [d[mode] for d in draws] for mode in results}


def ratio_interval(draws, level=LEVEL):
    """(low, high, share reached) of bootstrap ratios; "not reached" (None) counts as an infinite
    ratio, and an end of the interval that falls there is None."""
    values = sorted(math.inf if r is None else r for r in draws)
    tail = (1 - level) / 2
    low, high = (None if v == math.inf else v for v in (percentile(values, tail), percentile(values, 1 - tail)))
    return low, high, sum(r is not None for r in draws) / len(draws)


def summarize(results, k, level=LEVEL, resamples=RESAMPLES):
    """Per mode: times per iteration and their split, the evaluation reward at K (per seed, mean, t
    interval), the ratio (mean curves of all seeds) with its bootstrap interval, and the iteration at
    which the mean curve and each seed's curve reach the target."""
    per_iteration = {m: seconds_per_iteration(c) for m, c in results.items()}
    n = len(results["full"])
    point = ratios(results, per_iteration, k, range(n))
    draws = bootstrap_ratios(results, per_iteration, k, resamples)
    target = statistics.fmean(eval_at(c, k) for c in results["full"])
    rows = {}
    for mode, curves in results.items():
        at_k = [eval_at(c, k) for c in curves]
        low, high, share = ratio_interval(draws[mode], level)
        mean = mean_curve(curves, per_iteration[mode])
        rows[mode] = dict(
            seconds_per_iteration=per_iteration[mode],
            split={name: seconds_per_iteration(curves, name) for name in TIMES},
            cost_vs_full=per_iteration[mode] / per_iteration["full"],
            eval_at_k=at_k, eval_at_k_mean=statistics.fmean(at_k), eval_at_k_interval=t_interval(at_k, level),
            ratio=point[mode], ratio_interval=(low, high), reached_share=share,
            reach_iteration=time_to_reach(mean, target, "iteration"),
            reach_iteration_per_seed=[time_to_reach([p for p in c if "eval" in p], target, "iteration")
                                      for c in curves])
    return dict(K=k, target=target, level=level, resamples=resamples, rows=rows)


def _number(value, digits=2):
    return "not reached" if value is None else f"{value:.{digits}f}"


def markdown_tables(summary):
    """The results table and the 'why' table (time split, iterations to the target) as markdown."""
    k, pct, rows = summary["K"], round(100 * summary["level"]), summary["rows"]
    table = [f"| mode | s / iteration (median) | eval reward at {k}: seeds, mean [{pct}% t interval] | "
             f"ratio at K = {k} [{pct}% bootstrap interval] | resamples reaching |", "|---|---|---|---|---|"]
    why = ["| mode | rollout / reward + preparation / train s (medians) | cost per iteration vs full | "
           "iteration reaching the target: mean curve (seeds) | iterations vs K |", "|---|---|---|---|---|"]
    for mode, r in rows.items():
        interval = r["eval_at_k_interval"]
        eval_text = (" / ".join(f"{v:.2f}" for v in r["eval_at_k"]) + f", **{r['eval_at_k_mean']:.2f}**"
                     + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""))
        low, high = r["ratio_interval"]
        table.append(f"| {mode} | {_number(r['seconds_per_iteration'], 3)} | {eval_text} | {_number(r['ratio'])} "
                     f"[{_number(low)}, {_number(high)}] | {100 * r['reached_share']:.0f}% |")
        split = " / ".join(_number(r["split"][name], 3) if r["split"][name] is not None else "-" for name in TIMES)
        seeds = ", ".join(_number(i, 1) for i in r["reach_iteration_per_seed"])
        iterations = None if r["reach_iteration"] is None else r["reach_iteration"] / k
        why.append(f"| {mode} | {split} | {r['cost_vs_full']:.2f} | {_number(r['reach_iteration'], 1)} ({seeds}) | "
                   f"{_number(iterations)} |")
    return "\n".join(table), "\n".join(why)


def best_mode(summary):
    """The mode other than full with the smallest ratio (None if none reaches)."""
    reached = {m: r["ratio"] for m, r in summary["rows"].items() if m != "full" and r["ratio"] is not None}
    return min(reached, key=reached.get) if reached else None


def plot(results, summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[0::2] + tab20[1::2]  # the ten dark shades first, then the light ones
    for index, (mode, curves) in enumerate(results.items()):
        color = colors[index % len(colors)]
        mean = mean_curve(curves, summary["rows"][mode]["seconds_per_iteration"])
        for ax, key in zip(axes, ("wall", "iteration")):
            x = [p[key] for p in mean]
            ax.plot(x, [p["eval"] for p in mean], color=color, lw=1.8,
                    label=f"{mode} (mean of {len(curves)} seeds, band: min-max)")
            ax.fill_between(x, [p["low"] for p in mean], [p["high"] for p in mean], color=color, alpha=0.12, lw=0)
    for ax, xlabel in zip(axes, ("training time (s): iterations x median s/iteration", "iteration")):
        ax.axhline(summary["target"], color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval reward (-JPEG kB, ODE samples)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--lr", type=float, default=None, help="learning rate of every mode (default: the preset's)")
    p.add_argument("--window-size", type=int, default=2, help="SDE steps in the window and branch modes")
    p.add_argument("--iters", type=int, default=40, help="full-mode iterations (K)")
    p.add_argument("--window-iters", type=int, default=None,
                   help="the other modes' iterations (default: --iters; at least K)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="full is always run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    k = args.iters
    other_iters = args.window_iters or k
    if k < 1 or other_iters < k or args.eval_every < 1:
        p.error(f"need --iters >= 1, --window-iters >= --iters and --eval-every >= 1, got {k}, {other_iters}, "
                f"{args.eval_every}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must differ (the bootstrap resamples them), got {args.seeds}")
    torch.set_num_threads(args.threads)
    import mm_grpo  # noqa: F401
    preset = PRESETS[args.preset]
    if args.lr is not None:
        preset = dataclasses.replace(preset, lr=args.lr)
    paths = prepare(preset, default_workdir())
    modes = ["full"] + [m for m in args.modes if m != "full"]
    results = {mode: [] for mode in modes}
    for seed in args.seeds:  # modes alternate, so load changes hit all alike
        for mode in modes:
            results[mode].append(run(preset, paths, mode, seed, k if mode == "full" else other_iters,
                                     args.eval_every, args.window_size, k))
    summary = summarize(results, k)
    table, why = markdown_tables(summary)
    best = best_mode(summary)
    best_ratio = summary["rows"][best]["ratio"] if best else None
    verdict = (f"best: {best} at {_number(best_ratio)}x; target <= {TARGET_RATIO}x: "
               f"{'met' if best_ratio is not None and best_ratio <= TARGET_RATIO else 'not met'}")
    summary.update(preset=preset.name, lr=preset.lr, window_size=args.window_size, seeds=args.seeds,
                   table=table, why=why, best=best, target_ratio=TARGET_RATIO, verdict=verdict,
                   load=os.getloadavg())
    print(f"\ntarget: the full mode's mean eval reward at K = {k}: {summary['target']:.3f}\n\n{table}\n\n"
          f"why (time split; ratio = iterations vs K x cost per iteration vs full):\n\n{why}\n\n{verdict}",
          flush=True)
    if args.png:
        plot(results, summary, args.png)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(summary=summary, modes={m: MODES[m] for m in modes}, curves=results), f, indent=1,
                      default=lambda o: o.to_json())  # a mode's LoRAConfig
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
