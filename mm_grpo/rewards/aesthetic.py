"""LAION aesthetic predictor (as DDPO's aesthetic reward): a head on normalised CLIP image features.

`clip_path`: transformers CLIP folder (the predictor was trained on openai/clip-vit-large-patch14).
`path`: the head's state dict (.pth / .pt / .safetensors), either the predictor's MLP
(`layers.{0,2,4,6,7}.*`: linear layers with dropouts between and, as upstream, no
activations) or a single linear layer (`weight`, `bias`, the v1 linear predictor).
"""
import torch
from torch import nn

from mm_grpo.rewards.base import Reward, one_line, register_reward
from mm_grpo.rewards.clip import load_hf_clip


def _load_state_dict(path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


class LinearStack(nn.Module):
    """The LAION predictor's MLP as saved: `layers.i` is a Linear for each i in `shapes`
    ((out, in) per index), an eval-mode dropout (identity) at the other indices."""

    def __init__(self, shapes):
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.Linear(shapes[i][1], shapes[i][0]) if i in shapes else nn.Identity() for i in range(max(shapes) + 1))
        )

    def forward(self, x):
        return self.layers(x)


def build_head(state, in_features):
    """The head module for a state dict (single linear or LinearStack), weights loaded and checked."""
    if set(state) == {"weight", "bias"}:
        head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    else:
        shapes = {
            int(k.split(".")[1]): tuple(v.shape)
            for k, v in state.items()
            if k.startswith("layers.") and k.endswith(".weight")
        }
        if not shapes:
            raise ValueError(f"expected 'weight'/'bias' or 'layers.N.weight/bias' keys, got {sorted(state)[:6]}")
        head = LinearStack(shapes)
    head.load_state_dict(state)
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    if linears[0].in_features != in_features or linears[-1].out_features != 1:
        raise ValueError(f"head maps {linears[0].in_features} -> {linears[-1].out_features}, need {in_features} -> 1")
    return head


@register_reward("aesthetic")
class Aesthetic(Reward):
    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        path = cfg.require_path("path", "file")
        self.model, _, self.preprocess = load_hf_clip(cfg, "clip_path", self.device)
        try:
            head = build_head(_load_state_dict(path), self.model.config.projection_dim)
        except Exception as e:
            msg = f"reward {cfg.name!r}: {path} is not an aesthetic head for this CLIP: {one_line(e)}"
            raise ValueError(msg) from None
        self.head = head.to(self.device, cfg.torch_dtype).eval().requires_grad_(False)

    def score(self, images, prompts):
        pixels = self.preprocess(images).to(self.model.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        features = self.model.visual_projection(pooled)
        features = features / features.norm(dim=-1, keepdim=True)
        return self.head(features).squeeze(-1)
