"""GRPO in Megatron's `forward_step` + data-iterator shape, for MindSpeed-MM's (Megatron's) `pretrain`
(the entry: mm_grpo/training/mindspeed_grpo.py).

Megatron's loop calls, per optimizer step, `forward_backward_func(forward_step, data_iterator,
model, num_microbatches, ...)` and then the optimizer. GRPO fits that loop when the data
iterator does the rollout: `GRPOMicroBatches` yields (trajectory, trained timestep)
micro-batches, and when they run out it runs the next rollout, reward and advantages with the
current policy (the schedule's bare model chunks, inside the DDP wrappers the loop trains).

Megatron's `--global-batch-size` counts micro-batch rows per optimizer step: it must be
(generations per update) x (trained steps per sample) with the same `--micro-batch-size`.
The rollout runs inside the first `forward_step` of a step, so every rank of the pipeline group
would have to be in it at once: pipeline parallelism (and its virtual stages) needs mm-grpo's
own loop (`train_grpo`), which rolls out between the optimizer steps.
"""
import collections
import functools

import torch

from mm_grpo.parallel.pipeline import FORWARD_KEYS

# Rollout statistics logged with each micro-batch's loss (Megatron logs the loss dictionary).
LOGGED_ROLLOUT_STATS = ("reward/mean", "reward/std", "adv/abs_max")


class GRPOMicroBatches:
    """A Megatron data iterator over GRPO micro-batches of `schedule`; `iteration` counts
    rollouts (the first is `start_iteration`), `stats` holds the last rollout's."""

    def __init__(self, schedule, prompts, start_iteration: int = 0):
        self.schedule, self.prompts = schedule, prompts
        self.iteration = start_iteration
        self.queue = collections.deque()
        self.stats = {}

    def __iter__(self):
        return self

    def __next__(self):
        while not self.queue:
            prompts = self.prompts.next_batch(self.schedule.s.prompts_per_iteration)
            updates, self.stats = self.schedule.prepare(self.iteration, prompts)
            self.iteration += 1
            logged = {k: torch.tensor(float(self.stats[k])) for k in LOGGED_ROLLOUT_STATS if k in self.stats}
            for micro_batches in updates or []:  # a skipped rollout yields nothing
                self.queue.extend(dict(mb, logged=logged) for mb in micro_batches)
        return self.queue.popleft()


def _loss_func(schedule, batch, output):
    loss, stats = schedule.loss_fn(output, batch)
    # Megatron scales the returned loss in place, so report a copy of it.
    return loss, {"loss": loss.detach().clone(), **{k: v.detach() for k, v in stats.items()}, **batch["logged"]}


def grpo_forward_step(schedule, data_iterator, model):
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` for GRPO (bind
    `schedule` with functools.partial)."""
    batch = next(data_iterator)
    output = model(**{k: batch[k] for k in FORWARD_KEYS if k in batch})
    return output, functools.partial(_loss_func, schedule, batch)
