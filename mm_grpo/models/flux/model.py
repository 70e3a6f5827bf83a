"""FLUX.1 transformer on megatron-core.

`FluxTransformer.forward` has the meaning of diffusers' `FluxTransformer2DModel.forward`
(same arguments, returns the velocity tensor [B, S_img, C]). Inside, activations are
[S, B, D] with the joint sequence [text ; image], as Megatron lays them out.
"""
import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.enums import ModelType
from torch import nn
from torch.utils.checkpoint import checkpoint

from mm_grpo.models.flux.blocks import DoubleStreamBlock, SingleStreamBlock
from mm_grpo.models.flux.config import FluxConfig
from mm_grpo.models.flux.embeddings import TimeTextEmbedding, rope_tables
from mm_grpo.models.flux.layers import Modulation, layer_norm, modulate


def check_parallel_sizes(config: FluxConfig, tp: int, cp: int = 1):
    heads = config.num_attention_heads
    if heads % (tp * cp):
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor-model-parallel size ({tp})"
            + (f" x context-parallel size ({cp})" if cp > 1 else ""))


def transformer_config(config: FluxConfig, params_dtype=torch.float32, **overrides) -> TransformerConfig:
    """The megatron-core TransformerConfig the parallel layers and schedules read."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    check_parallel_sizes(config, tp, cp)
    from mm_grpo import get_platform
    kwargs = dict(
        num_layers=config.num_blocks, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.attention_head_dim,
        ffn_hidden_size=config.mlp_hidden_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        params_dtype=params_dtype, pipeline_dtype=torch.bfloat16 if config.bf16 else params_dtype,
        bf16=config.bf16, use_cpu_initialization=get_platform().name == "cpu",
        gradient_accumulation_fusion=False, sequence_parallel=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class FinalLayer(nn.Module):
    """AdaLayerNormContinuous (scale, shift: that order) then the output projection."""

    def __init__(self, config, tconfig):
        super().__init__()
        self.eps = config.norm_eps
        self.modulation = Modulation(config.hidden_size, 2, tconfig)
        # (64, D) is small: replicated.
        self.linear = nn.Linear(config.hidden_size, config.output_channels)

    def forward(self, img, vec):
        scale, shift = self.modulation(vec)
        return self.linear(modulate(layer_norm(img, self.eps), shift, scale))


class FluxTransformer(MegatronModule):
    """FLUX.1 transformer; `block_range` selects the stage's part of the block sequence
    [double blocks, then single blocks] (blocks are numbered locally, as Megatron does)."""

    def __init__(self, config: FluxConfig, tconfig: TransformerConfig = None,
                 pre_process: bool = True, post_process: bool = True, block_range=None):
        tconfig = tconfig or transformer_config(config)
        super().__init__(tconfig)
        self.flux_config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        start, end = block_range or (0, config.num_blocks)
        if not 0 <= start <= end <= config.num_blocks:
            raise ValueError(f"block_range {block_range} outside [0, {config.num_blocks}]")
        self.block_range = (start, end)
        n_double = config.num_layers
        # Global index of this stage's first double / single block (for loading weights).
        self.double_offset = min(start, n_double)
        self.single_offset = max(start, n_double) - n_double
        dim = config.hidden_size

        if pre_process:  # later stages receive silu(temb) packed into the pipeline tensor
            self.x_embedder = nn.Linear(config.in_channels, dim)
            self.context_embedder = nn.Linear(config.joint_attention_dim, dim)
            self.time_text_embed = TimeTextEmbedding(dim, config.pooled_projection_dim, config.guidance_embeds)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(config, tconfig) for _ in range(self.double_offset, min(end, n_double)))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(config, tconfig)
            for _ in range(max(start, n_double), max(end, n_double)))
        if post_process:
            self.final_layer = FinalLayer(config, tconfig)
        self.input_tensor = None

    # Megatron pipeline contract: the schedule hands the previous stage's output here.
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def conditioning(self, timestep, guidance, pooled_projections):
        """silu(temb): every adaLN linear of FLUX applies SiLU first, so do it once."""
        return F.silu(self.time_text_embed(timestep, guidance, pooled_projections))

    def rope(self, txt_ids, img_ids):
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids  # diffusers' deprecated 3-D ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        ids = torch.cat([txt_ids, img_ids])
        return rope_tables(ids, self.flux_config.axes_dims_rope, self.flux_config.rope_theta)

    def embed(self, hidden_states, encoder_hidden_states):
        """Inputs in diffusers' [B, S, C] -> the joint sequence [text ; image] as [S, B, D]."""
        txt = self.context_embedder(encoder_hidden_states)
        img = self.x_embedder(hidden_states)
        return torch.cat([txt, img], dim=1).transpose(0, 1).contiguous()

    def run_blocks(self, x, n_txt, vec, rope):
        for block in [*self.double_blocks, *self.single_blocks]:
            if self.flux_config.recompute_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, n_txt, vec, rope, use_reentrant=False)
            else:
                x = block(x, n_txt, vec, rope)
        return x

    def head(self, x, n_txt, vec):
        """Final norm and projection of the image tokens: [S, B, D] -> [B, S_img, C]."""
        return self.final_layer(x[n_txt:], vec).transpose(0, 1)

    def _autocast(self):
        if not self.flux_config.bf16:
            return contextlib.nullcontext()
        from mm_grpo import get_platform
        return torch.autocast(get_platform().device.type, dtype=torch.bfloat16)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                img_ids, txt_ids, guidance=None):
        n_txt = txt_ids.shape[-2]
        rope = self.rope(txt_ids, img_ids)  # fp32, outside autocast; no weights: every stage
        with self._autocast():
            if self.pre_process:
                vec = self.conditioning(timestep, guidance, pooled_projections)
                x = self.embed(hidden_states, encoder_hidden_states)
            else:
                x, vec = unpack_stage_tensor(self.input_tensor)
            x = self.run_blocks(x, n_txt, vec, rope)
            return self.head(x, n_txt, vec) if self.post_process else pack_stage_tensor(x, vec)


def pack_stage_tensor(x, vec):
    """One tensor between pipeline stages: [text ; image ; silu(temb)] as [S + 1, B, D].

    Sending the conditioning vector along as one extra row keeps Megatron's single-tensor
    p2p contract, keeps the embedders on the first stage only, and lets its gradient flow
    back through the normal pipeline backward (no cross-stage weight sharing to reduce)."""
    return torch.cat([x, vec.unsqueeze(0).to(x.dtype)])


def unpack_stage_tensor(packed):
    return packed[:-1], packed[-1]
