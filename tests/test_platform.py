"""The accelerator adaptor: detection, forcing, the NPU path, and the patch machinery.

Megatron itself on CPU (each patched call, DDP + optimizer + schedule) is in
test_platform_megatron.py.
"""
import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import mm_grpo  # noqa: F401  (runs init_platform)
from mm_grpo.platform import Platform, adaptor, cpu_patches, get_platform, init_platform
from tests.testbed import STANDIN_DIR
from tests.utils import assert_one_line_error

NPU_MACHINE = os.path.join(STANDIN_DIR, "npu_machine")


# ---- the platform of this process -----------------------------------------------------------

def test_cpu_platform_contract():
    p = get_platform()
    assert isinstance(p, Platform)
    assert (p.name, p.device, p.dist_backend) == ("cpu", torch.device("cpu"), "gloo")
    assert p.patches == tuple(x.name for x in cpu_patches.CPU_PATCHES if x.needed())
    assert p.patches[:4] == ("cuda_device_string", "cuda_tensor_type", "torch_cuda_calls", "cuda_rng_state")
    megatron_0_12 = {"tensor_cuda_method", "async_save_sync", "fp8_cast_without_fp8"}
    assert (megatron_0_12 & set(p.patches)) == (
        megatron_0_12 if cpu_patches.megatron_core_version() < (0, 13) else set())
    assert init_platform() is p and init_platform(force="cpu") is p  # idempotent


