import gc
import os

# Inductor compiles in the test process itself. Otherwise torch 2.7 (MindSpeed-MM's environment) starts
# a pool of compile processes in every process that imports inductor, each pool about 1.9 GB and
# seconds of CPU: pytest's, every trainer and converter a test starts, torchrun's agent and every
# worker. Set before torch is imported; the processes the tests start inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from tests.env_split import left_out_here
from tests.testbed import adapt_megatron_first, default_only_left_out, has_megatron_training

if has_megatron_training():  # MindSpeed-MM's environment: MindSpeed's adaptor before Megatron, as on NPU
    adapt_megatron_first(argv=[])  # pytest's flags are not MindSpeed's

import pytest

from mm_grpo.families.flux.tiny import build_tiny_pipeline
from tests.threads import threads_over_bound


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny diffusers FLUX pipeline folder (mm_grpo.families.flux.tiny, seed 0), built once per session."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux") / "pipeline", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image_pipeline_dir(tmp_path_factory):
    """A tiny diffusers Qwen-Image pipeline folder (mm_grpo.families.qwen_image.tiny, seed 0), built once per session."""
    from mm_grpo.families.qwen_image.tiny import build_tiny_pipeline as build_tiny_qwen_image
    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image") / "pipeline", seed=0)


def pytest_collection_finish(session):
    # Everything imported so far lives as long as the process: out of the collector's sight, so that
    # the full collections that free a layout's process groups (destroy_parallel) do not walk every
    # object of MindSpeed-MM, the testbed, transformers and diffusers (docs/running.md#tests).
    gc.freeze()


@pytest.fixture(autouse=True)
def bounded_threads():
    """Fails the test after which pytest's process holds more threads than tests/threads.py allows."""
    yield
    if (complaint := threads_over_bound()) is not None:
        pytest.fail(complaint)


# The two environments split the suite (docs/running.md#tests):
# - `mindspeed_mm` tests run the real MindSpeed-MM code (tests/testbed.py) and need MindSpeed-MM's
#   environment (Megatron-LM's tree with `megatron.training`): deselected in the default one.
# - The tests listed in tests/default_env_only.txt run in the default one only, unless
#   MM_GRPO_TEST_ALL=1: every line they run in MindSpeed-MM's environment, the tests kept there run
#   too (measured there: `python -m tests.env_split`; the listed torchrun checks: worker.py).
# Deselected, not skipped: the test command runs both environments, so nothing is skipped in CI.
def deselected(item):
    if not has_megatron_training():
        return "mindspeed_mm" in item.keywords
    return item.nodeid in left_out_here()


def pytest_collection_modifyitems(config, items):
    keep, left_out = [], []
    for item in items:
        (left_out if deselected(item) else keep).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep


def pytest_report_header(config):
    from tests.testbed import TESTBED
    import megatron.core
    env = "MindSpeed-MM (Megatron-LM tree)" if has_megatron_training() else "megatron-core wheel"
    if not has_megatron_training():
        why = "tests marked mindspeed_mm are deselected here: MM_GRPO_ENV=mindspeed-mm bash shell/run_tests.sh"
    elif default_only_left_out():
        why = ("the tests and torchrun checks listed in tests/default_env_only.txt run in the default environment "
               "only (MM_GRPO_TEST_ALL=1 runs them here)")
    else:
        why = None
    return [f"megatron: {megatron.core.__file__} ({env}); MindSpeed-MM testbed: {TESTBED}", *([why] if why else [])]
