"""The GRPO schedule driven the way MindSpeed-MM's `pretrain` drives a model: Megatron's
forward-backward function with `forward_step` and a data iterator, then the optimizer.
It must do exactly what mm-grpo's own GRPO iteration does."""
import functools

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from mm_grpo.mindspeed_mm.adapter import GRPOMicroBatches, grpo_forward_step
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs


def test_pretrain_style_step_equals_the_schedule(parallel_1proc, tiny_pipeline_dir, tmp_path):
    configs = write_configs(tmp_path, tiny_pipeline_dir)
    history, reference = run_grpo(grpo_argv(*configs, iters=1))

    _, run = run_grpo(grpo_argv(*configs, iters=0))
    m, s = run.model, run.schedule
    data_iterator = GRPOMicroBatches(s, run.prompts)
    num_microbatches = s.s.samples_per_iteration // s.s.micro_batch_size * s.s.trained_steps_per_sample
    for chunk in m.chunks:
        chunk.zero_grad_buffer()
    m.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=functools.partial(grpo_forward_step, s), data_iterator=data_iterator, model=m.chunks,
        num_microbatches=num_microbatches, seq_length=1, micro_batch_size=s.s.micro_batch_size,
        forward_only=False)
    assert not data_iterator.queue  # exactly one rollout's micro-batches were consumed
    assert losses[0]["ratio_min"] == losses[0]["ratio_max"] == 1.0
    assert all(float(x["reward/mean"]) == pytest.approx(history[0]["reward/mean"], rel=1e-6) for x in losses)
    ok, _, _ = m.optimizer.step()
    assert ok
    ours = dict(m.modules[0].named_parameters())
    for name, p in reference.model.modules[0].named_parameters():
        assert torch.equal(p, ours[name]), name
    assert data_iterator.stats["reward/mean"] == history[0]["reward/mean"]
