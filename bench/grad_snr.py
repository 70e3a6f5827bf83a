"""How much signal is in a GRPO policy gradient? Cosines between gradients of independent rollouts.

    python -m bench.grad_snr --batches 16 -- --mm-model M.json --mm-data D.json \
        --prompts-per-iteration 8 --num-generations 8 --micro-batch-size 8 [other trainer args]

Draws `--batches` independent rollouts of the same prompts (one iteration's worth from the
prompt file) at the same weights (one process, no optimizer step) and compares their policy
gradients. If a batch of n samples has gradient g = s + noise, with per-sample
signal-to-noise rho = |s|^2 / E|noise_1|^2, two independent batch means of n samples each have
cosine about n rho / (n rho + 1). From the cosine of the two halves' means this prints rho,
and the samples per update for which a batch gradient points within 60 degrees of the true
one (cosine 0.5: n rho = 1/3). "adam" repeats it with every coordinate divided by its RMS over
the batches (what Adam's update sees). Also: the fraction of coordinates whose mean is 3
standard errors from 0, with the chance level of a t distribution with batches - 1 degrees
of freedom.
See docs/demo.md ("Why small batches do not move the tiny model").
"""
import argparse
import itertools
import math
import statistics

import torch
import torch.nn.functional as F


def halves_cosine(grads: torch.Tensor) -> float:
    half = grads.shape[0] // 2
    return F.cosine_similarity(grads[:half].mean(0), grads[half:2 * half].mean(0), dim=0).item()


def signal_to_noise(cos: float, samples_per_half: int) -> float:
    """Per-sample |signal|^2 / noise variance from the halves' cosine (0 if not positive)."""
    return max(cos, 0.0) / (samples_per_half * (1 - cos))


def t_chance(dof: int, t: float = 3.0, steps: int = 2000) -> float:
    """P(|T| > t) for Student's t with `dof` degrees of freedom: 1 - 2 x the integral of its
    (smooth) density over [0, t] by Simpson's rule (no scipy needed)."""
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    pdf = lambda x: math.exp(log_norm - (dof + 1) / 2 * math.log1p(x * x / dof))
    h = t / steps
    integral = h / 3 * sum((1 if i in (0, steps) else 4 if i % 2 else 2) * pdf(i * h) for i in range(steps + 1))
    return 1 - 2 * integral


def report(grads: torch.Tensor, samples_per_batch: int) -> dict:
    r = grads.shape[0]
    pair = [F.cosine_similarity(grads[i], grads[j], dim=0).item() for i, j in itertools.combinations(range(r), 2)]
    adam = grads / (grads.pow(2).mean(0).sqrt() + 1e-30)
    n_half = r // 2 * samples_per_batch
    out = {"batches": r, "samples_per_batch": samples_per_batch, "pair_cos_mean": statistics.mean(pair),
           "pair_cos_sd": statistics.pstdev(pair)}
    for name, g in (("raw", grads), ("adam", adam)):
        cos = halves_cosine(g)
        rho = signal_to_noise(cos, n_half)
        out[name] = {"halves_cos": cos, "rho": rho, "samples_for_cos_0.5": (1 / (3 * rho)) if rho > 0 else math.inf}
    t = grads.mean(0) / (grads.std(0) / math.sqrt(r) + 1e-30)
    out["t_gt_3"] = (t.abs() > 3).float().mean().item()
    out["t_gt_3_chance"] = t_chance(r - 1)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=16, help="independent rollouts (even, >= 4)")
    p.add_argument("--fixed-init-noise", action="store_true",
                   help="the same initial noise in every batch (only the SDE noise differs): the signal "
                        "for these particular starting points rather than for the prompts")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --: the GRPO trainer's arguments")
    a = p.parse_args(argv)
    if a.batches < 4 or a.batches % 2:
        raise SystemExit(f"grad_snr: --batches must be even and >= 4, got {a.batches}")
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.families.flux.chunks import forward_backward
    from mm_grpo.training.arguments import parse_args
    from mm_grpo.training.train_grpo import GRPORun
    initialize_parallel(ParallelConfig())
    trainer_args = [x for x in a.trainer_args if x != "--"]
    run = GRPORun(parse_args(trainer_args + ["--train-iters", "0", "--no-progress-bar"]))
    s = run.schedule
    n_prompts = s.s.prompts_per_iteration
    prompts = run.prompts.next_batch(n_prompts)  # the same prompts for every batch
    if a.fixed_init_noise:
        draw = s.noise
        s.noise = lambda iteration, samples, channels: (draw(0, samples, channels)[0],
                                                        draw(iteration, samples, channels)[1])
    grads, rewards = [], []
    if s.s.updates_per_rollout != 1:
        raise ValueError("grad_snr measures the gradient of a whole batch: use --updates-per-rollout 1")
    for i in range(a.batches):
        updates, stats = s.prepare(i, prompts)
        if updates is None:
            raise ValueError(f"batch {i} was skipped: {stats.get('skip_reason')}")
        for chunk in run.model.chunks:
            chunk.zero_grad_buffer()
        forward_backward(run.model.chunks, updates[0], s.loss_fn)
        grads.append(torch.cat([p.main_grad.flatten().float() for c in run.model.chunks for p in c.parameters()
                                if p.requires_grad]))
        rewards.append(stats["reward/mean"])
    out = report(torch.stack(grads), s.s.samples_per_iteration)
    out["reward_mean"] = statistics.mean(rewards)
    print(f"[grad_snr] {a.batches} batches x {s.s.samples_per_iteration} samples, {n_prompts} prompts, "
          f"reward {out['reward_mean']:.3f}; cosine of two batches {out['pair_cos_mean']:+.3f} +- "
          f"{out['pair_cos_sd']:.3f}")
    for name in ("raw", "adam"):
        v = out[name]
        print(f"  {name:4s}: halves cosine {v['halves_cos']:+.4f}, per-sample SNR {v['rho']:.2e}, "
              f"samples per update for cosine 0.5 with the true gradient: {v['samples_for_cos_0.5']:.3g}")
    print(f"  coordinates with |t| > 3: {out['t_gt_3']:.4f} (chance {out['t_gt_3_chance']:.4f})")
    return out


if __name__ == "__main__":
    main()
