"""CLIP-family rewards on tiny random models saved locally, against their reference scorers.

The references are the upstream recipes written out with the libraries' own PIL
preprocessing: HPS v2 (open_clip transform, model(image, text) with output_dict),
PickScore (processor + get_*_features, cosine), DDPO's aesthetic scorer (CLIP image
features, L2-normalised, LAION MLP).
"""
import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mm_grpo.rewards import build_reward
from tests.utils import assert_one_line_error, clip_pil_image_processor

ARCH = "mmgrpo-tiny-clip"
PROMPTS = ["a photo of a cat sitting on a red chair", "two dogs playing in the snow", "a bowl of fruit"]

# open_clip's SimpleTokenizer emits ids up to 49407, so the text vocab stays full size.
OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


def _images(seed=0):
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(3, 3, 6, 8, generator=g)
    return F.interpolate(coarse, size=(96, 128), mode="bicubic", align_corners=False).clamp(0, 1)


def _pils(images):
    return [Image.fromarray((im * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()) for im in images]


@pytest.fixture(scope="module")
def open_clip_checkpoint(tmp_path_factory):
    """A tiny open_clip architecture registered by json, and an HPS-style checkpoint for it."""
    import open_clip

    folder = tmp_path_factory.mktemp("open_clip")
    (folder / f"{ARCH}.json").write_text(json.dumps(OPEN_CLIP_CONFIG))
    open_clip.add_model_config(folder / f"{ARCH}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(ARCH)
    # HPS v2.1 ships {'state_dict': ...} saved from DDP ('module.' prefix).
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, folder / "hps.pt")
    return folder / "hps.pt"


def _open_clip_reference(path, images, prompts):
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(ARCH, pretrained=str(path), output_dict=True)
    tokenizer = open_clip.get_tokenizer(ARCH)
    with torch.no_grad():
        out = model(torch.stack([preprocess(p) for p in _pils(images)]), tokenizer(prompts))
    return torch.diagonal(out["image_features"] @ out["text_features"].T)


def test_hps_matches_reference(open_clip_checkpoint):
    images = _images()
    reward = build_reward({"name": "hps", "path": str(open_clip_checkpoint), "arch": ARCH})
    values = reward(images, PROMPTS)
    ref = _open_clip_reference(open_clip_checkpoint, images, PROMPTS)
    assert values.dtype == torch.float32 and values.shape == (3,) and not values.requires_grad
    torch.testing.assert_close(values, ref, rtol=0, atol=1e-5)
    assert values.std() > 1e-4  # not a constant
    # clip_score: same model family through the plain architecture + file path.
    clip = build_reward({"name": "clip_score", "path": str(open_clip_checkpoint), "arch": ARCH})
    torch.testing.assert_close(clip(images, PROMPTS), ref, rtol=0, atol=1e-5)


def test_open_clip_errors(open_clip_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unknown open_clip architecture 'ViT-Q-99'"):
        build_reward({"name": "clip_score", "path": str(open_clip_checkpoint), "arch": "ViT-Q-99"})
    bad = tmp_path / "other.pt"
    torch.save({"visual.proj": torch.zeros(3)}, bad)
    assert_one_line_error(lambda: build_reward({"name": "hps", "path": str(bad), "arch": ARCH}),
                          f"is not an open_clip {ARCH} checkpoint")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not an open_clip"):
        build_reward({"name": "hps", "path": str(garbage), "arch": ARCH})


@pytest.fixture(scope="module")
def hf_clip_dir(tmp_path_factory):
    """A tiny transformers CLIPModel + CLIPProcessor folder (tokenizer from the tiny pipeline's)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from mm_grpo.families.flux.tiny import build_clip_tokenizer

    folder = tmp_path_factory.mktemp("hf_clip")
    tokenizer = build_clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=2, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            image_size=224, patch_size=32, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(folder)
    return folder


def _hf_reference_features(folder, images, prompts=None):
    # PIL-backend processor: the one PickScore and DDPO's scorer were written against.
    from transformers import CLIPModel, CLIPTokenizerFast

    model = CLIPModel.from_pretrained(folder).eval()
    pixels = clip_pil_image_processor().from_pretrained(folder)(images=_pils(images), return_tensors="pt").pixel_values
    with torch.no_grad():
        image = _projected(model.get_image_features(pixel_values=pixels))
        text = None
        if prompts is not None:
            tokenizer = CLIPTokenizerFast.from_pretrained(folder)
            tokens = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
            text = _projected(model.get_text_features(**tokens))
    return image, text


def _projected(features):
    # transformers 5 returns an output whose pooler_output is the projection; 4.x the tensor itself.
    return features if torch.is_tensor(features) else features.pooler_output


def test_pickscore_matches_reference(hf_clip_dir):
    images = _images(1)
    values = build_reward({"name": "pickscore", "path": str(hf_clip_dir)})(images, PROMPTS)
    image, text = _hf_reference_features(hf_clip_dir, images, PROMPTS)
    ref = F.cosine_similarity(image, text, dim=-1)  # PickScore's score / exp(logit_scale)
    torch.testing.assert_close(values, ref, rtol=0, atol=1e-5)
    assert values.std() > 1e-4


def _ddpo_mlp(in_features):
    # DDPO / LAION improved-aesthetic-predictor MLP layout (its ReLUs are commented out upstream).
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(in_features, 24), nn.Dropout(0.2), nn.Linear(24, 12), nn.Dropout(0.2),
                nn.Linear(12, 8), nn.Dropout(0.1), nn.Linear(8, 4), nn.Linear(4, 1),
            )

        def forward(self, x):
            return self.layers(x)

    torch.manual_seed(3)
    return MLP().eval()


@pytest.mark.parametrize("head_kind", ["mlp", "linear"])
def test_aesthetic_matches_reference(hf_clip_dir, tmp_path, head_kind):
    head = _ddpo_mlp(16) if head_kind == "mlp" else nn.Linear(16, 1)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    images = _images(2)
    cfg = {"name": "aesthetic", "path": str(tmp_path / "head.pth"), "clip_path": str(hf_clip_dir)}
    values = build_reward(cfg)(images, PROMPTS)
    image, _ = _hf_reference_features(hf_clip_dir, images)
    with torch.no_grad():
        ref = head(image / image.norm(dim=-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(values, ref, rtol=0, atol=1e-5)


def test_hf_reward_errors(hf_clip_dir, tmp_path):
    with pytest.raises(ValueError, match="is not a transformers CLIP folder"):
        build_reward({"name": "pickscore", "path": str(tmp_path)})
    torch.save(nn.Linear(8, 1).state_dict(), tmp_path / "small.pth")
    with pytest.raises(ValueError, match=r"head maps 8 -> 1, need 16 -> 1"):
        build_reward({"name": "aesthetic", "path": str(tmp_path / "small.pth"), "clip_path": str(hf_clip_dir)})
    with pytest.raises(ValueError, match="needs `clip_path`"):
        build_reward({"name": "aesthetic", "path": str(tmp_path / "small.pth")})


def test_rewards_propagate_nonfinite_and_stay_on_device(open_clip_checkpoint):
    reward = build_reward({"name": "hps", "path": str(open_clip_checkpoint), "arch": ARCH})
    images = _images()
    images[0, 1, 5, 5] = float("nan")
    values = reward(images, PROMPTS)
    assert values[0].isnan() and torch.isfinite(values[1:]).all()
    assert values.device == images.device and not torch.is_inference(values)
    assert all(not p.requires_grad for p in reward.model.parameters())
