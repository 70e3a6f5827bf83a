"""A preempted job of MindSpeed-MM's GRPO entry (mm_grpo.mindspeed_mm.grpo), whose loop is Megatron's own:
SIGTERM to examples/flux/mindspeed_mm/grpo_flux.sh reaches the workers, Megatron's --exit-signal-handler
(on by default in the script) saves and exits, at the end of a rollout (with --updates-per-rollout 2 an
iteration inside one is never saved), and every process ends; before `pretrain`, an exit flag without
--save and a flag argparse refuses are one line each."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mm_grpo.files.lock import LOCK_FILE
from tests.ports import free_port
from tests.standins.ascend_install import ascend_install
from tests.test_mindspeed_grpo import SCRIPT, SCRIPT_VARIABLES, TRACKER, _child_env, configs, entry_argv  # noqa: F401
from tests.test_run_trainer import children, running
from tests.testbed import TESTBED

pytestmark = pytest.mark.mindspeed_mm
UPDATES_PER_ROLLOUT = 2
START_TIMEOUT_S = 600  # MindSpeed-MM's start on a loaded 2-core machine
STOP_TIMEOUT_S = 300


ITERATION = re.compile(r"iteration +(\d+)/ +1000 \|")  # Megatron's line per iteration


def _logged(logs) -> int:
    """The last iteration the launch's log shows (0: none yet)."""
    found = [int(i) for f in logs.glob("*.log") for i in ITERATION.findall(f.read_text())]
    return max(found, default=0)


def _refusal(configs, *extra):  # noqa: F811
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    with pytest.raises(mindspeed_grpo.LaunchRefused) as refused:
        mindspeed_grpo.check_launch(entry_argv(configs, *extra))
    return str(refused.value)


def test_an_exit_flag_without_save_is_refused_before_pretrain(configs):  # noqa: F811
    assert _refusal(configs, "--exit-signal-handler") == (
        "--exit-signal-handler needs --save: the run saves its last iteration before it exits")


def test_a_flag_argparse_refuses_is_one_line(configs, capsys):  # noqa: F811
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    with pytest.raises(SystemExit) as stop:
        mindspeed_grpo.check_launch(entry_argv(configs, "--sampler", "foo"))
    assert stop.value.code == 2
    assert re.fullmatch(r"mm-grpo: error: argument --sampler: invalid choice: 'foo' \(choose from .*'dance_sde'.*\) "
                        r"\(--help lists the flags\)\n", capsys.readouterr().err)


def test_sigterm_to_the_script_saves_at_a_rollouts_end_and_ends_every_process(configs, tmp_path):  # noqa: F811
    _, model_json, data_json, tools_json = configs
    run_dir, logs = tmp_path / "run", tmp_path / "run" / "logs"
    env = _child_env(**{**SCRIPT_VARIABLES, "TRAIN_ITERS": "1000", "SAVE_INTERVAL": "1000", "EVAL_INTERVAL": "1000",
                        "EVAL_PROMPTS": "1", "KL_BETA": "0"},
                     MM_GRPO_ASCEND=str(ascend_install(tmp_path)), MASTER_PORT=str(free_port()),
                     MINDSPEED_MM=os.path.join(TESTBED, "MindSpeed-MM"), MM_MODEL=model_json, MM_DATA=data_json,
                     MM_TOOL=tools_json, LOAD_PATH=str(tmp_path / "nothing_yet"), SAVE_PATH=str(run_dir / "ckpt"),
                     TENSORBOARD_DIR=str(run_dir / "tb"), LOG_DIR=str(logs))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])  # torchrun
    script = subprocess.Popen(["bash", SCRIPT, "--updates-per-rollout", str(UPDATES_PER_ROLLOUT)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = []
    try:
        deadline = time.time() + START_TIMEOUT_S
        while _logged(logs) < UPDATES_PER_ROLLOUT:
            assert script.poll() is None and time.time() < deadline, script.stderr.read()[-3000:]
            time.sleep(0.2)
        job = [pid for child in children(script.pid) for pid in [child, *children(child)]]  # torchrun, its worker
        script.send_signal(signal.SIGTERM)  # in the second rollout's first update, most likely
        logged = _logged(logs)
        out, err = script.communicate(timeout=STOP_TIMEOUT_S)
    finally:
        for pid in job:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if script.poll() is None:
            script.kill()
    assert script.returncode == 128 + signal.SIGTERM, out[-3000:] + err[-3000:]
    assert job and not any(running(p) for p in job)
    done = int(ITERATION.findall(out)[-1])
    # the first rollout's end after the iteration in progress (Megatron alone would stop right after it)
    assert done == logged + UPDATES_PER_ROLLOUT - logged % UPDATES_PER_ROLLOUT, (logged, done)
    assert "exiting program after receiving SIGTERM" in out, out[-3000:]
    save = run_dir / "ckpt"
    assert (save / TRACKER).read_text() == str(done)
    assert sorted(os.listdir(save)) == [f"iter_{done:07d}", TRACKER] and LOCK_FILE not in os.listdir(save)
