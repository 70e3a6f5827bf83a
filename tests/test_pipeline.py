"""The tiny FLUX pipeline folder and the pipeline pieces, checked against diffusers' FluxPipeline."""
import json

import pytest
import torch
from transformers import T5TokenizerFast

from mm_grpo.families.flux import tiny
from mm_grpo.families.flux.text import TextEmbeddingCache, TextEncoders, save_text_embeddings
from mm_grpo.families.flux.tiny import build_tiny_pipeline
from mm_grpo.families.flux.transformer.latents import (latent_size, num_image_tokens, pack_latents, prepare_latent_image_ids,
                                         unpack_latents)
from mm_grpo.families.flux.vae import VaeDecoder

PROMPTS = ["a photo of a cat sitting on a red chair", "A fox running through the autumn forest at night, digital art!"]
SEQ = 16  # T5 length for the tiny pipeline (the second prompt is longer: truncation path)


@pytest.fixture(scope="module")
def pipe(tiny_pipeline_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_pipeline_dir)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_pipeline_layout_and_configs(tiny_pipeline_dir, pipe):
    index = json.loads((tiny_pipeline_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    components = {"transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler"}
    assert set(index) >= components
    # transformers 5 aliases T5TokenizerFast to T5Tokenizer (what model_index.json records).
    assert isinstance(T5TokenizerFast.from_pretrained(tiny_pipeline_dir / "tokenizer_2"), T5TokenizerFast)
    cfg = pipe.transformer.config
    for key, value in tiny.TRANSFORMER_CONFIG.items():
        assert cfg[key] == value, key
    assert pipe.vae.config.latent_channels * 4 == cfg.in_channels
    assert pipe.vae_scale_factor == 8
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)
    assert pipe.text_encoder.config.hidden_size == cfg.pooled_projection_dim == 32
    assert pipe.text_encoder_2.config.d_model == cfg.joint_attention_dim == 32
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 3.0
    assert pipe.tokenizer.model_max_length == 77
    # Tokenizers round-trip real words (learnt vocab, not <unk> soup).
    ids = pipe.tokenizer_2("a cat on a chair").input_ids
    assert ids[-1] == pipe.tokenizer_2.eos_token_id and pipe.tokenizer_2.unk_token_id not in ids
    clip_ids = pipe.tokenizer("a cat on a chair").input_ids
    assert pipe.tokenizer.decode(clip_ids, skip_special_tokens=True) == "a cat on a chair"
    size = sum(len(b) for b in _files(tiny_pipeline_dir).values())
    assert size < 4 * 2**20, size


def test_tiny_pipeline_generates(pipe):
    gen = torch.Generator().manual_seed(0)
    out = pipe(PROMPTS[0], height=64, width=64, num_inference_steps=2, max_sequence_length=SEQ,
               guidance_scale=3.5, generator=gen, output_type="pt").images
    assert out.shape == (1, 3, 64, 64)
    assert torch.isfinite(out).all() and 0 <= out.min() and out.max() <= 1 and out.std() > 0


def test_build_is_deterministic(tiny_pipeline_dir, tmp_path):
    again = _files(build_tiny_pipeline(tmp_path / "again", seed=0))
    assert again == _files(tiny_pipeline_dir)
    other = _files(build_tiny_pipeline(tmp_path / "other", seed=1))
    assert other.keys() == again.keys()
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert other[weights] != again[weights]
    assert other["tokenizer/tokenizer.json"] == again["tokenizer/tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]  # no temp dirs left


def test_build_refuses_existing_folder_and_cli(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        tiny.main(["--out", str(tmp_path / "taken")])
    assert list((tmp_path / "taken").iterdir()) == []


@pytest.mark.parametrize("height,width", [(64, 64), (32, 96)])
def test_latent_layout_matches_diffusers(height, width):
    from diffusers import FluxPipeline

    h, w = latent_size(height, width)
    x = torch.randn(2, 4, h, w)
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, h, w))
    assert packed.shape[1] == num_image_tokens(height, width)
    assert torch.equal(unpack_latents(packed, height, width), FluxPipeline._unpack_latents(packed, height, width, 8))
    assert torch.equal(unpack_latents(packed, height, width), x)
    for dtype in (torch.float32, torch.bfloat16):
        ours = prepare_latent_image_ids(h // 2, w // 2, dtype=dtype)
        assert torch.equal(ours, FluxPipeline._prepare_latent_image_ids(2, h // 2, w // 2, "cpu", dtype))


def test_latent_size_rejects_bad_sizes():
    assert latent_size(1024, 768) == (128, 96)
    with pytest.raises(ValueError, match="multiples of 16"):
        latent_size(1000, 1024)


def test_text_encoders_match_flux_encode_prompt(tiny_pipeline_dir, pipe):
    enc = TextEncoders(tiny_pipeline_dir, max_sequence_length=SEQ)
    ours = enc.encode(PROMPTS)
    with torch.no_grad():  # as FluxPipeline.__call__ runs it
        ref = pipe.encode_prompt(PROMPTS, prompt_2=None, device="cpu", max_sequence_length=SEQ)
    assert ours[0].shape == (2, SEQ, 32) and ours[1].shape == (2, 32) and ours[2].shape == (SEQ, 3)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.equal(ours[0][0], ours[0][1])


def test_text_encoders_errors(tiny_pipeline_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer/ in"):
        TextEncoders(tmp_path)
    with pytest.raises(ValueError, match="max_sequence_length"):
        TextEncoders(tiny_pipeline_dir, max_sequence_length=513)


def test_text_embedding_cache_round_trip(tiny_pipeline_dir, tmp_path):
    enc = TextEncoders(tiny_pipeline_dir, max_sequence_length=SEQ)
    path = save_text_embeddings(enc, PROMPTS + [PROMPTS[0]], tmp_path / "emb.safetensors", batch_size=1)
    assert [p.name for p in tmp_path.iterdir()] == ["emb.safetensors"]
    cache = TextEmbeddingCache(path)
    assert len(cache) == 2 and PROMPTS[1] in cache
    query = [PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    for a, b in zip(cache.get(query), enc.encode(query)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # batch of 1 vs 3: same math, maybe other kernels
    with pytest.raises(ValueError, match="not in text-embedding cache"):
        cache.get(["a prompt nobody encoded"])
    with pytest.raises(FileNotFoundError, match="no text-embedding cache"):
        TextEmbeddingCache(tmp_path / "missing.safetensors")


def test_vae_decode_matches_flux_pipeline(tiny_pipeline_dir, pipe):
    kwargs = dict(height=64, width=48, num_inference_steps=2, max_sequence_length=SEQ)
    latents = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(1), output_type="latent", **kwargs).images
    ref = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(1), output_type="pt", **kwargs).images
    images = VaeDecoder(tiny_pipeline_dir)(latents, 64, 48)
    assert images.shape == (1, 3, 64, 48) and images.dtype == torch.float32
    assert torch.equal(images, ref)
    with pytest.raises(FileNotFoundError, match="no VAE at"):
        VaeDecoder(tiny_pipeline_dir / "nowhere")
