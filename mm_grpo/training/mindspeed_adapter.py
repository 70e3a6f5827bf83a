"""The GRPO schedule inside MindSpeed-MM's (Megatron's) own `pretrain`.

Megatron's loop calls, per optimizer step, `forward_backward_func(forward_step,
data_iterator, model, num_microbatches, ...)` and then the optimizer. GRPO fits that loop
when the data iterator does the rollout: `GRPOMicroBatches` yields (trajectory, trained
timestep) micro-batches, and when they run out it runs the next rollout, reward and
advantages with the current policy. `make_forward_step` gives the matching
`forward_step(data_iterator, model) -> (output, loss_func)`. Usage in an entry script:

    schedule = GRPOSchedule(settings, model, optimizer, scheduler, conditioner, decoder, reward)
    data_iterator = GRPOMicroBatches(schedule, PromptStream(read_prompts(path)))
    pretrain(..., forward_step_func=make_forward_step(schedule), ...)   # with that iterator

Megatron takes the number of micro-batches per step from its arguments:
`--global-batch-size` there must be (generations per optimizer update) x (trained steps per
sample), i.e. `GRPO global batch / updates_per_rollout * K`, with the same
`--micro-batch-size`. One iterator serves one model chunk (no virtual pipeline stages).
"""
import collections
import functools

from mm_grpo.parallel.pipeline import FORWARD_KEYS


class GRPOMicroBatches:
    """A Megatron data iterator over GRPO micro-batches; `stats` holds the last rollout's."""

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
            for micro_batches in updates or []:  # a skipped rollout yields nothing
                self.queue.extend(micro_batches)
        return self.queue.popleft()


def make_forward_step(schedule):
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` for GRPO."""

    def loss_func(batch, output):
        loss, stats = schedule.loss_fn(output, batch)
        return loss, {k: v.detach() for k, v in stats.items()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(**{k: batch[k] for k in FORWARD_KEYS if k in batch})
        return output, functools.partial(loss_func, batch)

    return forward_step
