"""The real MindSpeed-MM stack for contract tests, and the only stand-ins the tests use.

`$MINDSPEED_MM_TESTBED` (default `../shared/mindspeed_mm_testbed` beside the repository) holds
unmodified MindSpeed-MM, MindSpeed and Megatron-LM core_v0.12.1 trees; point it at your own
checkout to run the same tests against it. Its layout: `MindSpeed-MM/` (packages `mindspeed_mm`,
`checkpoint`), `MindSpeed/` (package `mindspeed`), `Megatron-LM/` (package `megatron`, which
the MindSpeed-MM environment puts on PYTHONPATH itself, as MindSpeed-MM users do).

STANDINS below is every stand-in, with its reason: only what needs `torch_npu` / CANN, which a
CPU machine cannot have. Everything else runs as shipped.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN_DIR = os.path.join(REPO, "tests", "standins")
TESTBED = os.path.abspath(os.environ.get(
    "MINDSPEED_MM_TESTBED", os.path.join(REPO, "..", "shared", "mindspeed_mm_testbed")))
# Folders of the testbed that go on sys.path (Megatron-LM is the environment's choice, see above).
TESTBED_PATHS = tuple(os.path.join(TESTBED, d) for d in ("MindSpeed-MM", "MindSpeed"))

STANDINS = {
    "torch_npu": (
        "Ascend's torch backend: a C extension built against CANN, needs an NPU. MindSpeed-MM and "
        "MindSpeed (its real Megatron adaptor included) import it at module level; the stand-in imports "
        "with every submodule, answers torch_npu.npu.current_device() with the CPU (and synchronize() with nothing to wait for), lacks what a gloo "
        "group cannot take (HCCL options), constructs the profiler's set-up objects MindSpeed-MM's train "
        "builds even when not profiling, and raises on every NPU kernel when called "
        "(tests/standins/npu_only.py). torch_npu.contrib.transfer_to_npu, which maps cuda to the NPU "
        "for every module, does nothing: on CPU mm-grpo's CPU patch set maps cuda to the CPU, module by "
        "module (docs/adaptor.md)."),
    "torchair": (
        "Ascend's torch graph compiler (CANN): MindSpeed's op builders import it at module level and "
        "register their ops' graph converters with it (the stand-in's registrars return the function "
        "unchanged); same stand-in as torch_npu (tests/standins/npu_only.py)."),
    "torch_npu's fused kernels": (
        "npu_fusion_attention, npu_rms_norm, npu_rotary_mul, which mm_grpo/kernels.py calls on an NPU: "
        "Ascend kernels (CANN's aclnn ops) that run only on an NPU. The stand-in torch_npu carries CPU "
        "references of them written from their documented contracts (docs/adaptor.md, \"Fused NPU "
        "kernels: contracts\"): every argument checked first, float64 values rounded once to the "
        "documented output dtype (tests/standins/npu_kernels.py)."),
    "torch_npu and mindspeed.megatron_adaptor on an NPU machine": (
        "the platform adaptor's NPU path (tests/test_platform.py) needs a torch_npu that sees an NPU, "
        "whose transfer_to_npu runs before MindSpeed's adaptor and that before Megatron; the real ones "
        "need CANN and an NPU. A folder for a subprocess's PYTHONPATH: its torch_npu registers the 'npu' "
        "device with an NPU available, its transfer_to_npu and adaptor log the order they are imported in "
        "(tests/standins/npu_machine/)."),
    "CANN's set_env.sh": (
        "the Ascend install (MM_GRPO_ASCEND) that shell/launch_env.sh sources CANN from "
        "(tests/test_launch_env.py); CANN installs only where its drivers and an NPU are. A folder built "
        "per test: set_env.sh under cann/ or ascend-toolkit/, optionally putting a torch_npu that "
        "imports and sees no NPU on PYTHONPATH, and a `python` that answers as on an NPU machine "
        "(tests/standins/ascend_install.py)."),
}
_NPU_ONLY = ("torch_npu", "torchair")  # these and their submodules: tests/standins/npu_only.py


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if STANDIN_DIR not in sys.path:
            sys.path.insert(0, STANDIN_DIR)
        from npu_only import make_module
        return make_module(spec.name)

    def exec_module(self, module):
        pass


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Serves the stand-ins of STANDINS; everything else (`mindspeed` included) is real."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _NPU_ONLY:
            return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=True)
        return None


def testbed_missing() -> str | None:
    """Why the testbed cannot be used, in one line; None when it can."""
    for path in TESTBED_PATHS:
        if not os.path.isdir(path):
            return (f"MindSpeed-MM testbed not found: {path} is missing "
                    "(set MINDSPEED_MM_TESTBED to a folder with MindSpeed-MM/, MindSpeed/, Megatron-LM/)")
    return None


def install_standins():
    """Put the testbed and the stand-ins on this process's import path (idempotent).
    Refuses to stand in for torch_npu where the real one is installed."""
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path) and \
            importlib.util.find_spec("torch_npu") is not None:
        raise RuntimeError("torch_npu is installed here: the stand-ins are for CPU machines only")
    for path in (STANDIN_DIR, *TESTBED_PATHS):
        if path not in sys.path:
            sys.path.insert(0, path)
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())


def adapt_megatron_first(argv=None):
    """What `import mm_grpo` does on an NPU, before Megatron is imported: MindSpeed's Megatron
    adaptor, the real one. MindSpeed-MM's environment runs every test process this way
    (tests/conftest.py, tests/standins/sitecustomize.py).

    The adaptor parses this process's command line for its features' flags, once, at import
    (`mindspeed.args_utils.get_mindspeed_args`), and later injects them into every
    `TransformerConfig`. `argv` stands in for `sys.argv[1:]` there, for a process whose command line
    is not a training command (pytest's)."""
    if "mindspeed.megatron_adaptor" in sys.modules:
        return
    if "megatron.core" in sys.modules:
        raise RuntimeError("megatron.core was imported before MindSpeed's adaptor: install the testbed first")
    install_standins()
    command_line = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        importlib.import_module("mindspeed.megatron_adaptor")
    finally:
        sys.argv = command_line


class _AdaptorAsMegatronLoads(importlib.abc.MetaPathFinder):
    """`adapt_megatron_first` at the first import of `mm_grpo` or `megatron`, whichever comes first:
    paid only by the processes that use Megatron. Before mm_grpo, whose CPU patch set hooks the
    imports of Megatron's and MindSpeed-MM's modules: MindSpeed's adaptor must have imported its
    Megatron modules first, as on an NPU. For `megatron`, right after the package itself, before any
    of its modules (a loader that imports the adaptor then)."""

    def find_spec(self, name, path, target=None):
        if name not in ("mm_grpo", "megatron"):
            return None
        sys.meta_path.remove(self)
        if name == "mm_grpo":
            _adapt_in_mindspeed_mm_environment()
            return None  # mm_grpo itself is found as usual
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _ThenTheAdaptor(spec.loader)
        return spec


class _ThenTheAdaptor(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader  # None for a namespace package (Megatron-LM's tree has no megatron/__init__.py)

    def create_module(self, spec):
        return None if self.loader is None else self.loader.create_module(spec)

    def exec_module(self, module):
        if self.loader is not None:
            self.loader.exec_module(module)
        _adapt_in_mindspeed_mm_environment()

    def __getattr__(self, name):  # what else the package's loader answers (get_resource_reader, ...)
        return getattr(self.loader, name)


def _adapt_in_mindspeed_mm_environment():
    if has_megatron_training():  # MindSpeed-MM's environment (the wheel has no megatron.training)
        adapt_megatron_first()


def adapt_megatron_on_import():
    """`adapt_megatron_first` at this process's first import of mm_grpo or Megatron, for the
    processes a test starts (tests/standins/sitecustomize.py). Deferred, because helpers started with
    the stand-ins on PYTHONPATH import neither (jsonargparse's typeshed probe runs `python -c ...`):
    importing the adaptor up front cost each about 9 s of CPU in MindSpeed-MM's environment."""
    if "megatron" in sys.modules:
        _adapt_in_mindspeed_mm_environment()
    elif not any(isinstance(f, _AdaptorAsMegatronLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AdaptorAsMegatronLoads())


def subprocess_env(env=None) -> dict:
    """Environment for a child process that sees the testbed and the stand-ins."""
    env = dict(os.environ if env is None else env)
    paths = [STANDIN_DIR, *TESTBED_PATHS, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def has_megatron_training() -> bool:
    """Megatron-LM's `megatron.training` (MindSpeed-MM's environment) rather than the megatron-core
    wheel, which ships `megatron.core` only."""
    return importlib.util.find_spec("megatron.training") is not None


def default_only_left_out() -> bool:
    """Whether the tests and torchrun checks listed in tests/default_env_only.txt are left out here:
    in MindSpeed-MM's environment, unless MM_GRPO_TEST_ALL=1 (docs/running.md#tests)."""
    return has_megatron_training() and os.environ.get("MM_GRPO_TEST_ALL") != "1"


def require_testbed(needs_megatron_training=False):
    """Install the testbed for a test, or skip with one line saying why. In CI a missing testbed
    fails instead: the contract tests must never be skipped there."""
    why = testbed_missing()
    if why is None and needs_megatron_training and not has_megatron_training():
        why = ("needs Megatron-LM's megatron.training (the MindSpeed-MM environment: "
               "MM_GRPO_ENV=mindspeed-mm bash shell/run_tests.sh)")
    if why is not None:
        if os.environ.get("CI") == "true" and not needs_megatron_training:
            pytest.fail(why)
        pytest.skip(why)
    install_standins()
