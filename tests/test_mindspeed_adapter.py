"""The GRPO schedule driven the way MindSpeed-MM's `pretrain` drives a model: Megatron's
forward-backward function with `forward_step` and a data iterator, then the optimizer.
It must do exactly what GRPOSchedule.iteration does."""
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from mm_grpo.training.mindspeed_adapter import GRPOMicroBatches, make_forward_step
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs


def test_pretrain_style_step_equals_the_schedule(parallel_1proc, tiny_pipeline_dir, tmp_path):
    configs = write_configs(tmp_path, tiny_pipeline_dir)
    history, reference = run_grpo(grpo_argv(*configs, iters=1))

    _, run = run_grpo(grpo_argv(*configs, iters=0))
    s = run.schedule
    data_iterator = GRPOMicroBatches(s, run.prompts)
    num_microbatches = s.s.global_batch_size // s.s.micro_batch_size * len(s.trained_steps(0, s.local_samples())[0])
    for chunk in s.policy:
        chunk.zero_grad_buffer()
    s.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(s), data_iterator=data_iterator, model=s.policy,
        num_microbatches=num_microbatches, seq_length=1, micro_batch_size=s.s.micro_batch_size,
        forward_only=False)
    assert not data_iterator.queue  # exactly one rollout's micro-batches were consumed
    assert losses[0]["ratio_min"] == losses[0]["ratio_max"] == 1.0
    ok, _, _ = s.optimizer.step()
    assert ok
    ours = dict(s.policy_modules[0].named_parameters())
    for name, p in reference.schedule.policy_modules[0].named_parameters():
        assert torch.equal(p, ours[name]), name
    assert data_iterator.stats["reward/mean"] == history[0]["reward/mean"]
