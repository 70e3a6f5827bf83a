"""Stand-in torch_npu of a machine with an NPU (tests/testbed.py, STANDINS): registers the 'npu'
device type with an NPU that is available, and logs the imports of its modules and of MindSpeed's
adaptor in EVENTS, for the order mm_grpo's platform adaptor imports them in."""
import types

import torch

EVENTS = []
torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType(f"{__name__}.npu")
npu.is_available = lambda: True
torch._register_device_module("npu", npu)
