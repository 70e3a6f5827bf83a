"""The README's test command (shell/run_tests.sh) as CI runs it, both environments side by side: its
exit status is 0 only when both suites pass, and it leaves no file behind.

A run that selected one test in each environment and a run whose pytest arguments are wrong; the
environments are the ones already set up (set-up is a no-op when its pins are unchanged)."""
import os
import re
import subprocess

import pytest

from tests.test_launch_env import REPO
from tests.testbed import has_megatron_training

# It runs both environments itself: once is enough, from the default one.
pytestmark = pytest.mark.skipif(has_megatron_training(), reason="runs both environments itself, from the default one")

ONE_TEST = "test_cpu_platform_contract"  # tests/test_platform.py, in both (tests.env_split.ALWAYS_BOTH)


def _run_tests(tmp_path, *pytest_args):
    # As from a fresh shell: no environment chosen, no Megatron-LM tree on the path.
    env = {k: v for k, v in os.environ.items() if k not in ("MM_GRPO_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")}
    env["TMPDIR"] = str(tmp_path)  # where the background suite's log goes
    return subprocess.run(["bash", "shell/run_tests.sh", *pytest_args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def _logs_left(tmp_dir):
    """What mktemp made there and nobody removed (the nested pytest's own temporary folder aside)."""
    return [name for name in os.listdir(tmp_dir) if name.startswith("tmp.")]


def test_both_suites_pass_and_the_command_exits_0(tmp_path):
    proc = _run_tests(tmp_path, "-q", "-p", "no:cacheprovider", "-k", ONE_TEST)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"\b1 passed", out)) == 2, out[-3000:]
    for env in ("default", "mindspeed-mm"):
        assert f"[run_tests] MM_GRPO_ENV={env}: " in out  # MindSpeed-MM's: in its log, printed after
    assert "both suites side by side" in proc.stderr
    assert _logs_left(tmp_path) == []


def test_a_failing_suite_fails_the_command_and_names_its_environment(tmp_path):
    proc = _run_tests(tmp_path, "--no-such-pytest-option")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "[run_tests] tests failed in: default mindspeed-mm"
    assert _logs_left(tmp_path) == []
