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
        "Ascend's torch backend: needs CANN and an NPU. MindSpeed-MM and MindSpeed import it (and "
        "torch_npu.contrib.transfer_to_npu, which maps cuda to npu) at module level; the stand-in "
        "imports, answers torch_npu.npu.current_device() with the CPU and raises on every NPU kernel "
        "(tests/standins/npu_only.py)."),
    "torchair": (
        "Ascend's torch graph compiler (CANN): MindSpeed's op builders import it at module level; "
        "same stand-in as torch_npu."),
    "mindspeed.megatron_adaptor": (
        "patches Megatron for the NPU at import (torch_npu's cuda->npu mapping, HCCL process-group "
        "options, Ascend kernels built against CANN), which on CPU is mm-grpo's CPU patch set's job; "
        "the stand-in applies MindSpeed's own argument handling and multi-tensor pipeline schedule "
        "with MindSpeed's patch manager (tests/standins/mindspeed_megatron_adaptor.py)."),
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
    """Serves the stand-ins of STANDINS; everything else (the rest of `mindspeed` included) is real."""

    FILES = {"mindspeed.megatron_adaptor": os.path.join(STANDIN_DIR, "mindspeed_megatron_adaptor.py")}

    def find_spec(self, name, path, target=None):
        if name in self.FILES:
            return importlib.util.spec_from_file_location(name, self.FILES[name])
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


def adapt_megatron_first():
    """What `import mm_grpo` does on an NPU, before Megatron is imported: MindSpeed's Megatron
    adaptor (here its stand-in). MindSpeed-MM's environment runs every test process this way
    (tests/conftest.py, tests/standins/sitecustomize.py)."""
    if "mindspeed.megatron_adaptor" in sys.modules:
        return
    if "megatron.core" in sys.modules:
        raise RuntimeError("megatron.core was imported before MindSpeed's adaptor: install the testbed first")
    install_standins()
    importlib.import_module("mindspeed.megatron_adaptor")


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
