"""FLUX.1 transformer on megatron-core.

`FluxTransformer.forward` has the meaning of diffusers' `FluxTransformer2DModel.forward`
(same arguments, returns the velocity tensor [B, S_img, C]). Inside, activations are
[S, B, D] with the joint sequence [text ; image], as Megatron lays them out.

At any parallel layout every rank of the model-parallel group calls `forward` with the
same (whole) inputs: under Ulysses SP the first stage cuts out this rank's tokens and the
last stage gathers the output over the SP group; a pipeline stage that is not the first
reads the previous stage's tensor (`set_input_tensor`) and uses the inputs only for the
token ids, and one that is not the last returns the packed stage tensor.
"""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.enums import ModelType
from torch import nn

from mm_grpo import kernels
from mm_grpo.families.flux.transformer.blocks import DoubleStreamBlock, SingleStreamBlock
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.embeddings import TimeTextEmbedding, rope_tables
from mm_grpo.layers import Modulation, dense, layer_norm, megatron_config, modulate
from mm_grpo.parallel.ulysses import SequenceShard
from mm_grpo.recompute import run_blocks
from mm_grpo.platform.adaptor import torch_compile_replaced


def check_parallel_sizes(config: FluxConfig, tp: int, cp: int = 1):
    heads = config.num_attention_heads
    if heads % (tp * cp):
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor-model-parallel size ({tp})"
            + (f" x context-parallel size ({cp})" if cp > 1 else ""))


def transformer_config(config: FluxConfig, params_dtype=torch.float32, **overrides) -> TransformerConfig:
    """The megatron-core TransformerConfig the parallel layers and schedules read."""
    check_parallel_sizes(config, parallel_state.get_tensor_model_parallel_world_size(),
                         parallel_state.get_context_parallel_world_size())
    # The stage tensor is the residual stream and silu(temb), both in the compute dtype.
    return megatron_config(
        num_layers=config.num_blocks, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.attention_head_dim,
        ffn_hidden_size=config.mlp_hidden_size, params_dtype=params_dtype,
        pipeline_dtype=compute_dtype(config, params_dtype), bf16=config.bf16, **overrides)


