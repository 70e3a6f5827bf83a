import pytest

from mm_grpo.pipeline.tiny import build_tiny_pipeline


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny diffusers FLUX pipeline folder (mm_grpo.pipeline.tiny, seed 0), built once per session."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux") / "pipeline", seed=0)
