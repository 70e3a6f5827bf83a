"""The CPU patches for MindSpeed-MM's path (Megatron-LM's megatron.training, MindSpeed's multi-tensor
pipeline schedule), in MindSpeed-MM's environment: each works here and is applied to its module;
on a CUDA platform (simulated, no GPU) nothing is patched and the call fails."""
import subprocess
import sys

import pytest

from mm_grpo.platform import cpu_patches
from tests.testbed import REPO, require_testbed, subprocess_env

pytestmark = pytest.mark.mindspeed_mm

_SIMULATED_CUDA = """
import torch
torch.cuda.is_available = lambda: True
import mm_grpo
assert mm_grpo.get_platform().patches == ()
from tests.test_platform_mindspeed_mm import megatron_device_arch_version
try:
    megatron_device_arch_version()
except Exception as e:
    print("FAILED", type(e).__name__, e)
"""


def megatron_device_arch_version():
    """Megatron-LM's own get_device_arch_version (MindSpeed's adaptor answers the NPU's, 8, in its place:
    the CPU patch is for Megatron-LM without MindSpeed)."""
    from mindspeed.patch_utils import MindSpeedPatchesManager
    from megatron.training.utils import get_device_arch_version
    patch = MindSpeedPatchesManager.patches_info["megatron.training.utils.get_device_arch_version"]
    assert get_device_arch_version is patch.final_patch_func and get_device_arch_version() == 8
    return patch.orig_func()


def test_device_arch_version_on_cpu_and_not_patched_on_cuda():
    require_testbed(needs_megatron_training=True)
    assert megatron_device_arch_version() == 0  # a CPU has no CUDA compute capability
    assert cpu_patches.applied_targets("training_device_arch") == ("megatron.training.utils",)
    env = subprocess_env()
    env.pop("MM_GRPO_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", _SIMULATED_CUDA], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert "FAILED" in out.stdout and "NVIDIA" in out.stdout, out.stdout + out.stderr[-2000:]


def test_multi_tensor_schedule_module_is_patched_when_imported():
    require_testbed(needs_megatron_training=True)
    from mindspeed.core.pipeline_parallel.multi_parameter import communication
    import torch
    assert communication.torch.cuda.current_device() == torch.device("cpu")
    assert cpu_patches.applied_targets("mindspeed_multi_parameter_pipeline") == (communication.__name__,)


def test_ulysses_gather_module_is_patched_when_imported():
    require_testbed(needs_megatron_training=True)
    from mindspeed.core.context_parallel.ulysses_context_parallel.unaligned_cp import mapping
    assert cpu_patches.applied_targets("mindspeed_ulysses_device_check") == (mapping.__name__,)
    assert "cpu" in mapping._gather.__code__.co_consts and "cuda" not in mapping._gather.__code__.co_consts
