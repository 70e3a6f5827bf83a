"""FLUX as a MindSpeed-MM predictor: the `predictor` block of model.json -> this rank's model.

MindSpeed-MM's `PredictModel` (mindspeed_mm/models/predictor/predict_model.py) builds
`PREDICTOR_MODEL_MAPPINGS[model_id](**block)` with the whole block as keyword arguments and,
under pipeline parallelism, first checks `sum(pipeline_num_layers) == num_layers` and then
replaces `num_layers` by the stage's count and adds `pre_process`, `post_process` and
`global_layer_idx`. If `from_pretrained` is set it then loads that one file with its own
`load_checkpoint` (`model.load_state_dict(sd, strict=False)`). How the block names FLUX's
hyperparameters: mm_grpo/families/flux/predictor_block.py.
"""
import os
from typing import Mapping

import torch
from megatron.core import parallel_state
from torch.nn.modules.module import _IncompatibleKeys

from mm_grpo.families.flux.predictor_block import flux_config_from_block
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FLUX_DEV_GUIDANCE
from mm_grpo.families.flux.transformer.hf_weights import copy_hf_weights
from mm_grpo.families.flux.transformer.latents import VAE_SCALE_FACTOR, pack_latents, prepare_latent_image_ids, unpack_latents
from mm_grpo.families.flux.transformer.model import FluxTransformer
from mm_grpo.parallel.grad_scale import scale_grad
from mm_grpo.recompute import with_megatron_recompute

# MindSpeed-MM's flow-matching schedulers give timesteps on diffusers' 0..1000 scale (sigma x
# num_train_timesteps, 1000 in every FLUX scheduler config); FLUX's forward takes sigma, as
# diffusers' FluxPipeline passes it (timestep / 1000).
TIMESTEP_SCALE = 1000.0

# diffusers names that never occur among the Megatron model's own parameter names
_DIFFUSERS_ONLY = ("transformer_blocks.", "single_transformer_blocks.", "norm_out.", "proj_out.")


def _block_range(global_layer_idx, num_layers):
    idx = list(global_layer_idx)
    start = idx[0] if idx else 0
    if idx != list(range(start, start + len(idx))):
        raise ValueError(f"global_layer_idx must be consecutive, got {idx}")
    if num_layers is not None and num_layers != len(idx):
        raise ValueError(f"num_layers {num_layers} != len(global_layer_idx) {len(idx)}")
    return start, start + len(idx)


def is_diffusers_state_dict(state_dict: Mapping) -> bool:
    return any(k.startswith(_DIFFUSERS_ONLY) for k in state_dict)


