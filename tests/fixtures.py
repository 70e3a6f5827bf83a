"""Fixtures shared by single-process tests (import them into a test module to use them)."""
import pytest


@pytest.fixture(scope="module")
def parallel_1proc():
    """torch.distributed with one gloo process and megatron-core's groups (all sizes 1)."""
    from mm_grpo.parallel import destroy_parallel, initialize_parallel
    initialize_parallel()
    yield
    destroy_parallel()
