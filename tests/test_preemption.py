"""Preempted and time-limited jobs in mm-grpo's loop (mm_grpo/training/preemption.py), in this process:
--exit-duration-in-mins stops before the limit (the rule, and a run that saves and returns), either
exit flag without --save is one line, and a resume with other batch sizes says so. SIGTERM itself:
tests/test_resume_points.py (the resume after it is exact) and tests/test_run_trainer.py (the script)."""
import os
import re
import time

import pytest
import torch

from mm_grpo.checkpoint.paths import TRACKER_FILE
from mm_grpo.training import preemption
from mm_grpo.training.entry import run_entry
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs

MINUTE = 60.0
ITERATION_S = 1.0  # at least, in the test of a run near its limit


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("preemption_cfg"), tiny_pipeline_dir)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_duration_limit_stops_before_the_next_iteration_and_save_could_pass_it():
    """10-minute limit, iterations of 60 s (one of 90 s), saves of 30 s: stop once elapsed + the longest
    iteration + the last save would pass 600 s, not once 600 s have passed."""
    clock = Clock()
    guard = preemption.ExitGuard(False, 10, torch.device("cpu"), clock=clock, started=0.0)
    stops = []
    for iteration, seconds in enumerate([60, 90, 60, 60, 60, 60, 60, 60], start=1):
        clock.now += seconds
        if iteration == 2:
            guard.saved(30)
        stop = guard.check(seconds)
        stops.append(stop)
        if stop:
            break
    # after iteration 7 (450 s): 450 + 90 + 30 = 570, go on; after 8 (510 s): 630 > 600, stop 90 s before the limit
    assert [s is not None for s in stops] == [False] * 7 + [True]
    assert stops[-1].signal_name is None and stops[-1].describe(10) == (
        "--exit-duration-in-mins 10: 8.5 minutes elapsed, and the next iteration and a save could take 2.0 more")


def test_no_flag_costs_nothing():
    guard = preemption.ExitGuard(False, None, torch.device("cpu"), started=0.0)
    assert not guard.active and guard.check(1e9) is None


def test_a_run_near_its_limit_saves_the_iteration_and_returns(parallel_1proc, configs, tmp_path, capsys,
                                                              monkeypatch):  # noqa: F811
    """A job 1.5 s short of its 60-minute limit, whose iterations take over a second: the first iteration
    is its last, saved; the run returns (exit 0) with its lock released, without the final evaluation."""
    from mm_grpo.training.train_grpo import GRPORun
    step = GRPORun.step

    def slow_step(self, iteration):
        time.sleep(ITERATION_S)
        return step(self, iteration)
    monkeypatch.setattr(GRPORun, "step", slow_step)
    monkeypatch.setattr(preemption, "process_start", lambda: time.time() - 60 * MINUTE + 1.5 * ITERATION_S)
    save = tmp_path / "ckpt"
    history, run = run_grpo(grpo_argv(*configs, iters=5, extra=["--save", str(save), "--exit-duration-in-mins", "60"]))
    assert len(history) == 1 and run.stopped is not None
    line, = [x for x in capsys.readouterr().out.splitlines() if "stopped after" in x]
    assert re.fullmatch(r"mm-grpo: --exit-duration-in-mins 60: (59\.9|60\.0) minutes elapsed, and the next iteration "
                        r"and a save could take 0\.0 more: stopped after iteration 1 of 5, saved in "
                        + re.escape(f"{save}; resume with --load {save}"), line), line
    assert sorted(os.listdir(save)) == ["iter_0000001", TRACKER_FILE] and (save / TRACKER_FILE).read_text() == "1"


@pytest.mark.parametrize("flag", [["--exit-signal-handler"], ["--exit-duration-in-mins", "30"]])
def test_an_exit_flag_without_save_is_one_line(parallel_1proc, configs, capsys, flag):  # noqa: F811
    from mm_grpo.training import train_grpo
    with pytest.raises(SystemExit) as stop:
        run_entry(lambda: train_grpo.main(grpo_argv(*configs, iters=2, extra=flag)))
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"mm-grpo: error: {flag[0]} needs --save: the run saves its last iteration before it exits")
