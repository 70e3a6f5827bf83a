"""Fixtures shared by single-process tests (import them into a test module to use them)."""
import pytest


@pytest.fixture(scope="module")
def parallel_1proc():
    """torch.distributed with one gloo process and megatron-core's groups (all sizes 1)."""
    from mm_grpo.parallel import destroy_parallel, initialize_parallel
    initialize_parallel()
    yield
    destroy_parallel()


@pytest.fixture
def peft_without_mindspeed_te_dummies(monkeypatch):
    """In MindSpeed-MM's environment MindSpeed's Transformer Engine shim defines dummy
    `transformer_engine.pytorch` classes (torch.nn.Module itself, no LayerNormMLP): peft would take
    every linear for a TE one and fail. Tests whose reference side is plain diffusers + peft use this."""
    from peft.tuners.lora import te
    monkeypatch.setattr(te, "is_te_pytorch_available", lambda: False)
