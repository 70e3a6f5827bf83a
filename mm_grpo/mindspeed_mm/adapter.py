"""GRPO in Megatron's `forward_step` + data-iterator shape, for MindSpeed-MM's (Megatron's) `pretrain`
(the entry: mm_grpo/mindspeed_mm/grpo.py).

Megatron's loop calls, per optimizer step, `forward_backward_func(forward_step, data_iterator,
model, num_microbatches, ...)` and then the optimizer. GRPO fits that loop when the data
iterator does the rollout: `GRPOMicroBatches` yields (trajectory, trained timestep)
micro-batches, and when they run out it runs the next rollout, reward and advantages with the
current policy (the schedule's bare model chunks, inside the DDP wrappers the loop trains).

A rollout whose rewards are not all finite is skipped as mm-grpo's own trainer skips an
iteration: nothing of it is trained. Here the iterator rolls out again (the next prompts, the
next rollout index) before Megatron's step sees a micro-batch, so no optimizer step, LR step or
checkpoint comes of it; `--max-skipped-iterations` of them in a row stop the run (`SkipGuard`).

Megatron's `--global-batch-size` counts micro-batch rows per optimizer step: it must be
(generations per update) x (trained steps per sample) with the same `--micro-batch-size`.

The rollout runs before Megatron's forward-backward of a step (`rollout_before_each_step`), on
every rank at once: under pipeline parallelism its denoising forwards go through every stage,
while Megatron's schedule has every stage but the first receive activations before it calls
`forward_step`, so a rollout inside the first `forward_step` would deadlock the stages
(docs/grpo_schedule.md section 11).
"""
import collections
import contextlib
import functools

import torch
import torch.distributed as dist

from mm_grpo.training.run_guard import SkipGuard

# Rollout statistics logged with each micro-batch's loss (Megatron logs the loss dictionary).
LOGGED_ROLLOUT_STATS = ("reward/mean", "reward/std", "adv/abs_max")


class GRPOMicroBatches:
    """A Megatron data iterator over GRPO micro-batches of `schedule`; `iteration` counts
    rollouts (the first is `start_iteration`, skipped ones included), `stats` holds the last
    rollout's. `max_skipped`: --max-skipped-iterations (0: roll out again for ever).
    `before_rollout()` is called before each rollout (the held-out evaluation's hook)."""

    def __init__(self, schedule, prompts, start_iteration: int = 0, max_skipped: int = 0, before_rollout=None):
        self.schedule, self.prompts = schedule, prompts
        self.iteration = start_iteration
        self.queue = collections.deque()
        self.stats = {}
        self.skips = SkipGuard(max_skipped)
        self.before_rollout = before_rollout

    def __iter__(self):
        return self

    def __next__(self):
        self.fill()
        return self.queue.popleft()

    def fill(self):
        """Roll out until there are micro-batches to train (nothing if some are left)."""
        while not self.queue:
            if self.before_rollout is not None:
                self.before_rollout()
            prompts = self.prompts.next_batch(self.schedule.s.prompts_per_iteration)
            updates, self.stats = self.schedule.prepare(self.iteration, prompts)
            self.iteration += 1
            if self.skips.update(self.iteration, self.stats):  # raises TrainingStopped at the limit
                if not dist.is_initialized() or dist.get_rank() == 0:
                    limit = self.skips.max_in_a_row or "no limit"
                    print(f"mm-grpo: warning: rollout {self.iteration} skipped ({self.stats['skip_reason']}), "
                          f"{self.skips.in_a_row} in a row (--max-skipped-iterations {limit}): rolling out again",
                          flush=True)
                continue
            logged = {k: torch.tensor(float(self.stats[k])) for k in LOGGED_ROLLOUT_STATS if k in self.stats}
            for micro_batches in updates:
                self.queue.extend(dict(mb, logged=logged) for mb in micro_batches)


def _loss_func(schedule, batch, output):
    loss, stats = schedule.loss_fn(output, batch)
    # Megatron scales the returned loss in place, so report a copy of it.
    return loss, {"loss": loss.detach().clone(), **{k: v.detach() for k, v in stats.items()}, **batch["logged"]}


def grpo_forward_step(schedule, data_iterator, model):
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` for GRPO (bind
    `schedule` with functools.partial)."""
    batch = next(data_iterator)
    return schedule.denoiser.forward(model, batch), functools.partial(_loss_func, schedule, batch)


@contextlib.contextmanager
def rollout_before_each_step(before_step):
    """MindSpeed-MM's loop (`mindspeed_mm.training.train`) with `before_step()` before each
    `train_step`; it fills the GRPOMicroBatches that `pretrain`'s data provider built, so every rank
    rolls out together, before the step's pipeline schedule starts."""
    import mindspeed_mm.training as loop
    train_step = loop.train_step

    @functools.wraps(train_step)
    def train_step_after_rollout(*args, **kwargs):
        before_step()
        return train_step(*args, **kwargs)

    loop.train_step = train_step_after_rollout
    try:
        yield
    finally:
        loop.train_step = train_step
