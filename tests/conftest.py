import gc
import os

# Inductor compiles in the test process itself. Otherwise torch 2.7 (MindSpeed-MM's environment) starts
# a pool of compile processes in every process that imports inductor, each pool about 1.9 GB and
# seconds of CPU: pytest's, every trainer and converter a test starts, torchrun's agent and every
# worker. Set before torch is imported; the processes the tests start inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from tests.testbed import adapt_megatron_first, env_independent_deselected, has_megatron_training

if has_megatron_training():  # MindSpeed-MM's environment: MindSpeed's adaptor before Megatron, as on NPU
    adapt_megatron_first()

import pytest

from mm_grpo.pipeline.tiny import build_tiny_pipeline
from tests.threads import threads_over_bound


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny diffusers FLUX pipeline folder (mm_grpo.pipeline.tiny, seed 0), built once per session."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux") / "pipeline", seed=0)


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
# - `env_independent` modules execute no code of the packages whose versions differ between the
#   environments (Megatron, MindSpeed, MindSpeed-MM, transformers, diffusers; measured by
#   `python -m tests.env_split`): they run in the default one only, unless MM_GRPO_TEST_ALL=1.
# Deselected, not skipped: the test command runs both environments, so nothing is skipped in CI.
def deselected_mark():
    if not has_megatron_training():
        return "mindspeed_mm"
    return "env_independent" if env_independent_deselected() else None


def pytest_collection_modifyitems(config, items):
    mark = deselected_mark()
    if mark is None:
        return
    keep = [i for i in items if mark not in i.keywords]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if mark in i.keywords])
        items[:] = keep


def pytest_report_header(config):
    from tests.testbed import TESTBED, has_megatron_training
    import megatron.core
    env = "MindSpeed-MM (Megatron-LM tree)" if has_megatron_training() else "megatron-core wheel"
    why = {"mindspeed_mm": "tests marked mindspeed_mm are deselected here: MM_GRPO_ENV=mindspeed-mm bash shell/run_tests.sh",
           "env_independent": "modules marked env_independent run in the default environment only (MM_GRPO_TEST_ALL=1 runs them here)"}
    mark = deselected_mark()
    return [f"megatron: {megatron.core.__file__} ({env}); MindSpeed-MM testbed: {TESTBED}",
            *([why[mark]] if mark else [])]
