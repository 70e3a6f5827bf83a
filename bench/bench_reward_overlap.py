"""Scoring beside the rollout (--reward-overlap-groups) with a remote reward that takes time.

    python -m bench.bench_reward_overlap [--delay-ms-per-image 40 --iters 4 --groups 1]

The tiny preset with 4 prompts x G 8 = 32 samples per iteration (micro-batch 8), rewarded by
mm-grpo's reward server on localhost serving jpeg_compressibility, each batch held for
--delay-ms-per-image x its images (a reward model on another machine: its time grows with the
images, and it leaves this machine's cores free). The same schedule runs iterations with the
rollout in one piece and then scored (reference) and in parts of --groups groups each scored
while the next part is rolled out, alternating; the figure is the ratio of the mean iteration
times in the same run. docs/rewards.md#overlap.
"""
import argparse
import dataclasses
import time

import torch

from bench.grpo_setup import PRESETS, build_mm_grpo, default_workdir, iteration_prompts, prepare

PROMPTS_PER_ITERATION, MICRO_BATCH = 4, 8


class Delayed:
    """A reward held for a fixed time per image, as a reward model on other hardware would be."""

    def __init__(self, reward, seconds_per_image: float):
        self.reward, self.seconds_per_image, self.weights = reward, seconds_per_image, reward.weights

    def check_prompts(self, prompts):
        self.reward.check_prompts(prompts)

    def __call__(self, images, prompts):
        time.sleep(self.seconds_per_image * len(prompts))
        return self.reward(images, prompts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms-per-image", type=float, default=40.0)
    p.add_argument("--iters", type=int, default=4, help="iterations of each mode, after one warm-up of each")
    p.add_argument("--groups", type=int, default=1, help="--reward-overlap-groups of the overlapped mode")
    args = p.parse_args(argv)
    from mm_grpo.rewards import CombinedReward
    from mm_grpo.tools.reward_server import ServerSettings, create_app, serve_app

    preset = dataclasses.replace(PRESETS["tiny"], prompts_per_iteration=PROMPTS_PER_ITERATION,
                                 micro_batch_size=MICRO_BATCH, reward="jpeg_compressibility")
    paths = prepare(preset, default_workdir())
    served = Delayed(CombinedReward.from_configs([{"name": preset.reward}]), args.delay_ms_per_image / 1000)
    with serve_app(create_app(served, ServerSettings(rewards="-", max_batch=preset.batch))) as url:
        schedule, step = build_mm_grpo(preset, paths, torch.device("cpu"), reward=[{"name": "remote", "url": url}])
        modes = {"whole batch, then scored": 0, f"parts of {args.groups} group(s), scored beside": args.groups}
        times = {name: [] for name in modes}
        waits = {name: [] for name in modes}
        for it in range(args.iters + 1):
            for name, groups in modes.items():
                schedule.s = dataclasses.replace(schedule.s, reward_overlap_groups=groups)
                start = time.perf_counter()
                stats = step(it, iteration_prompts(preset, it))
                if it:  # the first of each mode warms up
                    times[name].append(time.perf_counter() - start)
                    waits[name].append(stats["time_reward"])
    images = preset.batch
    print(f"tiny preset, {images} samples per iteration (micro-batch {MICRO_BATCH}), remote jpeg_compressibility "
          f"held {args.delay_ms_per_image:g} ms per image ({images * args.delay_ms_per_image / 1000:.2f} s per "
          f"iteration), {torch.get_num_threads()} torch threads, {args.iters} iterations per mode")
    mean = {name: sum(v) / len(v) for name, v in times.items()}
    for name in modes:
        print(f"  {name:34s} {mean[name]:6.2f} s per iteration, {sum(waits[name]) / len(waits[name]):5.2f} s waiting "
              f"for scores after the rollout")
    (ref, over) = mean.values()
    print(f"overlapped / reference = {over / ref:.2f}")


if __name__ == "__main__":
    main()
