"""Wan2.1's umT5 conditioner and VAE decoder give what diffusers' WanPipeline gives, on the tiny
Wan folder (mm_grpo.families.wan.tiny)."""
import pytest
import torch

from mm_grpo.families.wan.encoders import UMT5Conditioner, WanVaeDecoder, load_tokenizer, video_latent_shape
from mm_grpo.families.wan.tiny import TINY_TEXT_LEN, TINY_WAN_PREDICTOR, build_tiny_wan, main


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from diffusers import WanPipeline

    folder = build_tiny_wan(tmp_path_factory.mktemp("tiny_wan") / "pipeline", seed=0)
    # Fast tokenizer: under transformers 4.x the model_index of a folder written under 5 names a slow class.
    pipe = WanPipeline.from_pretrained(folder, tokenizer=None)
    pipe.register_modules(tokenizer=load_tokenizer(folder))
    return folder, pipe


def test_umt5_conditioner_matches_the_pipeline(tiny_wan):
    folder, pipe = tiny_wan
    # WanPipeline's cleaning (HTML entities, whitespace), a prompt truncated at the length, a short one.
    prompts = ["a cat  sitting on a red chair &amp; a dog", " ".join(["a fox running through the forest"] * 4), "owl"]
    with torch.no_grad():  # as in WanPipeline.__call__ (with autograd on, CPU attention rounds differently)
        expected, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                         max_sequence_length=TINY_TEXT_LEN)
    embeds, mask = UMT5Conditioner(folder, max_sequence_length=TINY_TEXT_LEN).encode_with_mask(prompts)
    assert embeds.shape == (3, TINY_TEXT_LEN, pipe.text_encoder.config.d_model)
    assert torch.equal(embeds, expected)
    lengths = mask.sum(1).tolist()
    assert lengths[1] == TINY_TEXT_LEN and lengths[2] < TINY_TEXT_LEN  # truncated; padded
    assert torch.all(embeds[2, lengths[2]:] == 0) and torch.all(embeds[2, :lengths[2]].abs().sum(-1) > 0)


def test_vae_decoder_matches_the_pipelines_last_step(tiny_wan):
    folder, pipe = tiny_wan
    run = dict(prompt="a fox in the snow", height=32, width=48, num_frames=5, num_inference_steps=2,
               guidance_scale=1.0, max_sequence_length=TINY_TEXT_LEN)
    # The same sampling twice: its latents, and the frames WanPipeline decodes them to.
    latents = pipe(**run, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    frames = pipe(**run, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert latents.shape[1:] == video_latent_shape(5, 32, 48, channels=pipe.vae.config.z_dim) == (4, 2, 4, 6)
    decoded = WanVaeDecoder(folder)(latents)
    assert decoded.shape == frames.shape == (1, 5, 3, 32, 48) and decoded.dtype == torch.float32
    assert torch.equal(decoded, frames)
    # A batch of random latents: frames in [0, 1], 4(T - 1) + 1 of them.
    decoded = WanVaeDecoder(folder)(torch.randn(2, 4, 3, 2, 2, generator=torch.Generator().manual_seed(1)))
    assert decoded.shape == (2, 9, 3, 16, 16) and 0 <= decoded.min() and decoded.max() <= 1


def test_video_latent_shape():
    assert video_latent_shape(81, 480, 832) == (16, 21, 60, 104)  # Wan2.1 480p
    assert video_latent_shape(1, 16, 32, channels=4) == (4, 1, 2, 4)  # one frame: an image


@pytest.mark.parametrize("args, message", [
    ((80, 480, 832), "num_frames 80: Wan's VAE takes 4k + 1 frames (77, 81, ...)"),
    ((0, 480, 832), "num_frames 0:"),
    ((81, 36, 832), "video size 36x832 must be positive multiples of 16"),
    ((81, 480, 840), "video size 480x840 must be positive multiples of 16"),
])
def test_video_latent_shape_refuses_in_one_line(args, message):
    with pytest.raises(ValueError) as error:
        video_latent_shape(*args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_missing_folders_are_named_in_one_line(tiny_wan, tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        UMT5Conditioner(tmp_path / "missing")
    assert str(error.value) == f"no tokenizer/ in {tmp_path / 'missing'} (expected a diffusers Wan pipeline folder)"
    with pytest.raises(FileNotFoundError, match=r"^no vae/ in .*/pipeline/transformer \(expected"):
        WanVaeDecoder(tiny_wan[0] / "transformer")  # a component, not the pipeline folder
    with pytest.raises(FileExistsError):
        build_tiny_wan(tiny_wan[0])  # atomic: never over an existing folder
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tiny_wan[0])])
    assert exit_.value.code == 2


def test_predictor_block_is_the_tiny_transformer(tiny_wan):
    folder, pipe = tiny_wan
    cfg, p = pipe.transformer.config, TINY_WAN_PREDICTOR
    assert p["hidden_size"] == cfg.num_attention_heads * cfg.attention_head_dim == p["num_heads"] * 24
    assert (p["in_dim"], p["out_dim"]) == (cfg.in_channels, cfg.out_channels) == (pipe.vae.config.z_dim,) * 2
    assert p["text_dim"] == cfg.text_dim == pipe.text_encoder.config.d_model
    assert (p["ffn_dim"], p["freq_dim"], p["num_layers"], p["max_seq_len"]) == (
        cfg.ffn_dim, cfg.freq_dim, cfg.num_layers, cfg.rope_max_seq_len)
    assert tuple(p["patch_size"]) == tuple(cfg.patch_size) and p["text_len"] == TINY_TEXT_LEN
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)
