"""CLIP-family rewards: cosine similarity of image and prompt embeddings.

`hps` (HPS v2.1) and `clip_score` run open_clip models; `pickscore` a transformers
CLIPModel. All use the cosine similarity without CLIP's logit scale: HPS's reference
score is exactly that (values about 0.2-0.4); PickScore's reference multiplies by
exp(logit_scale) (about 100), a constant that the reward `weight` can carry. Images are
preprocessed on the device by `ClipPreprocess`, bit-exact with the PIL reference path.
"""
from mm_grpo.rewards.base import Reward, one_line, register_reward
from mm_grpo.rewards.preprocess import ClipPreprocess


@register_reward("clip_score")
class OpenCLIPScore(Reward):
    """open_clip model `arch` with weights from `path` (a checkpoint file open_clip can load)."""

    default_arch = None

    def __init__(self, cfg, device="cpu"):
        import open_clip

        super().__init__(cfg, device)
        arch = cfg.arch or self.default_arch
        if arch is None:
            raise ValueError(f"reward {cfg.name!r} needs `arch` (an open_clip model name such as ViT-L-14)")
        path = cfg.require_path("path", "file")
        if open_clip.get_model_config(arch) is None:
            raise ValueError(f"reward {cfg.name!r}: unknown open_clip architecture {arch!r}")
        try:  # open_clip's own loader (strict): HPS's {'state_dict': ...} and 'module.' prefixes included
            model = open_clip.create_model(arch, pretrained=str(path))
        except Exception as e:
            msg = f"reward {cfg.name!r}: {path} is not an open_clip {arch} checkpoint: {one_line(e)}"
            raise ValueError(msg) from None
        self.model = model.to(self.device, cfg.torch_dtype).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(arch)
        self.preprocess = _open_clip_preprocess(cfg.name, model.visual.preprocess_cfg)

    def score(self, images, prompts):
        pixels = self.preprocess(images).to(self.cfg.torch_dtype)
        tokens = self.tokenizer(prompts).to(self.device)
        image_features = self.model.encode_image(pixels, normalize=True)
        text_features = self.model.encode_text(tokens, normalize=True)
        return (image_features * text_features).sum(-1)


def _open_clip_preprocess(name, cfg):
    size = cfg["size"]
    size = size if isinstance(size, int) else size[0] if size[0] == size[1] else None
    bicubic = cfg.get("interpolation", "bicubic") == "bicubic"
    if size is None or not bicubic or cfg.get("resize_mode", "shortest") != "shortest":
        raise ValueError(f"reward {name!r}: only square, bicubic, shortest-side preprocessing is supported, got {cfg}")
    # torchvision's CenterCrop (open_clip) rounds the crop offset.
    return ClipPreprocess(size, tuple(cfg["mean"]), tuple(cfg["std"]), crop_offset="round")


@register_reward("hps")
class HPSv2(OpenCLIPScore):
    """HPS v2.1: open_clip ViT-H-14 with the HPS v2.1 checkpoint at `path` (`arch` overridable for tests)."""

    default_arch = "ViT-H-14"


def load_hf_clip(cfg, field, device):
    """A transformers CLIPModel + processor folder -> (model, tokenizer, on-device preprocessing)."""
    from transformers import AutoProcessor, CLIPModel

    path = cfg.require_path(field, "folder")
    try:
        model = CLIPModel.from_pretrained(path, dtype=cfg.torch_dtype)
        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"reward {cfg.name!r}: {path} is not a transformers CLIP folder: {one_line(e)}") from None
    ip = processor.image_processor
    size, crop = ip.size, ip.crop_size
    if not (ip.do_resize and ip.do_center_crop and size.get("shortest_edge") and int(ip.resample) == 3):
        raise ValueError(f"reward {cfg.name!r}: {path} must preprocess by bicubic shortest-edge resize + center crop")
    if crop.get("height") != crop.get("width"):
        raise ValueError(f"reward {cfg.name!r}: only square center crops are supported, got {crop}")
    # transformers' center crop floors the offset (torchvision's rounds).
    preprocess = ClipPreprocess(
        size["shortest_edge"], tuple(ip.image_mean), tuple(ip.image_std), crop_offset="floor", crop_size=crop["height"]
    )
    return model.to(device).eval().requires_grad_(False), processor.tokenizer, preprocess


@register_reward("pickscore")
class PickScore(Reward):
    """PickScore: a transformers CLIPModel folder (weights + processor) at `path`."""

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.model, self.tokenizer, self.preprocess = load_hf_clip(cfg, "path", self.device)

    def score(self, images, prompts):
        pixels = self.preprocess(images).to(self.model.dtype)
        text = self.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        out = self.model(pixel_values=pixels, **text.to(self.device))
        return (out.image_embeds * out.text_embeds).sum(-1)  # both already L2-normalised
