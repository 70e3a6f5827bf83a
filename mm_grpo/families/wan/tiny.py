"""A tiny but complete diffusers Wan2.1 text-to-video pipeline folder, built locally (no hub).

Every component WanPipeline needs, with the real classes and Wan2.1's real scheduler, VAE
strides and latent normalisation, only shrunk: tests and CPU smoke runs load it through the same
code paths as Wan2.1-T2V-1.3B. The umT5 tokenizer is the SentencePiece Unigram model that
mm_grpo/tiny/text.py learns for the tiny T5s (umT5 tokenizes the same way, with a larger vocabulary).

    python -m mm_grpo.families.wan.tiny --out DIR [--seed 0]
"""
import argparse

from mm_grpo.families.wan.encoders import WAN_PATCH
from mm_grpo.tiny.pipeline import seeded, write_pipeline
from mm_grpo.tiny.text import T5_CONFIG, build_t5_tokenizer, t5_token_ids

TINY_TEXT_LEN = 16  # max_sequence_length for tiny runs (Wan2.1: 512)

# umT5 is T5 v1.1's layout (gated GELU, untied head) with a relative-position bias in every layer:
# the tiny T5's sizes (FLUX's too), d_model 32.
UMT5_CONFIG = T5_CONFIG

# Wan2.1's VAE shrunk: four stages = three 2x spatial downsamples (factor 8), the last two also 2x
# in time (factor 4, so 4k + 1 frames -> k + 1 latent frames), as the real one. Four latent
# channels with Wan2.1's first four normalisation constants, so the decoder's
# denormalisation is exercised with real numbers.
VAE_CONFIG = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
)

# Wan2.1's DiT shrunk: 2 heads x 24 (head dim a multiple of 6, so RoPE splits it 8 / 8 / 8 over
# frames / rows / columns), latent channels in and out, the umT5 width as text width.
TRANSFORMER_CONFIG = dict(
    patch_size=WAN_PATCH,
    num_attention_heads=2,
    attention_head_dim=24,
    in_channels=VAE_CONFIG["z_dim"],
    out_channels=VAE_CONFIG["z_dim"],
    text_dim=UMT5_CONFIG["d_model"],
    freq_dim=16,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)

# Wan2.1-T2V-1.3B-Diffusers' scheduler (flow_shift 3.0: its 480p setting).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)


def wandit_predictor(transformer_config: dict, text_len: int) -> dict:
    """The same transformer as MindSpeed-MM's `wandit` predictor block (its names; img_dim is used by
    i2v only) from a diffusers WanTransformer3DModel config, reading `text_len` umT5 tokens."""
    heads = transformer_config["num_attention_heads"]
    return dict(
        model_id="wandit",
        model_type="t2v",
        patch_size=list(transformer_config["patch_size"]),
        text_len=text_len,
        in_dim=transformer_config["in_channels"],
        hidden_size=heads * transformer_config["attention_head_dim"],
        ffn_dim=transformer_config["ffn_dim"],
        freq_dim=transformer_config["freq_dim"],
        text_dim=transformer_config["text_dim"],
        img_dim=16,
        out_dim=transformer_config["out_channels"],
        num_heads=heads,
        num_layers=transformer_config["num_layers"],
        qk_norm=True,
        qk_norm_type="rmsnorm",
        cross_attn_norm=transformer_config["cross_attn_norm"],
        eps=transformer_config["eps"],
        max_seq_len=transformer_config["rope_max_seq_len"],
    )


TINY_WAN_PREDICTOR = wandit_predictor(TRANSFORMER_CONFIG, TINY_TEXT_LEN)


def build_tiny_wan_components(seed=0):
    """The five WanPipeline components, deterministic from `seed`."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_tokenizer()
    umt5_config = UMT5Config(**t5_token_ids(tokenizer), **UMT5_CONFIG)
    # One seed per weight-bearing component: changing one does not shift the others.
    return dict(
        scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        vae=seeded(seed, lambda: AutoencoderKLWan(**VAE_CONFIG)),
        text_encoder=seeded(seed + 1, lambda: UMT5EncoderModel(umt5_config)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: WanTransformer3DModel(**TRANSFORMER_CONFIG)),
    )


def build_tiny_wan(out, seed=0):
    """Write the tiny Wan pipeline folder to `out` (which must not exist); returns its path."""
    from diffusers import WanPipeline

    return write_pipeline(out, lambda: WanPipeline(**build_tiny_wan_components(seed)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(build_tiny_wan(args.out, args.seed))
    except FileExistsError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
