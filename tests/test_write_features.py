"""`python -m mm_grpo.tools.write_features`: MindSpeed-MM's feature files from an image-caption
folder, checked against diffusers' FluxPipeline (its prompt encoding, its VAE, its image
preprocessing) and FLUX.1's published latent normalisation. That MindSpeed-MM's own
pretrain_sora.py trains on them: tests/test_mindspeed_mm_sora.py."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from mm_grpo.families.flux.text import load_tokenizers
from mm_grpo.tools import write_features
from mm_grpo.tools.write_features import PROG, main

# FLUX.1's autoencoder normalisation (BFL's AutoEncoderParams; MindSpeed-MM's flux_vae defaults):
# latents = SCALE x (posterior mode - SHIFT). The tiny pipeline's VAE carries FLUX.1's values.
FLUX1_SCALE, FLUX1_SHIFT = 0.3611, 0.1159
CAPTIONS = ("a red apple next to a green pear", "two dogs playing in the snow", "an owl")
TEXT_LEN = 8


def image_folder(root, sizes, captions=CAPTIONS):
    """An image-caption folder: random RGB images of the given (H, W) sizes, metadata.jsonl."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    with open(root / "metadata.jsonl", "w") as f:
        for i, ((h, w), caption) in enumerate(zip(sizes, captions)):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / f"{i}.png")
            f.write(json.dumps({"file_name": f"images/{i}.png", "text": caption}) + "\n")
    return root


def write(pipeline, data, out, *extra):
    main(["--pipeline", str(pipeline), "--data", str(data), "--out", str(out), "--max-sequence-length",
          str(TEXT_LEN), "--dtype", "float32", "--batch-size", "2", *extra])


def diffusers_pipeline(folder):
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32, tokenizer=None, tokenizer_2=None)
    pipe.register_modules(**load_tokenizers(folder))
    return pipe


def test_features_are_what_diffusers_encodes(tiny_pipeline_dir, tmp_path):
    from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
    data = image_folder(tmp_path / "data", [(32, 48)] * len(CAPTIONS))
    write(tiny_pipeline_dir, data, tmp_path / "out")

    rows = [json.loads(line) for line in open(tmp_path / "out" / "data.jsonl")]
    assert rows == [{"file_name": f"images/{i}.png", "text": c, "file": f"features/images_{i}_png.pt"}
                    for i, c in enumerate(CAPTIONS)]
    assert sorted(os.listdir(tmp_path / "out")) == ["data.jsonl", "features"]
    pipe = diffusers_pipeline(tiny_pipeline_dir)
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (FLUX1_SCALE, FLUX1_SHIFT)
    embeds, pooled, _ = pipe.encode_prompt(list(CAPTIONS), None, max_sequence_length=TEXT_LEN)
    for i, row in enumerate(rows):
        sample = torch.load(tmp_path / "out" / row["file"])
        assert sorted(sample) == ["prompt_ids", "prompt_mask", "video"]
        image = pipe.image_processor.preprocess(Image.open(data / row["file_name"]))  # [-1, 1]
        with torch.no_grad():
            mode = retrieve_latents(pipe.vae.encode(image), sample_mode="argmax")[0]
        torch.testing.assert_close(sample["video"], FLUX1_SCALE * (mode - FLUX1_SHIFT), rtol=1e-5, atol=1e-6)
        assert sample["video"].shape == (pipe.vae.config.latent_channels, 32 // 8, 48 // 8)
        t5, clip = sample["prompt_ids"]
        torch.testing.assert_close(t5, embeds[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(clip, pooled[i], rtol=1e-5, atol=1e-6)
        # one file per sample: a row of a batch tensor saved alone, not the batch's storage
        assert t5.untyped_storage().nbytes() == t5.numel() * t5.element_size()
        masks = [tok(row["text"], padding="max_length", max_length=n, truncation=True,
                     return_tensors="pt").attention_mask[0]
                 for tok, n in ((pipe.tokenizer_2, TEXT_LEN), (pipe.tokenizer, pipe.tokenizer.model_max_length))]
        assert all(torch.equal(a, b) for a, b in zip(sample["prompt_mask"], masks))
        assert [m.shape for m in sample["prompt_mask"]] == [(TEXT_LEN,), (77,)]


def test_resolution_crops_to_one_square_size_and_bf16_is_kept(tiny_pipeline_dir, tmp_path):
    data = image_folder(tmp_path / "data", [(48, 64), (64, 40)], CAPTIONS[:2])
    main(["--pipeline", str(tiny_pipeline_dir), "--data", str(data), "--out", str(tmp_path / "out"),
          "--max-sequence-length", str(TEXT_LEN), "--resolution", "32"])
    for i in range(2):
        sample = torch.load(tmp_path / "out" / "features" / f"images_{i}_png.pt")
        assert sample["video"].shape == (4, 4, 4) and sample["video"].dtype == torch.bfloat16
        assert all(t.dtype == torch.bfloat16 for t in sample["prompt_ids"])


def one_line_error(capsys, loads, run):
    """The one line of a refusal (exit 2), the last on stderr (above it: model loading's progress
    bars, if it came after loading), and whether the VAE was loaded first."""
    loads.clear()
    with pytest.raises(SystemExit) as exit_:
        run()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and err.count(f"{PROG}: error:") == 1, err
    assert err.endswith("\n") and err.rstrip("\n").splitlines()[-1].startswith(f"{PROG}: error:"), err
    return err.rstrip("\n").splitlines()[-1], bool(loads)


def test_bad_input_is_one_line_and_leaves_nothing(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    loads, load_vae = [], write_features.load_vae
    monkeypatch.setattr(write_features, "load_vae", lambda *a, **k: loads.append(a) or load_vae(*a, **k))

    def refused(data, out, *extra):
        return one_line_error(capsys, loads, lambda: write(tiny_pipeline_dir, data, out, *extra))

    mixed = image_folder(tmp_path / "mixed", [(32, 32), (32, 48)], CAPTIONS[:2])
    err, loaded = refused(mixed, tmp_path / "out")
    assert not loaded and "images differ in size" in err and "32x32" in err and "32x48" in err and "--resolution" in err
    odd = image_folder(tmp_path / "odd", [(24, 24)], CAPTIONS[:1])
    err, loaded = refused(odd, tmp_path / "out")
    assert not loaded and "image size 24x24 must be positive multiples of 16" in err and "--resolution" in err
    err, loaded = refused(odd, tmp_path / "out", "--resolution", "40")
    assert not loaded and "image size 40x40 must be positive multiples of 16" in err
    err, loaded = refused(tmp_path, tmp_path / "out")
    assert not loaded and "no metadata.jsonl in" in err
    err, loaded = refused(odd, odd)
    assert not loaded and f"{odd} already exists" in err and "--overwrite" in err
    (odd / "images" / "0.png").write_bytes(b"not a png")  # before any model is loaded
    err, loaded = refused(odd, tmp_path / "out", "--resolution", "32")
    assert not loaded and "cannot identify image file" in err and "0.png" in err
    # An image whose header reads but whose pixels do not, met while writing: nothing is left.
    png = (mixed / "images" / "1.png").read_bytes()
    (mixed / "images" / "1.png").write_bytes(png[:len(png) // 2])
    err, loaded = refused(mixed, tmp_path / "out", "--resolution", "32")
    assert "truncated" in err and loaded
    assert sorted(os.listdir(tmp_path)) == ["mixed", "odd"]  # no out/, no temporary folder