class FluxPredictor(FluxTransformer):
    """FLUX built from a MindSpeed-MM `predictor` block (keyword arguments), for this rank's
    tensor-parallel shard and pipeline stage (or virtual stage).

    `from_pretrained` is one file, loaded by whoever builds the predictor (MindSpeed-MM's
    `PredictModel` does) through `load_state_dict`, which takes either this rank's own
    Megatron state dict (what Megatron's `--load` and mm-convert's shards hold) or the whole
    model under diffusers' names (`diffusion_pytorch_model.safetensors`, or mm-convert
    `mm_to_hf` output), which it cuts for this rank at any TP / PP / virtual-stage layout."""

    def __init__(self, model_id="flux", pre_process=True, post_process=True, global_layer_idx=None, **block):
        path = block.get("from_pretrained")
        if path and not os.path.isfile(path):
            raise ValueError(
                f"predictor from_pretrained {path!r} is not a file: MindSpeed-MM loads one .safetensors / .pt / .pth "
                "file (e.g. a transformer's diffusion_pytorch_model.safetensors); a sharded checkpoint goes "
                "through --load")
        block = with_megatron_recompute(block)
        staged = global_layer_idx is not None
        config = flux_config_from_block(block, staged)
        block_range = _block_range(global_layer_idx, block.get("num_layers")) if staged else None
        vp_stage = (parallel_state.get_virtual_pipeline_model_parallel_rank()
                    if parallel_state.get_virtual_pipeline_model_parallel_world_size() else None)
        super().__init__(config, pre_process=pre_process, post_process=post_process,
                         block_range=block_range, vp_stage=vp_stage)
        self.text_len = block.get("text_len")
        self.guidance_scale = block.get("guidance_scale", FLUX_DEV_GUIDANCE)

    def forward(self, *args, **kwargs):
        """diffusers' forward (FluxTransformer's), or the call of MindSpeed-MM's SoRAModel,
        `predictor(latents, timestep=, prompt=, video_mask=, prompt_mask=, **batch)`."""
        if "prompt" in kwargs:
            return self.sora_forward(*args, **kwargs)
        return super().forward(*args, **kwargs)

    def sora_forward(self, latents, timestep, prompt, video_mask=None, prompt_mask=None, guidance=None,
                     ori_shape=None, **batch):
        """SoRAModel's predictor call; returns the velocity (noise - x0) in the latents' layout.

        latents: noised VAE latents [B, C, h, w] (or [B, C, 1, h, w]); on a later pipeline stage the
            previous stage's tensor, with `ori_shape` the latents' shape (pipeline_set_prev_stage_tensor).
        timestep: [B] or [1] on the scheduler's 0..1000 scale.
        prompt: the text features [T5 hidden states [B, L, joint_attention_dim], pooled CLIP
            [B, pooled_projection_dim]], in either order (told apart by their rank); None on later stages.
        prompt_mask / video_mask: unused (FLUX attends to every text token, as diffusers does).
        guidance: [B] FLUX.1-dev's guidance embedding input (default: the block's guidance_scale).
        """
        shape = tuple(ori_shape if ori_shape is not None else latents.shape)
        b, (h, w) = shape[0], shape[-2:]
        sigma = (timestep.float() / TIMESTEP_SCALE).expand(b)
        img_ids = prepare_latent_image_ids(h // 2, w // 2, device=sigma.device)
        if self.pre_process:
            hidden_states = pack_latents(latents.reshape(b, -1, h, w))
            encoder_hidden_states, pooled = _text_features(prompt)
            n_txt = encoder_hidden_states.shape[1]
        else:  # the stage tensor is [text ; image ; silu(temb)]
            hidden_states = encoder_hidden_states = pooled = None
            n_txt = latents.shape[0] - 1 - img_ids.shape[0]
        if guidance is None and self.flux_config.guidance_embeds:
            guidance = torch.full((b,), float(self.guidance_scale), device=sigma.device)
        out = super().forward(hidden_states, encoder_hidden_states, pooled, sigma, img_ids,
                              torch.zeros(n_txt, 3, device=sigma.device), guidance=guidance)
        if not self.post_process:
            return out
        # pretrain_sora.py's loss_func divides the loss by the context-parallel size, so that
        # Megatron's scaling by it cancels; MindSpeed-MM's DiTs scale the gradient in their
        # gather's backward instead. (mm-grpo's own loss keeps Megatron's scaling.)
        out = scale_grad(out, parallel_state.get_context_parallel_world_size())
        return unpack_latents(out, h * VAE_SCALE_FACTOR, w * VAE_SCALE_FACTOR).reshape(shape)

    # MindSpeed-MM's pipeline contract (pretrain_sora.py / SoRAModel under PP): the tensors that
    # travel between stages are [stage tensor, latents, noised latents, timesteps, noise]. Their
    # dtypes are the ones sent, whatever --bf16 makes of the weights (Float16Module): the stage
    # tensor in the pipeline dtype `forward` packs it in, the rest in fp32, whatever the features'.
    def initialize_pipeline_tensor_shapes(self):
        from megatron.training import get_args
        args = get_args()
        pre = args.mm.data.dataset_param.preprocess_parameters
        if self.text_len is None:
            raise ValueError("predictor block: pipeline parallelism needs text_len (the T5 sequence length)")
        h, w = pre.max_height // VAE_SCALE_FACTOR, pre.max_width // VAE_SCALE_FACTOR
        channels = self.flux_config.in_channels // 4
        mbs = args.micro_batch_size
        seq = self.text_len + (h // 2) * (w // 2) + 1
        latent = {"shape": (mbs, channels, h, w), "dtype": torch.float32}
        return [{"shape": (seq, mbs, self.flux_config.hidden_size), "dtype": self.config.pipeline_dtype}, latent,
                latent, {"shape": (mbs,), "dtype": torch.float32}, latent]

    @staticmethod
    def pipeline_set_next_stage_tensor(input_list, output_list, extra_kwargs=None):
        latents, noised_latents, timesteps, noise, _ = input_list
        return [output_list, latents.float(), noised_latents.float(), timesteps.float(), noise.float()]

    @staticmethod
    def pipeline_set_prev_stage_tensor(input_tensor_list, extra_kwargs):
        stage, latents, noised_latents, timesteps, noise = input_tensor_list
        extra_kwargs["ori_shape"] = latents.shape
        return [stage, timesteps, None, None, None], [latents, noised_latents, timesteps, noise, None]

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if not is_diffusers_state_dict(state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return load_diffusers_state_dict(self, state_dict, strict)


def _text_features(prompt):
    """(T5 hidden states [B, L, D], pooled CLIP [B, D']) from SoRAModel's `prompt`."""
    features = list(prompt) if isinstance(prompt, (list, tuple)) else [prompt]
    by_rank = {t.ndim: t for t in features if torch.is_tensor(t)}
    if len(features) != 2 or set(by_rank) != {2, 3}:
        raise ValueError("flux predictor: prompt must hold two text features, T5 hidden states [B, L, D] and "
                         f"pooled CLIP [B, D'], got {[tuple(t.shape) if torch.is_tensor(t) else t for t in features]}")
    return by_rank[3], by_rank[2]


def load_diffusers_state_dict(model: FluxTransformer, state_dict: Mapping, strict: bool = True):
    """The whole model's diffusers-named weights into this rank's shard of `model`.

    Missing keys are the diffusers names this stage needs and `state_dict` lacks; unexpected
    keys are names that are no FLUX weight at all (other stages' weights are expected)."""
    config = model.flux_config
    everything = {h for r in layout.stage_rules(config) for h in r.hf}
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    missing = sorted(h for r in rules for h in r.hf if h not in state_dict)
    unexpected = sorted(set(state_dict) - everything)
    if strict and (missing or unexpected):
        raise ValueError(f"diffusers FLUX state dict does not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    copy_hf_weights(model, state_dict, [r for r in rules if all(h in state_dict for h in r.hf)])
    return _IncompatibleKeys(missing, unexpected)
