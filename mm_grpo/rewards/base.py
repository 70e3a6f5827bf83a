"""Reward interface, config and registry.

A reward maps images [B, 3, H, W] (float in [0, 1], on the device) and their prompts to a
float32 tensor [B]. Rewards are built from a `RewardConfig` by name; everything that can
be wrong with a config (unknown name, missing or mismatched weights) fails at construction.
"""
import dataclasses
import importlib
import math
import typing
from pathlib import Path
from typing import Annotated, Literal, Optional

import torch
from pydantic import Field

from mm_grpo.settings import NonNegative, check_keys, read_block

REWARDS = {}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a remote reward's timeout


@dataclasses.dataclass
class RewardConfig:
    """One reward. Fields a reward does not use are ignored by it.

    name: registry key (see `REWARDS`).
    path: weights: a file (open_clip / aesthetic head) or a folder (transformers CLIP).
    weight: its weight in `CombinedReward` (0 = computed and logged, not optimised).
    arch: open_clip architecture name (`hps`: ViT-H-14 by default; `clip_score`: required).
    clip_path: `aesthetic` only: transformers CLIP folder whose image features feed the head.
    dtype: "float32", "bfloat16" or "float16" for the reward model.
    url: remote rewards only: the server's address (http://host:port).
    timeout: remote rewards only: seconds one try may take in all (connect, send, the whole reply; a
        `vlm_judge` batch's requests together), retried `retries` more times.
    retries: remote rewards only: further tries after a failed request (unreachable, timed out,
        busy); when they fail too the batch scores NaN and the iteration is skipped.
    model: `vlm_judge` only: the served model's name on the OpenAI-compatible endpoint.
    backbone: `hpsv3` only: the Qwen2-VL folder (config, tokenizer, processor) HPSv3 was trained from.
    module: a Python module imported before `name` is looked up: where a reward of your own registers
        itself (`@register_reward(name)` on a `Reward` subclass). Every process that scores imports it,
        so it must be importable there (installed, or on PYTHONPATH).
    """

    name: str
    path: Optional[str] = None
    weight: float = 1.0  # finite: CombinedReward's check
    arch: Optional[str] = None
    clip_path: Optional[str] = None
    dtype: Literal[tuple(_DTYPES)] = "float32"
    url: Optional[str] = None
    timeout: Seconds = 60.0
    retries: NonNegative = 2
    model: Optional[str] = None
    backbone: Optional[str] = None
    module: Optional[str] = None

    @classmethod
    def from_any(cls, cfg, where: str = None):
        """The config of a dict (a model.json `reward` entry): its keys are the fields of its reward's
        config class (`config_class`, else this one), any other refused in one line naming `where`
        (e.g. 'model.json reward "hps"'; default: 'reward config "<name>"'), as is a value of the wrong
        type or range; a field holding another reward's config (`frames`' inner) is read the same way."""
        if isinstance(cfg, cls):
            return cfg
        if not isinstance(cfg, dict):
            raise ValueError(f"reward config must be a dict or RewardConfig, got {type(cfg).__name__}")
        if cfg.get("module") is not None:  # before the name is looked up: the module registers it
            import_reward_module(cfg["module"], where or f'reward config "{cfg.get("name")}"')
        own = getattr(REWARDS.get(cfg.get("name")), "config_class", cls)  # a reward with fields of its own
        if issubclass(own, cls) and own is not cls:
            return own.from_any(cfg, where)
        where = where or f'reward config "{cfg.get("name")}"'
        if "name" not in cfg:
            check_keys(cfg, [f.name for f in dataclasses.fields(cls)], where)  # a misspelt key first
            raise ValueError(f"reward config needs a 'name': {cfg}")
        nested = [k for k in _reward_fields(cls) if cfg.get(k) is not None]
        config = read_block(cls, {k: v for k, v in cfg.items() if k not in nested}, where)
        return dataclasses.replace(config, **{k: RewardConfig.from_any(cfg[k], f"{where} {k}") for k in nested})

    @property
    def torch_dtype(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"reward {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def require_path(self, field="path", kind="file"):
        """The existing path in `field`, or a one-line error saying what is missing."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"reward {self.name!r} needs `{field}` (a {kind})")
        path = Path(value)
        if not (path.is_file() if kind == "file" else path.is_dir()):
            raise FileNotFoundError(f"reward {self.name!r}: {field} {path} is not an existing {kind}")
        return path


def import_reward_module(module, where: str):
    """Imports `module` (a reward config's `module`), refusing in one line naming `where`."""
    if not isinstance(module, str) or not module:
        raise ValueError(f"{where}: module must be a Python module name (a string), got {module!r}")
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported in one line
        raise ValueError(f"{where}: module {module!r} cannot be imported ({type(e).__name__}: {one_line(e)}); "
                         "it must be importable in every process (installed, or on PYTHONPATH)") from None


def _reward_fields(config_class) -> list:
    """The fields of a reward config class that hold another reward's config."""
    hints = typing.get_type_hints(config_class)
    return [name for name, hint in hints.items() if RewardConfig in (hint, *typing.get_args(hint))]


def register_reward(name):
    def register(cls):
        REWARDS[name] = cls
        cls.name = name
        return cls

    return register


class Reward:
    """Base class: input checks, no_grad, device moves; subclasses implement `score`."""

    name = None

    def __init__(self, cfg, device="cpu"):
        self.cfg = cfg
        self.device = torch.device(device)

    def score(self, images, prompts):
        raise NotImplementedError

    def check_prompts(self, prompts):
        """Raise ValueError for a prompt this reward cannot score (checked before training)."""

    def check_inputs(self, images, prompts):
        """One-line ValueError unless `images` is a float [B, 3, H, W] batch with one prompt per image."""
        _check_inputs(images, prompts)

    def __call__(self, images, prompts):
        self.check_inputs(images, prompts)
        # no_grad rather than inference_mode: inference tensors would break a trainer
        # that later multiplies advantages built from these values into its loss.
        with torch.no_grad():
            values = self.score(images.to(self.device), list(prompts)).float()
            # A non-finite image gets a non-finite reward instead of a quantised-away one.
            bad = ~torch.isfinite(images.to(self.device)).flatten(1).all(1)
            values = torch.where(bad, torch.full_like(values, math.nan), values)
        return values.to(images.device)


def one_line(error) -> str:
    """The first line of an error's message (at most 200 characters), or its type's name."""
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def uint8_pixels(images):
    """images [B, 3, H, W] in [0, 1] -> [B, H, W, 3] uint8 on the host: round(255 x), the
    quantisation every reference reward (and PIL) applies."""
    return (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def _check_inputs(images, prompts):
    if not (torch.is_tensor(images) and images.ndim == 4 and images.shape[1] == 3 and images.is_floating_point()):
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"reward images must be a float tensor [B, 3, H, W] in [0, 1], got {shape}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(f"need one prompt per image: {images.shape[0]} images, prompts={prompts!r:.80}")


def build_reward(cfg, device="cpu"):
    """Build one reward from a `RewardConfig` or a dict."""
    cfg = RewardConfig.from_any(cfg)
    if cfg.name not in REWARDS:
        where = f" (module {cfg.module!r} registers none by that name)" if cfg.module else ""
        raise ValueError(f"unknown reward {cfg.name!r}{where}; known: {', '.join(sorted(REWARDS))}")
    cfg.torch_dtype  # validates dtype before any loading
    return REWARDS[cfg.name](cfg, device)
