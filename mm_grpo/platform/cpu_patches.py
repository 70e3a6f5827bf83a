"""The CPU patch set: lets megatron-core's CUDA-only calls run on the CPU.

On an Ascend cluster `torch_npu.contrib.transfer_to_npu` maps `cuda` to `npu`; here the
same mapping sends `cuda` to the CPU, with one difference: it is scoped. Every patch
names the Megatron modules it changes and touches nothing else, so torch itself and
every other library keep their behaviour (`torch.cuda.is_available()` stays False,
`torch.cuda.synchronize()` still raises outside Megatron). Megatron's own functions
run unchanged; only the CUDA-only calls inside them are redirected:

- string constants in a module's code (`device="cuda"`, `'torch.cuda.FloatTensor'`)
  are swapped for their CPU twins, in place, in the code objects of the functions and
  methods the module defines;
- a module's global name `torch` is rebound to a view of torch whose `torch.cuda`
  answers the few calls Megatron makes (`current_device`, `synchronize`, the RNG) for
  the CPU and forwards everything else to the real `torch.cuda`;
- a method name in a module's code (`tensor.cuda()`, megatron-core 0.12) is swapped for
  its CPU twin (`tensor.cpu()`), in the same code objects.

Patches are declared in `CPU_PATCHES` (name, targets, why), like MindSpeed's patch
manager. `apply_cpu_patches()` patches the targets already imported and hooks the
import of the others, so it works before or after Megatron is imported.
`docs/adaptor.md` has the table and the reasons.
"""
import dataclasses
import dis
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from typing import Callable

import torch

from mm_grpo.platform.megatron_core import find_megatron_core

_MC = "megatron.core."


def _swap_code_constants(code: types.CodeType, mapping: dict) -> types.CodeType:
    """`code` with the string constants in `mapping` replaced, nested code and tuples included."""

    def swap(const):
        if isinstance(const, str):
            return mapping.get(const, const)
        if isinstance(const, types.CodeType):
            return _swap_code_constants(const, mapping)
        if isinstance(const, (tuple, frozenset)):  # `x in ['a', 'b']` compiles to a tuple constant
            return type(const)(swap(c) for c in const)
        return const

    return code.replace(co_consts=tuple(swap(c) for c in code.co_consts))


def _own_functions(module: types.ModuleType):
    """Plain functions whose code lives in `module`'s file: its functions and its classes' methods."""
    seen, stack = set(), list(vars(module).values())
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type) and obj.__module__ == module.__name__:
            stack.extend(vars(obj).values())
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType) and obj.__code__.co_filename == module.__file__:
            yield obj
        wrapped = getattr(obj, "__wrapped__", None)  # functools.wraps: contextmanager, lru_cache, nvtx
        if isinstance(wrapped, types.FunctionType):
            stack.append(wrapped)


def _constant_swapper(mapping: dict) -> Callable[[types.ModuleType], None]:
    def apply(module):
        for fn in _own_functions(module):
            fn.__code__ = _swap_code_constants(fn.__code__, mapping)

    return apply


def _is_method_load(instruction: dis.Instruction) -> bool:
    """`x.name(...)`: LOAD_METHOD up to Python 3.11, LOAD_ATTR with the method flag from 3.12."""
    return instruction.opname == "LOAD_METHOD" or (
        instruction.opname == "LOAD_ATTR" and instruction.argrepr.startswith("NULL|self"))


