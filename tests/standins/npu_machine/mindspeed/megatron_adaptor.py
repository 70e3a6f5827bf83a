"""Stand-in of MindSpeed's Megatron adaptor on an NPU machine: logs that it was imported and
whether Megatron was imported before it (it must not have been)."""
import sys

import torch_npu

torch_npu.EVENTS.append(f"megatron_adaptor, megatron.core imported: {'megatron.core' in sys.modules}")
