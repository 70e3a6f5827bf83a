"""mm-grpo: GRPO fine-tuning of FLUX on Megatron / MindSpeed-MM.

Importing the package first finds the megatron-core in use (the wheel, or Megatron-LM's tree on
PYTHONPATH as MindSpeed-MM has it), names it in `MEGATRON` and refuses one it does not support;
then it selects the accelerator (NPU, CUDA or CPU) and, on CPU, applies the small patch set that
lets megatron-core's CUDA-only calls run there. Both must happen before Megatron is imported, so
they happen here, first.
"""
import logging
import warnings

from mm_grpo.platform import get_platform, init_platform
from mm_grpo.platform.megatron_core import check_megatron_core

# megatron-core says so at every import when Apex / Transformer Engine are absent (always on
# CPU); it then uses its torch fallbacks, which is what we want.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and )?Apex (is|are) not installed")

MEGATRON = check_megatron_core()
logging.getLogger(__name__).info("mm_grpo uses %s", MEGATRON)
if MEGATRON.others:
    warnings.warn(f"two Megatron installs: mm_grpo uses {MEGATRON}; the copy at "
                  f"{', '.join(MEGATRON.others)} is shadowed (remove it or the megatron-core wheel)")

init_platform()

__all__ = ["MEGATRON", "get_platform", "init_platform"]
__version__ = "0.1.0"
