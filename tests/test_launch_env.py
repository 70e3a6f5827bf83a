"""shell/launch_env.sh on CPU, with the stand-in Ascend install (MM_GRPO_ASCEND; tests/testbed.py,
STANDINS) holding a stand-in of CANN's set_env.sh: CANN is sourced before the device is detected,
an Ascend machine whose torch_npu does not import stops with the import error, and MindSpeed-MM's
NPU settings are exported."""
import os
import subprocess
import sys

import pytest

from tests.standins.ascend_install import SOURCED, ascend_install, npu_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPU_SETTINGS = {"ASCEND_SLOG_PRINT_TO_STDOUT": "0", "ASCEND_GLOBAL_LOG_LEVEL": "3", "TASK_QUEUE_ENABLE": "2",
                "COMBINED_ENABLE": "1", "CPU_AFFINITY_CONF": "2", "HCCL_CONNECT_TIMEOUT": "1200",
                "NPU_ASD_ENABLE": "0", "ASCEND_LAUNCH_BLOCKING": "0", "ACLNN_CACHE_LIMIT": "100000",
                "MULTI_STREAM_MEMORY_REUSE": "2", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
                "HCCL_BUFFSIZE": "800"}
# Sources launch_env.sh the way the launch scripts do, then reports what it set.
PROBE = f"""set -euo pipefail
REPO={REPO}
source "$REPO/shell/launch_env.sh"
echo "DEVICE=$DEVICE"
echo "{SOURCED}=${{{SOURCED}:-}}"
for v in {' '.join(NPU_SETTINGS)} OMP_NUM_THREADS; do echo "$v=${{!v:-}}"; done
"""


def launch(ascend, python=sys.executable, command=("bash", "-c", PROBE), **env):
    environ = {k: v for k, v in os.environ.items()
               if k not in NPU_SETTINGS and k not in ("MM_GRPO_DEVICE", SOURCED, "OMP_NUM_THREADS")}
    environ.update(MM_GRPO_ASCEND=str(ascend), MM_GRPO_PYTHON=str(python), PYTHONWARNINGS="ignore", **env)
    proc = subprocess.run(list(command), capture_output=True, text=True, env=environ, cwd=REPO, timeout=300)
    report = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return proc, report


def test_without_ascend_the_cpu_is_chosen_and_cann_left_alone(tmp_path):
    proc, report = launch(tmp_path / "no_ascend_here")
    assert proc.returncode == 0, proc.stderr
    assert report["DEVICE"] == "cpu" and report[SOURCED] == "" and report["OMP_NUM_THREADS"] == "1"
    assert all(report[k] == "" for k in NPU_SETTINGS)


@pytest.mark.parametrize("set_env", ["cann", "ascend-toolkit"])
def test_ascend_without_torch_npu_stops_with_the_import_error(tmp_path, set_env):
    proc, report = launch(ascend_install(tmp_path, set_env))
    assert proc.returncode == 1 and "DEVICE" not in report  # no fallback to the CPU
    assert proc.stderr.count("\n") == 1 and f"sourced {tmp_path}/Ascend/{set_env}/set_env.sh" in proc.stderr
    assert proc.stderr.strip().endswith("torch_npu does not import with " + sys.executable +
                                        ": ModuleNotFoundError: No module named 'torch_npu'")


def test_cann_is_sourced_before_torch_npu_is_imported_and_the_device_detected(tmp_path):
    """The stand-in set_env.sh is what makes torch_npu importable: the check and the detection see it."""
    proc, report = launch(ascend_install(tmp_path, torch_npu=True))
    assert proc.returncode == 0, proc.stderr
    assert report[SOURCED] == "cann" and report["DEVICE"] == "cpu"  # torch_npu imports, sees no NPU


def test_on_npu_mindspeed_mm_settings_are_exported_and_the_users_win(tmp_path):
    proc, report = launch(ascend_install(tmp_path), npu_python(tmp_path), HCCL_BUFFSIZE="400")
    assert proc.returncode == 0, proc.stderr
    assert report["DEVICE"] == "npu" and report[SOURCED] == "cann"
    assert {k: report[k] for k in NPU_SETTINGS} == {**NPU_SETTINGS, "HCCL_BUFFSIZE": "400"}


def test_an_ascend_folder_without_cann_is_refused(tmp_path):
    proc, _ = launch(ascend_install(tmp_path, set_env=None))
    assert proc.returncode == 1
    assert "has neither cann/set_env.sh nor ascend-toolkit/set_env.sh" in proc.stderr


def test_a_forced_cpu_skips_the_ascend_steps(tmp_path):
    proc, report = launch(ascend_install(tmp_path, set_env=None), MM_GRPO_DEVICE="cpu")
    assert proc.returncode == 0, proc.stderr
    assert report["DEVICE"] == "cpu" and report[SOURCED] == ""


@pytest.mark.parametrize("script", ["grpo_flux.sh", "pretrain_flux.sh"])
def test_the_launch_scripts_stop_before_torchrun(tmp_path, script):
    proc, _ = launch(ascend_install(tmp_path), command=("bash", f"examples/flux/{script}"),
                     PIPELINE_DIR=str(tmp_path), DATA_DIR=str(tmp_path), PROMPT_FILE=str(tmp_path / "p.txt"))
    assert proc.returncode == 1 and "torch_npu does not import" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr + proc.stdout and "device=" not in proc.stdout
