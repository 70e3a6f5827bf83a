"""Tensor-parallel checks: TP = 2 and 4 against TP = 1 and diffusers (fp32)."""
import torch

from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, lora
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from tests.distributed.worker import check
from tests.utils import (gather_adapters, gather_tp, make_inputs, random_adapters, random_reference, reference_output,
                         rel_err)

CONFIG = FluxConfig.preset("tiny")


def _forward_backward(tp, ref, inputs, out_weight, adapters=None):
    """Output and whole gradients under TP size `tp`: of every weight, or with `adapters` (a LoRA
    config) of random (non-zero B) adapters on its targets."""
    initialize_parallel(ParallelConfig(tp=tp))
    model = FluxTransformer(CONFIG)
    load_hf_weights(model, ref.state_dict())
    if adapters is not None:
        lora.add_adapters(model, adapters, seed=2)
        lora.copy_full_adapters(model, random_adapters(model, adapters), adapters)
    out = model(**inputs)
    (out * out_weight).sum().backward()
    return out.detach(), (gather_tp(model, "grad") if adapters is None else gather_adapters(model, "grad"))


@check(2, 4)
def tp_matches_tp1_and_diffusers():
    import torch.distributed as dist
    ref = random_reference(CONFIG, seed=3)
    inputs = make_inputs(CONFIG, batch=3, height=3, width=5, txt_len=9)
    out_weight = torch.randn(3, 15, CONFIG.output_channels, generator=torch.Generator().manual_seed(7))
    expected = reference_output(ref, inputs)
    out1, grads1 = _forward_backward(1, ref, inputs, out_weight)
    tp = dist.get_world_size()
    out_tp, grads_tp = _forward_backward(tp, ref, inputs, out_weight)
    grad_errs = {name: rel_err(grads_tp[name], grads1[name]) for name in grads1}
    worst = max(grad_errs, key=grad_errs.get)
    return {"tp": tp, "out_vs_tp1": rel_err(out_tp, out1), "out_vs_diffusers": rel_err(out_tp, expected),
            "grad_vs_tp1_max": grad_errs[worst], "worst_grad": worst, "n_grads": len(grad_errs)}


LORA_ALL = lora.LoRAConfig(r=4, alpha=8, targets=tuple(lora.TARGETS))


@check(2, 4)
def tp_lora_matches_tp1():
    import torch.distributed as dist
    ref = random_reference(CONFIG, seed=3)
    inputs = make_inputs(CONFIG, batch=2, height=3, width=5, txt_len=9)
    out_weight = torch.randn(2, 15, CONFIG.output_channels, generator=torch.Generator().manual_seed(7))
    out1, grads1 = _forward_backward(1, ref, inputs, out_weight, LORA_ALL)
    out_tp, grads_tp = _forward_backward(dist.get_world_size(), ref, inputs, out_weight, LORA_ALL)
    grad_errs = {"/".join(name): rel_err(grads_tp[name], grads1[name]) for name in grads1}
    worst = max(grad_errs, key=grad_errs.get)
    return {"tp": dist.get_world_size(), "out_vs_tp1": rel_err(out_tp, out1), "grad_vs_tp1_max": grad_errs[worst],
            "worst_grad": worst, "n_grads": len(grad_errs),
            "min_grad": min(g.abs().max().item() for g in grads1.values())}
