"""MindSpeed-MM's own LoRA on the models this entry trains.

With `--lora-target-modules`, MindSpeed-MM's `lora_patch` (mindspeed_mm/tasks/finetune/lora/) wraps
the model `model_provider` returns in peft's LoRA: peft's Megatron layers replace the target
parallel linears in place and freeze everything else, so the policy `pretrain` trains is the
frozen base plus adapters. GRPO's KL reference is then that base, read through the policy with
its adapters off (no second copy), as mm-grpo's own LoRA takes it (families/flux/transformer/lora.py
`AdaptersOff`)."""
from typing import List

from torch import nn

from mm_grpo.families.flux.transformer import lora as flux_lora


def tuner_layers(model: nn.Module) -> list:
    """peft's adapter layers inside `model` (empty without MindSpeed-MM's LoRA)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class AdaptersOff(flux_lora.AdaptersOff):
    """The policy seen with its peft adapters off: their weights and requires_grad untouched (peft's
    `enable_adapters` would also flip requires_grad on parameters DDP has hooked)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.layers = tuner_layers(model)

    def adapters_off(self):
        # `_disable_adapters`: the flag peft's forward (and MindSpeed-MM's patched one) reads.
        return flux_lora.switched(self.layers, "_disable_adapters", True)


def reference_policy(model: nn.Module) -> List[AdaptersOff]:
    return [AdaptersOff(model)]
