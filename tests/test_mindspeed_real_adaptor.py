"""MindSpeed's real Megatron adaptor in MindSpeed-MM's environment (docs/adaptor.md#mindspeeds-adaptor-on-cpu).

Every test process there imports `mindspeed.megatron_adaptor` itself, unmodified, before Megatron
(tests/testbed.py: only torch_npu, torchair and CANN are stood in for). These tests pin what that
import does and what mm-grpo does about it."""
import dataclasses
import os
import sys

import pytest

from tests.testbed import TESTBED, require_testbed

pytestmark = pytest.mark.mindspeed_mm


def test_the_real_adaptor_applies_every_feature_its_defaults_enable():
    require_testbed(needs_megatron_training=True)
    from mindspeed.args_utils import get_mindspeed_args
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager
    adaptor = sys.modules["mindspeed.megatron_adaptor"]
    assert os.path.realpath(adaptor.__file__).startswith(os.path.realpath(TESTBED))  # not a stand-in
    enabled = [f for f in MindSpeedFeaturesManager.FEATURES_LIST if f.is_need_apply(get_mindspeed_args())]
    names = {type(f).__name__ for f in enabled}
    assert {"MegatronBasicFeature", "RequirementsBasicFeature", "TransformerEngineBasicFeature",
            "FusedEmaAdamwFeature"} <= names, names
    patches = MindSpeedPatchesManager.patches_info
    not_applied = [name for name, patch in patches.items() if not patch.is_applied]
    assert patches and not not_applied, not_applied
    # What the counts in docs/adaptor.md are (printed with -s).
    print(f"{len(enabled)} of {len(MindSpeedFeaturesManager.FEATURES_LIST)} features enabled, "
          f"{len(patches)} patches, all applied")


def test_megatron_optimizer_is_mindspeeds_adamw_on_the_cpu():
    """MindSpeed makes Megatron's Adam its fused AdamW; the CPU patch `mindspeed_adamw` keeps its step
    count on the CPU. One step equals torch's AdamW."""
    require_testbed(needs_megatron_training=True)
    import torch
    from megatron.core.optimizer import Adam
    from mindspeed.core.optimizer.adamw import AdamW
    assert Adam is AdamW
    torch.manual_seed(0)
    weights = [torch.randn(5, 3, requires_grad=True) for _ in range(2)]
    reference = [w.detach().clone().requires_grad_() for w in weights]
    for params, optimizer in ((weights, AdamW), (reference, torch.optim.AdamW)):
        for p in params:
            p.grad = torch.full_like(p, 0.5) * p.detach()
        opt = optimizer(params, lr=0.1, weight_decay=0.01)
        opt.step()
        opt.step()
    for w, r in zip(weights, reference):
        torch.testing.assert_close(w, r)


def test_flux_transformer_config_ignores_the_command_lines_megatron_arguments():
    """MindSpeed's TransformerConfig.__init__ fills the fields a caller leaves out from Megatron's parsed
    arguments (MindSpeed-MM's `pretrain` sets them): FLUX's config passes every field, so each equals
    the one Megatron's own __init__ makes; MindSpeed's flags still arrive as extra attributes."""
    require_testbed(needs_megatron_training=True)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from mindspeed.patch_utils import MindSpeedPatchesManager
    from mm_grpo.families.flux.transformer.config import FluxConfig
    from mm_grpo.families.flux.transformer.model import transformer_config
    from mm_grpo.parallel.state import destroy_parallel, initialize_parallel
    # pretrain_flux.sh's flags that name TransformerConfig fields or change their defaults.
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-5", "--train-iters", "5", "--bf16", "--seq-length", "1",
            "--max-position-embeddings", "1", "--use-multiparameter-pipeline-model-parallel",
            "--context-parallel-algo", "ulysses_cp_algo"]
    command_line, sys.argv = sys.argv, ["pretrain_sora.py", *argv]
    try:
        args = parse_args()
    finally:
        sys.argv = command_line
    config = FluxConfig.preset("tiny")
    patches = MindSpeedPatchesManager.patches_info
    megatrons_own = [patches[f"megatron.core.transformer.transformer_config.TransformerConfig.{name}"]
                     for name in ("__init__", "__post_init__")]
    initialize_parallel()
    previous, global_vars._GLOBAL_ARGS = global_vars._GLOBAL_ARGS, args
    try:
        under_mindspeed = transformer_config(config)
        for patch in megatrons_own:
            setattr(TransformerConfig, patch.orig_func_name, patch.orig_func)
        try:
            megatrons = transformer_config(config)
        finally:
            for patch in megatrons_own:
                setattr(TransformerConfig, patch.orig_func_name, patch.final_patch_func)
    finally:
        global_vars._GLOBAL_ARGS = previous
        destroy_parallel()
    differing = {f.name: (getattr(megatrons, f.name), getattr(under_mindspeed, f.name))
                 for f in dataclasses.fields(TransformerConfig)
                 if not callable(getattr(megatrons, f.name)) and getattr(megatrons, f.name) != getattr(under_mindspeed, f.name)}
    assert not differing, differing
    assert under_mindspeed.use_multiparameter_pipeline_model_parallel is True  # MindSpeed's flag, injected
