"""The frozen parts of a GRPO run on each rank besides the transformer (FLUX or Wan2.1): VAE, text
encoders (or the text-embedding cache), reward model. Sizes are public parameter counts or read from a
diffusers pipeline folder; the VAE decode working set is a measured constant per VAE.
"""
import dataclasses
import json
import os

# Public parameter counts.
FLUX_VAE_PARAMS = 83_821_011  # FLUX.1 AutoencoderKL (encoder + decoder); count of diffusers' model at its config
T5_XXL_ENCODER_PARAMS = 4_762_310_656  # google/t5-v1_1-xxl encoder (FLUX.1's text_encoder_2)
CLIP_L_TEXT_PARAMS = 123_060_480  # openai/clip-vit-large-patch14 text model (FLUX.1's text_encoder)
REWARD_PARAMS = {  # open_clip / transformers CLIP models the rewards load (whole model: image + text towers)
    "hps": 986_109_440,  # HPS v2.1 = open_clip ViT-H-14 (open_clip's model table: 986.11M)
    "pickscore": 986_109_440,  # PickScore_v1 = CLIP ViT-H-14
    "clip_score": 427_616_513,  # ViT-L-14 (open_clip: 427.62M)
    "aesthetic": 427_616_513 + 927_969,  # CLIP ViT-L-14 + the LAION aesthetic MLP (768-1024-128-64-16-1)
    "jpeg_compressibility": 0, "jpeg_incompressibility": 0, "compositional": 0,
}
# Wan2.1 (text-to-video): its VAE and its text encoder, counts of diffusers' AutoencoderKLWan at its
# default (= Wan2.1's) config and of transformers' UMT5EncoderModel at Wan2.1's text_encoder config
# (umT5-XXL: d_model 4096, d_ff 10240, 24 layers, 64 heads, vocabulary 256384), both built on the meta device.
WAN_VAE_PARAMS = 126_892_531
UMT5_XXL_ENCODER_PARAMS = 5_680_910_336
# Wan's VAE decodes a video one latent frame (4 output frames, the first alone) at a time, with a
# cache of the last frames of every causal convolution. Largest live set of a no-grad decode, in
# values per output pixel (of one frame), plus 3 values per output pixel per frame (the decoded
# video): 4900, measured with the live-tensor meter on diffusers' AutoencoderKLWan (random weights,
# fp32, CPU) at 64 and 128 px for 5 to 25 frames (tests/test_plan_wan.py measures it again).
WAN_VAE_DECODE_VALUES_PER_PIXEL = 4900.0
WAN_VAE_DECODE_VALUES_PER_PIXEL_FRAME = 3.0
# Convolution FLOPs of that decode per output pixel: the first frame 10.75M, every later frame
# 8.445M (counted by torch's FlopCounterMode on the same model; the decoder's middle attention, one
# head over the h x w latent of each latent frame at 384 channels, is added by hand: 4 (hw)^2 x 384).
WAN_VAE_DECODE_FLOPS_FIRST_FRAME = 10.748e6
WAN_VAE_DECODE_FLOPS_PER_FRAME = 8.445e6
WAN_VAE_MIDDLE_CHANNELS = 384

# Largest live set of one image's no-grad VAE decode, in values per output pixel (bytes = values
# x element size), measured with the live-tensor meter (`python bench/plan_validate.py --probe-vae`).
# FLUX.1's VAE: 768 = 3 x 256 channels at full resolution (the last up block's input, its first
# ResNet's GroupNorm and SiLU outputs), which is also the hand count. The tiny pipeline's VAE: 40
# (its hand count gives 32; CPU convolutions add a copy of their input in another memory format).
VAE_DECODE_VALUES_PER_PIXEL = {((128, 256, 512, 512), 2): 768.0, ((8, 8, 16, 16), 1): 40.1}


@dataclasses.dataclass(frozen=True)
class Components:
    vae_params: int
    vae_decode_values_per_pixel: float
    text_encoder_params: int  # on the device when there is no text-embedding cache (else 0)
    reward_params: int
    reward_bytes_per_param: int = 4  # rewards load in float32 unless their config says otherwise
    latent_channels: int = 16  # VAE latent channels (packed 2x2: the transformer's in_channels / 4)


def vae_decode_values(block_out_channels, layers_per_block) -> float:
    """Measured constant when known, else the hand count: 3 x the last up block's input channels."""
    key = (tuple(block_out_channels), int(layers_per_block))
    if key in VAE_DECODE_VALUES_PER_PIXEL:
        return VAE_DECODE_VALUES_PER_PIXEL[key]
    return 3.0 * list(reversed(block_out_channels))[-2] if len(block_out_channels) > 1 else 3.0 * block_out_channels[0]


def flux_components(reward: str = "hps", text_cache: bool = True) -> Components:
    """FLUX.1 (dev or schnell): its VAE, T5-XXL + CLIP-L unless cached, and the reward."""
    if reward not in REWARD_PARAMS:
        raise ValueError(f"unknown reward {reward!r}; choose one of {', '.join(REWARD_PARAMS)}")
    return Components(FLUX_VAE_PARAMS, VAE_DECODE_VALUES_PER_PIXEL[((128, 256, 512, 512), 2)],
                      0 if text_cache else T5_XXL_ENCODER_PARAMS + CLIP_L_TEXT_PARAMS, REWARD_PARAMS[reward])


def wan_components(reward: str = "hps", text_cache: bool = True) -> Components:
    """Wan2.1 text-to-video: its VAE, umT5-XXL unless the embeddings are cached, and the reward
    (an image reward scores a frame of the video, as DanceGRPO's Wan recipe scores the first)."""
    if reward not in REWARD_PARAMS:
        raise ValueError(f"unknown reward {reward!r}; choose one of {', '.join(REWARD_PARAMS)}")
    return Components(WAN_VAE_PARAMS, WAN_VAE_DECODE_VALUES_PER_PIXEL, 0 if text_cache else UMT5_XXL_ENCODER_PARAMS,
                      REWARD_PARAMS[reward])


def _safetensors_params(folder: str) -> int:
    """Parameter count of a diffusers model folder from its safetensors headers (no tensor is read)."""
    total = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for key, meta in header.items():
                if key != "__metadata__":
                    n = 1
                    for d in meta["shape"]:
                        n *= d
                    total += n
    return total


def components_of_pipeline(pipeline_dir: str, reward: str = "hps", text_cache: bool = True) -> Components:
    """A diffusers pipeline folder's VAE and text encoders (counted from their files)."""
    vae_dir = os.path.join(pipeline_dir, "vae")
    with open(os.path.join(vae_dir, "config.json")) as f:
        vae = json.load(f)
    if reward not in REWARD_PARAMS:
        raise ValueError(f"unknown reward {reward!r}; choose one of {', '.join(REWARD_PARAMS)}")
    text = 0 if text_cache else sum(_safetensors_params(os.path.join(pipeline_dir, d))
                                    for d in ("text_encoder", "text_encoder_2"))
    return Components(_safetensors_params(vae_dir), vae_decode_values(vae["block_out_channels"], vae["layers_per_block"]),
                      text, REWARD_PARAMS[reward], latent_channels=vae["latent_channels"])
