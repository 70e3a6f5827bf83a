"""The offline text-embedding cache gives the trainer what the encoders give."""
import torch

from mm_grpo.encoders.text import TextEmbeddingCache, TextEncoders
from mm_grpo.tools.precompute_text import main
from mm_grpo.training.components import conditioner


def test_cache_serves_the_same_embeddings_as_the_encoders(tiny_pipeline_dir, tmp_path):
    prompts = ["a red circle", "two blue squares", "a red circle"]
    (tmp_path / "p.txt").write_text("\n".join(prompts))
    main(["--pipeline", str(tiny_pipeline_dir), "--prompts", str(tmp_path / "p.txt"),
          "--out", str(tmp_path / "cache.safetensors"), "--max-sequence-length", "32", "--dtype", "float32"])
    assert len(TextEmbeddingCache(tmp_path / "cache.safetensors")) == 2
    cached = conditioner({"embeddings_cache": str(tmp_path / "cache.safetensors")}, "cpu", torch.float32)
    direct = TextEncoders(tiny_pipeline_dir, max_sequence_length=32).encode
    for a, b in zip(cached(prompts[::-1]), direct(prompts[::-1])):
        assert torch.equal(a, b)
