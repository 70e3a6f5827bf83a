from tests.testbed import adapt_megatron_first, has_megatron_training

if has_megatron_training():  # MindSpeed-MM's environment: MindSpeed's adaptor before Megatron, as on NPU
    adapt_megatron_first()

import pytest

from mm_grpo.pipeline.tiny import build_tiny_pipeline


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny diffusers FLUX pipeline folder (mm_grpo.pipeline.tiny, seed 0), built once per session."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux") / "pipeline", seed=0)


# Tests marked `mindspeed_mm` run the real MindSpeed-MM code (tests/testbed.py). They need
# MindSpeed-MM's environment: its dependencies and Megatron-LM's source tree with
# `megatron.training` (MM_GRPO_ENV=mindspeed-mm bash shell/run_tests.sh). Elsewhere they are
# deselected, not skipped: .ci/run runs both environments, so nothing is skipped in CI.
def pytest_collection_modifyitems(config, items):
    from tests.testbed import has_megatron_training
    if has_megatron_training():
        return
    keep = [i for i in items if "mindspeed_mm" not in i.keywords]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "mindspeed_mm" in i.keywords])
        items[:] = keep


def pytest_report_header(config):
    from tests.testbed import TESTBED, has_megatron_training
    import megatron.core
    env = "MindSpeed-MM (Megatron-LM tree)" if has_megatron_training() else "megatron-core wheel"
    return [f"megatron: {megatron.core.__file__} ({env}); MindSpeed-MM testbed: {TESTBED}",
            *([] if has_megatron_training() else
              ["tests marked mindspeed_mm are deselected here: MM_GRPO_ENV=mindspeed-mm bash shell/run_tests.sh"])]
