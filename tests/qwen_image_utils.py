"""Qwen-Image test helpers: diffusers' QwenImageTransformer2DModel with random weights (the oracle),
its inputs (prompts of mixed lengths, masked; a non-square grid) and its gradients in Megatron's layout."""
import torch

from mm_grpo.families.qwen_image.transformer import QwenImageConfig, layout

TINY = QwenImageConfig.preset("tiny")


def random_reference(config: QwenImageConfig, seed=0, std=0.1):
    """diffusers' QwenImageTransformer2DModel with every weight random (no zero-init gates, norms not 1)."""
    from diffusers import QwenImageTransformer2DModel
    torch.manual_seed(seed)
    ref = QwenImageTransformer2DModel(**config.to_diffusers_config())
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, std)
    return ref.eval()


def make_inputs(config: QwenImageConfig, lengths=(7, 3), height=4, width=6, seed=1):
    """diffusers-style forward kwargs: packed latents on a height x width token grid, prompts padded to
    the longest of `lengths` with their mask (None when every prompt is whole), t in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    batch, n_txt = len(lengths), max(lengths)
    mask = torch.arange(n_txt) < torch.tensor(lengths)[:, None]
    return dict(
        hidden_states=torch.randn(batch, height * width, config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, n_txt, config.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=None if mask.all() else mask.long(),  # the pipeline's mask is 0 / 1
        timestep=torch.rand(batch, generator=g),
        img_shapes=[[(1, height, width)]] * batch)


def reference_output(ref, inputs):
    return ref(**inputs, return_dict=False)[0]


def hf_grads_as_megatron(ref, config: QwenImageConfig):
    """diffusers' parameter gradients merged into full (unsharded) Megatron tensors (None where diffusers
    has none: the last block's text tail)."""
    grads = {n: p.grad for n, p in ref.named_parameters()}
    return {r.megatron: None if grads[r.hf[0]] is None else layout.merge(r, [grads[h] for h in r.hf], config)
            for r in layout.stage_rules(config)}
