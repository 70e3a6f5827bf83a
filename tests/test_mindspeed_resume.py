"""MindSpeed-MM's GRPO entry (mm_grpo.mindspeed_mm.grpo) resuming as mm-grpo's trainers do
(tests/test_resume_points.py): before `pretrain`, a damaged tracker names its file, a truncated latest
iteration names the newest intact one and Megatron's --ckpt-step that loads it, and --train-iters
below the checkpoint is refused; each one line (LaunchRefused: one per launch)."""
import argparse
import os

import pytest
import torch

from tests.test_mindspeed_grpo import TRACKER, configs, entry_argv  # noqa: F401

pytestmark = pytest.mark.mindspeed_mm
SHARD = os.path.join("mp_rank_00", "model_optim_rng.pt")


def megatron_checkpoint(root, iterations):
    """Iteration folders as Megatron's `--ckpt-format torch` writes them (no mm-grpo metadata, no
    checksum files), the tracker at the last."""
    for iteration in iterations:
        folder = root / f"iter_{iteration:07d}" / "mp_rank_00"
        folder.mkdir(parents=True)
        args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None)
        shard = {"args": args, "iteration": iteration, "model": {"w": torch.zeros(64)}}
        torch.save(shard, folder / "model_optim_rng.pt")
    (root / TRACKER).write_text(str(iterations[-1]))
    return root


def _refusal(configs, *extra):  # noqa: F811
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    with pytest.raises(mindspeed_grpo.LaunchRefused) as refused:
        mindspeed_grpo.check_launch(entry_argv(configs, *extra))
    return str(refused.value)


def test_a_truncated_latest_checkpoint_points_at_ckpt_step(configs, tmp_path):  # noqa: F811
    root = megatron_checkpoint(tmp_path / "ckpt", [1, 2, 3])
    shard = root / "iter_0000003" / SHARD
    os.truncate(shard, os.path.getsize(shard) // 2)
    assert _refusal(configs, "--train-iters", "4", "--load", str(root)) == (
        f"{root}/iter_0000003 is unreadable ({SHARD} is truncated, or not a torch.save file: no zip directory at its "
        f"end ({os.path.getsize(shard)} bytes)); the newest intact checkpoint is iteration 2: resume from it with "
        "--ckpt-step 2")
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    launch = mindspeed_grpo.check_launch(entry_argv(configs, "--train-iters", "4", "--load", str(root),
                                                    "--ckpt-step", "2"))
    assert launch.args.ckpt_step == 2 and launch.args.load == str(root)  # Megatron loads iteration 2 itself


def test_a_damaged_tracker_names_its_file(configs, tmp_path):  # noqa: F811
    root = megatron_checkpoint(tmp_path / "ckpt", [1])
    (root / TRACKER).write_bytes(b"\xff1")
    assert _refusal(configs, "--load", str(root)) == (
        f"{root / TRACKER} is not text: byte 0 is b'\\xff'; it should hold \"release\" or an iteration number; the "
        "newest intact checkpoint is iteration 1: resume from it with --ckpt-step 1")


def test_train_iters_below_the_checkpoint_is_refused(configs, tmp_path):  # noqa: F811
    root = megatron_checkpoint(tmp_path / "ckpt", [3])
    assert _refusal(configs, "--load", str(root)) == (  # MEGATRON_ARGV's --train-iters 2
        f"--train-iters 2 is less than the checkpoint's iteration 3 ({root}/iter_0000003): nothing to train; "
        "--train-iters counts from iteration 0: raise it, or load an earlier iteration with --ckpt-step")
