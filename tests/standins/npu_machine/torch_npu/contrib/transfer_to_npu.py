"""Stand-in of torch_npu's cuda -> npu mapping: only logs that it was imported."""
import torch_npu

torch_npu.EVENTS.append("transfer_to_npu")
