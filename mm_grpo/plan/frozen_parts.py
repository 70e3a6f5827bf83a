"""The frozen parts of a GRPO run on each rank besides the transformer: VAE, text encoders (or the
text-embedding cache), reward model. The rewards' sizes are here; each family's VAE and encoders are
its planner's (families/<name>/plan.py: public parameter counts, or read from a diffusers pipeline
folder; the VAE decode working set is a measured constant per VAE).
"""
import dataclasses
import json
import os

REWARD_PARAMS = {  # open_clip / transformers CLIP models the rewards load (whole model: image + text towers)
    "hps": 986_109_440,  # HPS v2.1 = open_clip ViT-H-14 (open_clip's model table: 986.11M)
    "pickscore": 986_109_440,  # PickScore_v1 = CLIP ViT-H-14
    "clip_score": 427_616_513,  # ViT-L-14 (open_clip: 427.62M)
    "aesthetic": 427_616_513 + 927_969,  # CLIP ViT-L-14 + the LAION aesthetic MLP (768-1024-128-64-16-1)
    "jpeg_compressibility": 0, "jpeg_incompressibility": 0, "compositional": 0,
}


@dataclasses.dataclass(frozen=True)
class Components:
    vae_params: int
    vae_decode_values_per_pixel: float
    text_encoder_params: int  # on the device when there is no text-embedding cache (else 0)
    reward_params: int
    reward_bytes_per_param: int = 4  # rewards load in float32 unless their config says otherwise
    latent_channels: int = 16  # VAE latent channels (packed 2x2: the transformer's in_channels / 4)


def safetensors_params(folder: str) -> int:
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


def reward_params(reward: str) -> int:
    if reward not in REWARD_PARAMS:
        raise ValueError(f"unknown reward {reward!r}; choose one of {', '.join(REWARD_PARAMS)}")
    return REWARD_PARAMS[reward]
