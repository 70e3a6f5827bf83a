"""Qwen-Image transformer on megatron-core.

`QwenImageTransformer.forward` has the meaning of diffusers' `QwenImageTransformer2DModel.forward`
(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes; returns the
velocity tensor [B, S_img, C]). Inside, activations are [S, B, D] with the joint sequence
[text ; image], as Megatron lays them out.

At any parallel layout every rank of the model-parallel group calls `forward` with the same (whole)
inputs: under Ulysses SP the first stage cuts out this rank's tokens and the last stage gathers the
output over the SP group; a pipeline stage that is not the first reads the previous stage's tensor
(`set_input_tensor`) and uses the inputs only for their shapes and the text mask, and one that is not
the last returns the packed stage tensor [x ; silu(temb)].
"""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from mm_grpo import kernels
from mm_grpo.families.qwen_image.transformer.blocks import DualStreamBlock
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.families.qwen_image.transformer.embeddings import TimestepEmbedding, rope_tables
from mm_grpo.layers import Modulation, dense, layer_norm, megatron_config, modulate
from mm_grpo.parallel.ulysses import SequenceShard
from mm_grpo.recompute import run_blocks


def check_parallel_sizes(config: QwenImageConfig, tp: int, cp: int = 1):
    heads = config.num_attention_heads
    if heads % (tp * cp):
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor-model-parallel size ({tp})"
                         + (f" x context-parallel size ({cp})" if cp > 1 else ""))