def _rename_methods(code: types.CodeType, mapping: dict) -> types.CodeType:
    """`code` calling method mapping[m] where it called m, nested code included. A name is
    renamed only in code that uses it as a method name and nothing else (so `torch.cuda.x`
    beside `t.cuda()` keeps its meaning)."""
    uses = {}
    for instruction in dis.get_instructions(code):
        if instruction.opcode in dis.hasname and instruction.argval in mapping:
            uses.setdefault(instruction.argval, []).append(_is_method_load(instruction))
    renamed = {name for name, methods in uses.items() if all(methods)}
    consts = tuple(_rename_methods(c, mapping) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    names = tuple(mapping[n] if n in renamed else n for n in code.co_names)
    return code.replace(co_consts=consts, co_names=names)


def _method_renamer(mapping: dict) -> Callable[[types.ModuleType], None]:
    def apply(module):
        for fn in _own_functions(module):
            fn.__code__ = _rename_methods(fn.__code__, mapping)

    return apply


class _CudaOnCpu:
    """`torch.cuda` as a patched Megatron module sees it: the CPU stands in for the GPU."""

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        """CPU kernels have finished when they return: nothing to wait for."""

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def get_device_properties(device=None):
        """A CPU has no CUDA compute capability: major 0 keeps Megatron's pre-Blackwell rules."""
        return types.SimpleNamespace(name="cpu", major=0, minor=0)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """The name `torch` inside a patched Megatron module: real torch, but `.cuda` is `_CudaOnCpu`."""

    def __init__(self):
        super().__init__("torch", "torch as Megatron sees it on CPU (mm_grpo.platform.cpu_patches)")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchOnCpu()


def _bind_torch_on_cpu(module):
    module.torch = _TORCH_ON_CPU


def _not_fork_warning(record: logging.LogRecord) -> bool:
    # fork() warns when the CPU RNG moves inside a forked GPU RNG region; on CPU that is the point.
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _rng_on_cpu(module):
    # Megatron's twins of torch.cuda.get/set_rng_state read the CUDA default generator;
    # on CPU the device generator is the CPU one.
    module._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    module._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    logging.getLogger(module.__name__).addFilter(_not_fork_warning)  # added once: same function


def _fp8_cast_only_with_fp8_params(module):
    # Without Transformer Engine, 0.12's _quantize_param_shard_impl raises whatever it is given.
    raise_without_te = module._quantize_param_shard_impl

    def quantize_param_shard_impl(model_params, *args, **kwargs):
        if len(model_params):  # fp8 parameters do need Transformer Engine
            raise_without_te(model_params, *args, **kwargs)

    module._quantize_param_shard_impl = quantize_param_shard_impl


def megatron_core_version() -> tuple[int, int] | None:
    """(major, minor) of the megatron.core in use, read without importing it (which would
    defeat patching on import); None if there is none."""
    core = find_megatron_core()
    return None if core is None else core.version[:2]


def _megatron_before_0_13() -> bool:
    version = megatron_core_version()
    return version is not None and version < (0, 13)


@dataclasses.dataclass(frozen=True)
class CpuPatch:
    name: str
    targets: tuple[str, ...]  # modules the patch changes, fully qualified
    why: str
    apply: Callable[[types.ModuleType], None]  # called with each target module after its code ran
    needed: Callable[[], bool] = lambda: True  # e.g. only for some megatron-core versions


_SCHEDULES, _P2P = _MC + "pipeline_parallel.schedules", _MC + "pipeline_parallel.p2p_communication"
_DDP, _BUFFER = _MC + "distributed.distributed_data_parallel", _MC + "distributed.param_and_grad_buffer"
_OPTIMIZER, _DISTRIB = _MC + "optimizer.optimizer", _MC + "optimizer.distrib_optimizer"
_CLIP, _SCALER = _MC + "optimizer.clip_grads", _MC + "optimizer.grad_scaler"
_RANDOM, _UTILS = _MC + "tensor_parallel.random", _MC + "utils"
_TP_LAYERS, _TP_MAPPINGS, _TP_UTILS = (_MC + "tensor_parallel." + m for m in ("layers", "mappings", "utils"))
_CKPT_SAVER, _CKPT_WRITER, _CKPT_ASYNC = (_MC + "dist_checkpointing.strategies." + m
                                          for m in ("state_dict_saver", "filesystem_async", "async_utils"))
_FP8 = _MC + "fp8_utils"

CPU_PATCHES = (
    CpuPatch(
        "cuda_device_string",
        (_SCHEDULES, _OPTIMIZER, _CLIP, _SCALER, _UTILS),
        "tensors are created with device='cuda' (token counts, grad norms, found-inf flags, "
        "loss scale); the constant 'cuda' becomes 'cpu' in these modules' code",
        _constant_swapper({"cuda": "cpu"}),
    ),
    CpuPatch(
        "cuda_tensor_type",
        (_OPTIMIZER, _DISTRIB, _CLIP),
        "optimizer and grad clipping assert param.type() == 'torch.cuda.FloatTensor' (and pick "
        "fp16/bf16 params by 'torch.cuda.HalfTensor'/'torch.cuda.BFloat16Tensor'); these "
        "modules compare with the CPU type names instead",
        _constant_swapper({f"torch.cuda.{t}Tensor": f"torch.{t}Tensor"
                           for t in ("Float", "Half", "BFloat16")}),
    ),
    CpuPatch(
        "torch_cuda_calls",
        (_P2P, _DDP, _BUFFER, _DISTRIB, _RANDOM, _UTILS, _TP_LAYERS, _TP_MAPPINGS, _TP_UTILS, _CKPT_SAVER,
         _CKPT_WRITER),
        "torch.cuda.current_device() as a device argument, torch.cuda.synchronize(), "
        "torch.cuda.get_rng_state()/manual_seed() raise without a GPU; in these modules "
        "they mean the CPU, its no-op sync and its RNG",
        _bind_torch_on_cpu,
    ),
    CpuPatch(
        "cuda_rng_state",
        (_RANDOM,),
        "the RNG tracker (model_parallel_cuda_manual_seed, get_cuda_rng_tracker().fork(), "
        "activation checkpointing) saves and restores the CUDA generator through "
        "_get_cuda_rng_state/_set_cuda_rng_state; on CPU they use the CPU generator",
        _rng_on_cpu,
    ),
    CpuPatch(
        "tensor_cuda_method",
        (_SCHEDULES,),
        "megatron-core 0.12.x makes the schedules' token count with Tensor.cuda() where 0.16 "
        "passes device='cuda'; in this module's code the method called is Tensor.cpu() instead",
        _method_renamer({"cuda": "cpu"}),
        needed=_megatron_before_0_13,
    ),
    CpuPatch(
        "async_save_sync",
        (_CKPT_ASYNC,),
        "megatron-core 0.12.x runs a synchronous dist_checkpointing.save through its async caller, "
        "which calls torch.cuda.synchronize(); in this module torch is the view of torch_cuda_calls",
        _bind_torch_on_cpu,
        needed=_megatron_before_0_13,
    ),
    CpuPatch(
        "fp8_cast_without_fp8",
        (_FP8,),
        "without Transformer Engine (never on CPU), megatron-core 0.12.x's distributed optimizer "
        "raises in quantize_param_shard at every step, even with no fp8 parameters (MindSpeed's "
        "adaptor replaces it on NPU); with no fp8 parameters it now does nothing",
        _fp8_cast_only_with_fp8_params,
        needed=_megatron_before_0_13,
    ),
    CpuPatch(
        "training_device_arch",
        ("megatron.training.utils",),
        "Megatron-LM's get_device_arch_version() reads torch.cuda.get_device_properties (MindSpeed-MM's "
        "validate_args calls it under context parallelism); in this module torch is the view of "
        "torch_cuda_calls, whose CPU reports compute capability 0",
        _bind_torch_on_cpu,
    ),
    CpuPatch(
        "mindspeed_ulysses_device_check",
        ("mindspeed.core.context_parallel.ulysses_context_parallel.unaligned_cp.mapping",),
        "MindSpeed's Ulysses gather (MindSpeed-MM's wandit under context parallelism) asserts that a tensor is on "
        "'cuda' or 'npu' before its all-gather; the constant 'cuda' becomes 'cpu' in this module's code, so that "
        "a gloo group's CPU tensors pass the same check",
        _constant_swapper({"cuda": "cpu"}),
    ),
    CpuPatch(
        "mindspeed_multi_parameter_pipeline",
        ("mindspeed.core.pipeline_parallel.multi_parameter.communication",),
        "MindSpeed's multi-tensor pipeline schedule (pretrain_sora.py under PP) makes its gradient "
        "buffers on torch.cuda.current_device(), which torch_npu maps to the NPU; in this module torch "
        "is the view of torch_cuda_calls",
        _bind_torch_on_cpu,
    ),
)


# --- Megatron-LM's training loop (megatron.training) and MindSpeed-MM's fork of it -------------
# `pretrain` as MindSpeed-MM runs it: initialize_megatron, get_model, the train loop, checkpoints.
class _CudaDeviceOnCpu(_CudaOnCpu):
    """`torch.cuda` as Megatron-LM's loop sees it: one device, the CPU (with its generator)."""

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        """The process's one device is the CPU: nothing to select."""

    @staticmethod
    def set_rng_state(state, device="cuda"):
        torch.set_rng_state(state)


class _TorchWithCpuDevice(_TorchOnCpu):
    def __init__(self):
        super().__init__()
        self.cuda = _CudaDeviceOnCpu()


_TORCH_WITH_CPU_DEVICE = _TorchWithCpuDevice()


def _bind_torch_with_cpu_device(module):
    module.torch = _TORCH_WITH_CPU_DEVICE


def _call_method_instead(code: types.CodeType, old: str, new: str) -> types.CodeType:
    """`code` calling `x.new(...)` where it called `x.old(...)`, nested code included; attribute
    loads of `old` (`torch.cuda.current_device`) keep their meaning. One-byte name indices only
    (LOAD_METHOD up to Python 3.11, LOAD_ATTR with the method bit from 3.12)."""
    names = code.co_names if new in code.co_names else code.co_names + (new,)
    index = names.index(new)
    raw = bytearray(code.co_code)
    for instruction in dis.get_instructions(code):
        if instruction.argval == old and _is_method_load(instruction):
            arg = index if instruction.opname == "LOAD_METHOD" else index << 1 | 1
            if instruction.arg > 255 or arg > 255:
                raise NotImplementedError(f"{code.co_name}: a name index past one byte")
            raw[instruction.offset + 1] = arg
    consts = tuple(_call_method_instead(c, old, new) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_code=bytes(raw), co_names=names, co_consts=consts)


def _optimizer_state_on_cpu(module):
    _bind_torch_on_cpu(module)
    for fn in _own_functions(module):
        fn.__code__ = _call_method_instead(fn.__code__, "cuda", "cpu")


def _model_moved_with_to(module):
    module.get_model.__code__ = _call_method_instead(module.get_model.__code__, "cuda", "to")


def _nothing_to_compile(module):
    def _compile_dependencies():
        """On CPU: no fused CUDA kernels to build, and no dataset index builder (see the patch)."""

    module._compile_dependencies = _compile_dependencies


_MT = "megatron.training."
CPU_PATCHES += (
    CpuPatch(
        "mindspeed_megatron_basic",
        ("mindspeed.core.megatron_basic.megatron_basic",),
        "MindSpeed's replacements of the distributed optimizer's load_state_dict and the checkpoint writer's "
        "preload_tensors make state on torch.cuda.current_device() and call torch.cuda.synchronize(), the NPU "
        "under torch_npu's mapping; in this module torch is the view of torch_cuda_calls",
        _bind_torch_on_cpu,
    ),
    CpuPatch(
        "mindspeed_adamw",
        ("mindspeed.core.optimizer.adamw",),
        "MindSpeed's adaptor makes Megatron's Adam its own AdamW (torch._fused_adamw_, registered as "
        "apex.optimizers.FusedAdam), which keeps its step count on torch.cuda.current_device() and moves "
        "it there with Tensor.cuda(), both NPU under torch_npu's mapping; in this module they mean the CPU",
        _optimizer_state_on_cpu,
    ),
    CpuPatch(
        "training_cuda_device",
        (_MT + "initialize", _MT + "training", _MT + "checkpointing", _MC + "timers"),
        "Megatron-LM's loop asks torch.cuda for its device: initialize_megatron asserts is_available(), "
        "makes the model-parallel groups and seeds only when device_count() > 0 and calls set_device(); "
        "get_model moves the model to current_device(); checkpoints save and restore get_rng_state(); "
        "timers synchronize(); in these modules torch.cuda is one device, the CPU, with its generator",
        _bind_torch_with_cpu_device,
    ),
    CpuPatch(
        "training_cuda_device_string",
        (_MT + "initialize", _MT + "training", _MT + "checkpointing", "mindspeed_mm.training"),
        "the loop makes tensors with device='cuda' (the JIT warm-up's, the data flags, the start time, the "
        "logged loss sums, the checkpoint iteration check); the constant 'cuda' becomes 'cpu' in these "
        "modules' code",
        _constant_swapper({"cuda": "cpu"}),
    ),
    CpuPatch(
        "training_model_to_device",
        (_MT + "training",),
        "get_model moves each model chunk with Module.cuda(torch.cuda.current_device()), which only takes a "
        "CUDA device; there it calls Module.to(device) instead, with the device training_cuda_device gives",
        _model_moved_with_to,
    ),
    CpuPatch(
        "training_nothing_to_compile",
        (_MT + "initialize",),
        "initialize_megatron compiles Megatron's fused CUDA kernels (nvcc) and the C++ index builder of its "
        "GPT/BERT datasets into the Megatron source tree (MindSpeed's adaptor keeps only the latter on NPU); "
        "on CPU there are no CUDA kernels, mm-grpo's entries read no Megatron dataset, and the tree may be "
        "read-only (a shared checkout), so nothing is compiled",
        _nothing_to_compile,
    ),
)


class _PatchingLoader(importlib.abc.Loader):
    """Executes a module with its own loader, then applies the patches registered for it."""

    def __init__(self, loader, patches):
        self._loader, self._patches = loader, patches

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for patch in self._patches:
            _apply(patch, module)

    def __getattr__(self, name):  # get_source, get_code, is_package... for inspect and pkgutil
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the target modules each time they are executed (import, reload).

    Targets are plain files, as megatron-core installs them, so the stock PathFinder finds them.
    """

    def __init__(self):
        self.patches: dict[str, list[CpuPatch]] = {}  # module name -> patches, in declaration order

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, tuple(self.patches[name]))
        return spec


_HOOK = _PatchOnImport()
_APPLIED: set[tuple[str, str]] = set()  # (patch name, module name)


def _apply(patch: CpuPatch, module: types.ModuleType):
    patch.apply(module)
    _APPLIED.add((patch.name, module.__name__))


def arm_patches(patches) -> tuple[str, ...]:
    """Register `patches` (idempotent): targets already imported are patched now, the others
    when they are imported. Returns the patches' names."""
    for patch in patches:
        for target in patch.targets:
            registered = _HOOK.patches.setdefault(target, [])
            if patch not in registered:
                registered.append(patch)
                if target in sys.modules:
                    _apply(patch, sys.modules[target])
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    return tuple(p.name for p in patches)


def apply_cpu_patches() -> tuple[str, ...]:
    """Arm the CPU patch set (the patches this megatron-core needs); returns their names."""
    return arm_patches(tuple(p for p in CPU_PATCHES if p.needed()))


def applied_targets(name: str) -> tuple[str, ...]:
    """Modules that patch `name` has been applied to so far."""
    return tuple(sorted(m for p, m in _APPLIED if p == name))
