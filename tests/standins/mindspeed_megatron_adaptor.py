"""Stand-in for `mindspeed.megatron_adaptor`: see tests/testbed.py.

The real module patches Megatron for the NPU at import: torch_npu's cuda->npu mapping, HCCL
process-group options in `initialize_model_parallel`, Ascend kernels compiled against CANN. On a
CPU those are what mm-grpo's CPU patch set replaces. This stand-in applies, with MindSpeed's own
functions and patch manager, the pure-Python parts a MindSpeed-MM entry script relies on:
MindSpeed's Transformer Engine shim, its argument handling (its features' arguments in
`parse_args`, their validation) and, when `--use-multiparameter-pipeline-model-parallel` is
given, the multi-tensor pipeline schedule that pretrain_sora.py uses under pipeline parallelism.
"""
import argparse
import sys

import torch
from mindspeed.args_utils import get_full_args, get_mindspeed_args  # noqa: F401  (re-exported, as the real one does)
from mindspeed.core.megatron_basic.arguments_basic import (parse_args_wrapper, print_args_wrapper,
                                                           validate_args_wrapper)
from mindspeed.core.megatron_basic.requirements_basic import version_wrapper
from mindspeed.features_manager.pipeline_parallel.multi_parameter import MultiParameterFeature
from mindspeed.patch_utils import MindSpeedPatchesManager

# MindSpeed's Transformer Engine shim (RequirementsBasicFeature.te_adaptation and
# TransformerEngineBasicFeature.pre_register_patches): dummy `transformer_engine` classes, so
# that megatron.core.extensions.transformer_engine, which MindSpeed-MM imports, imports. (Its
# other patches, e.g. torch.compile made a no-op, are for the NPU and are left out.)
for name in ("pytorch.LayerNorm", "pytorch.LayerNormLinear", "pytorch.DotProductAttention", "pytorch.Linear",
             "pytorch.GroupedLinear", "pytorch.distributed.CudaRNGStatesTracker", "common.recipe.DelayedScaling",
             "pytorch.tensor.QuantizedTensor"):
    MindSpeedPatchesManager.register_patch(f"transformer_engine.{name}", torch.nn.Module, create_dummy=True)
MindSpeedPatchesManager.register_patch("importlib.metadata.version", version_wrapper)  # the dummy's version
MindSpeedPatchesManager.apply_patches()

MindSpeedPatchesManager.register_patch("megatron.training.arguments.parse_args", parse_args_wrapper)
MindSpeedPatchesManager.register_patch("megatron.training.arguments.validate_args", validate_args_wrapper)
MindSpeedPatchesManager.register_patch("megatron.training.arguments._print_args", print_args_wrapper)
# The feature reads its flag from the command line, as the real adaptor does; only that flag is
# looked for (MindSpeed's whole parser would exit a process started with --help at import).
_FLAG = "--use-multiparameter-pipeline-model-parallel"
MultiParameterFeature().register_patches(
    MindSpeedPatchesManager, argparse.Namespace(**{_FLAG[2:].replace("-", "_"): _FLAG in sys.argv}))
MindSpeedPatchesManager.apply_patches()