def compute_dtype(config: QwenImageConfig, weight_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """bf16 under `bf16`, else the dtype the weights are held in (norm statistics, RoPE and the
    timestep sinusoid run in fp32 inside their ops)."""
    return torch.bfloat16 if config.bf16 else weight_dtype


def transformer_config(config: QwenImageConfig, params_dtype=torch.float32, **overrides) -> TransformerConfig:
    """The megatron-core TransformerConfig the parallel layers and schedules read."""
    check_parallel_sizes(config, parallel_state.get_tensor_model_parallel_world_size(),
                         parallel_state.get_context_parallel_world_size())
    return megatron_config(
        num_layers=config.num_blocks, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.attention_head_dim,
        ffn_hidden_size=config.mlp_hidden_size, params_dtype=params_dtype,
        pipeline_dtype=compute_dtype(config, params_dtype), bf16=config.bf16, **overrides)


def grid_of(img_shapes, n_img: int):
    """One sample's (frames, height, width) grids from diffusers' `img_shapes` (a list per sample of
    such tuples, or of one tuple each), checked: the same for every sample and `n_img` tokens."""
    if not img_shapes:
        raise ValueError("img_shapes is empty: pass one [(frames, height, width)] per sample")
    per_sample = [[tuple(s)] if isinstance(s, tuple) else [tuple(g) for g in s] for s in img_shapes]
    if any(s != per_sample[0] for s in per_sample):
        raise ValueError(f"img_shapes differ within the batch ({per_sample}): Qwen-Image's RoPE takes one grid "
                         "for all samples; batch images of one size")
    grid = per_sample[0]
    tokens = sum(f * h * w for f, h, w in grid)
    if tokens != n_img:
        raise ValueError(f"img_shapes {grid} make {tokens} image tokens, but hidden_states has {n_img}")
    return tuple(grid)


class RMSNorm(nn.Module):
    """diffusers' RMSNorm with a weight (the prompt features' `txt_norm`); replicated, and its input
    whole on every TP rank, so its gradient is whole there too."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class FinalLayer(nn.Module):
    """AdaLayerNormContinuous (scale, shift: that order) then the output projection."""

    def __init__(self, config, tconfig):
        super().__init__()
        self.eps = config.norm_eps
        self.modulation = Modulation(config.hidden_size, 2, tconfig)
        self.linear = nn.Linear(config.hidden_size, config.output_channels)  # small: replicated

    def forward(self, img, vec):
        scale, shift = self.modulation(vec)
        return dense(self.linear, modulate(layer_norm(img, self.eps), shift, scale))


class QwenImageTransformer(MegatronModule):
    """Qwen-Image's transformer; `block_range` selects the stage's blocks (numbered locally, as
    Megatron does); `vp_stage` is the virtual pipeline chunk it is (None without virtual stages)."""

    def __init__(self, config: QwenImageConfig, tconfig: TransformerConfig = None, pre_process: bool = True,
                 post_process: bool = True, block_range=None, vp_stage=None):
        tconfig = tconfig or transformer_config(config)
        super().__init__(tconfig)
        self.qwen_config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage
        self.share_embeddings_and_output_weights = False  # read by Megatron's finalize_model_grads
        self.pre_process, self.post_process = pre_process, post_process
        start, end = block_range or (0, config.num_blocks)
        if not 0 <= start <= end <= config.num_blocks:
            raise ValueError(f"block_range {block_range} outside [0, {config.num_blocks}]")
        self.block_range = (start, end)
        dim = config.hidden_size
        if pre_process:
            self.img_in = nn.Linear(config.in_channels, dim)
            self.txt_norm = RMSNorm(config.joint_attention_dim, config.norm_eps)
            self.txt_in = nn.Linear(config.joint_attention_dim, dim)
            self.time_text_embed = TimestepEmbedding(dim)
        self.blocks = nn.ModuleList(DualStreamBlock(config, tconfig, text_out=g < config.num_blocks - 1)
                                    for g in range(start, end))
        if post_process:
            self.final_layer = FinalLayer(config, tconfig)
        self.input_tensor = None
        self._rope_cache = None  # ((grid, n_txt, device), (cos, sin)) of the last forward

    def set_input_tensor(self, input_tensor):  # Megatron's pipeline contract
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    @property
    def compute_dtype(self) -> torch.dtype:
        weight = next(self.parameters(), None)
        return compute_dtype(self.qwen_config, torch.float32 if weight is None else weight.dtype)

    def rope(self, grid, n_txt, device):
        """(cos, sin) [S, head_dim] fp32 of the joint sequence; the last ones are reused while the grid and
        the text length stay (a rollout's steps and its training micro-batches share them). Only the last:
        prompts of other lengths make other tables, which kept would grow without bound."""
        key = (grid, n_txt, device)
        if self._rope_cache is None or self._rope_cache[0] != key:
            cfg = self.qwen_config
            tables = tuple(t.to(device) for t in rope_tables(grid, n_txt, cfg.axes_dims_rope, cfg.rope_theta))
            self._rope_cache = (key, tables)
        return self._rope_cache[1]

    def embed(self, hidden_states, encoder_hidden_states):
        """Inputs in diffusers' [B, S, C] -> the joint sequence [text ; image] as [S, B, D]: the
        prompt's features RMS-normalised, then both streams projected to the model width."""
        dtype = self.compute_dtype
        txt = dense(self.txt_in, self.txt_norm(encoder_hidden_states.to(dtype)).to(dtype))
        img = dense(self.img_in, hidden_states.to(dtype))
        return torch.cat([txt, img], dim=1).transpose(0, 1).contiguous()

    def run_blocks(self, x, n_txt, vec, rope, key_mask=None):
        return run_blocks(self.blocks, x, self.qwen_config.recompute, n_txt, vec, rope, key_mask)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes):
        n_img = hidden_states.shape[1]
        seq = SequenceShard.current(n_txt=encoder_hidden_states.shape[1], n_img=n_img)
        device = hidden_states.device
        rope = kernels.rope_table(*(seq.joint(t) for t in self.rope(grid_of(img_shapes, n_img), seq.n_txt, device)))
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(device)
        key_mask = seq.key_mask(device, mask)
        if self.pre_process:
            vec = F.silu(self.time_text_embed(timestep, self.compute_dtype))  # every adaLN applies SiLU first
            x = self.embed(seq.img(hidden_states, dim=1), seq.txt(encoder_hidden_states, dim=1))
        else:
            packed = self.input_tensor.to(self.compute_dtype)
            x, vec = packed[:-1], packed[-1]
        x = self.run_blocks(x, seq.txt_len, vec, rope, key_mask)
        if not self.post_process:
            # [x ; silu(temb)] as one tensor: Megatron's single-tensor p2p, the embedders on the first stage.
            return torch.cat([x, vec.unsqueeze(0)]).to(self.config.pipeline_dtype)
        return seq.gather_img(self.final_layer(x[seq.txt_len:], vec)).transpose(0, 1)
