"""bench/demo_compute.py reads what it compares: the phase times of train.log lines as the trainer's
logger writes them, and the shipped default's ITERS and MBS as bash sets them from the script."""
import os
import subprocess

import pytest

from bench.demo_compute import EARLIER_DEFAULT, SCRIPT, SETTINGS, iteration_seconds, shipped_default
from mm_grpo.training.logging_utils import TrainLogger


def test_iteration_seconds_sums_the_logged_phases(tmp_path):
    logger = TrainLogger(progress_bar=False)
    lines = [logger._line(1, {"reward/mean": 0.25, "time_rollout": 1.5, "time_reward": 0.25, "loss": 4.0,
                              "time_train": 1.0, "lr": 1e-4}),
             logger._line(1, {"eval/reward_mean": 0.2}),  # an evaluation: no phases
             logger._line(2, {"time_rollout": 2e-3, "time_reward": 1e-3, "time_train": 5e-4})]
    (tmp_path / "train.log").write_text("\n".join(["[run_trainer] a launch line", *lines]))
    assert iteration_seconds(tmp_path / "train.log") == pytest.approx([2.75, 3.5e-3])


def test_shipped_default_is_what_the_script_sets():
    """The CPU branch's ITERS, MBS and G as bash evaluates those lines with nothing set."""
    lines = [line for line in SCRIPT.read_text().splitlines()
             if any(f'{name}="${{{name}:-' in line for name in SETTINGS)]
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    echo = 'echo ' + " ".join(f'"${name}"' for name in SETTINGS)
    out = subprocess.run(["bash", "-c", "\n".join(lines[:2] + [echo])], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert shipped_default() == dict(zip(SETTINGS, map(int, out)))
    assert shipped_default() != EARLIER_DEFAULT