def test_cpu_platform_helpers():
    p = get_platform()
    p.synchronize()  # no-op, must not touch CUDA
    with torch.autocast(p.device.type, dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with open("/proc/self/status") as f:  # the kernel's own peak-RSS figure, in kB
        vm_hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    assert p.max_memory_allocated() == pytest.approx(vm_hwm, rel=0.05)


def test_ordinary_torch_is_untouched():
    """Outside the patched Megatron modules torch still has no CUDA."""
    assert not torch.cuda.is_available()
    for call in (torch.cuda.synchronize, torch.cuda.current_device, lambda: torch.zeros(1, device="cuda"),
                 lambda: torch.ones(1).cuda(), torch.cuda.get_rng_state):
        with pytest.raises((RuntimeError, AssertionError)):
            call()
    state = torch.get_rng_state()
    torch.cuda.manual_seed(7)  # lazy and CUDA-only: must not reseed the CPU generator
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_torch_view_inside_megatron_modules():
    from megatron.core.pipeline_parallel import p2p_communication
    view = p2p_communication.torch
    assert view is not torch and view.zeros is torch.zeros and view.distributed is torch.distributed
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.cuda.synchronize() is None
    assert not view.cuda.is_available()  # forwarded to the real torch.cuda
    view.cuda.manual_seed(11)
    torch.testing.assert_close(view.cuda.get_rng_state(), torch.Generator().manual_seed(11).get_state())


# ---- forcing and detection ------------------------------------------------------------------

@pytest.fixture
def fresh_platform(monkeypatch):
    """init_platform as in a new process (restored afterwards); no GPU or NPU unless a test fakes one."""
    monkeypatch.setattr(adaptor, "_PLATFORM", None)
    monkeypatch.delenv("MM_GRPO_DEVICE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(adaptor, "_npu_available", lambda: False)
    return monkeypatch


def _no_cpu_patches():
    raise AssertionError("CPU patches applied on an accelerator")


def test_detects_cuda_without_cpu_patches(fresh_platform):
    fresh_platform.setattr(torch.cuda, "is_available", lambda: True)
    fresh_platform.setenv("LOCAL_RANK", "3")
    fresh_platform.setattr(adaptor, "apply_cpu_patches", _no_cpu_patches)
    p = init_platform()
    assert (p.name, p.device, p.dist_backend, p.patches) == ("cuda", torch.device("cuda", 3), "nccl", ())


def test_env_forces_cpu_over_cuda(fresh_platform):
    fresh_platform.setattr(torch.cuda, "is_available", lambda: True)
    fresh_platform.setenv("MM_GRPO_DEVICE", "cpu")
    p = init_platform()
    assert (p.name, p.dist_backend) == ("cpu", "gloo") and "torch_cuda_calls" in p.patches


def test_force_argument_beats_env(fresh_platform):
    fresh_platform.setattr(torch.cuda, "is_available", lambda: True)
    fresh_platform.setenv("MM_GRPO_DEVICE", "cpu")
    fresh_platform.setattr(adaptor, "apply_cpu_patches", _no_cpu_patches)
    assert init_platform(force="cuda").name == "cuda"


@pytest.mark.parametrize("force, env, message", [
    ("tpu", None, "unknown device 'tpu'"),
    (None, "gpu", "unknown device 'gpu'"),
    ("cuda", None, "torch.cuda.is_available() is False"),
    (None, "npu", "torch_npu is not installed"),
])
def test_bad_device_requests(fresh_platform, force, env, message):
    if env:
        fresh_platform.setenv("MM_GRPO_DEVICE", env)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        init_platform(force=force)


def test_no_switch_after_init():
    with pytest.raises(ValueError, match="already initialised as 'cpu'.*MM_GRPO_DEVICE"):
        init_platform(force="cuda")


_NPU_REPORT = """
import json, sys, mm_grpo, torch_npu
p = mm_grpo.get_platform()
print(json.dumps({"name": p.name, "device": str(p.device), "backend": p.dist_backend,
                  "patches": list(p.patches), "events": torch_npu.EVENTS,
                  "megatron_imported": "megatron.core" in sys.modules,
                  "hooked": any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)}))
"""


def test_npu_path_with_the_npu_machine_standin():
    """torch_npu and MindSpeed's adaptor as on an NPU machine (tests/testbed.py, STANDINS), in a
    subprocess: the platform fields, and the two imports in order with Megatron not yet imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [NPU_MACHINE, os.environ.get("PYTHONPATH")])),
               LOCAL_RANK="2", PYTHONWARNINGS="ignore")
    env.pop("MM_GRPO_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _NPU_REPORT], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"name": "npu", "device": "npu:2", "backend": "hccl", "patches": [],
                      "events": ["transfer_to_npu", "megatron_adaptor, megatron.core imported: False"],
                      "megatron_imported": False, "hooked": False}


# ---- the patch machinery --------------------------------------------------------------------

def test_constant_swap_reaches_nested_code_and_tuples():
    def f(t):
        inner = lambda: "cuda"  # noqa: E731
        return "cuda", t in ["torch.cuda.HalfTensor", "x"], inner(), "cudax"

    mapping = {"cuda": "cpu", "torch.cuda.HalfTensor": "torch.HalfTensor"}
    f.__code__ = cpu_patches._swap_code_constants(f.__code__, mapping)
    assert f("torch.HalfTensor") == ("cpu", True, "cpu", "cudax")  # exact matches only


_SYNTHETIC = '''
import contextlib, functools
from json import dumps

def plain():
    return "cuda"

@contextlib.contextmanager
def managed():
    yield "cuda"

@functools.lru_cache
def cached():
    return "cuda"

class Thing:
    def method(self):
        return "cuda"

    @staticmethod
    def static():
        return "cuda"

    @classmethod
    def klass(cls):
        return "cuda"

    @property
    def prop(self):
        return "cuda"
'''


@pytest.fixture
def synthetic_module(tmp_path, monkeypatch):
    """An importable module `mmgrpo_synthetic_<n>` whose functions all return 'cuda'."""
    name = f"mmgrpo_synthetic_{len(os.listdir(tmp_path))}"
    (tmp_path / f"{name}.py").write_text(_SYNTHETIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    cpu_patches._HOOK.patches.pop(name, None)


def _returns(module):
    thing = module.Thing()
    with module.managed() as managed:
        return [module.plain(), managed, module.cached(), thing.method(), module.Thing.static(),
                module.Thing.klass(), thing.prop]


def _counting_patch(target, calls):
    def apply(module):
        calls.append(module.__name__)
        cpu_patches._constant_swapper({"cuda": "cpu"})(module)
    return cpu_patches.CpuPatch("test_swap", (target,), "test", apply)


def test_patch_applies_on_import_to_all_own_functions(synthetic_module):
    import json
    dumps_code = json.dumps.__code__
    calls = []
    assert cpu_patches.arm_patches([_counting_patch(synthetic_module, calls)]) == ("test_swap",)
    assert calls == []  # not imported yet: nothing patched, nothing imported
    module = importlib.import_module(synthetic_module)
    assert calls == [synthetic_module]
    assert _returns(module) == ["cpu"] * 7
    assert json.dumps.__code__ is dumps_code  # imported from elsewhere: untouched
    assert '"cuda"' in inspect.getsource(module.plain)  # the loader still serves the source
    importlib.reload(module)  # re-executed code is patched again
    assert calls == [synthetic_module] * 2 and _returns(module) == ["cpu"] * 7


def test_patch_applies_at_once_to_imported_module_and_only_once(synthetic_module):
    module = importlib.import_module(synthetic_module)
    assert _returns(module) == ["cuda"] * 7
    module.cached.cache_clear()  # a value cached before patching would stay cached
    calls = []
    patch = _counting_patch(synthetic_module, calls)
    cpu_patches.arm_patches([patch])
    cpu_patches.arm_patches([patch])
    assert calls == [synthetic_module]
    assert _returns(module) == ["cpu"] * 7
    assert sum(isinstance(f, cpu_patches._PatchOnImport) for f in sys.meta_path) == 1


def test_cpu_patches_reached_their_imported_targets():
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    assert cpu_patches.apply_cpu_patches() == get_platform().patches  # idempotent
    for patch in cpu_patches.CPU_PATCHES:
        if patch.needed():
            imported = {t for t in patch.targets if t in sys.modules}
            assert imported <= set(cpu_patches.applied_targets(patch.name)), patch.name
            # megatron.core's targets are all imported by now (megatron.training is not always there)
            assert imported or not any(t.startswith("megatron.core.") for t in patch.targets), patch.name


def test_megatron_0_12_patches_only_for_megatron_0_12(monkeypatch):
    from megatron.core import package_info
    assert cpu_patches.megatron_core_version() == (package_info.MAJOR, package_info.MINOR)
    gated = [p for p in cpu_patches.CPU_PATCHES
             if p.name in ("tensor_cuda_method", "async_save_sync", "fp8_cast_without_fp8")]
    assert len(gated) == 3
    for version, needed in [((0, 12), True), ((0, 16), False), (None, False)]:
        monkeypatch.setattr(cpu_patches, "megatron_core_version", lambda v=version: v)
        assert all(patch.needed() is needed for patch in gated)


def test_method_rename_only_where_the_name_is_only_a_method():
    def method_only(t):
        inner = lambda: t.cuda()  # noqa: E731
        return t.cuda(), inner()

    def also_attribute(t):
        return t.cuda(), torch.cuda.is_available

    t = torch.ones(2)
    for fn in (method_only, also_attribute):
        with pytest.raises((RuntimeError, AssertionError)):  # no GPU
            fn(t)
        fn.__code__ = cpu_patches._rename_methods(fn.__code__, {"cuda": "cpu"})
    assert all(r is t for r in method_only(t))  # Tensor.cpu() of a CPU tensor is the tensor
    with pytest.raises((RuntimeError, AssertionError)):  # `torch.cuda` beside it: left as it was
        also_attribute(t)


def test_fp8_cast_without_fp8_params_does_nothing():
    module = type(sys)("fake_fp8_utils")

    def raise_without_te(*args, **kwargs):
        raise RuntimeError("Invalid Transformer Engine version for FP8 distributed optimizer")

    module._quantize_param_shard_impl = raise_without_te
    patch = next(p for p in cpu_patches.CPU_PATCHES if p.name == "fp8_cast_without_fp8")
    patch.apply(module)
    assert module._quantize_param_shard_impl([], [], [], None) is None
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        module._quantize_param_shard_impl([torch.ones(1)], [torch.ones(1)], [0], None)


# ---- the megatron-core in use -----------------------------------------------------------------

def test_import_names_the_megatron_core_in_use():
    import megatron.core
    from megatron.core import package_info
    used = mm_grpo.MEGATRON
    assert used.path == os.path.realpath(os.path.dirname(megatron.core.__file__))
    assert used.version == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    assert str(used) == f"megatron.core {package_info.__version__} at {used.path}"


@pytest.mark.parametrize("version, supported", [
    ((0, 11, 0), False), ((0, 12, 1), True), ((0, 13, 0), True), ((0, 16, 1), True), ((0, 17, 0), False),
    ((1, 0, 0), False)])
def test_megatron_core_versions(monkeypatch, version, supported):
    from mm_grpo.platform import megatron_core
    core = megatron_core.MegatronCore("/x/megatron/core", version)
    monkeypatch.setattr(megatron_core, "find_megatron_core", lambda: core)
    if supported:
        assert megatron_core.check_megatron_core() is core
    else:
        assert_one_line_error(megatron_core.check_megatron_core,
                              rf"megatron.core {'.'.join(map(str, version))} at /x/megatron/core is not "
                              r"supported: mm_grpo runs on megatron-core 0.12.x to 0.16.x", ImportError)


def test_missing_megatron_core_is_refused(monkeypatch):
    from mm_grpo.platform import megatron_core
    monkeypatch.setattr(megatron_core, "find_megatron_core", lambda: None)
    assert_one_line_error(megatron_core.check_megatron_core,
                          r"mm_grpo needs megatron.core and none is importable: pip install -e \"\.\[megatron\]\"",
                          ImportError)


def _fake_megatron_tree(root, version):
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    major, minor, patch = version
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    return os.path.realpath(core)


@pytest.mark.parametrize("version", [(0, 17, 0), (0, 13, 2)], ids=["unsupported", "supported"])
def test_import_with_a_second_megatron_tree_first_on_the_path(tmp_path, version):
    """A Megatron tree put before the installed one is the one used (and named); the other is
    reported as shadowed, and an unsupported version stops `import mm_grpo` in one line."""
    fake = _fake_megatron_tree(tmp_path, version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    code = "import warnings; warnings.simplefilter('always'); import mm_grpo; print('USES', mm_grpo.MEGATRON)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    real = mm_grpo.MEGATRON.path
    if version == (0, 17, 0):
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert last == (f"ImportError: megatron.core 0.17.0 at {fake} is not supported: mm_grpo runs on "
                        "megatron-core 0.12.x to 0.16.x")
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"USES megatron.core 0.13.2 at {fake}" in proc.stdout
        assert f"two Megatron installs: mm_grpo uses megatron.core 0.13.2 at {fake}; the copy at {real} is shadowed" \
            in proc.stderr
