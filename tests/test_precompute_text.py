"""The offline text-embedding cache gives the trainer what the encoders give."""
import pytest
import torch

from mm_grpo.families.flux.parts import conditioner
from mm_grpo.families.flux.text import TextEmbeddingCache, TextEncoders
from mm_grpo.tools.precompute_text import main


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


@pytest.mark.parametrize("case, message", [("no prompts", "p.txt"), ("no pipeline", "missing"),
                                           ("zero tokens", "--max-sequence-length must be >= 1, got 0")])
def test_bad_input_is_one_line_and_writes_nothing(tiny_pipeline_dir, tmp_path, capsys, case, message):
    if case != "no prompts":
        (tmp_path / "p.txt").write_text("a red circle\n")
    pipeline = tmp_path / "missing" if case == "no pipeline" else tiny_pipeline_dir
    tokens = "0" if case == "zero tokens" else "32"
    with pytest.raises(SystemExit) as exit_:
        main(["--pipeline", str(pipeline), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "c.safetensors"),
              "--max-sequence-length", tokens])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert message in err and not (tmp_path / "c.safetensors").exists()
