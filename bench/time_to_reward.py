"""Time to reward: DanceGRPO-style full mode against MixGRPO's sliding window, Flow-GRPO-Fast's
branching, advantage-weighted matching, DiffusionNFT and PPO with GRPO-Guard's RatioNorm,
and LoRA (`-lora` modes: adapters on the frozen base) against full fine-tuning.

    python -m bench.time_to_reward [--preset tiny --iters 40 --window-iters 60 --seeds 1 2 3
                                    --eval-every 4 --lr 3e-3 --window-size 2
                                    --png docs/time_to_reward.png --json results.json]

Each (mode, seed) trains the preset's pipeline from the same weights with mm-grpo's GRPO
schedule (JPEG compressibility; tiny: lr 3e-3, G = 8, 16 images, N = 8; bench: see
bench/grpo_setup.py, where training dominates the iteration), every mode with the same initial
noise within a group (DanceGRPO's init_same_noise, which branching needs), except the awm and nft
modes, which roll out with ODE (a group then differs by its initial noises). Training rewards are not
comparable between modes: window mode samples with ODE steps outside its window, which
alone makes images smoother. So every `--eval-every` iterations every run is scored the same
way, outside the timed clock: deterministic ODE sampling of a fixed set (the 8 prompts x 2
fixed noises). Time = iterations x the mode's median iteration time (the machine is shared:
load spikes hit single iterations; the measured cumulative times are kept as "raw").
K = the full mode's last iteration; the report gives the time each mode needs to reach the
full mode's mean evaluation reward at K (mean curves over seeds, linearly interpolated).
"""
import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from bench.grpo_setup import PRESETS, PROMPTS, build_mm_grpo, default_workdir, iteration_prompts, prepare
from mm_grpo.grpo.schedule import draw_noise
from mm_grpo.models.flux.lora import LoRAConfig

MODES = {
    "full": dict(timestep_selection="random"),
    "window": dict(timestep_selection="window", window_shift_every=25),  # + --window-size
    "window+reuse": dict(timestep_selection="window", window_shift_every=25, ode_reuse=2),
    "branch": dict(timestep_selection="branch"),
    "branch+reuse": dict(timestep_selection="branch", ode_reuse=2),
    "awm": dict(policy_loss="awm", sampler="ode", init_same_noise=False),
    "nft": dict(policy_loss="nft", sampler="ode", init_same_noise=False),
    "ppo+rationorm": dict(ratio_norm=True),
    "ppo+guard": dict(ratio_norm=True, step_reweight=True),  # GRPO-Guard: RatioNorm and 1/|dt| step weights
    "nft-lr5": dict(policy_loss="nft", sampler="ode", init_same_noise=False, lr_scale=5.0),
    # 4 optimizer updates per rollout (a quarter of the images each; micro-batch 4 so they split)
    "full-x4": dict(updates_per_rollout=4, micro_batch_size=4),
    "ppo+rationorm-x4": dict(ratio_norm=True, updates_per_rollout=4, micro_batch_size=4),
    "awm-x4": dict(policy_loss="awm", sampler="ode", init_same_noise=False, updates_per_rollout=4, micro_batch_size=4),
    "nft-x4": dict(policy_loss="nft", sampler="ode", init_same_noise=False, updates_per_rollout=4, micro_batch_size=4),
    # LoRA (r = 8, alpha = 16, attention and MLP linears: docs/lora.md) on the frozen base, the same
    # schedule and learning rate as "full"
    "full-lora": dict(lora_config=LoRAConfig()),
    "awm-lora": dict(policy_loss="awm", sampler="ode", init_same_noise=False, lora_config=LoRAConfig()),
    # ... and with 10x the learning rate (LoRA's usual setting: its B starts at zero)
    "full-lora-lr10": dict(lora_config=LoRAConfig(), lr_scale=10.0),
    "awm-lora-lr10": dict(policy_loss="awm", sampler="ode", init_same_noise=False, lora_config=LoRAConfig(),
                          lr_scale=10.0),
}


@torch.no_grad()
def evaluate(schedule, samples_per_prompt=2):
    """Mean reward of deterministic ODE samples of every prompt with fixed noise."""
    from mm_grpo.parallel.pipeline import make_velocity_fn
    from mm_grpo.rollout import rollout
    prompts = [p for p in PROMPTS for _ in range(samples_per_prompt)]
    cond = schedule.conditioning(prompts)
    # the same evaluation noise for every run, a different one for every sample (not per group)
    fixed = dataclasses.replace(schedule.s, seed=0, init_same_noise=False)
    x0, _ = draw_noise(fixed, 0, range(len(prompts)), schedule.grid[0] * schedule.grid[1],
                       schedule.policy[0].flux_config.in_channels)
    x0 = x0.to(schedule.device)
    traj = rollout(make_velocity_fn(schedule.policy, cond, len(prompts)), x0, schedule.sigmas, "ode")
    _, total, _ = schedule.score(traj.x0_hat, prompts)
    return total.mean().item()


