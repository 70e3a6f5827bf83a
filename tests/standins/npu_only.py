"""Stand-in modules for `torch_npu` and `torchair` (Ascend's torch backend and its graph
compiler; both need CANN and an NPU): see tests/testbed.py.

MindSpeed-MM and MindSpeed import them at module level almost everywhere, for NPU kernels
they call only on an NPU. A stand-in module imports, has every submodule, and every attribute
is an NPU-only function that raises when called; the exceptions are
`torch_npu.npu.current_device()` / `is_available()` / `synchronize()` and `Tensor.npu()`, which answer for the CPU the
tests run on (importing the stand-in registers them as `torch.npu` / `Tensor.npu`, as the real torch_npu does),
and the fused kernels mm-grpo calls, whose CPU references are in tests/standins/npu_kernels.py.
"""
import sys
import types

import torch


# Decorator factories MindSpeed calls at import to register graph converters for its ops.
REGISTRARS = {"torchair.register_fx_node_ge_converter",
              "torchair.ge_concrete_graph.fx2ge_converter.register_fx_node_ge_converter"}

# Set-up objects MindSpeed-MM's `train` builds whether or not it profiles (mindspeed_mm/tools/profiler.py):
# they construct; what they do (profile().start(), .step(), .stop()) raises, as every NPU function.
CONSTRUCTIBLE = {f"torch_npu.profiler.{name}" for name in (
    "_ExperimentalConfig", "profile", "schedule", "tensorboard_trace_handler")}

# Attributes the stand-in does not have, so that MindSpeed takes the branch it takes for a torch_npu
# without them: HCCL options are for HCCL groups; the CPU's gloo groups take none.
ABSENT = {"torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options.hccl_config"}


class NpuOnly:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        if self._name in REGISTRARS:
            return lambda fn: fn
        if self._name in CONSTRUCTIBLE:
            return NpuOnly(f"{self._name}()")
        raise NotImplementedError(f"{self._name} needs an Ascend NPU (stand-in on CPU, tests/testbed.py)")

    def __getattr__(self, name):
        if name.startswith("__") or f"{self._name}.{name}" in ABSENT:
            raise AttributeError(name)
        return NpuOnly(f"{self._name}.{name}")

    def __mro_entries__(self, bases):  # `class X(torch_npu.Something)` at import time
        return (object,)


class NpuOnlyModule(types.ModuleType):
    __standin__ = True

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return NpuOnly(f"{self.__name__}.{name}")


def make_module(name: str) -> types.ModuleType:
    module = NpuOnlyModule(name, f"stand-in for {name} (tests/testbed.py)")
    module.__path__ = []  # a package: every submodule imports
    module.__file__ = __file__
    if name == "torch_npu":
        module.npu = sys.modules["torch_npu.npu"] = make_module("torch_npu.npu")
        module.__version__ = "0.0.0+standin"
        import npu_kernels  # the fused kernels mm-grpo calls: CPU references of their contracts
        for op in npu_kernels.__all__:
            setattr(module, op, getattr(npu_kernels, op))
        torch.npu = module.npu  # as importing the real torch_npu registers its backend module ...
        torch.Tensor.npu = lambda self, *args, **kwargs: self  # ... and Tensor.npu(): to the device, the CPU here
        module.unsupported_dtype = []  # dtypes the NPU lacks; the CPU lacks none MindSpeed lists
    elif name == "torch_npu.npu":  # where MindSpeed-MM places tensors: the CPU the tests run on
        module.current_device = lambda: torch.device("cpu")
        module.is_available = lambda: False
        module.synchronize = lambda device=None: None  # the CPU runs each op to its end: nothing to wait for
    return module
