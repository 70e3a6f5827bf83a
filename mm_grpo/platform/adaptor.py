"""Accelerator detection: NPU (torch_npu + MindSpeed), CUDA, or CPU (gloo + the CPU patch set).

`init_platform()` runs once per process, from `import mm_grpo`, before Megatron is
imported: MindSpeed's adaptor and the CPU patches must be in place before Megatron's
modules are used. See docs/adaptor.md.
"""
import dataclasses
import importlib
import importlib.util
import logging
import os
import resource
import sys
import warnings

import torch

from mm_grpo.platform.cpu_patches import apply_cpu_patches

logger = logging.getLogger(__name__)

DEVICES = ("npu", "cuda", "cpu")
DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@dataclasses.dataclass(frozen=True)
class Platform:
    name: str  # "npu" | "cuda" | "cpu"
    device: torch.device  # this process's device: <name>:LOCAL_RANK, or cpu
    dist_backend: str  # "hccl" | "nccl" | "gloo"
    patches: tuple[str, ...] = ()  # CPU patches in force (empty on NPU/CUDA)

    def synchronize(self):
        """Wait for this device's queued kernels (CPU kernels are synchronous)."""
        if self.name != "cpu":
            getattr(torch, self.name).synchronize(self.device)

    def max_memory_allocated(self) -> int:
        """Peak bytes: the allocator's peak on NPU/CUDA, the process's peak RSS on CPU (Linux)."""
        if self.name == "cpu":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return getattr(torch, self.name).max_memory_allocated(self.device)


_PLATFORM: Platform | None = None


def _requested(force: str | None) -> str | None:
    name = force or os.environ.get("MM_GRPO_DEVICE") or None
    if name is not None and name not in DEVICES:
        raise ValueError(
            f"unknown device {name!r} (force= or MM_GRPO_DEVICE): use one of {', '.join(DEVICES)}")
    return name


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    return importlib.import_module("torch_npu").npu.is_available()  # importing registers torch.npu


def detect_device() -> str:
    """'npu' if torch_npu sees an NPU, else 'cuda' if torch sees a GPU, else 'cpu'."""
    if _npu_available():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare_npu():
    if not _npu_available():
        raise ValueError("device 'npu' requested but torch_npu is not installed or sees no NPU")
    # Maps torch.cuda.*, device='cuda', Tensor.cuda() and 'nccl' to their NPU twins, globally.
    importlib.import_module("torch_npu.contrib.transfer_to_npu")
    if importlib.util.find_spec("mindspeed") is not None:
        if "megatron.core" in sys.modules:
            warnings.warn(
                "megatron.core was imported before mindspeed.megatron_adaptor: import mm_grpo first")
        importlib.import_module("mindspeed.megatron_adaptor")  # patches Megatron before it is used


def torch_compile_replaced() -> str | None:
    """Who replaced torch.compile with a function that compiles nothing, or None. MindSpeed's
    adaptor does on Ascend (RequirementsBasicFeature: torch.compile and torch.jit.script run the
    function as it is)."""
    module = getattr(torch.compile, "__module__", "") or ""
    return "MindSpeed's adaptor" if module.split(".")[0] == "mindspeed" else None


def _build(name: str) -> Platform:
    if name == "cpu":
        return Platform("cpu", torch.device("cpu"), DIST_BACKENDS["cpu"], apply_cpu_patches())
    if name == "npu":
        _prepare_npu()
    elif not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Platform(name, torch.device(name, local_rank), DIST_BACKENDS[name])


def init_platform(force: str | None = None) -> Platform:
    """Select the device once per process: `force`, else $MM_GRPO_DEVICE, else detection."""
    global _PLATFORM
    requested = _requested(force)
    if _PLATFORM is None:
        _PLATFORM = _build(requested or detect_device())
        logger.info("mm_grpo platform: %s", _PLATFORM)
    elif force is not None and requested != _PLATFORM.name:
        raise ValueError(
            f"platform already initialised as {_PLATFORM.name!r}, cannot switch to {requested!r}: "
            "set MM_GRPO_DEVICE before importing mm_grpo"
        )
    return _PLATFORM


def get_platform() -> Platform:
    return init_platform()