def run(preset, paths, mode, seed, iters, eval_every, window_size=2):
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
        point = dict(iteration=it + 1, wall=wall, seconds=seconds, train=stats["reward/mean"])
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            point["eval"] = evaluate(schedule)
        curve.append(point)
    print(f"[time-to-reward] {mode} seed {seed}: {iters} iterations in {wall:.1f} s, eval "
          f"{curve[0]['eval']:.3f} -> {curve[-1]['eval']:.3f}", flush=True)
    return curve


def seconds_per_iteration(curves):
    """Median iteration time over all runs of a mode (the first iteration of a run warms up):
    robust to the load spikes of a shared machine, which hit single iterations."""
    return statistics.median(p["seconds"] for c in curves for p in c[2:])


def mean_curve(curves):
    """Per evaluated iteration: mean evaluation reward over seeds, the time as iterations x the
    median iteration time ("wall"), and the mean of the measured cumulative times ("raw")."""
    per_iteration = seconds_per_iteration(curves)
    points = [[p for p in c if "eval" in p] for c in curves]
    return [dict(iteration=ps[0]["iteration"], wall=ps[0]["iteration"] * per_iteration,
                 raw=sum(p["wall"] for p in ps) / len(ps), eval=sum(p["eval"] for p in ps) / len(ps))
            for ps in zip(*points)]


def time_to_reach(curve, target):
    """Wall time at which the (linearly interpolated) mean curve first reaches `target`."""
    for a, b in zip(curve, curve[1:]):
        if b["eval"] >= target:
            if a["eval"] >= target:
                return a["wall"]
            return a["wall"] + (target - a["eval"]) / (b["eval"] - a["eval"]) * (b["wall"] - a["wall"])
    return None


def plot(results, means, target, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")
    for mode, color in zip(results, colors):
        per_iteration = seconds_per_iteration(results[mode])
        for curve in results[mode]:
            pts = [p for p in curve if "eval" in p]
            axes[0].plot([p["iteration"] * per_iteration for p in pts], [p["eval"] for p in pts], color=color,
                         alpha=0.25, lw=0.8)
        axes[0].plot([p["wall"] for p in means[mode]], [p["eval"] for p in means[mode]], color=color, lw=2,
                     label=f"{mode} (mean of {len(results[mode])} seeds)")
        axes[1].plot([p["iteration"] for p in means[mode]], [p["eval"] for p in means[mode]], color=color, lw=2,
                     label=mode)
    for ax, xlabel in zip(axes, ("training time (s): iterations x median s/iteration", "iteration")):
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval reward (-JPEG kB, ODE samples)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's)")
    p.add_argument("--window-size", type=int, default=2, help="SDE steps in the window and branch modes")
    p.add_argument("--iters", type=int, default=40, help="full-mode iterations (K)")
    p.add_argument("--window-iters", type=int, default=None,
                   help="window and branch modes' iterations (default: --iters)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="full is always run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import mm_grpo  # noqa: F401
    preset = PRESETS[args.preset]
    if args.lr is not None:
        preset = dataclasses.replace(preset, lr=args.lr)
    paths = prepare(preset, default_workdir())
    modes = ["full"] + [m for m in args.modes if m != "full"]
    iters = {mode: args.iters if mode == "full" else args.window_iters or args.iters for mode in modes}
    results = {mode: [] for mode in modes}
    for seed in args.seeds:  # modes alternate, so load changes hit both alike
        for mode in modes:
            results[mode].append(run(preset, paths, mode, seed, iters[mode], args.eval_every, args.window_size))
    means = {mode: mean_curve(curves) for mode, curves in results.items()}
    target = means["full"][-1]["eval"]
    reach = {mode: time_to_reach(means[mode], target) for mode in modes}
    summary = dict(preset=preset.name, lr=preset.lr, window_size=args.window_size, K=args.iters, target=target,
                   time_to_target=reach,
                   ratio_to_full={m: reach[m] / reach["full"] if reach[m] else None for m in modes},
                   seconds_per_iteration={m: seconds_per_iteration(results[m]) for m in modes},
                   final_eval={m: means[m][-1]["eval"] for m in modes}, load=os.getloadavg())
    print(json.dumps(summary, indent=1))
    if args.png:
        plot(results, means, target, args.png)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(summary=summary, modes={m: MODES[m] for m in modes}, curves=results, means=means), f, indent=1,
                      default=lambda o: o.to_json())  # a mode's LoRAConfig
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
