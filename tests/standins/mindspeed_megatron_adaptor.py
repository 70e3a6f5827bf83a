"""Stand-in for `mindspeed.megatron_adaptor`: see tests/testbed.py.

The real module imports `torch_npu.contrib.transfer_to_npu` and, at import, patches Megatron with
MindSpeed's NPU features (fused kernels, NPU memory and communication settings). On CPU there is
no NPU to patch for; the argument helpers it re-exports are MindSpeed's own.
"""
from mindspeed.args_utils import get_full_args, get_mindspeed_args  # noqa: F401
