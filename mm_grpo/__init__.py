"""mm-grpo: GRPO fine-tuning of FLUX on Megatron / MindSpeed-MM.

Importing the package selects the accelerator (NPU, CUDA or CPU) and, on CPU,
applies the small patch set that lets megatron-core's CUDA-only calls run there.
This must happen before Megatron is imported, so it happens here, first.
"""
import warnings

from mm_grpo.platform import get_platform, init_platform

# megatron-core says so at every import when Apex / Transformer Engine are absent (always on
# CPU); it then uses its torch fallbacks, which is what we want.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and )?Apex (is|are) not installed")

init_platform()

__all__ = ["get_platform", "init_platform"]
__version__ = "0.1.0"
