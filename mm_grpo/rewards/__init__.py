"""Image-text rewards for GRPO: a registry of `name -> Reward class` and their weighted sum.

Importing the package registers every built-in reward.
"""
from mm_grpo.rewards import (  # noqa: F401  (registration)
    aesthetic, clip, compositional, flow_grpo_servers, hpsv3, jpeg, ocr, remote, vlm_judge)
from mm_grpo.rewards import video  # noqa: F401  (registration: frames, motion)
from mm_grpo.rewards.base import REWARDS, Reward, RewardConfig, build_reward, register_reward
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.rewards.preprocess import ClipPreprocess, pil_bicubic_resize

__all__ = [
    "REWARDS",
    "ClipPreprocess",
    "CombinedReward",
    "Reward",
    "RewardConfig",
    "build_reward",
    "pil_bicubic_resize",
    "register_reward",
]