def compute_dtype(config: FluxConfig, weight_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype the model computes in (activations, GEMMs, the element-wise chains): bf16 under
    `bf16`, else the dtype its weights are held in (fp32, or bf16 where Megatron's Float16Module
    converted them under MindSpeed-MM's --bf16). Norm statistics, RoPE and the timestep sinusoid
    run in fp32 inside their ops."""
    return torch.bfloat16 if config.bf16 else weight_dtype


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
        return dense(self.linear, modulate(layer_norm(img, self.eps), shift, scale))


class FluxTransformer(MegatronModule):
    """FLUX.1 transformer; `block_range` selects the stage's part of the block sequence
    [double blocks, then single blocks] (blocks are numbered locally, as Megatron does).
    `vp_stage` is the virtual pipeline chunk it is (None without virtual stages)."""

    def __init__(self, config: FluxConfig, tconfig: TransformerConfig = None,
                 pre_process: bool = True, post_process: bool = True, block_range=None,
                 vp_stage=None):
        if config.compile_blocks and (replaced_by := torch_compile_replaced()):
            raise ValueError(f"compile_blocks (--compile-blocks): {replaced_by} replaced torch.compile with "
                             "a function that compiles nothing, so the blocks would run eager; leave it off")
        tconfig = tconfig or transformer_config(config)
        super().__init__(tconfig)
        self.flux_config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage  # Megatron's schedules check it against the chunk they run
        self.share_embeddings_and_output_weights = False  # read by Megatron's finalize_model_grads
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
        self._rope_cache = None  # ((txt_ids, img_ids, their versions), (cos, sin)) of the last forward
        if config.compile_blocks:
            self.compile_blocks()

    # Megatron pipeline contract: the schedule hands the previous stage's output here.
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    @property
    def compute_dtype(self) -> torch.dtype:
        weight = next(self.parameters(), None)
        return compute_dtype(self.flux_config, torch.float32 if weight is None else weight.dtype)

    def conditioning(self, timestep, guidance, pooled_projections):
        """silu(temb): every adaLN linear of FLUX applies SiLU first, so do it once."""
        return F.silu(self.time_text_embed(timestep, guidance, pooled_projections, self.compute_dtype))

    def rope(self, txt_ids, img_ids):
        """(cos, sin) [S, head_dim] fp32 of the joint sequence; the last ones are reused while the
        forward gets the same id tensors (the rollout's and the training's micro-batches share them),
        checked on the host: comparing values would read the device at every call."""
        key = (txt_ids, img_ids, txt_ids._version, img_ids._version)
        cached = self._rope_cache
        if cached is None or cached[0][0] is not txt_ids or cached[0][1] is not img_ids or cached[0][2:] != key[2:]:
            txt = txt_ids[0] if txt_ids.ndim == 3 else txt_ids  # diffusers' deprecated 3-D ids
            img = img_ids[0] if img_ids.ndim == 3 else img_ids
            tables = rope_tables(torch.cat([txt, img]), self.flux_config.axes_dims_rope, self.flux_config.rope_theta)
            self._rope_cache = cached = (key, tables)
        return cached[1]

    def embed(self, hidden_states, encoder_hidden_states):
        """Inputs in diffusers' [B, S, C] -> the joint sequence [text ; image] as [S, B, D]."""
        dtype = self.compute_dtype
        txt = dense(self.context_embedder, encoder_hidden_states.to(dtype))
        img = dense(self.x_embedder, hidden_states.to(dtype))
        return torch.cat([txt, img], dim=1).transpose(0, 1).contiguous()

    def run_blocks(self, x, n_txt, vec, rope, key_mask=None):
        """This chunk's blocks, double- then single-stream, as one sequence for Megatron's recompute."""
        return run_blocks([*self.double_blocks, *self.single_blocks], x, self.flux_config.recompute,
                          n_txt, vec, rope, key_mask)

    def compile_blocks(self):
        """Every block's call under torch.compile (inductor). Between its GEMMs a block is a chain of
        memory-bound element-wise ops (LayerNorm + modulation, QK norm, RoPE, GELU, gated residuals)
        that inductor fuses: ~7% on a whole GRPO iteration at D = 256 on CPU (docs/performance.md;
        GELU takes its sigmoid form then, kernels.gelu_tanh). `nn.Module.compile` compiles the block
        in place: no wrapper module joins the tree, so state_dict, train() / eval() and the parameter
        names are the eager model's. The weights are graph inputs (dynamo inlines nn.Modules), so
        blocks of one kind share their compiled code."""
        for block in [*self.double_blocks, *self.single_blocks]:
            block.compile()

    def head(self, x, n_txt, vec):
        """Final norm and projection of the image tokens: [S, B, D] -> [S_img, B, C]."""
        return self.final_layer(x[n_txt:], vec)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                img_ids, txt_ids, guidance=None):
        seq = SequenceShard.current(n_txt=txt_ids.shape[-2], n_img=img_ids.shape[-2])
        # fp32; no weights, so every stage makes its own; cut like the tokens.
        rope = kernels.rope_table(*(seq.joint(t) for t in self.rope(txt_ids, img_ids)))
        key_mask = seq.key_mask(img_ids.device)
        if self.pre_process:
            vec = self.conditioning(timestep, guidance, pooled_projections)
            x = self.embed(seq.img(hidden_states, dim=1), seq.txt(encoder_hidden_states, dim=1))
        else:
            x, vec = (t.to(self.compute_dtype) for t in unpack_stage_tensor(self.input_tensor))
        x = self.run_blocks(x, seq.txt_len, vec, rope, key_mask)
        if not self.post_process:
            return pack_stage_tensor(x, vec).to(self.config.pipeline_dtype)  # p2p's buffer dtype
        return seq.gather_img(self.head(x, seq.txt_len, vec)).transpose(0, 1)


def pack_stage_tensor(x, vec):
    """One tensor between pipeline stages: [text ; image ; silu(temb)] as [S + 1, B, D]
    (under SP: this rank's [text piece ; image piece ; silu(temb)]).

    Sending the conditioning vector along as one extra row keeps Megatron's single-tensor
    p2p contract, keeps the embedders on the first stage only, and lets its gradient flow
    back through the normal pipeline backward (no cross-stage weight sharing to reduce)."""
    return torch.cat([x, vec.unsqueeze(0)])


def unpack_stage_tensor(packed):
    return packed[:-1], packed[-1]
