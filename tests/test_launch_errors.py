"""A launch script given a bad variable, or run with the wrong Python, device or port: one line naming
the variable and what it must be, exit 2, before torchrun starts (shell/run_trainer.sh's checks,
shell/launch_env.sh's); a flag the trainer refuses is one line once per launch, whatever the number of
processes (argparse's refusal as entry.UsageError); MindSpeed-MM's entry says the same in one line."""
import os
import re
import socket
import stat
import subprocess
import sys

import pytest

from tests.ports import free_port
from tests.test_launch_env import REPO
from tests.test_run_trainer import _pythonpath
from tests.testbed import has_megatron_training, require_testbed

LAUNCH_TIMEOUT_S = 300
SAMPLER_LINE = ("mm-grpo: error: argument --sampler: invalid choice: 'foo' (choose from 'cps', 'dance_sde', "
                "'flow_sde', 'ode') (--help lists the flags)")


def _grpo_flux_sh(tmp_path, **variables):
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable, MM_GRPO_DEVICE="cpu",
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(tmp_path / "run"), NPUS_PER_NODE="1",
               ITERS="1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    env.update(variables)
    return subprocess.run(["bash", "examples/flux/grpo_flux.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


CASES = {  # variables -> the one line (before any process starts)
    "TP": ({"TP": "abc"}, "grpo_flux.sh: TP=abc: must be a whole number >= 1"),
    "G": ({"G": "abc"}, "grpo_flux.sh: G=abc: must be a whole number >= 1"),
    "NPUS_PER_NODE": ({"NPUS_PER_NODE": "0"}, "grpo_flux.sh: NPUS_PER_NODE=0: must be a whole number >= 1"),
    "MM_GRPO_DEVICE": ({"MM_GRPO_DEVICE": "gpu"}, "launch_env.sh: MM_GRPO_DEVICE=gpu: must be npu, cuda or cpu "
                                                  "(unset: detected)"),
    "npu": ({"MM_GRPO_DEVICE": "npu"},
            f"launch_env.sh: MM_GRPO_DEVICE=npu: mm_grpo could not use the device with MM_GRPO_PYTHON={sys.executable} "
            "(ValueError: device 'npu' requested but torch_npu is not installed or sees no NPU): install its support "
            "there, or set another MM_GRPO_DEVICE"),
    "MM_GRPO_PYTHON": ({"MM_GRPO_PYTHON": "/usr/bin/false"},
                       "launch_env.sh: MM_GRPO_PYTHON=/usr/bin/false cannot start mm-grpo (it printed nothing; exit "
                       "status 1): point MM_GRPO_PYTHON at the Python of an environment with mm-grpo and torch (bash "
                       "shell/setup_env.sh makes .venv), or leave it unset"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_launch_variable_is_one_line_before_torchrun(tmp_path, case):
    variables, line = CASES[case]
    proc = _grpo_flux_sh(tmp_path, **variables)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == "" and not (tmp_path / "run").exists()  # nothing started, nothing written


# Each check of shell/run_trainer.sh on its own (the scripts call them as above): variables -> check -> line.
CHECKS = {
    "NODE_RANK": ({"NNODES": "2", "NODE_RANK": "2"}, "check_torchrun_sizes",
                  "job.sh: NODE_RANK=2: must be below NNODES=2 (nodes are numbered from 0)"),
    "MASTER_PORT": ({"MASTER_PORT": "70000"}, "check_torchrun_sizes",
                    "job.sh: MASTER_PORT=70000: must be a port number, 1-65535"),
    "layout": ({"TP": "4", "PP": "1"}, "check_layout TP PP",
               "job.sh: TP=4 PP=1: their product 4 must divide the 2 processes (NPUS_PER_NODE x NNODES)"),
    "negative": ({"ITERS": "-5"}, "check_whole_numbers 0 ITERS", "job.sh: ITERS=-5: must be a whole number >= 0"),
    "choice": ({"EXIT_SIGNAL_HANDLER": "yes"}, "check_one_of EXIT_SIGNAL_HANDLER 0 1",
               "job.sh: EXIT_SIGNAL_HANDLER=yes: must be one of: 0 1"),
}


@pytest.mark.parametrize("case", sorted(CHECKS))
def test_each_launch_check_is_one_line(case):
    variables, check, line = CHECKS[case]
    sizes = {"NPUS_PER_NODE": "2", "NNODES": "1", "NODE_RANK": "0", "MASTER_PORT": str(free_port()), **variables}
    script = f"set -euo pipefail; source shell/run_trainer.sh; {check}; echo passed"
    proc = subprocess.run(["bash", "-c", script, "job.sh"], cwd=REPO, env=dict(os.environ, **sizes),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (2, "", [line])


def test_a_busy_master_port_names_the_variable_before_torchrun(tmp_path):
    """A second launch on the port of a job already running (a listening socket stands in for its torchrun)."""
    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", free_port()))
        other_job.listen()
        port = other_job.getsockname()[1]
        proc = _grpo_flux_sh(tmp_path, MASTER_PORT=str(port))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"grpo_flux.sh: MASTER_PORT={port} is in use on this machine (another job's "
                                        "torchrun?): set MASTER_PORT to a free port"]


def test_a_flag_the_trainer_refuses_is_one_line_once_per_launch(tmp_path):
    """SAMPLER=foo reaches the trainer's parser on both processes: one line, in the log once too."""
    proc = _grpo_flux_sh(tmp_path, NPUS_PER_NODE="2", SAMPLER="foo")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == SAMPLER_LINE and output.count("mm-grpo: error:") == 1, output[-3000:]
    assert "usage:" not in output
    assert (tmp_path / "run" / "train.log").read_text().count(SAMPLER_LINE) == 1


def _python_without_mindspeed_mm(tmp_path):
    """This environment's Python where it lacks MindSpeed-MM's packages (the default environment: no `six`),
    else the same Python without the testbed's trees on its path."""
    if not has_megatron_training():
        return sys.executable
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def test_the_wan_script_with_a_python_without_mindspeed_mm_is_one_line(tmp_path):
    require_testbed(needs_megatron_training=False)
    python = _python_without_mindspeed_mm(tmp_path)
    env = dict(os.environ, MM_GRPO_PYTHON=python, MM_GRPO_ASCEND=str(tmp_path / "no_ascend"),
               RUN_DIR=str(tmp_path / "run"), PYTHONWARNINGS="ignore")
    env.pop("PIPELINE_DIR", None)  # the tiny CPU run
    proc = subprocess.run(["bash", "examples/wan/grpo_wan.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert re.fullmatch(
        rf"launch_env.sh: grpo_wan.sh runs MindSpeed-MM's code, which MM_GRPO_PYTHON={re.escape(python)} cannot import "
        r"\((ModuleNotFoundError|ImportError): .+\): use MindSpeed-MM's environment "
        rf"\(MM_GRPO_PYTHON={re.escape(REPO)}/.venv-mindspeed-mm/bin/python, made by MM_GRPO_ENV=mindspeed-mm bash "
        r"shell/setup_env.sh\)\n", proc.stderr), proc.stderr
