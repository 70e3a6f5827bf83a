"""Stand-in modules for `torch_npu` and `torchair` (Ascend's torch backend and its graph
compiler; both need CANN and an NPU): see tests/testbed.py.

MindSpeed-MM and MindSpeed import them at module level almost everywhere, for NPU kernels
they call only on an NPU. A stand-in module imports, has every submodule, and every attribute
is an NPU-only function that raises when called; the one exception is
`torch_npu.npu.current_device()` / `is_available()`, which answer for the CPU the tests run on.
"""
import types

import torch


class NpuOnly:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} needs an Ascend NPU (stand-in on CPU, tests/testbed.py)")

    def __getattr__(self, name):
        if name.startswith("__"):
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


class _Npu(NpuOnly):
    def current_device(self):
        return torch.device("cpu")

    def is_available(self):
        return False


def make_module(name: str) -> types.ModuleType:
    module = NpuOnlyModule(name, f"stand-in for {name} (tests/testbed.py)")
    module.__path__ = []  # a package: every submodule imports
    module.__file__ = __file__
    if name == "torch_npu":
        module.npu = _Npu("torch_npu.npu")
        module.__version__ = "0.0.0+standin"
    return module
